"""The process a submission runs in: fresh, its own, in an empty scratch directory with a clean
environment, and, where bubblewrap can make Linux namespaces, sealed off from the machine.

Two levels, chosen by a check that runs bubblewrap once (``level()``):

- ``bwrap``: the worker sees a read-only view of the interpreter, the installed packages and
  the ``pagedlab`` and ``pagedlab_course`` packages (without the hidden checks), a private writable ``/tmp`` and
  ``/scratch`` that vanish with it, no network, its own process ids (it cannot see or signal
  the grader or another submission) and nothing else: not the references, an instructor's
  checks, the submissions or the home directory. It dies with the grader.
- ``process``: where bubblewrap is absent or cannot create namespaces (some containers and CI
  runners). A fresh process per submission, a new session, an empty temporary working
  directory and a clean environment; it runs with the grader's user, so the files it could
  write are protected only by the static rules (``pagedlab_course.grade.rules``) and detected after
  the fact: the grader compares digests of the package, the references and the instructor's
  checks before and after each submission and refuses to go on if one changed.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# The two packages the worker imports, wherever they are installed: the library the students
# use, and this course package, whose hidden checks the worker must not see.
PACKAGES = tuple(Path(importlib.util.find_spec(name).origin).resolve().parent
                 for name in ("pagedlab", "pagedlab_course"))
HIDDEN = PACKAGES[1] / "grade" / "hidden"


def _env(home: str) -> dict[str, str]:
    env = {"PATH": "/usr/bin:/bin", "HOME": home, "TMPDIR": "/tmp" if home == "/scratch" else home,
           "LANG": "C.UTF-8", "MPLBACKEND": "Agg", "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1",
           "PYTHONPATH": os.pathsep.join(dict.fromkeys(str(p.parent) for p in PACKAGES)), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "TRITON_CACHE_DIR": f"{home}/.triton", "MPLCONFIGDIR": f"{home}/.mpl"}
    for name in ("TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES"):  # the device the course runs on
        if name in os.environ:
            env[name] = os.environ[name]
    return env


def _readable() -> list[str]:
    """What the worker must read: the interpreter, its standard library and the installed
    packages (the entries of sys.path inside an interpreter or environment prefix); the package
    itself is bound separately, and a checkout's other files never."""
    prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    paths = set(prefixes) | {os.path.realpath(sys.executable)}
    for entry in sys.path:
        real = os.path.realpath(entry) if entry else ""
        if real and os.path.isdir(real) and any(real.startswith(p + os.sep) for p in prefixes):
            paths.add(real)
    paths |= {sys.prefix, os.path.dirname(sys.executable)}  # the environment as it is named (a symlink)
    return sorted(p for p in paths if os.path.exists(p))


def bwrap_command(argv: list[str]) -> list[str]:
    cmd = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--clearenv",
           "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--tmpfs", "/scratch", "--chdir", "/scratch"]
    for system in ("/usr", "/bin", "/lib", "/lib64", "/sbin", "/etc"):
        if os.path.islink(system):
            cmd += ["--symlink", os.readlink(system), system]
        elif os.path.exists(system):
            cmd += ["--ro-bind", system, system]
    for path in _readable():
        cmd += ["--ro-bind", path, path]
    for package in PACKAGES:
        cmd += ["--ro-bind", str(package), str(package)]
    cmd += ["--tmpfs", str(HIDDEN)]
    for name, value in _env("/scratch").items():
        cmd += ["--setenv", name, value]
    return cmd + argv


@functools.lru_cache(maxsize=None)
def level() -> str:
    """'bwrap' if bubblewrap runs a sealed python here, else 'process'."""
    if os.environ.get("PAGEDLAB_GRADE_SANDBOX") == "process" or shutil.which("bwrap") is None:
        return "process"
    try:
        done = subprocess.run(bwrap_command([sys.executable, "-c", "print('ok')"]), capture_output=True,
                              text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return "process"
    return "bwrap" if done.returncode == 0 and done.stdout.strip() == "ok" else "process"


def run(argv: list[str], stdin: str, timeout: float) -> tuple[int | None, str, str]:
    """Run ``argv`` sealed at the best level: (exit status or None if it ran past ``timeout``
    and was killed, stdout, stderr)."""
    with tempfile.TemporaryDirectory(prefix="pagedlab-grade-") as scratch:
        if level() == "bwrap":
            cmd, env, cwd = bwrap_command(argv), None, scratch
        else:
            cmd, env, cwd = argv, _env(scratch), scratch
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=env, cwd=cwd, start_new_session=True)
        try:
            out, err = proc.communicate(stdin, timeout=timeout)
            return proc.returncode, out, err
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            out, err = proc.communicate()
            return None, out, err
