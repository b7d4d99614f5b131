"""The download menu: a chapter's ".ipynb" is its Colab copy (review 2026-12-04, row 8), and
every page offers the whole book as a PDF.

sphinx-book-theme's download button links to ``_sources/<page>.ipynb``, which the theme copies
from MyST-NB's executed notebook (``_build/jupyter_execute``): the MyST source as a notebook,
its roles unrendered (``{glue:text}``, ``{cite:p}``) and the cells the book removes still in
it. The Colab button opens ``book/chNN.ipynb``, the clean copy ``make notebooks`` writes
(:mod:`pagedlab_course.colab`). Once the build has finished, every downloadable notebook that
has such a copy beside its source is replaced by that copy, so the two buttons give one notebook.

The book's PDF, ``pagedlab.pdf`` at the root of the site, is printed from the finished HTML build
by ``make pdf`` (tools/book_pdf.py); the menu links to it as "book (.pdf)", beside the theme's
".pdf", which prints the page alone and is called "page (.pdf)" here.
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


BOOK_PDF = "pagedlab.pdf"


def add_book_pdf(app, pagename, templatename, context, doctree) -> None:
    """Add the book's PDF to the page's download menu, where the theme made one (its buttons
    are made at priority 501, so this runs after), and call the theme's ".pdf" "page (.pdf)"."""
    for group in context.get("header_buttons", []):
        if group.get("label") == "download-buttons":
            for button in group["buttons"]:
                if button.get("label") == "download-pdf-button":
                    button["text"] = "page (.pdf)"
            group["buttons"].append({
                "type": "link", "url": context["pathto"](BOOK_PDF, 1), "text": "book (.pdf)",
                "tooltip": "Download the whole book as one PDF", "icon": "fas fa-book",
                "label": "download-book-pdf-button"})


def setup(app):
    app.connect("build-finished", _build_finished)
    app.connect("html-page-context", add_book_pdf, priority=502)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
