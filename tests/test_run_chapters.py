"""tools/run_chapters.py: a chapter that runs past its timeout takes its workers with it."""

import importlib.util
import json
import os
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("run_chapters", ROOT / "tools" / "run_chapters.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _alive(pid: int) -> bool:
    """Running, not merely a zombie waiting to be reaped."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_a_timed_out_chapter_leaves_no_worker_running(tmp_path):
    pidfile = tmp_path / "worker.pid"
    # The worker lets go of the chapter's output pipe: one left running would otherwise hold
    # the run open till it ended, and pass the check below, late.
    cell = "\n".join([
        "import multiprocessing, os, pathlib, time",
        "def work():",
        "    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)",
        "    os.dup2(1, 2)",
        "    time.sleep(120)",
        "worker = multiprocessing.get_context('fork').Process(target=work)",
        "worker.start()",
        f"pathlib.Path({str(pidfile) + '.new'!r}).write_text(str(worker.pid))",
        f"pathlib.Path({str(pidfile) + '.new'!r}).rename({str(pidfile)!r})",
        "time.sleep(120)",
    ])
    notebook = tmp_path / "chXX.ipynb"
    notebook.write_text(json.dumps({"cells": [{"cell_type": "code", "source": [cell]}]}))
    # The chapter hangs; the timeout must come after it has started its worker (Python, IPython,
    # a fork: under 2 s here with both cores busy), so a run killed before that is tried again
    # with twice the time, to 30 s at most
    for timeout in (2, 4, 8, 16, 30):
        result = _tool().run_chapter(str(notebook), timeout=timeout)
        assert result["status"] == "timeout", result
        if pidfile.exists():
            break
    else:
        pytest.fail("the chapter never started its worker before its timeout")
    worker = int(pidfile.read_text())
    for _ in range(50):  # the kill is sent; give the kernel a moment to deliver it
        if not _alive(worker):
            break
        time.sleep(0.1)
    alive = _alive(worker)
    if alive:
        os.kill(worker, 9)
    assert not alive, f"worker {worker} of the timed-out chapter is still running"
