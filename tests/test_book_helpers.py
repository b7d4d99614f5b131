"""The helpers chapters share: marked source excerpts, tensor differences, timing."""

import importlib
import re
import textwrap
from pathlib import Path

import pytest
import torch

from pagedlab.book import excerpt, max_diff
from pagedlab.kernels import decode
from pagedlab.timing import copy_bandwidth, seconds_per_call

BOOK = Path(__file__).resolve().parents[1] / "book"
CALL = re.compile(r"""excerpt\((\w+)\.(\w+), "(\w+)"\)""")  # excerpt(module.function, "section")


def test_a_section_is_the_lines_between_its_markers_without_any_marker(capsys):
    excerpt(decode._paged_attention_kernel, "split")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("# This split's tokens")
    assert lines[-1] == "end = tl.minimum(start + split_len, seq_len)"
    excerpt(decode._paged_attention_kernel, "grid")  # holds the split section inside it
    grid = capsys.readouterr().out
    assert "\n".join(lines) in grid and "# >>>" not in grid and "# <<<" not in grid
    excerpt(decode._paged_attention_kernel)  # the whole kernel, still without markers
    whole = capsys.readouterr().out
    assert whole.startswith("@triton.jit") and "# >>>" not in whole
    assert textwrap.indent(grid, "    ") in whole  # the section, at the kernel body's indent


def test_an_unknown_section_is_named_with_the_sections_there_are():
    with pytest.raises(ValueError, match=r"no section 'nope' .* \['merge'\]"):
        excerpt(decode._merge_splits_kernel, "nope")


def _excerpted(owner: str, name: str):
    """``excerpt(module.function, ...)`` names a kernel module's function;
    ``excerpt(Class.method, ...)`` a method of a class from ``pagedlab.memory`` (chapter 4)."""
    try:
        return getattr(importlib.import_module(f"pagedlab.kernels.{owner}"), name)
    except ModuleNotFoundError:
        return getattr(getattr(importlib.import_module("pagedlab.memory"), owner), name)


def test_every_section_the_chapters_excerpt_exists(capsys):
    calls = [(md.name, *c) for md in sorted(BOOK.glob("ch*.md"))
             for c in CALL.findall(md.read_text())]
    assert len(calls) >= 10  # chapters 7 and 11
    for chapter, module, function, section in calls:
        fn = _excerpted(module, function)
        excerpt(fn, section)
        assert capsys.readouterr().out.strip(), (chapter, function, section)


def test_max_diff_is_the_largest_absolute_difference_in_float64():
    a = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float16)
    b = torch.tensor([1.5, -2.0, 3.0])
    assert max_diff(a, b) == 4.0
    assert max_diff(torch.tensor([1e-12], dtype=torch.float64), torch.zeros(1)) == 1e-12


def test_seconds_per_call_warms_up_then_takes_the_median():
    calls = []
    assert seconds_per_call(lambda: calls.append(1), repeats=5) >= 0
    assert len(calls) == 6 or torch.cuda.is_available()  # do_bench decides on a GPU
    assert copy_bandwidth(2**12) > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU's timing: CUDA runs do_bench")
def test_seconds_per_call_on_a_cpu_counts_work_not_waiting():
    """Time the process spends off the cores (here asleep; on a shared machine, waiting for
    another program's turn) is not the call's cost."""
    import time

    assert seconds_per_call(lambda: time.sleep(0.05)) < 0.01


def test_gpu_results_away_from_the_repository_downloads_once_then_reads_the_cache(
        tmp_path, monkeypatch):
    """As on Colab: no benchmarks/results beside the notebook, so the committed run comes
    from the published repository, once; offline afterwards, the cached copy serves."""
    import json

    from pagedlab import book

    site = tmp_path / "site"
    site.mkdir()
    (site / "mine.json").write_text(json.dumps({"device": "X", "date": "2026-12-03"}))
    monkeypatch.setattr(book, "RESULTS_URL", site.as_uri())
    monkeypatch.setenv("PAGEDLAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path / "site")  # no benchmarks/ here nor one level up
    assert book.gpu_results("mine") == {"device": "X", "date": "2026-12-03"}
    (site / "mine.json").unlink()  # offline now
    assert book.gpu_results("mine")["device"] == "X"
    with pytest.raises(FileNotFoundError, match=r"benchmarks/results/other.json is neither"):
        book.gpu_results("other")


def test_a_download_cut_short_or_corrupt_leaves_no_file_in_the_cache(tmp_path, monkeypatch):
    """gpu_results and trace_path trust what the cache holds: a download killed before it
    completes, or one whose bytes are not the published file's, must leave nothing there."""
    from pathlib import Path

    from pagedlab.checkpoints import download_to_cache

    source = tmp_path / "mine.json"
    source.write_text('{"device": "X"}')
    target = tmp_path / "cache" / "results" / "mine.json"
    with pytest.raises(ValueError, match=r"not the published one \(SHA-256 [0-9a-f]{64}, "):
        download_to_cache(source.as_uri(), target, sha256="0" * 64)
    assert not target.exists()

    def killed(self, target):
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "replace", killed)  # the process dies before the rename
    with pytest.raises(KeyboardInterrupt):
        download_to_cache(source.as_uri(), target)
    assert not target.exists()
    monkeypatch.undo()
    assert download_to_cache(source.as_uri(), target).read_text() == '{"device": "X"}'
