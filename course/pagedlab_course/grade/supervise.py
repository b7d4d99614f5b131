"""The grader's side of one submission's run: it starts the judge and the submission's process,
reads the judge's results as they come, one JSON line per cell or hidden check, and enforces
from outside what code in the submission's process could dodge: each cell's time (a cell that
catches its ``CellTimeout`` still stops), the whole run's time, how much the judge may send, how
many processes the two may start. A run that is stopped keeps the
results it sent before, so a hang loses only what follows it."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time

from pagedlab_course.grade import sandbox

GRACE = 5.0  # seconds past a cell's limit before the grader stops it (the submission's and the judge's alarms come first)
STARTUP = 120.0  # seconds for the processes' imports before the first cell
POLL = 0.5  # seconds between two counts of the processes below the two
OVERFLOW, END = object(), object()
# What a cell's error says when it met a resource limit (torch and Python's words for ENOMEM, EFBIG).
HITS = {"memory": ("MemoryError", "Cannot allocate memory"), "file size": ("File too large", "EFBIG")}


def supervise(job: dict, timeout: float, limits: sandbox.Limits) -> dict:
    """The judge's results for ``job``, assembled here: {"cells", "hidden", "violations",
    "notes"}, and "crash" (why the run did not finish) when it did not. The judge and the
    submission's process run sealed, each in its own sandbox, joined only by two pipes."""
    result = {"cells": [], "hidden": [], "violations": [], "notes": []}
    with tempfile.TemporaryDirectory(prefix="pagedlab-grade-") as scratch:
        requests, answers = os.pipe(), os.pipe()  # (read, write): judge -> submission, submission -> judge
        pipes, procs, seen = [*requests, *answers], [], {}  # seen: every process seen below either, killed with them
        try:
            for name in ("worker", "judge"):
                os.mkdir(os.path.join(scratch, name))
            procs.append(sandbox.start([sys.executable, "-m", "pagedlab_course.grade.worker", json.dumps(
                {k: job["forbid"][k] for k in ("modules", "callables")})], os.path.join(scratch, "worker"), limits,
                stdin=requests[0], stdout=answers[1], hide=job["forbid"]["paths"], sealed=True))
            procs.append(sandbox.start([sys.executable, "-m", "pagedlab_course.grade.judge", str(requests[1]),
                                        str(answers[0])], os.path.join(scratch, "judge"), limits,
                                       pass_fds=(requests[1], answers[0])))
            _close(pipes)  # the grader's copies: each end is the judge's or the submission's alone
            judge = procs[1]
            lines: queue.Queue = queue.Queue()
            for target, args in ((_feed, (judge.stdin, json.dumps(job).encode())),
                                 (_read, (judge.stdout, limits.output_mb << 20, lines)),
                                 *((_drain, (p.stderr,)) for p in procs)):
                threading.Thread(target=target, args=args, daemon=True).start()
            crash = _follow(procs, lines, result, job["cell_timeout"], timeout, limits, seen)
        finally:
            _close(pipes)
            for proc in procs:
                sandbox.stop(proc, seen)
    if crash:
        result["crash"] = crash
        result["notes"].append(f"the grader stopped your submission: {crash}")
    return result


def _close(fds: list[int]) -> None:
    while fds:
        os.close(fds.pop())


def _follow(procs: list, lines: queue.Queue, result: dict, cell_timeout: float, timeout: float,
            limits: sandbox.Limits, seen: dict[int, str]) -> str | None:
    """Read the judge's lines into ``result`` until it says it is done (None) or a limit is
    hit (why, naming the cell that ran and the limit)."""
    now = time.monotonic()
    end, deadline, current, counted = now + timeout, now + STARTUP, "the start", now
    while True:
        now = time.monotonic()
        if now >= end:
            return f"it ran for more than {timeout:g} s, the time limit of a whole run, during {current}"
        if now >= deadline:
            return f"{current} ran past the time limit of {cell_timeout:g} s per cell"
        if now >= counted + POLL:
            counted, below = now, {pid: t for proc in procs for pid, t in sandbox.descendants(proc.pid).items()}
            seen.update(below)
            if len(below) > limits.processes:
                return f"it started more than {limits.processes} processes (the limit) during {current}"
        try:
            line = lines.get(timeout=max(0.01, min(POLL, deadline - now, end - now)))
        except queue.Empty:
            continue
        if line is END:
            return f"the judge's process {_ended(procs[1])} during {current} before reporting"
        if line is OVERFLOW:
            return f"it sent more than {limits.output_mb} MB of results (the output limit) during {current}"
        item = _parse(line)
        if item is None:
            return f"it sent something that is not a result during {current}"
        if item.get("done"):
            return None
        current = str(item.get("begin", current))[:200]
        for key, into in (("cell", "cells"), ("hidden", "hidden")):
            if key in item:
                result[into].append(item[key])
                result["notes"] += _limits_met(item[key], current, limits)
        if isinstance(item.get("violations"), list):
            result["violations"] += item["violations"]
        deadline = time.monotonic() + cell_timeout + GRACE


def _parse(line: bytes) -> dict | None:
    """The judge's line as a dict whose every string UTF-8 can write, or None."""
    try:
        item = _writable(json.loads(line))
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
        return None
    return item if isinstance(item, dict) else None


def _writable(value):
    """``value`` with each lone surrogate in its strings as an escape (``\\ud800``): JSON carries
    them from the student's messages and prints, and printing one ended a batch after grading."""
    if type(value) is str:
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if type(value) is list:
        return [_writable(v) for v in value]
    if type(value) is dict:
        return {_writable(k): _writable(v) for k, v in value.items()}
    return value


def _ended(proc) -> str:
    try:
        return f"ended (status {proc.wait(timeout=5)})"
    except subprocess.TimeoutExpired:
        return "closed its output"


def _limits_met(entry, where: str, limits: sandbox.Limits) -> list[str]:
    """A note for a cell whose error says it met the memory or file size limit."""
    error = entry.get("error") if isinstance(entry, dict) else None
    text = f"{error.get('type')}: {error.get('message')}" if isinstance(error, dict) else ""
    sizes = {"memory": limits.memory_mb, "file size": limits.file_mb}
    return [f"{where} hit the {name} limit ({sizes[name]} MB)" for name, words in HITS.items()
            if any(w in text for w in words)]


def _feed(pipe, data: bytes) -> None:
    try:
        pipe.write(data)
        pipe.close()
    except OSError:  # the judge died or closed its stdin: its results say what it did
        pass


def _read(pipe, limit: int, lines: queue.Queue) -> None:
    """Put each line of ``pipe`` in ``lines``, then END; OVERFLOW once ``limit`` bytes are read."""
    total = 0
    while True:
        line = pipe.readline(limit - total + 1)
        total += len(line)
        if total > limit:
            lines.put(OVERFLOW)
            return
        if not line:
            lines.put(END)
            return
        lines.put(line)


def _drain(pipe) -> None:
    """Read and drop stderr, so that a process that writes there never blocks (nothing reads it)."""
    while pipe.read(1 << 16):
        pass
