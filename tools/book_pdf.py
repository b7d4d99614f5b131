"""The book as one PDF, printed from the HTML build that `make book` made: `make pdf` writes
`_build/html/pagedlab.pdf`, which the published site offers in every page's download menu.

Why not Jupyter Book's `--builder pdfhtml`: it executes every chapter a second time, and prints
through pyppeteer, which downloads a Chromium of its own (no network here, fragile in CI). This
opens each page of the build in the order of `_toc.yml` in the Chromium the browser test uses,
offline (tools/book_browser.py), prints it (A4, the print rules of _static/pagedlab.css), and
merges the pages with pypdf: an outline entry per page, titled by its h1, under its part's
caption, with its sections beneath; a link to another page of the book lands there in the PDF;
every page numbered at its foot.
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

import yaml

from book_browser import CHROMIUM, CHROMIUM_ARGS, route_offline, serve, typeset

MARGIN_MM = 15
A4_WIDTH_MM = 210
PX_PER_MM = 96 / 25.4

# Run in the page, laid out for print at the paper's width, before it is printed: collapsed
# blocks opened (the page's own `beforeprint` handlers: pagedlab.js, sphinx-togglebutton) and
# done fading in, every image loaded, a formula or figure wider than the column shrunk to fit it
# (paper cannot scroll sideways), every id made the target of a hidden in-page link (so that
# Chromium names a PDF destination for it, which links from other pages can land on), and the
# page's title and sections returned.
PREPARE_JS = """async () => {
  window.dispatchEvent(new Event("beforeprint"));
  await Promise.all(document.getAnimations().map((a) => a.finished.catch(() => null)));
  for (const img of document.images) img.loading = "eager";
  await Promise.all([...document.images].map((img) => img.complete ? null :
    new Promise((done) => { img.onload = img.onerror = done; })));
  await document.fonts.ready;
  for (const box of document.querySelectorAll("main *")) {
    if (box.closest("mjx-assistive-mml")  // MathJax's invisible copy for screen readers
        || !["auto", "scroll", "hidden"].includes(getComputedStyle(box).overflowX)
        || box.scrollWidth - box.clientWidth <= 2 || !box.clientWidth) continue;
    for (const child of box.children) child.style.zoom = box.clientWidth / box.scrollWidth;
  }
  const anchors = document.createElement("div");
  anchors.hidden = true;
  for (const el of document.querySelectorAll("main [id]")) {
    const a = document.createElement("a");
    a.href = "#" + el.id;
    anchors.append(a);
  }
  document.body.append(anchors);
  const text = (h) => {
    const copy = h.cloneNode(true);
    copy.querySelectorAll(".headerlink").forEach((a) => a.remove());
    return copy.textContent.replace(/\\s+/g, " ").trim();
  };
  const h1 = document.querySelector("main article h1");
  return {title: h1 ? text(h1) : document.title,
          sections: [...document.querySelectorAll("main article section > h2")]
            .map((h) => [text(h), h.parentElement.id])};
}"""


def toc_pages(toc: Path) -> list[tuple[str | None, str]]:
    """Each page of ``_toc.yml`` in its order, as (its part's caption or None, its path)."""
    data = yaml.safe_load(toc.read_text())
    pages = [(None, data["root"])]

    def walk(entries, caption):
        for entry in entries:
            if "file" in entry:
                pages.append((caption, entry["file"]))
            walk(entry.get("sections", []), caption)

    for part in data.get("parts", []):
        walk(part.get("chapters", []), part.get("caption"))
    walk(data.get("chapters", []), None)
    return pages


def print_pages(html: Path, paths: list[str]) -> tuple[str, list[tuple[bytes, dict]]]:
    """Each page printed to PDF in headless Chromium, with its title and sections; and the
    address the pages were served from, which their links to each other start with."""
    from playwright.sync_api import sync_playwright

    width = round((A4_WIDTH_MM - 2 * MARGIN_MM) * PX_PER_MM)
    margin = {side: f"{MARGIN_MM}mm" for side in ("top", "bottom", "left", "right")}
    printed, unknown = [], []
    with serve(html) as base, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        for path in paths:
            page = browser.new_page(viewport={"width": width, "height": 1100})
            route_offline(page, html.parent / "cdn", unknown)
            page.emulate_media(media="print")
            page.goto(f"{base}/{path}.html", wait_until="load")
            typeset(page)
            info = page.evaluate(PREPARE_JS)
            if unknown:  # a script the page could not load: MathJax, say, and raw TeX printed
                sys.exit(f"book_pdf: {path} loads what no cache serves: {unknown}")
            pdf = page.pdf(format="A4", print_background=True, margin=margin)
            printed.append((pdf, info))
            page.close()
        browser.close()
    return base, printed


# One A4 sheet per number, the number alone at the foot of the sheet, in the bottom margin the
# pages are printed with: printed once and laid over the merged pages (each page of the book was
# printed on its own, so Chromium's own footer would start every page of the book at 1).
NUMBERS_HTML = """<!doctype html><style>
@page { size: A4; margin: 0; }
body { margin: 0; }
div { height: 1px; position: relative; break-after: page; }
span { position: absolute; top: 286mm; width: 100%; text-align: center;
       font: 9pt sans-serif; color: #555; }
</style>"""


def page_numbers(count: int) -> bytes:
    """A PDF of ``count`` transparent A4 sheets, sheet i showing the number i + 1 at its foot."""
    from playwright.sync_api import sync_playwright

    sheets = "".join(f"<div><span>{n}</span></div>" for n in range(1, count + 1))
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page()
        page.set_content(NUMBERS_HTML + sheets)
        pdf = page.pdf(format="A4", margin={"top": "0", "bottom": "0", "left": "0", "right": "0"})
        browser.close()
    return pdf


def number(writer) -> None:
    """Write its number at the foot of every page of ``writer``."""
    from pypdf import PdfReader

    numbers = PdfReader(io.BytesIO(page_numbers(len(writer.pages)))).pages
    assert len(numbers) == len(writer.pages), "the number sheets did not come out one a page"
    for page, sheet in zip(writer.pages, numbers):
        page.merge_page(sheet)
        page.compress_content_streams()  # merging leaves the page's drawing uncompressed: 2x the file


def merge(pages: list[tuple[str | None, str]], base: str, printed: list[tuple[bytes, dict]]):
    """One PDF of the printed pages (a pypdf ``PdfWriter``), with an outline, and links between
    pages made internal."""
    from pypdf import PdfReader, PdfWriter
    from pypdf.generic import ArrayObject, FloatObject, NameObject, NullObject

    writer = PdfWriter()
    starts, targets, parts = {}, {}, {}  # page path -> first PDF page; (path, id) -> (page, top)
    owner = []  # the page path of each PDF page
    for (caption, path), (pdf, info) in zip(pages, printed):
        reader = PdfReader(io.BytesIO(pdf))
        starts[path] = len(writer.pages)
        for name, dest in reader.named_destinations.items():
            targets[path, unquote(name.lstrip("/"))] = (
                starts[path] + reader.get_destination_page_number(dest), dest.top)
        for page in reader.pages:
            writer.add_page(page)
            owner.append(path)
        if caption and caption not in parts:
            parts[caption] = writer.add_outline_item(title=caption, page_number=starts[path])
        entry = writer.add_outline_item(title=info["title"], page_number=starts[path],
                                        parent=parts.get(caption))
        for title, section in info["sections"]:
            if (path, section) in targets:
                writer.add_outline_item(title=title, page_number=targets[path, section][0],
                                        parent=entry)
    for path, page in zip(owner, writer.pages):
        if "/Annots" not in page:
            continue
        kept = ArrayObject()
        for ref in page["/Annots"]:
            annot = ref.get_object()
            target = link_target(annot, path, base, starts, targets)
            if target:
                number, top = target
                annot[NameObject("/Dest")] = ArrayObject(
                    [writer.pages[number].indirect_reference, NameObject("/XYZ"), NullObject(),
                     FloatObject(top) if top is not None else NullObject(), NullObject()])
                annot.pop("/A", None)
            if target is not False:
                kept.append(ref)
        page[NameObject("/Annots")] = kept
    writer.page_mode = "/UseOutlines"
    return writer


def link_target(annot, path: str, base: str, starts: dict, targets: dict):
    """Where a link of page ``path`` lands in the merged PDF, as (page, top); None for a link
    out of the book (kept as it is), False for one to a file of the build that is no page of
    the PDF (a figure's full-size image: dropped, since the figure is on the page)."""
    dest, action = annot.get("/Dest"), annot.get("/A")
    if isinstance(dest, str):  # a named destination in the same page
        return targets.get((path, unquote(dest.lstrip("/"))), False)
    if action is None or not str(action.get("/URI", "")).startswith(base):
        return None
    url = urlsplit(urljoin(f"{base}/{path}.html", action["/URI"]))
    linked = url.path.lstrip("/").removesuffix(".html")
    if linked not in starts:
        return False
    return targets.get((linked, unquote(url.fragment))) or (starts[linked], None)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--html", type=Path, default=Path("_build/html"))
    parser.add_argument("--toc", type=Path, default=Path("_toc.yml"))
    parser.add_argument("--config", type=Path, default=Path("_config.yml"))
    parser.add_argument("--out", type=Path, help="default: HTML/pagedlab.pdf")
    args = parser.parse_args(argv)
    out = args.out or args.html / "pagedlab.pdf"
    start = time.monotonic()
    pages = toc_pages(args.toc)
    writer = merge(pages, *print_pages(args.html.resolve(), [path for _, path in pages]))
    number(writer)
    config = yaml.safe_load(args.config.read_text())
    writer.add_metadata({"/Title": config["title"], "/Author": config["author"]})
    with open(out, "wb") as f:
        writer.write(f)
    print(f"book_pdf: {out}, {len(writer.pages)} pages from {len(pages)} pages of the book, "
          f"{out.stat().st_size / 2**20:.1f} MiB, {time.monotonic() - start:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
