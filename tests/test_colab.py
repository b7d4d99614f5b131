"""The Colab copies behave like the book: what the book hides is folded, and a copy run from a
wheel, away from the repository, computes the numbers its prose quotes."""

import re
import shutil
from pathlib import Path

import jupytext
import nbformat
import pytest
import wheels

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "book").glob("ch*.md"))
HIDDEN = {"remove-cell", "remove-input", "hide-input"}  # Jupyter Book's tags that hide code
# Colab's form syntax: a first line `# @title Text { display-mode: "form" }`
COLAB_TITLE = re.compile(r'^#\s*@title\s+[^{}\n]+\{\s*display-mode:\s*"form"\s*\}$')


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_every_cell_the_book_hides_is_folded_in_its_colab_copy(chapter):
    """Colab ignores the book's tags: a hidden cell must be in Colab's form view (a title, the
    code behind "Show code") and folded for JupyterLab; every other cell stays open."""
    source = [c for c in jupytext.read(chapter).cells if c.cell_type == "code"]
    copy = [c for c in nbformat.read(chapter.with_suffix(".ipynb"), as_version=4).cells
            if c.cell_type == "code"]
    assert copy[0].source == source[0].source  # the install cell, first and shown
    assert len(copy) == len(source)
    for number, (book, colab) in enumerate(zip(source[1:], copy[1:]), 2):
        where = f"{chapter.stem}, code cell {number}"
        if HIDDEN & set(book.metadata.get("tags", [])):
            title, _, code = colab.source.partition("\n")
            assert COLAB_TITLE.match(title), f"{where}: no Colab form title: {title!r}"
            assert code == book.source, f"{where}: the code changed"
            assert colab.metadata.get("cellView") == "form", where
            assert colab.metadata.get("jupyter", {}).get("source_hidden") is True, where
        else:
            assert colab.source == book.source, where
            assert "cellView" not in colab.metadata and "jupyter" not in colab.metadata, where


def glued(notebook: nbformat.NotebookNode) -> dict[str, str]:
    """The values an executed notebook glued, as MyST-NB records them (its text/plain repr)."""
    values = {}
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            name = output.get("metadata", {}).get("scrapbook", {}).get("name")
            if name:
                text = output["data"]["application/papermill.record/text/plain"]
                values[name] = text[1:-1] if text[:1] in "'\"" and text[-1:] == text[:1] else text
    return values


COLAB_CHAPTER = "ch02_contiguous_allocation"  # about a minute; the Azure traces, no timings


@pytest.mark.slow
def test_a_colab_copy_run_from_the_wheel_computes_the_numbers_its_prose_quotes(tmp_path, monkeypatch):
    """As Colab runs it: pagedlab installed from a wheel, the copy alone in a folder with no
    repository and no ../shared beside it. The traces come from the cache `trace_path` fills
    on its first download (the download is tested in test_sim_traces.py), seeded here with what
    `trace_path` finds on this machine (../shared/traces, or its own download), so the run
    needs no network. Every glued value must be the one the copy quotes, which the book build
    computed."""
    pytest.importorskip("myst_nb")  # records the glued values in the outputs
    from nbclient import NotebookClient

    from pagedlab.sim import traces

    found = {name: traces.trace_path(name) for name in traces.PUBLISHED_TRACES}
    if None in found.values():
        pytest.skip("the Azure traces are neither in ../shared/traces nor downloadable")
    site = wheels.install(tmp_path, "pagedlab")
    cache = tmp_path / "cache" / "traces"
    cache.mkdir(parents=True)
    for name, path in found.items():
        shutil.copy(path, cache / f"{name}.csv")

    run = tmp_path / "content"  # Colab's working folder
    run.mkdir()
    copy = nbformat.read(ROOT / "book" / f"{COLAB_CHAPTER}.ipynb", as_version=4)
    expected = copy.metadata["pagedlab"]["glue"]
    copy.cells.append(nbformat.v4.new_code_cell("import pagedlab; print(pagedlab.__file__)"))
    monkeypatch.setenv("PYTHONPATH", str(site))  # ahead of the shared venv's editable install
    monkeypatch.setenv("PAGEDLAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("PAGEDLAB_TRACES", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    NotebookClient(copy, timeout=900, kernel_name="python3",
                   resources={"metadata": {"path": str(run)}}).execute()

    where = copy.cells[-1].outputs[0]["text"].strip()
    assert Path(where).is_relative_to(site), f"the copy imported pagedlab from {where}"
    got = glued(copy)
    assert expected and set(expected) <= set(got), sorted(set(expected) - set(got))
    differ = {k: (got[k], v) for k, v in expected.items() if got[k] != v}
    assert not differ, f"{COLAB_CHAPTER} run from the wheel (got, prose): {differ}"
