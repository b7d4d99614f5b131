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
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
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


def bwrap_command(argv: list[str], sizes: list[str] = ()) -> list[str]:
    """bubblewrap's command line for ``argv``; ``sizes`` (``--size BYTES``) caps each tmpfs."""
    cmd = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--clearenv", "--proc", "/proc",
           "--dev", "/dev", *sizes, "--tmpfs", "/tmp", *sizes, "--tmpfs", "/scratch", "--chdir", "/scratch"]
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
def probe() -> tuple[str, str]:
    """('bwrap', '') if bubblewrap runs a sealed python here, else ('process', why not)."""
    if os.environ.get("PAGEDLAB_GRADE_SANDBOX") == "process":
        return "process", "PAGEDLAB_GRADE_SANDBOX=process asks for it"
    if shutil.which("bwrap") is None:
        return "process", "bwrap is not installed"
    try:
        done = subprocess.run(bwrap_command([sys.executable, "-c", "print('ok')"]), capture_output=True,
                              text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        return "process", f"bwrap did not run: {type(err).__name__}: {err}"
    if done.returncode == 0 and done.stdout.strip() == "ok":
        return "bwrap", ""
    return "process", f"bwrap failed (status {done.returncode}): {done.stderr.strip()[-300:]}"


def level() -> str:
    """'bwrap' or 'process': see the module's docstring."""
    return probe()[0]



@dataclass(frozen=True)
class Limits:
    """What one submission's process may take, set by the grader before the worker's code runs
    (resource limits, inherited and never raised again without privileges) or watched from the
    grader's side (processes, output, time)."""

    memory_mb: int = 4096  # RLIMIT_DATA: the heap and private mappings, not a GPU's address space
    file_mb: int = 64  # RLIMIT_FSIZE: any one file written
    scratch_mb: int = 256  # bwrap's /tmp and /scratch (tmpfs)
    processes: int = 64  # counted by the grader from outside (RLIMIT_NPROC does not bind root)
    output_mb: int = 16  # the results read from the worker

    def rlimits(self) -> dict[str, int]:
        return {"RLIMIT_DATA": self.memory_mb << 20, "RLIMIT_FSIZE": self.file_mb << 20, "RLIMIT_CORE": 0}


# Sets the limits in the child, then becomes the command: nothing of the grader's runs after it.
_LIMITED = ("import os, resource, sys\n"
            "for name, value in {}.items():\n"
            "    resource.setrlimit(getattr(resource, name), (value, value))\n"
            "os.execv(sys.argv[1], sys.argv[1:])\n")


def start(argv: list[str], scratch: str, limits: Limits) -> subprocess.Popen:
    """``argv`` started at the best level with ``limits``, in a session of its own, its stdin,
    stdout and stderr pipes (bytes)."""
    if level() == "bwrap":
        sizes = ["--size", str(limits.scratch_mb << 20)]
        cmd, env = bwrap_command(argv, sizes), None
    else:
        cmd, env = argv, _env(scratch)
    cmd = [sys.executable, "-c", _LIMITED.format(limits.rlimits()), shutil.which(cmd[0]) or cmd[0], *cmd[1:]]
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=env, cwd=scratch, start_new_session=True)


def descendants(pid: int) -> dict[int, str]:
    """The processes below ``pid`` (from /proc; the sandbox's show with the host's ids), each
    with its start time, which tells it from a later process given the same id."""
    children: dict[int, list[tuple[int, str]]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            children.setdefault(int(fields[1]), []).append((int(entry.name), fields[19]))
    found, todo = {}, [pid]
    while todo:
        for child, started in children.get(todo.pop(), []):
            found[child] = started
            todo.append(child)
    return found


def stop(proc: subprocess.Popen, seen: dict[int, str] | None = None) -> None:
    """Kill the process, its session's group, every process below it and every process ``seen``
    below it before (one that was orphaned since), and wait for it. A process that left the
    session and its parent between two looks (a double fork with setsid) escapes this in the
    ``process`` level; under bwrap it dies with the sandbox's pid namespace."""
    below = {**(seen or {}), **descendants(proc.pid)}
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    for pid, started in below.items():
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[19] == started:
                    os.kill(pid, signal.SIGKILL)
        except (OSError, IndexError):
            pass
    proc.wait()


def run(argv: list[str], stdin: str, timeout: float, limits: Limits = Limits()) -> tuple[int | None, str, str]:
    """Run ``argv`` sealed at the best level: (exit status or None if it ran past ``timeout``
    and was killed, stdout, stderr)."""
    with tempfile.TemporaryDirectory(prefix="pagedlab-grade-") as scratch:
        proc = start(argv, scratch, limits)
        try:
            out, err = proc.communicate(stdin.encode(), timeout=timeout)
            status = proc.returncode
        except subprocess.TimeoutExpired:
            status, out, err = None, b"", b""
        stop(proc)
        return status, out.decode(errors="replace"), err.decode(errors="replace")
