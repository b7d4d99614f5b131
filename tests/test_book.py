"""The book's sources agree with what is derived from them and with each other."""

import re
from pathlib import Path

import jupytext
import nbformat
import pytest
import yaml

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


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_colab_notebook_matches_its_chapter(chapter):
    """The launch button opens book/<chapter>.ipynb; it must hold the chapter's cells."""
    colab = chapter.with_suffix(".ipynb")
    assert colab.exists(), f"{colab.name} missing: run `make notebooks`"
    source = jupytext.read(chapter)
    copy = nbformat.read(colab, as_version=4)
    as_pairs = lambda nb: [(c.cell_type, c.source, c.metadata.get("tags", [])) for c in nb.cells]
    assert as_pairs(copy) == as_pairs(source), f"{colab.name} is stale: run `make notebooks`"
    assert not any(c.get("outputs") for c in copy.cells), f"{colab.name} must be stored without outputs"


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_installs_pagedlab_on_colab_first(chapter):
    first = next(c for c in jupytext.read(chapter).cells if c.cell_type == "code")
    assert "pip install" in first.source and "pagedlab" in first.source


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
    env = yaml.safe_load((ROOT / "environment.yml").read_text())["dependencies"]
    conda = {_name(d) for d in env if isinstance(d, str)} - {"python", "pip"}
    pip = {_name(d) for d in next(d["pip"] for d in env if isinstance(d, dict)) if not d.startswith("-e")}
    assert {"pytorch" if n == "torch" else n for n in declared} == conda | pip


BUILT = ROOT / "_build" / "html"


@pytest.mark.skipif(not BUILT.exists(), reason="the book is not built (`make test` builds it first)")
@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_built_chapter_has_outputs_and_a_colab_button_to_its_notebook(chapter):
    html = (BUILT / "book" / f"{chapter.stem}.html").read_text()
    links = set(re.findall(r"colab\.research\.google\.com/github/[^/]+/[^/]+/blob/[^/]+/([^\"]+)", html))
    assert links == {f"book/{chapter.stem}.ipynb"}
    assert 'class="output' in html, "no executed output in the built chapter"


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
