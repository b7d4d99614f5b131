"""A live playground in a real JupyterLab with a real kernel (issue 51, item 5): headless
Chromium (Debian's `chromium`, launched as tests/test_browser.py does) opens a notebook in a
`jupyter lab` server of this venv, runs its cells from the Run menu and clicks the widget's
buttons, whose handlers run in the kernel on a real KVCacheManager.

The notebook is chapter 5's Colab copy cut down to what the playground needs: its setup cell
(the one that installs pagedlab on Colab) and its playground cell, copied by content, so the
test breaks if the chapter's playground cell changes shape; running the whole chapter would
take minutes. The same playground cell, run here in the test's own process, is the twin that
says what each click must show: the log line its handler writes and the picture it draws. An
HTML export could not do this: without a kernel no button calls Python.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from book_browser import CHROMIUM, CHROMIUM_ARGS  # noqa: E402

CHAPTER = ROOT / "book" / "ch05_sharing.ipynb"
TOKEN = "pagedlab-live-widgets"
BUG = "a bug under the resume button"  # what the test's own cell makes swap_in raise
# The longest any one wait may take, in ms; a click's answer comes in well under a second here,
# JupyterLab's start (plugins, the notebook, its kernel) in 6-12 s on two busy cores.
WAIT, START = 20_000, 40_000

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path(CHROMIUM).exists(),
                       reason="no chromium: `apt-get install -y chromium` (.ci/run does it)"),
]


def chapter_cells() -> tuple[str, str, str]:
    """The Colab copy's setup cell and its playground cell, and the playground's name."""
    cells = [c for c in json.loads(CHAPTER.read_text())["cells"] if c["cell_type"] == "code"]
    sources = ["".join(c["source"]) for c in cells]
    setup = [s for s in sources if 'find_spec("pagedlab")' in s]
    playground = [s for s in sources if "KVPlayground(" in s]
    assert len(setup) == 1 and len(playground) == 1, (
        f"{CHAPTER.name}: expected one setup cell and one KVPlayground cell, found "
        f"{len(setup)} and {len(playground)}")
    name = re.search(r"^(\w+) = KVPlayground\(", playground[0], re.M)
    assert name, f"{CHAPTER.name}'s playground cell names no KVPlayground:\n{playground[0]}"
    return setup[0], playground[0], name[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def lab(tmp_path):
    """A `jupyter lab` server (no browser, a known token, this venv's kernel, this checkout's
    pagedlab on PYTHONPATH) serving a notebook of the chapter's cells and one of the test's
    own; its url. At the end, even on failure, the server is shut down through its API, which
    ends its kernels; whatever outlives that is killed."""
    pytest.importorskip("jupyterlab", reason="jupyterlab is not installed")
    pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    pytest.importorskip("ipywidgets", reason="ipywidgets is not installed")
    import nbformat
    import psutil  # ipykernel's own dependency

    setup, playground, name = chapter_cells()
    test_cell = (  # the test's own cell: a library bug that only the resume button reaches
        f"def broken(*args):\n    raise RuntimeError({BUG!r})\n\n"
        f"{name}.mgr.swap_in = broken\n"
        "import pagedlab\nprint(pagedlab.__file__)")
    notebook_dir = tmp_path / "notebooks"  # the server's root: only the notebook in it
    notebook_dir.mkdir()
    nb = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell(s) for s in (setup, playground, test_cell)],
        metadata=json.loads(CHAPTER.read_text())["metadata"])
    nbformat.write(nb, notebook_dir / "play.ipynb")

    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "course")]),
               OMP_NUM_THREADS="1",
               # nothing read from or written to the user's Jupyter settings or workspaces
               JUPYTER_CONFIG_DIR=str(tmp_path / "config"),
               JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
               JUPYTERLAB_SETTINGS_DIR=str(tmp_path / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "workspaces"))
    log = open(tmp_path / "lab.log", "w")
    # the kernel spec's "python" is this interpreter (jupyter_client runs sys.executable)
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root",
         "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
         f"--IdentityProvider.token={TOKEN}", f"--ServerApp.root_dir={notebook_dir}",
         "--LabApp.news_url=None",
         "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
        env=env, cwd=notebook_dir, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30  # the server imports its extensions: 3-6 s here
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status?token={TOKEN}", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"jupyter lab did not start:\n{(tmp_path / 'lab.log').read_text()}")
                time.sleep(0.2)
        yield url
    finally:
        kernels = psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []
        try:
            urllib.request.urlopen(urllib.request.Request(
                f"{url}/api/shutdown?token={TOKEN}", method="POST"), timeout=5)
            proc.wait(timeout=20)  # it asks each kernel to stop, and kills it after 5 s
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
        _, alive = psutil.wait_procs(kernels, timeout=5)
        for p in alive:
            p.kill()
        log.close()
        assert not alive, f"kernel processes outlived the server: {alive}"


def expected_after(playground: str, name: str, *operations) -> tuple[str, str]:
    """The twin: the playground cell run here, then ``operations``; its last log line and its
    picture (the HTML the widget shows)."""
    namespace: dict = {}
    exec(playground, namespace)
    play = namespace[name]
    for op in operations:
        play.do(*op)
    return play.log[-1], play.picture()


def test_a_playground_runs_in_jupyterlab_and_its_buttons_drive_the_manager(lab):
    """Run All Cells from the Run menu; the widget shows what the chapter's cell did; append to
    the parent of a fork shows its shared block copied, then the append, exactly the log line and
    pictures the twin draws; fork onto an existing sequence shows the manager's refusal and
    changes no picture; a bug under a button shows in the widget's log."""
    from playwright import sync_api

    _, playground, name = chapter_cells()
    messages: list[str] = []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("console", lambda m: messages.append(f"{m.type}: {m.text}"))
            page.on("pageerror", lambda e: messages.append(f"uncaught: {e}"))
            drive(page, lab, playground, name, messages)
        finally:
            browser.close()


def drive(page, url, playground, name, messages):
    from playwright.sync_api import expect

    def why(what):
        return f"{what}; the page's console said:\n" + "\n".join(messages[-30:])

    page.set_default_timeout(WAIT)
    page.goto(f"{url}/lab/tree/play.ipynb?token={TOKEN}")
    # JupyterLab loads its ~100 plugins, opens the notebook and starts a kernel for it, all
    # after the page's load event: the status bar says Idle once the kernel answers.
    page.wait_for_selector("#jp-main-statusbar >> text=Idle", timeout=START)
    page.locator(".lm-MenuBar-item", has_text="Run").first.click()
    page.locator("li[data-command='runmenu:run-all']").click()  # Run > Run All Cells

    # The kernel runs the cells and sends the widget's models; the front end (jupyterlab_widgets'
    # labextension) draws them when the models arrive.
    widget = page.locator(".jp-OutputArea-output .widget-vbox").first
    try:
        widget.wait_for()
    except Exception:
        pytest.fail(why("no widget rendered: is jupyterlab_widgets' labextension there?"))
    prints = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stdout']")
    # the test's cell, run after the playground's, prints where the kernel found pagedlab
    expect(prints.last).to_contain_text(str(ROOT / "pagedlab"), timeout=WAIT)
    shown = widget.locator(":scope > .widget-html .widget-html-content").all()
    assert len(shown) == 2, "the playground is no longer its controls, a picture and a log"
    picture, log = shown

    def same_as_browser_parses(markup):  # the twin's HTML as the page would hold it
        return page.evaluate("h => { const t = document.createElement('template');"
                             " t.innerHTML = h; return t.innerHTML }", markup)

    def last_line():
        return log.inner_text().strip().splitlines()[-1]

    def press(label):
        widget.locator("button", has_text=re.compile(f"^{re.escape(label)}$")).click()

    # What the chapter's cell did shows as the twin predicts.
    line, drawn = expected_after(playground, name)
    assert last_line() == line
    assert picture.inner_html() == same_as_browser_parses(drawn)

    # Append to the parent of a fork: its shared last block is copied first. Each input is set
    # as a reader would: typing in a text box syncs at once, a number box when Enter is pressed.
    # by role: a block view is an image whose label names sequences and tokens too
    widget.get_by_role("textbox", name="sequence", exact=True).fill("A")
    widget.get_by_role("textbox", name="fork into", exact=True).fill("B")
    widget.get_by_role("spinbutton", name="tokens", exact=True).fill("1")
    widget.get_by_role("spinbutton", name="tokens", exact=True).press("Enter")
    press("append")
    append = ("append", "A", 1)
    line, drawn = expected_after(playground, name, append)
    assert "copied" in line  # the test exercises copy-on-write, or the chapter changed
    # The click goes to the kernel over the websocket; the handler's new picture, then its
    # log, come back as model updates a moment later, in that order.
    expect(log).to_contain_text(line, timeout=WAIT)
    assert last_line() == line
    assert picture.inner_html() == same_as_browser_parses(drawn)
    assert drawn.count("<svg") == 2 == picture.locator("svg").count()  # the copy, the append

    # An invalid operation: B exists already. The manager's own message, and no change.
    before = picture.inner_html()
    press("fork")
    line, _ = expected_after(playground, name, append, ("fork", "A", "B"))
    assert line.startswith("refused: fork A B:")
    expect(log).to_contain_text(line, timeout=WAIT)  # the refusal too comes from the kernel
    assert last_line() == line and picture.inner_html() == before

    # A bug in the library (the test's cell made swap_in raise) shows in the page, not only in
    # JupyterLab's log console, where ipywidgets sends a callback's traceback.
    press("resume (swap in)")
    expect(log).to_contain_text(f"RuntimeError: {BUG}", timeout=WAIT)
    assert last_line().startswith("error in resume (swap in)")
    assert last_line().endswith(f"RuntimeError: {BUG}")
    uncaught = [m for m in messages if m.startswith("uncaught")]
    assert not uncaught, why("uncaught errors in the page")
