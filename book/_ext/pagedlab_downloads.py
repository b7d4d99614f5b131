"""A chapter's ".ipynb" download is its Colab copy (review 2026-12-04, row 8).

sphinx-book-theme's download button links to ``_sources/<page>.ipynb``, which the theme copies
from MyST-NB's executed notebook (``_build/jupyter_execute``): the MyST source as a notebook,
its roles unrendered (``{glue:text}``, ``{cite:p}``) and the cells the book removes still in
it. The Colab button opens ``book/chNN.ipynb``, the clean copy ``make notebooks`` writes
(:mod:`pagedlab_course.colab`). Once the build has finished, every downloadable notebook that
has such a copy beside its source is replaced by that copy, so the two buttons give one notebook.
"""

import shutil
from pathlib import Path


def use_colab_copies(srcdir, outdir) -> None:
    """Copy each ``<srcdir>/<page>.ipynb`` over ``<outdir>/_sources/<page>.ipynb``, where both
    exist (a page with no notebook beside its source keeps the theme's)."""
    sources = Path(outdir) / "_sources"
    for download in sources.rglob("*.ipynb"):
        colab_copy = Path(srcdir) / download.relative_to(sources)
        if colab_copy.is_file():
            shutil.copyfile(colab_copy, download)


def _build_finished(app, exception):
    if exception is None and app.builder.format == "html":
        use_colab_copies(app.srcdir, app.outdir)


def setup(app):
    app.connect("build-finished", _build_finished)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
