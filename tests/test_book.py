"""The book's sources agree with what is derived from them and with each other."""

import re
from pathlib import Path

import jupytext
import nbformat
import pytest
import yaml

from pagedlab_course import colab

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "book").glob("ch*.md"))


def toc_files(node):
    """Every `file:` entry of _toc.yml, depth first."""
    if isinstance(node, dict):
        found = [node["file"]] if "file" in node else []
        if "root" in node:
            found.append(node["root"])
        return found + [f for v in node.values() for f in toc_files(v)]
    if isinstance(node, list):
        return [f for v in node for f in toc_files(v)]
    return []


def test_every_chapter_is_in_the_toc_and_every_toc_entry_exists():
    listed = toc_files(yaml.safe_load((ROOT / "_toc.yml").read_text()))
    assert all(any((ROOT / f).with_suffix(s).exists() for s in (".md", ".ipynb")) for f in listed), listed
    assert {f"book/{c.stem}" for c in CHAPTERS} <= set(listed)


@pytest.fixture(scope="module")
def book():
    return colab.Book.scan(sorted((ROOT / "book").glob("*.md")))  # chapters and back matter


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_colab_notebook_is_what_its_chapter_converts_to(chapter, book):
    """The launch button opens book/<chapter>.ipynb: regenerated from the chapter with the
    glued values it stores, it must come out the same, with a value for every glued name."""
    path = chapter.with_suffix(".ipynb")
    assert path.exists(), f"{path.name} missing: run `make notebooks`"
    copy = nbformat.read(path, as_version=4)
    fresh, missing = colab.convert(chapter, book, colab.stored_glue(path))
    as_pairs = lambda nb: [(c.cell_type, c.source, c.metadata.get("tags", [])) for c in nb.cells]
    assert as_pairs(copy) == as_pairs(fresh), f"{path.name} is stale: run `make notebooks`"
    assert not missing, f"{path.name} lacks glued values {sorted(missing)}: `make book notebooks`"
    assert not any(c.get("outputs") for c in copy.cells), f"{path.name} must be stored without outputs"


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_colab_notebook_has_no_myst_left(chapter):
    """Colab renders plain Markdown: a role, directive or label left over shows as raw text."""
    cells = nbformat.read(chapter.with_suffix(".ipynb"), as_version=4).cells
    left = [m.group(0) for c in cells if c.cell_type == "markdown"
            for m in colab.LEFTOVER.finditer(c.source)]
    assert not left, f"{chapter.stem}: MyST left in the Colab copy: {left[:5]}"


def test_converter_turns_every_myst_form_into_markdown(book):
    """Forms other chapters use (admonitions, dropdowns, glossary, figures) convert too."""
    text = "\n".join([
        "(sec-x)=", "## A section", "",
        "```{admonition} Then and now", ":class: tip", "", "vLLM {cite:t}`kwon2023pagedattention`.", "```",
        ":::{dropdown} Hint", "Use {term}`a block <block>` and {glue:text}`n`.", ":::",
        "````{note}", "```{prf:proof}", "Trivial.", "```", "````",
        "```{glossary}", "block", "  A fixed-size run of {math}`k` slots.", "```",
        "```{figure} fig.svg", ":name: fig-x", ":width: 600px", "", "The caption.", "```",
        "See {ref}`sec-x`, {ref}`the chapter <ch-paging>` and {numref}`fig-x`.",
        "```python", "x = {cite}`not a role in code`", "```",
    ])
    conv = colab.Converter(colab.Book({**book.targets, "sec-x": colab.Target("here", "A section"),
                                       "fig-x": colab.Target("here", "Figure")},
                                      book.references), "here", {"n": "16"})
    out = conv.markdown(text)
    assert not colab.LEFTOVER.search(out.replace("{cite}`not a role in code`", "")), out
    assert "> **Then and now**" in out and "Kwon et al. (2023)" in out
    assert "<details><summary>Hint</summary>" in out and "a block and 16." in out
    assert "**Proof.**" in out and "**block**: A fixed-size run of $k$ slots." in out
    assert '<img src="https://raw.githubusercontent.com/' in out and "*The caption.*" in out
    assert "[A section](#sec-x)" in out and "](https://colab.research.google.com/" in out
    assert "x = {cite}`not a role in code`" in out, "code fences are copied as they are"
    with pytest.raises(ValueError, match="no Colab form"):
        conv.markdown("```{unheardof}\nx\n```")


def test_a_dropdown_in_a_list_item_stays_in_it(book):
    """A hint folded under an exercise keeps the exercise's indent on every line: a line of it
    starting "128." must not become a list item of its own (chapter 4's exercise 5 did)."""
    text = "\n".join(["5. Find the block size.", "", "   ```{dropdown} Hint", "   Loop over 1, 2, 4, ...,",
                      "   128. The waste grows.", "   ```", "", "6. Next."])
    out = colab.Converter(book, "here", {}).markdown(text).split("\n")
    details = out[out.index("   <details><summary>Hint</summary>"):out.index("   </details>") + 1]
    assert [line for line in details if line.strip()] == [
        "   <details><summary>Hint</summary>", "   Loop over 1, 2, 4, ...,",
        "   128. The waste grows.", "   </details>"]


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_colab_notebook_installs_pagedlab_first_and_visibly(chapter):
    first = nbformat.read(chapter.with_suffix(".ipynb"), as_version=4).cells[0]
    assert first.cell_type == "code"
    assert "pip install" in first.source and "pagedlab" in first.source
    assert not first.metadata.get("tags"), "Colab shows every cell; the book may hide it"


def test_citations_exist_in_the_bibliography():
    keys = set(re.findall(r"@\w+\{([^,]+),", (ROOT / "book" / "references.bib").read_text()))
    cited = {k.strip() for p in (ROOT / "book").glob("*.md") for group in re.findall(r"\{cite(?::\w+)?\}`([^`]+)`", p.read_text()) for k in group.split(",")}
    assert cited <= keys, cited - keys
    assert {"kwon2023pagedattention", "yu2022orca", "dao2022flashattention", "milakov2018online", "vaswani2017attention"} <= cited


def _name(requirement: str) -> str:
    return re.split(r"[<>=;\s\[]", requirement.strip(), maxsplit=1)[0].lower()


def test_environment_yml_lists_what_pyproject_declares():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {_name(r) for r in project["dependencies"]}
    declared |= {_name(r) for extra in project["optional-dependencies"].values() for r in extra}
    course = tomllib.loads((ROOT / "course" / "pyproject.toml").read_text())["project"]
    declared |= {_name(r) for r in course["dependencies"]} - {"pagedlab"}
    env = yaml.safe_load((ROOT / "environment.yml").read_text())["dependencies"]
    conda = {_name(d) for d in env if isinstance(d, str)} - {"python", "pip"}
    pip = {_name(d) for d in next(d["pip"] for d in env if isinstance(d, dict)) if not d.startswith("-e")}
    assert {"pytorch" if n == "torch" else n for n in declared} == conda | pip


def glossary_terms() -> set[str]:
    """The terms the glossary page defines: the unindented lines of its {glossary} block."""
    text = (ROOT / "book" / "glossary.md").read_text()
    block = text.split("```{glossary}", 1)[1].split("\n```", 1)[0]
    return {line.strip().lower() for line in block.splitlines()
            if line.strip() and not line.startswith((" ", ":"))}


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_opens_with_objectives_linking_notation_and_glossary(chapter):
    first = jupytext.read(chapter).cells[0]
    assert first.cell_type == "markdown" and "admonition} In this chapter" in first.source
    assert "You will learn" in first.source and "It assumes" in first.source
    assert "{ref}`notation`" in first.source and "{ref}`glossary`" in first.source


def test_every_term_a_page_uses_is_in_the_glossary():
    terms = glossary_terms()
    assert {"slot", "program", "split", "watermark", "parked block", "sequence group",
            "block table", "copy-on-write", "prefix cache"} <= terms
    used = {re.sub(r".*<(.*)>", r"\1", t).strip().lower()
            for p in (ROOT / "book").glob("*.md")
            for t in re.findall(r"\{term\}`([^`]+)`", p.read_text())}
    assert used and used <= terms, used - terms


# Glossary terms whose first word-for-word use is in another sense (the test reads words)
OTHER_SENSE = {
    "block": "ch02 first says it of the buddy allocator's power-of-two run of memory",
    "recompute": "ch01 first says it of the calculator's controls",
    "split": "ch01 first says it of weights divided among GPUs",
}
_LINK = "\x00"  # marks a {term} link in a chapter's prose


def _without_listings(markdown: str) -> str:
    """The Markdown without its code and math blocks; directives' text (admonitions, proofs,
    dropdowns) kept, their fences dropped."""
    kept, fences = [], []  # the open fences: (marker, holds code)
    for line in markdown.splitlines():
        fence = re.match(r"\s*(`{3,}|:{3,})\s*(\S*)", line)
        if fence and fences and fence[1] == fences[-1][0] and not fence[2]:
            fences.pop()
        elif fence:
            fences.append((fence[1], not fence[2].startswith("{")
                           or fence[2] in ("{code-block}", "{code}", "{math}")))
        elif not any(code for _, code in fences):
            kept.append(line)
    return "\n".join(kept)


def _prose(markdown: str) -> str:
    """What a reader reads of a chapter's Markdown: code, math, roles other than {term},
    comments, labels and headings blanked; each {term} link replaced by _LINK + its target."""
    markdown = _without_listings(re.sub(r"<!--.*?-->|\$\$.*?\$\$", " ", markdown, flags=re.S))
    markdown = re.sub(r"\{term\}`(?:[^`<]*<)?([^`>]+)>?`",
                      lambda m: _LINK + m[1].lower() + _LINK, markdown)
    for pattern in (r"\{[\w:-]+\}`[^`]*`", r"`[^`]*`", r"\$[^$\n]*\$", r"^#+ .*$",
                    r"^\([\w-]+\)=$", r"^:\w+:.*$"):
        markdown = re.sub(pattern, " ", markdown, flags=re.M)
    return markdown


def _defined(prose: str, match) -> bool:
    """Whether a term's use defines it: set in italics or bold, or spelt out before its
    abbreviation ("time to first token (TTFT)"), or the abbreviation itself in parentheses."""
    start, end = match.span()
    if any(s <= start and end <= e for s, e in
           (m.span() for m in re.finditer(r"(\*\*?)\S[^*\n]*?\1", prose))):
        return True
    return bool(re.match(r"\s*\([A-Z][\w-]*\)", prose[end:])) or (
        prose[start - 1:start] == "(" and prose[end:end + 1] == ")")


def test_every_glossary_term_links_or_is_defined_where_the_book_first_uses_it():
    """Read in order, a glossary term's first use links to the glossary ({term}) or defines the
    term on the spot: no chapter leans on a word the reader has not met (a chapter that
    assumes a later one's terms fails here)."""
    seen, unexplained = set(), []
    for chapter in CHAPTERS:
        prose = _prose("\n".join(c.source for c in jupytext.read(chapter).cells
                                 if c.cell_type == "markdown"))
        for term in sorted(glossary_terms() - seen):
            word = re.escape(term)
            match = re.search(rf"{_LINK}{word}{_LINK}|\b{word}(?:s|es)?\b", prose, re.I)
            if match is None:
                continue
            seen.add(term)
            if not (match[0].startswith(_LINK) or _defined(prose, match) or term in OTHER_SENSE):
                context = prose[max(0, match.start() - 60):match.end() + 20].replace("\n", " ")
                unexplained.append(f"{chapter.stem}: {term!r} in ...{context}")
    assert len(seen) > 30 and not unexplained, "\n".join(unexplained)


def test_bibliography_is_author_year_and_sorted_without_regard_to_case():
    """The book's pybtex style (book/_ext): labels as the text cites, A to Z whatever the case
    or braces of a name ({NVIDIA}, vLLM), and no raw TeX left in a rendered entry."""
    import importlib.util

    from pybtex.database import parse_file

    spec = importlib.util.spec_from_file_location("pagedlab_bib", ROOT / "book/_ext/pagedlab_bib.py")
    bib_style = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bib_style)
    data = parse_file(str(ROOT / "book" / "references.bib"))
    entries = list(bib_style.AuthorYearStyle().format_bibliography(data))
    labels = {e.key: e.label for e in entries}
    assert labels["kwon2023pagedattention"] == "Kwon et al., 2023"
    assert labels["milakov2018online"] == "Milakov and Gimelshein, 2018"
    names = [e.label.rsplit(",", 1)[0].casefold() for e in entries]
    assert names == sorted(names), names
    assert len(set(labels.values())) == len(labels), "equal author-year labels need a, b"
    assert labels["vllm_v1_rejection_sampler"].startswith("vLLM Team, 2025")  # one of many
    suffixes = [label.rsplit(", ", 1)[1].lstrip("0123456789") for label in labels.values()]
    assert all(s.isalpha() and s.islower() for s in suffixes if s), suffixes  # past z: aa
    refs = colab.load_references()  # the Colab copies cite by the same labels
    assert {k: f"{r.authors}, {r.year}" for k, r in refs.items()} == labels
    config = yaml.safe_load((ROOT / "_config.yml").read_text())["sphinx"]["config"]
    assert config["bibtex_reference_style"] == "label"  # the text cites by these labels
    texts = [e.text.render_as("text") for e in entries]
    assert not [t for t in texts if "$" in t or "\\" in t], "raw TeX in the bibliography"


def test_equal_author_years_are_told_apart_past_z():
    from pybtex.database import Entry, Person

    def entry(author, year):
        return Entry("misc", fields={"year": year}, persons={"author": [Person(author)]})

    labels = colab.labelled([entry("{vLLM Team}", "2025")] * 28 + [entry("Kwon", "2023")])
    assert [y for _, y in labels[:28]] == [f"2025{c}" for c in "abcdefghijklmnopqrstuvwxyz"] + [
        "2025aa", "2025ab"]
    assert labels[28] == ("Kwon", "2023")


def test_the_notebook_download_is_replaced_by_the_colab_copy(tmp_path):
    """book/_ext/pagedlab_downloads.py, on a built book's layout: a notebook the theme offers
    for download (`_sources/<page>.ipynb`, the MyST source as a notebook) becomes the Colab copy
    beside the page's source; one with no copy there is left as it is. The book registers it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("pagedlab_downloads",
                                                  ROOT / "book/_ext/pagedlab_downloads.py")
    downloads = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(downloads)
    src, out = tmp_path / "src", tmp_path / "html"
    (src / "book").mkdir(parents=True)
    (out / "_sources" / "book").mkdir(parents=True)
    (src / "book" / "ch01.ipynb").write_text("the Colab copy")
    (out / "_sources" / "book" / "ch01.ipynb").write_text("{glue:text}`raw`")
    (out / "_sources" / "book" / "other.ipynb").write_text("no copy beside its source")
    downloads.use_colab_copies(src, out)
    assert (out / "_sources" / "book" / "ch01.ipynb").read_text() == "the Colab copy"
    assert (out / "_sources" / "book" / "other.ipynb").read_text() == "no copy beside its source"
    config = yaml.safe_load((ROOT / "_config.yml").read_text())["sphinx"]
    assert config["local_extensions"]["pagedlab_downloads"] == "book/_ext"


def test_the_download_menu_offers_the_books_pdf():
    """book/_ext/pagedlab_downloads.py adds "book (.pdf)", a link to `pagedlab.pdf` at the site's
    root, to the download menu sphinx-book-theme makes, and calls the theme's ".pdf" (which
    prints the page alone) "page (.pdf)"; a page without that menu is left as it is."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("pagedlab_downloads",
                                                  ROOT / "book/_ext/pagedlab_downloads.py")
    downloads = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(downloads)
    page_pdf = {"type": "javascript", "text": ".pdf", "label": "download-pdf-button"}
    menu = {"type": "group", "label": "download-buttons", "buttons": [page_pdf]}
    context = {"header_buttons": [{"label": "fullscreen-button"}, menu],
               "pathto": lambda name, resource: f"../{name}" if resource else name}
    downloads.add_book_pdf(None, "book/ch01", "page.html", context, None)
    assert [b["text"] for b in menu["buttons"]] == ["page (.pdf)", "book (.pdf)"]
    assert menu["buttons"][1]["url"] == "../pagedlab.pdf"
    bare = {"header_buttons": [{"label": "fullscreen-button"}], "pathto": None}
    downloads.add_book_pdf(None, "genindex", "genindex.html", bare, None)
    assert bare["header_buttons"] == [{"label": "fullscreen-button"}]


def test_the_edition_line_names_the_device_the_chapters_ran_on(monkeypatch):
    """book/_ext/pagedlab_edition.py: a CUDA build is the GPU edition and names its GPU; a CPU
    build says whether Triton's interpreter or the torch references ran the kernels. The book
    registers it, and it becomes the theme's announcement."""
    import importlib.util
    from types import SimpleNamespace

    import torch

    from pagedlab import device

    spec = importlib.util.spec_from_file_location("pagedlab_edition",
                                                  ROOT / "book/_ext/pagedlab_edition.py")
    ext = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ext)
    monkeypatch.delenv("PAGEDLAB_SIZE", raising=False)
    monkeypatch.setattr(device, "HAS_CUDA", False)
    monkeypatch.setattr(device, "has_triton", lambda: True)
    assert ext.edition().startswith("CPU edition:")
    assert "Triton's kernels in its interpreter, at the small size preset" in ext.edition()
    monkeypatch.setattr(device, "has_triton", lambda: False)
    assert "the torch reference kernels (no Triton)" in ext.edition()
    monkeypatch.setattr(device, "HAS_CUDA", True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA H100")
    assert ext.edition() == ("GPU edition: every chapter ran on a GPU (NVIDIA H100), "
                             "Triton's kernels compiled, at the large size preset.")
    config = SimpleNamespace(html_theme_options={"use_repository_button": True})
    ext._config_inited(None, config)
    assert config.html_theme_options == {"use_repository_button": True,
                                         "announcement": ext.edition()}
    assert yaml.safe_load((ROOT / "_config.yml").read_text())["sphinx"]["local_extensions"][
        "pagedlab_edition"] == "book/_ext"
