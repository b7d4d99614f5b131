"""The built book as a reader's browser shows it: every page of `_build/html` in headless
Chromium (Debian's `chromium`; `.ci/run` installs it), served over local HTTP.

A page fails on a console error or an uncaught exception, on a block player whose frame stays
put when its controls are used, and on anything a reader cannot see at 1280 px: a table, an
output block (`pre`) or a formula wider than its box, whether cut off or scrolled sideways (a
scrollbar hides what the prose quotes); a figure whose text shows under 9 px. Code (an input
cell, a source listing, code in the prose) keeps its lines at any width: a line wider than its
box scrolls sideways, since a wrap splits tokens and loses the indentation. At either width
punctuation after a formula stays on the formula's line. At 400 px a page must not scroll
sideways, no formula is cut off (a wide one scrolls in its box), and an SVG figure's text (a
block view's) must still show at 9 px or more, in a box that scrolls sideways if need be.
Collapsed outputs are opened before they are measured. The scripts a page loads from a CDN
(MathJax, require.js, the widget manager) are served from the same versions' npm packages,
fetched once into `_build/cdn` (tools/book_browser.py, which the book's PDF shares), so the test
sees what an online reader sees without depending on those hosts. Screenshots of every page at both widths go to `_build/screenshots`, for a
person to look at. Each chapter's page must also hold its executed outputs and a Colab button
to its notebook, and its glossary links must land on entries; chapter 1's calculator must
recompute in the page as `kv_summary` does. Every figure must say what it shows to a reader who
cannot see it: a chapter's image sits in a captioned <figure> with alt text that is not its file
name, and a block view's SVG is an image named in words.

These are the only tests that read the build: `make test` runs the rest beside the build.
`PAGEDLAB_BOOK_HTML` points them at another build's html folder (its `cdn` and `screenshots`
are then beside it), e.g. a copy whose pages were edited by hand.
"""

from __future__ import annotations

import os
import re
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from book_browser import CHROMIUM, CHROMIUM_ARGS, route_offline, serve, typeset  # noqa: E402

BUILT = Path(os.environ.get("PAGEDLAB_BOOK_HTML", ROOT / "_build" / "html")).resolve()
CDN_CACHE = BUILT.parent / "cdn"
SHOTS = BUILT.parent / "screenshots"
PAGES = sorted(p for p in BUILT.rglob("*.html")
               if not {"_static", "_sources"} & set(p.relative_to(BUILT).parts)
               and p.name not in ("genindex.html", "search.html")
               and 'http-equiv="Refresh"' not in p.read_text()) if BUILT.exists() else []

# What third-party code says whoever wrote the book: sphinx-thebe 0.3 declares the same
# constant in two inline scripts; pydata-sphinx-theme notes that no colour mode is stored yet;
# the widget manager (@jupyter-widgets/html-manager 1.0, which shows chapter 1's calculator)
# typesets with MathJax 2's `MathJax.Hub.Queue` while Sphinx loads MathJax 3, and looks for its
# icon fonts beside the page. Any other message, and any other missing file, fails the page.
THIRD_PARTY_NOISE = ("Identifier 'THEBE_JS_URL' has already been declared",
                     "Got invalid theme mode", "reading 'Queue'")
THIRD_PARTY_MISSING = "/@jupyter-widgets/html-manager/dist/"

pytestmark = pytest.mark.skipif(not BUILT.exists(),
                                reason="the book is not built (`make test` builds it first)")


@pytest.fixture(scope="module")
def server():
    with serve(BUILT) as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        pytest.fail("no chromium: `apt-get install -y chromium` (.ci/run does it)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


# Everything a reader could miss at the page's width, as (kind, what, how it fails). Tables,
# `pre` blocks and source listings must not be wider than their box: neither cut off nor
# scrolled sideways. A table may leave the text column only inside a full-width block (the
# theme's `full-width` class or cell tag). Figure text: an inline SVG's <text> at its rendered
# size; an SVG shown by <img> is fetched and its <text> scaled by the image's rendered width; a
# PNG's text cannot be read from the page: its smallest is taken as PNG_MIN_PT at its 1:1 size
# (pagedlab.viz.style's fonts are 9 pt or more; a chapter's legend goes down to 7 pt), so it
# fails when shown too small for that to read at 9 px.
PNG_MIN_PT = 7
MEASURE_JS = """async ({layout, pngs}) => {
  const MIN_PX = 9, PNG_MIN_PT = %s;
  document.querySelectorAll("main details").forEach((d) => { d.open = true; });
  const column = (document.querySelector("main article") || document.querySelector("main")
                  || document.body).getBoundingClientRect();
  const shown = (el) => el.checkVisibility();  // an SVG element has no offsetParent
  const label = (el) => (el.innerText || el.getAttribute("alt") || "").trim().slice(0, 70);
  const found = [];
  const wide = (el) => el.scrollWidth > el.clientWidth + 1;
  for (const t of layout ? document.querySelectorAll("main table") : []) {
    if (!shown(t)) continue;
    let right = column.right;
    const full = t.closest(".full-width, .full_width, .tag_full-width, .tag_full_width");
    if (full) right = Math.max(right, full.getBoundingClientRect().right);
    let scroller = null;
    for (let a = t.parentElement; a && a !== document.body; a = a.parentElement)
      if (["auto", "scroll"].includes(getComputedStyle(a).overflowX) && wide(a)) { scroller = a; break; }
    if (scroller)
      found.push(["table", label(t), `scrolls sideways: ${scroller.scrollWidth - scroller.clientWidth} px hidden`]);
    else if (t.getBoundingClientRect().right > right + 1)
      found.push(["table", label(t), `${Math.round(t.getBoundingClientRect().right - right)} px past the column`]);
  }
  for (const p of layout ? document.querySelectorAll("main pre") : []) {
    // code (all but a cell's printed output) keeps its lines and may scroll; output must fit
    if (!shown(p)) continue;
    const style = getComputedStyle(p);
    if (p.closest(".output") && !p.closest(".pagedlab-source")) {
      if (wide(p))
        found.push(["output", label(p), `${p.scrollWidth - p.clientWidth} px wider than its box`]);
    } else if (style.whiteSpace !== "pre") {
      found.push(["code", label(p), `wraps its lines (white-space: ${style.whiteSpace})`]);
    } else if (wide(p) && !["auto", "scroll"].includes(style.overflowX)) {
      found.push(["code", label(p), `${p.scrollWidth - p.clientWidth} px cut off`]);
    }
  }
  for (const m of layout ? document.querySelectorAll("main article mjx-container") : []) {
    // a formula wider than the column runs past it, or scrolls inside its box (one in the
    // page's contents, beside the column, is not measured against it)
    if (!shown(m)) continue;
    const box = m.parentElement;
    const over = Math.max(m.getBoundingClientRect().right - column.right,
                          m.scrollWidth - m.clientWidth, box.scrollWidth - box.clientWidth);
    const tex = window.MathJax?.startup?.document?.getMathItemsWithin(m)?.[0]?.math;
    if (over > 1) found.push([m.hasAttribute("display") ? "equation" : "inline math",
                              (tex || label(m)).trim().slice(0, 70),
                              `${Math.round(over)} px past its box`]);
  }
  const svgText = (svg, scale, what) => {
    for (const t of svg.querySelectorAll("text")) {
      const px = parseFloat(t.getAttribute("font-size") || getComputedStyle(t).fontSize) * scale;
      if (t.textContent.trim() && px < MIN_PX - 0.05) {
        found.push(["figure text", `${what}: ${t.textContent.trim().slice(0, 30)}`, `${px.toFixed(1)} px`]);
        return;  // one line per figure
      }
    }
  };
  for (const svg of document.querySelectorAll("main svg")) {
    if (!shown(svg) || svg.closest("mjx-container, .MathJax, button, .headerlink")) continue;
    const box = svg.viewBox.baseVal;
    const scale = box && box.width ? svg.getBoundingClientRect().width / box.width : 1;
    svgText(svg, scale, "svg");
  }
  for (const img of document.querySelectorAll("main img")) {
    if (!shown(img) || !img.closest(".cell_output, figure, .figure")) continue;
    if (img.currentSrc.endsWith(".svg")) {
      const doc = new DOMParser().parseFromString(await (await fetch(img.currentSrc)).text(),
                                                  "image/svg+xml");
      const svg = doc.documentElement;
      const width = svg.viewBox.baseVal && svg.viewBox.baseVal.width
                    || parseFloat(svg.getAttribute("width"));
      svgText(svg, img.getBoundingClientRect().width / width, img.currentSrc.split("/").pop().slice(0, 12));
    } else if (pngs && img.naturalWidth) {
      // Retina PNGs carry their 1:1 width in their style; others show 1 image px per CSS px.
      const natural = parseFloat(img.style.width) || img.naturalWidth;
      const px = PNG_MIN_PT * 96 / 72 * img.getBoundingClientRect().width / natural;
      if (px < MIN_PX - 0.05)
        found.push(["figure text", img.currentSrc.split("/").pop().slice(0, 12),
                    `${PNG_MIN_PT} pt shows at ${px.toFixed(1)} px`]);
    }
  }
  return found;
}""" % PNG_MIN_PT

# At a phone's width: whether the page itself scrolls sideways, and what sticks out of its
# parent past the window's edge (inside no box that scrolls or clips).
PAGE_SCROLL_JS = """() => {
  const doc = document.scrollingElement, width = doc.clientWidth;
  if (doc.scrollWidth <= width + 1) return null;
  const out = (el) => el.getBoundingClientRect().right > width + 1;
  const clipped = (el) => {
    for (let a = el.parentElement; a; a = a.parentElement)
      if (getComputedStyle(a).overflowX !== "visible") return a !== document.body && a !== doc;
    return false;
  };
  const spills = (el) => el.clientWidth > 0 && el.scrollWidth > el.clientWidth + 1
    && getComputedStyle(el).overflowX === "visible";  // its text runs out of it
  const culprits = [...document.querySelectorAll("body *")].filter((el) =>
    el.checkVisibility() && !clipped(el) && (out(el) && !out(el.parentElement)
      || spills(el) && ![...el.children].some(spills)));
  return [doc.scrollWidth, culprits.slice(0, 5).map((el) =>
    `${el.tagName.toLowerCase()}.${el.className}: ${(el.innerText || "").slice(0, 50)}`)];
}"""

# At a phone's width a formula, displayed or inline, may be wider than the page, but its end
# must stay reachable: inside a box that scrolls sideways, not one that clips it (the theme
# clipped inline math: review 2026-12-04, row 5).
CLIPPED_MATH_JS = """() => [...document.querySelectorAll("main mjx-container")]
  .filter((m) => m.checkVisibility()).flatMap((m) => {
    const right = m.firstElementChild.getBoundingClientRect().right;
    for (let a = m; a && a !== document.body; a = a.parentElement) {
      const overflow = getComputedStyle(a).overflowX;
      if (overflow === "auto" || overflow === "scroll") return [];
      if (overflow !== "visible" && right > a.getBoundingClientRect().right + 1) {
        const tex = window.MathJax?.startup?.document?.getMathItemsWithin(m)?.[0]?.math;
        return [`${m.hasAttribute("display") ? "equation" : "inline math"} "${(tex || "")
          .trim().slice(0, 60)}": ${Math.round(right -
          a.getBoundingClientRect().right)} px cut off`];
      }
    }
    return [];
  })"""

# Punctuation right after an inline formula that starts the next line (". An early exit"):
# review 2026-12-04, row 14.
STRANDED_PUNCTUATION_JS = """() => [...document.querySelectorAll("main span.math")]
  .filter((m) => m.checkVisibility()).flatMap((m) => {
    const next = m.nextSibling;
    if (!next || next.nodeType !== Node.TEXT_NODE || !/^[.,;:!?)\\]]/.test(next.data)) return [];
    const range = document.createRange();
    range.setStart(next, 0);
    range.setEnd(next, 1);
    const mark = range.getBoundingClientRect(), math = m.getBoundingClientRect();
    return mark.top < math.bottom - 1 ? [] :
      [`"${next.data[0]}" after the formula "${m.textContent.slice(0, 50)}" starts a line`];
  })"""

VISIBLE_FRAME_JS = """(player) => [...player.querySelectorAll('.pagedlab-frame')]
  .findIndex((f) => !f.hidden)"""


def check_page(page, url: str, measure: bool = True) -> list[str]:
    problems, external = [], []
    route_offline(page, CDN_CACHE, external)
    def report(kind, text):
        if not any(noise in text for noise in THIRD_PARTY_NOISE):
            problems.append(f"{kind}: {text}")

    def console(message):  # a failed load is reported with its address by on_response
        if message.type == "error" and not message.text.startswith("Failed to load resource"):
            report("console", message.text)

    def on_response(response):
        if response.status >= 400 and THIRD_PARTY_MISSING not in response.url:
            problems.append(f"missing: {response.status} {response.url}")

    page.on("console", console)
    page.on("pageerror", lambda e: report("uncaught", str(e)))
    page.on("response", on_response)
    page.goto(url, wait_until="load")
    typeset(page)
    problems += [f"script from an unknown CDN: {u}" for u in external]
    problems += page.evaluate(STRANDED_PUNCTUATION_JS)
    if not measure:  # the phone's width: only whether the page scrolls sideways
        if scroll := page.evaluate(PAGE_SCROLL_JS):
            problems.append(f"the page scrolls sideways: {scroll[0]} px wide; the widest: {scroll[1]}")
        problems += page.evaluate(CLIPPED_MATH_JS)
        # an SVG figure (a block view) keeps readable text: a box that scrolls, not a shrink
        problems += [f"{kind} {what!r}: {how}" for kind, what, how in
                     page.evaluate(MEASURE_JS, {"layout": False, "pngs": False})]
        screenshot(page, url, "-400px")
        return problems
    problems += [f"{kind} {what!r}: {how}" for kind, what, how in
                 page.evaluate(MEASURE_JS, {"layout": True, "pngs": True})]
    for i, player in enumerate(page.query_selector_all(".pagedlab-player")):
        before = page.evaluate(VISIBLE_FRAME_JS, player)
        player.query_selector("[data-act=prev]" if before > 0 else "[data-act=next]").click()
        after = page.evaluate(VISIBLE_FRAME_JS, player)
        slider = player.query_selector("input[type=range]")
        slider.fill("0")  # a range input: sets the value and fires input, as a drag does
        at_zero = page.evaluate(VISIBLE_FRAME_JS, player)
        if before < 0 or after in (before, -1) or at_zero != 0:
            problems.append(f"player {i}: frame {before} -> {after} after a button, "
                            f"{at_zero} after the slider went to 0")
    screenshot(page, url)
    return problems


def screenshot(page, url: str, suffix: str = "") -> None:
    """The whole page, for a person to look at (`_build/screenshots`)."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    name = url.split("/", 3)[-1].replace("/", "_").removesuffix(".html")
    # a long page on a busy machine takes more than playwright's 30 s to capture
    page.screenshot(path=str(SHOTS / f"{name}{suffix}.png"), full_page=True, timeout=300_000)


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(BUILT)))
def test_page_reads_in_a_browser(path, server, browser):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    try:
        problems = check_page(page, f"{server}/{path.relative_to(BUILT).as_posix()}")
    finally:
        page.close()
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems)


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(BUILT)))
def test_page_fits_a_phone(path, server, browser):
    page = browser.new_page(viewport={"width": 400, "height": 800})
    try:
        problems = check_page(page, f"{server}/{path.relative_to(BUILT).as_posix()}", measure=False)
    finally:
        page.close()
    assert not problems, "\n".join(problems)


def test_every_chapter_page_was_found():
    assert {p.stem for p in (ROOT / "book").glob("ch*.md")} <= {p.stem for p in PAGES}


def test_every_page_is_in_the_table_of_contents():
    """A page the contents do not list (an index an extension adds, like sphinx-proof's
    "Proof index") is one a reader reaches only from search, with nothing around it."""
    listed = set(re.findall(r"(?:root|file): (\S+)", (ROOT / "_toc.yml").read_text()))
    assert not {p.relative_to(BUILT).with_suffix("").as_posix() for p in PAGES} - listed


def test_every_page_says_which_edition_it_is():
    """The CPU and GPU editions differ in every measured number: each page says which one it
    is, at its top (book/_ext/pagedlab_edition.py), as the device the chapters ran on decides."""
    from pagedlab.device import HAS_CUDA

    edition = "GPU edition: " if HAS_CUDA else "CPU edition: every chapter ran on a CPU"
    banner = re.compile(r'class="bd-header-announcement__content">([^<]*)<')
    unlabelled = [p.relative_to(BUILT).as_posix() for p in PAGES
                  if edition not in "".join(banner.findall(p.read_text()))]
    assert not unlabelled, f"pages without the {edition!r} banner: {unlabelled}"


@pytest.mark.parametrize("chapter", sorted((ROOT / "book").glob("ch*.md")), ids=lambda p: p.stem)
def test_built_chapter_has_outputs_and_a_colab_button_to_its_notebook(chapter):
    html = (BUILT / "book" / f"{chapter.stem}.html").read_text()
    links = set(re.findall(r"colab\.research\.google\.com/github/[^/]+/[^/]+/blob/[^/]+/([^\"]+)", html))
    assert links == {f"book/{chapter.stem}.ipynb"}
    assert 'class="output' in html, "no executed output in the built chapter"


# A cell's printed output, as MyST-NB writes it: streams (merged) and stderr.
PRINTED = re.compile(r'<div class="output (?:stream|stderr)[^"]*"><div class="highlight"><pre>'
                     r"(.*?)</pre>", re.S)
PY_WARNING = re.compile(r"^.*\b\w*Warning: .*$", re.M)


@pytest.mark.parametrize("chapter", sorted((ROOT / "book").glob("ch*.md")), ids=lambda p: p.stem)
def test_built_chapter_prints_no_warning(chapter):
    """A Python warning in an output (matplotlib's "layout has changed to tight", a
    deprecation) or a library's progress bar is noise above a figure or a table: the chapter
    must not cause it."""
    html = (BUILT / "book" / f"{chapter.stem}.html").read_text()
    printed = [re.sub(r"<[^>]+>", "", block) for block in PRINTED.findall(html)]
    # the pattern still reads every printed output MyST-NB writes
    assert len(printed) == len(re.findall(r'class="output (?:stream|stderr)', html))
    warnings = [w.strip() for text in printed for w in PY_WARNING.findall(text)]
    assert not warnings, "\n".join(warnings)
    # a library's progress bar (transformers' "Loading weights") saved as a widget
    assert "ProgressModel" not in html, "a progress bar is saved in the page"


@pytest.mark.parametrize("chapter", sorted((ROOT / "book").glob("ch*.md")), ids=lambda p: p.stem)
def test_built_chapter_numbers_its_equations_from_1(chapter):
    """Equations are numbered per chapter, as its Colab copy numbers them (pagedlab_course.colab):
    a chapter's first equation is (1), not the book's fifth."""
    html = (BUILT / "book" / f"{chapter.stem}.html").read_text()
    numbers = re.findall(r'<span class="eqno">\((\d+)\)', html)
    labels = re.findall(r"^\$\$ *\((eq-[\w-]+)\)|^:label: *(eq-[\w-]+)", chapter.read_text(), re.M)
    assert numbers == [str(i) for i in range(1, len(labels) + 1)]


# Sets the calculator's controls as a reader would (a change event each) and reads its summary.
CALCULATOR_JS = """([root, settings]) => settings.map((s) => {
  for (const [key, value] of Object.entries(s)) {
    const control = root.querySelector(`[data-key=${key}]`);
    control.value = String(value);
    control.dispatchEvent(new Event("change"));
  }
  return root.querySelector("pre").textContent;
})"""


def test_calculator_computes_in_the_page(server, browser):
    """Chapter 1's calculator works with no kernel: its page recomputes the summary as
    kv_summary does, for every preset, KV dtype, GPU, GPU count and weight dtype at three
    context lengths; a reader's choice in a menu changes it."""
    import itertools

    from pagedlab.viz.kv_calculator import CHOICES, DEFAULTS, kv_summary

    def expected(setting):
        try:
            return kv_summary(**setting)
        except ValueError as err:  # a GPU count that cannot split the model's KV heads
            return str(err)

    page = browser.new_page(viewport={"width": 1280, "height": 900})
    try:
        page.goto(f"{server}/book/ch01_memory_wall.html", wait_until="load")
        root = page.query_selector(".pagedlab-calculator")
        assert root is not None, "chapter 1 shows no calculator that works without a kernel"
        shown = root.query_selector("pre").text_content()
        assert shown == kv_summary(**DEFAULTS)
        root.query_selector("[data-key=model]").select_option("Llama-3-8B")
        root.query_selector("[data-key=context_len]").fill("4096")
        moved = root.query_selector("pre").text_content()
        assert moved == kv_summary(**{**DEFAULTS, "model": "Llama-3-8B", "context_len": 4096})
        keys = list(CHOICES)
        settings = [{**dict(zip(keys, combo)), "context_len": n}
                    for combo in itertools.product(*CHOICES.values()) for n in (1, 2048, 131_072)]
        texts = page.evaluate(CALCULATOR_JS, [root, settings])
    finally:
        page.close()
    wrong = [(s, t, expected(s)) for s, t in zip(settings, texts) if t != expected(s)]
    assert not wrong, f"{len(wrong)} of {len(settings)} settings differ; first: {wrong[0]}"


def test_the_contents_buttons_open_their_drawers_on_a_phone(server, browser):
    """At 400 px the visible ☰ opens the table of contents and "Contents" the page's sections
    (pydata-sphinx-theme #2451: the themes bound a hidden button, and the visible ones did
    nothing; _static/pagedlab.js passes their clicks on)."""
    page = browser.new_page(viewport={"width": 400, "height": 800})
    try:
        page.route("**/*", lambda r: r.continue_() if r.request.url.startswith(server)
                   else r.abort())
        page.goto(f"{server}/book/ch04_paging.html", wait_until="load")
        opened = {}
        for kind in ("primary", "secondary"):
            page.locator(f".{kind}-toggle:visible").first.click()
            page.wait_for_timeout(300)
            opened[kind] = page.evaluate(
                f"() => document.querySelector('#pst-{kind}-sidebar-modal').open")
            page.keyboard.press("Escape")
        assert opened == {"primary": True, "secondary": True}, opened
    finally:
        page.close()


# Each code block of the page (input cells, source listings) as [source lines, lines shown,
# scrollable width, how far it scrolls]: the lines shown are the distinct tops of its text.
CODE_LINES_JS = """() => [...document.querySelectorAll(".cell_input pre, .pagedlab-source pre")]
  .filter((p) => p.checkVisibility()).map((p) => {
    const range = document.createRange();
    range.selectNodeContents(p);
    const tops = new Set([...range.getClientRects()].map((r) => Math.round(r.top)));
    p.scrollLeft = p.scrollWidth;
    return [p.textContent.replace(/\\n$/, "").split("\\n").length, tops.size,
            p.scrollWidth - p.clientWidth, p.scrollLeft];
  })"""


def test_code_keeps_its_lines_and_scrolls_on_a_phone(server, browser):
    """At 400 px chapter 7's code shows each line as one line, and a line wider than the column
    scrolls into view: wrapping it split tokens (`MODEL_I` / `D`) and sent the rest to column 0
    (review 2026-12-04, row 6)."""
    page = browser.new_page(viewport={"width": 400, "height": 800})
    try:
        page.route("**/*", lambda r: r.continue_() if r.request.url.startswith(server)
                   else r.abort())
        page.goto(f"{server}/book/ch07_decode_kernel.html", wait_until="load")
        blocks = page.evaluate(CODE_LINES_JS)
    finally:
        page.close()
    assert len(blocks) > 20
    wrapped = [b for b in blocks if b[1] > b[0]]
    assert not wrapped, f"{len(wrapped)} of {len(blocks)} code blocks wrap their lines"
    wide = [b for b in blocks if b[2] > 0]
    assert wide, "no code line wider than a phone's column: the test shows nothing"
    assert all(scrolled == overflow for _, _, overflow, scrolled in wide), wide


@pytest.mark.parametrize("chapter", sorted((ROOT / "book").glob("ch*.md")), ids=lambda p: p.stem)
def test_the_notebook_download_is_the_colab_copy(chapter):
    """The ".ipynb" download button gives the notebook the Colab button opens, the clean copy
    `book/chNN.ipynb`, not the MyST source as a notebook (review 2026-12-04, row 8;
    book/_ext/pagedlab_downloads.py)."""
    page = BUILT / "book" / f"{chapter.stem}.html"
    links = re.findall(r'<a href="([^"]+\.ipynb)"[^>]*download-notebook-button', page.read_text())
    assert links == [f"../_sources/book/{chapter.stem}.ipynb"], links
    download = (page.parent / links[0]).resolve()
    assert download.read_bytes() == chapter.with_suffix(".ipynb").read_bytes()


@pytest.mark.parametrize("chapter", sorted((ROOT / "book").glob("ch*.md")), ids=lambda p: p.stem)
def test_every_glossary_link_of_a_chapter_lands_on_an_entry(chapter):
    """A {term} link must open the glossary at its entry, not at the page's top."""
    html = (BUILT / "book" / f"{chapter.stem}.html").read_text()
    glossary = (BUILT / "book" / "glossary.html").read_text()
    targets = set(re.findall(r'href="glossary\.html#([^"]+)"', html))
    ids = set(re.findall(r'\bid="([^"]+)"', glossary))
    assert targets - {"glossary"} or "{term}" not in chapter.read_text(), \
        f"{chapter.stem} uses {{term}} but its page links no glossary entry"
    assert targets <= ids, f"{chapter.stem}: links to missing glossary entries {sorted(targets - ids)}"


class Figures(HTMLParser):
    """A page's chapter images (``_images/``; the theme's icons and logos live in ``_static``)
    with their alt text and the caption of the <figure> they sit in, and its block views' SVGs
    (the root <svg> of a ``pagedlab-*`` box, pagedlab.viz.block_view.scroll_box) with their
    role, their aria-label and the text of their first child if it is a <title>."""

    def __init__(self, html: str):
        super().__init__()
        self.images, self.svgs = [], []  # [src, alt, caption or None], [role, label, title]
        self._figures, self._in_caption, self._svg_depth, self._title = [], False, 0, None
        self._last_start = ("", {})
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "figure":
            self._figures.append([])
        elif tag == "figcaption":
            self._in_caption = True
        elif tag == "img" and "_images/" in (attrs.get("src") or ""):
            image = [attrs["src"], attrs.get("alt") or "", None]
            self.images.append(image)
            if self._figures:
                self._figures[-1].append(image)
        elif tag == "svg":
            last_tag, last_attrs = self._last_start
            if self._svg_depth == 0 and last_tag == "div" \
                    and (last_attrs.get("class") or "").startswith("pagedlab-"):
                self.svgs.append([attrs.get("role"), attrs.get("aria-label") or "", ""])
                self._title = ""  # the next start tag says whether the first child is a title
            self._svg_depth += 1
        elif self._title == "" and self._svg_depth == 1:
            self._title = None if tag != "title" else self.svgs[-1]
        self._last_start = (tag, attrs)

    def handle_endtag(self, tag):
        if tag == "figure" and self._figures:
            images = self._figures.pop()
            for image in images:
                image[2] = image[2] or ""
        elif tag == "figcaption":
            self._in_caption = False
        elif tag == "svg":
            self._svg_depth = max(0, self._svg_depth - 1)
        elif tag == "title":
            self._title = None

    def handle_data(self, data):
        if self._in_caption and self._figures:
            for image in self._figures[-1]:
                image[2] = (image[2] or "") + data
        if isinstance(self._title, list):
            self._title[2] += data


@pytest.mark.parametrize("chapter", sorted((ROOT / "book").glob("ch*.md")), ids=lambda p: p.stem)
def test_every_chapter_image_has_alt_text_and_a_caption(chapter):
    """A screen reader reads an image's alt text, and MyST-NB's default is the image's file name
    (`../_images/b39c...png`); every reader sees the caption (review 2026-12-04, row 10). A
    chapter sets both in its figure cell's metadata (`mystnb: {figure: {caption, name},
    image: {alt}}`), which wraps the output in a captioned <figure>."""
    page = Figures((BUILT / "book" / f"{chapter.stem}.html").read_text())
    problems = []
    for src, alt, caption in page.images:
        name = src.rsplit("/", 1)[-1]
        if not alt.strip() or name in alt or re.search(r"\.(png|jpe?g|gif|svg)$", alt.strip()):
            problems.append(f"{name[:12]}: alt text {alt!r} is no description")
        if caption is None:
            problems.append(f"{name[:12]}: not in a <figure>")
        elif not caption.strip():
            problems.append(f"{name[:12]}: its <figure> has no caption")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("chapter", sorted((ROOT / "book").glob("ch*.md")), ids=lambda p: p.stem)
def test_every_block_view_is_an_image_named_in_words(chapter):
    """A block view (or a player's frame, or a playground's picture) is inline SVG: without a
    role and a name a screen reader reads its few hundred numbers one by one, out of order."""
    page = Figures((BUILT / "book" / f"{chapter.stem}.html").read_text())
    unnamed = [(role, label[:40], title[:40]) for role, label, title in page.svgs
               if role != "img" or not label.strip() or not title.strip()]
    assert not unnamed, f"{len(unnamed)} of {len(page.svgs)} block views: {unnamed[:3]}"


def test_the_figure_checks_read_what_myst_nb_writes():
    """The two checks above pass only if they find what they check: the parser on a made-up page,
    then the built book, which has images and block views."""
    page = Figures('<figure id="f"><a href="x"><img alt="a plot" src="../_images/ab.png"></a>'
                   '<figcaption><p><span>Fig. 1 </span><span>A caption.</span></p></figcaption>'
                   '</figure><img alt="../_images/cd.png" src="../_images/cd.png">'
                   '<img alt="Colab logo" src="../_static/images/logo_colab.png">'
                   '<div class="pagedlab-blockview"><svg role="img" aria-label="seq A">'
                   '<title>seq A</title><g><title>block 0</title></g></svg></div>'
                   '<div class="pagedlab-frame-svg"><svg><rect/><title>late</title></svg></div>'
                   '<svg class="sd-octicon" aria-hidden="true"></svg>')
    assert page.images == [["../_images/ab.png", "a plot", "Fig. 1 A caption."],
                           ["../_images/cd.png", "../_images/cd.png", None]]
    assert page.svgs == [["img", "seq A", "seq A"], [None, "", ""]]
    chapters = [Figures(p.read_text()) for p in sorted((BUILT / "book").glob("ch*.html"))]
    assert sum(len(c.images) for c in chapters) >= 30 and sum(len(c.svgs) for c in chapters) >= 30
