"""The bibliography's pybtex style: author-year labels, as the text cites, sorted by author.

pybtex's own styles label entries alpha-style ([KLZ+23]) and sort braced names such as
``{NVIDIA}`` after Z; this one labels "Kwon et al., 2023" and "vLLM Team, 2025a" (the labels
the Colab copies cite with, :func:`pagedlab_course.colab.labelled`) and sorts on those names,
case and braces ignored. Titles keep their case as written: they name APIs, versions and
flags (``LLM.beam_search``, ``SamplingParams``, ``GPU``) that sentence case would lowercase.
The text cites by these labels (``bibtex_reference_style: label`` in ``_config.yml``), so a
citation names one entry even where authors and year repeat.
"""

from pybtex.plugin import register_plugin
from pybtex.style.formatting.unsrt import Style as UnsrtStyle
from pybtex.style.labels import BaseLabelStyle
from pybtex.style.sorting import BaseSortingStyle
from pybtex.style.template import field, sentence

from pagedlab_course.colab import labelled, sort_key


class AuthorYearLabels(BaseLabelStyle):
    def format_labels(self, sorted_entries):
        for names, year in labelled(sorted_entries):
            yield f"{names}, {year}"


class AuthorYearSorting(BaseSortingStyle):
    def sorting_key(self, entry):
        return sort_key(entry)


class AuthorYearStyle(UnsrtStyle):
    default_label_style = AuthorYearLabels
    default_sorting_style = AuthorYearSorting

    def format_title(self, e, which_field, as_sentence=True):
        title = field(which_field)  # as written, not sentence-cased
        return sentence[title] if as_sentence else title


def setup(app):
    register_plugin("pybtex.style.formatting", "pagedlab_author_year", AuthorYearStyle)
    return {"parallel_read_safe": True}
