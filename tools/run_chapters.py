"""Execute the book's chapters where no Jupyter stack is installed (a borrowed GPU machine).

Each chapter's notebook copy (book/chNN_*.ipynb, kept in sync with its MyST source by the
tests) runs cell by cell in a fresh IPython shell in its own process, as the book build would
run it, and stops at its first error. Needs IPython (and ipywidgets for the widget cells), not
Jupyter. Prints each chapter's output and writes one JSON summary:

    python tools/run_chapters.py book/ch0[6-8]*.ipynb --json results.json [--jobs 3]

With ``PAGEDLAB_BLOCK_TRITON=1`` each chapter runs with Triton unimportable, as on macOS or
Windows (``tools/no_triton.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def run_notebook(path: str) -> None:
    """Run every code cell of ``path`` in this process; exit 1 at the first failing cell."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance(colors="nocolor")
    cells = [c for c in json.loads(Path(path).read_text())["cells"] if c["cell_type"] == "code"]
    for number, cell in enumerate(cells, 1):
        result = shell.run_cell("".join(cell["source"]), store_history=False)
        if not result.success:
            print(f"FAILED: {path}, code cell {number} of {len(cells)}", flush=True)
            sys.exit(1)
    print(f"OK: {path}, {len(cells)} code cells", flush=True)


def run_chapter(path: str, timeout: float) -> dict:
    """One chapter in a child process of its own session: its status, seconds and output.
    On a timeout the whole process group is killed, so the chapter's multiprocessing workers
    die with it instead of running on as orphans."""
    start = time.perf_counter()
    env = {**os.environ, "MPLBACKEND": "Agg", "PYTHONUNBUFFERED": "1"}
    child = subprocess.Popen([sys.executable, __file__, "--one", path], env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             start_new_session=True)
    try:
        output, _ = child.communicate(timeout=timeout)
        status = "ok" if child.returncode == 0 else "failed"
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        output, _ = child.communicate()
        status = "timeout"
    return dict(chapter=path, status=status, seconds=round(time.perf_counter() - start, 1),
                output=output)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="+")
    parser.add_argument("--json", help="write the summary here")
    parser.add_argument("--jobs", type=int, default=2, help="chapters run at once")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per chapter")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        from no_triton import block_if_asked  # beside this script, first on sys.path

        block_if_asked()
        run_notebook(args.notebooks[0])
        return 0
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda p: run_chapter(p, args.timeout), args.notebooks))
    for r in results:
        print(f"===== {r['chapter']}: {r['status']} in {r['seconds']} s =====\n{r['output']}")
    print("\n".join(f"{r['status']:>8} {r['seconds']:7.1f} s  {r['chapter']}" for r in results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return int(any(r["status"] != "ok" for r in results))


if __name__ == "__main__":
    sys.exit(main())
