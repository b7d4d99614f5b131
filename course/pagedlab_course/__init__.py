"""The pagedlab course's tooling, apart from the library students import: the grader
(:mod:`pagedlab_course.grade`), the student notebooks (:mod:`pagedlab_course.assignments`) and the
chapters' Colab copies (:mod:`pagedlab_course.colab`). It imports ``pagedlab``; ``pagedlab``
never imports it."""
