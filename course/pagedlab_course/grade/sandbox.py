"""The process a submission runs in: fresh, its own, in an empty scratch directory with a clean
environment, with resource limits (``Limits``) set before its code starts, and, where bubblewrap
can make Linux namespaces, sealed off from the machine.

Two levels, chosen by a check that runs bubblewrap once (``probe()``):

- ``bwrap``: the worker sees a read-only view of the interpreter, the installed packages and
  the ``pagedlab`` and ``pagedlab_course`` packages (without the hidden checks), a private writable ``/tmp`` and
  ``/scratch`` of a fixed size that vanish with it, no network, its own process ids (it cannot
  see or signal the grader or another submission) and nothing else: not the references, an
  instructor's checks, the submissions or the home directory. It dies with the grader.
- ``process``: where bubblewrap is absent or cannot create namespaces (some containers and CI
  runners). A fresh process per submission, a new session, an empty temporary working
  directory and a clean environment; it runs with the grader's user, so the files it could
  write are protected only by the static rules (``pagedlab_course.grade.rules``) and detected after
  the fact: the grader compares digests of the package, the references and the instructor's
  checks before and after a batch and refuses to go on if one changed. A batch is graded at
  this level only when the instructor asks (``--allow-unsealed``), and every report says so.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from pagedlab_course.grade import seal as seal_module

# The two packages the worker imports, wherever they are installed: the library the students
# use, and this course package, whose hidden checks the worker must not see.
PACKAGES = tuple(Path(importlib.util.find_spec(name).origin).resolve().parent
                 for name in ("pagedlab", "pagedlab_course"))
HIDDEN = PACKAGES[1] / "grade" / "hidden"


def forbidden(names: list[str]) -> dict[str, list[str]]:
    """The assignment's forbidden names as the submission's process must lack them: modules
    (imported there as stubs; their files hidden under bubblewrap: ``paths``) and single callables
    (``torch.softmax``, replaced there)."""
    found = {"modules": [], "callables": [], "paths": []}
    for name in names:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):  # "torch.nn.functional.softmax": its parent is not a package
            spec = None
        if spec is None:
            found["callables"].append(name)
            continue
        found["modules"].append(name)
        if spec.submodule_search_locations:
            found["paths"] += [str(Path(p).resolve()) for p in spec.submodule_search_locations]
        elif spec.origin:
            origin = Path(spec.origin).resolve()
            found["paths"] += [str(origin), *map(str, sorted(origin.parent.glob(f"__pycache__/{origin.stem}.*.pyc")))]
    return found


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


def bwrap_command(argv: list[str], sizes: list[str] = (), hide: list[str] = ()) -> list[str]:
    """bubblewrap's command line for ``argv``; ``sizes`` (``--size BYTES``) caps each tmpfs;
    ``hide``: files and directories of the packages left out (the assignment's forbidden modules,
    for the submission's process: an empty directory or file in their place)."""
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
    for path in hide:
        cmd += ["--tmpfs", path] if os.path.isdir(path) else ["--ro-bind", "/dev/null", path]
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
# Without address randomisation (personality ADDR_NO_RANDOMIZE), so that the judge and the
# submission's process lay out the interpreter alike: an object hashed by its address hashes the
# same in both (Python 3.11's None: A3's block keys are ``hash((None, tokens))``).
# A submission's process at the ``process`` level is sealed there too (``grade/seal.py``): a seccomp
# filter, and no capabilities when the grader is root, both kept across the exec.
_LIMITED = ("import ctypes, os, resource, sys\n"
            "for name, value in {limits}.items():\n"
            "    resource.setrlimit(getattr(resource, name), (value, value))\n"
            "ctypes.CDLL(None).personality(0x0040000)\n"
            "{seal}"
            "os.execv(sys.argv[1], sys.argv[1:])\n")
_SEAL = "from pagedlab_course.grade import seal\nseal.apply()\n"


WORKERS: set[int] = set()  # the workers running now; any other child of the grader is an orphan of one
_CHILDREN = threading.Lock()  # held while a worker starts or orphans are looked for


@functools.lru_cache(maxsize=None)
def _adopt_orphans() -> bool:
    """Make the grader the parent of every process its workers orphan (Linux's child subreaper),
    however it forked and whatever session it made, so that ``stop`` finds it."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def start(argv: list[str], scratch: str, limits: Limits, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
          pass_fds: tuple = (), hide: list[str] = (), sealed: bool = False) -> subprocess.Popen:
    """``argv`` started at the best level with ``limits``, in a session of its own, its stderr a
    pipe, its stdin and stdout pipes unless given, ``pass_fds`` open in it; ``hide``: see
    ``bwrap_command`` (nothing is hidden at the ``process`` level); ``sealed`` (the submission's
    process): at the ``process`` level, sealed by ``grade/seal.py``, and the grader made
    undumpable (its pipes out of reach of the submission's ``/proc``)."""
    seal = ""
    if level() == "bwrap":
        sizes = ["--size", str(limits.scratch_mb << 20)]
        cmd, env = bwrap_command(argv, sizes, hide), None
    else:
        cmd, env = argv, _env(scratch)
        if sealed:
            seal_module.undumpable()
            seal = _SEAL
    cmd = [sys.executable, "-c", _LIMITED.format(limits=limits.rlimits(), seal=seal), shutil.which(cmd[0]) or cmd[0],
           *cmd[1:]]
    _adopt_orphans()
    with _CHILDREN:
        proc = subprocess.Popen(cmd, stdin=stdin, stdout=stdout, stderr=subprocess.PIPE, env=env, cwd=scratch,
                                start_new_session=True, pass_fds=pass_fds)
        WORKERS.add(proc.pid)
    return proc


def _stat(pid) -> list[str] | None:
    """/proc/PID/stat's fields after the command's name (state, parent, ...), or None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _children() -> dict[int, dict[int, str]]:
    """Every process's children (from /proc), each with its start time, which tells it from a
    later process given the same id."""
    children: dict[int, dict[int, str]] = {}
    for entry in os.scandir("/proc"):
        fields = _stat(entry.name) if entry.name.isdigit() else None
        if fields:
            children.setdefault(int(fields[1]), {})[int(entry.name)] = fields[19]
    return children


def descendants(pid: int, children: dict[int, dict[int, str]] | None = None) -> dict[int, str]:
    """The processes below ``pid`` (the sandbox's show with the host's ids), with start times."""
    children = _children() if children is None else children
    found, todo = {}, [pid]
    while todo:
        below = children.get(todo.pop(), {})
        found.update(below)
        todo += below
    return found


def stop(proc: subprocess.Popen, seen: dict[int, str] | None = None) -> None:
    """Kill the process, its session's group, every process below it or ``seen`` below it
    before, and every orphan the grader adopted, and wait for them. Where the kernel lets the
    grader adopt orphans (Linux), nothing a submission started outlives it; elsewhere a process
    that left the session and its parent between two looks escapes in the ``process`` level.
    Under bwrap everything dies with the sandbox's pid namespace anyway."""
    _kill({**(seen or {}), **descendants(proc.pid)})
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    proc.wait()
    with _CHILDREN:
        WORKERS.discard(proc.pid)
        children = _children()
        orphans = {pid: started for pid, started in children.get(os.getpid(), {}).items() if pid not in WORKERS}
        _kill({**orphans, **{p: t for pid in orphans for p, t in descendants(pid, children).items()}})
        for pid in orphans:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


def _kill(processes: dict[int, str]) -> None:
    """SIGKILL each process that is still the one with that start time (not a later one given its id)."""
    for pid, started in processes.items():
        fields = _stat(pid)
        if fields and fields[19] == started:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


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
