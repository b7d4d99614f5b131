"""The channel between the judge and the submission's process (issue 46, item 1): frames over a
pair of pipes, and requests that either side may make while it waits for the answer to its own
(a check calls the student's ``PrefixIndex.insert``, which calls back the ``key_fn`` the check
gave it, which the judge runs).

A frame is two lengths (a JSON header's and a binary payload's) and the two. The judge's
requests carry their arguments as a pickle, which only the submission's process unpickles; the
submission's answers carry plain data, checked by ``pagedlab_course.grade.copyout`` in the judge,
which never unpickles anything. Both sides are single-threaded, so answers come back in the order
of the requests; a side that breaks that order, or sends what is not a frame, has broken the
channel (``Broken``), and every later request fails at once.
"""

from __future__ import annotations

import json
import os
import struct

HEAD = struct.Struct("<II")
LIMIT = 64 << 20  # bytes of one frame's header or payload (a tensor of A4 is a few kB)


class Broken(Exception):
    """The channel cannot be used any more: the submission's process sent what is not a frame,
    closed it, or did not answer in time."""


class CellTimeout(BaseException):
    """A cell or hidden check ran past its time limit (an infinite loop, usually). Not an
    Exception: the notebooks' ``error()``, the checks' ``outcome()`` and Hypothesis catch those."""


class Channel:
    """One end of the channel. ``serve(header, payload)`` answers a request the other side makes
    while this side waits for an answer (and, in the submission's process, every request)."""

    def __init__(self, read_fd: int, write_fd: int, serve):
        self.read_fd, self.write_fd, self.serve = read_fd, write_fd, serve
        self.dead: str | None = None  # why the channel cannot be used any more

    def request(self, header: dict, payload: bytes = b"") -> tuple[dict, bytes]:
        """Send a request; answer the other side's requests until its answer comes."""
        if self.dead:
            raise Broken(self.dead)
        try:
            self.send(header, payload)
            while True:
                reply, data = self.receive()
                if "op" not in reply:
                    return reply, data
                self.send(*self.serve(reply, data))
        except (EOFError, OSError) as exc:
            self.dead = self.dead or f"the submission's process closed the channel ({exc})"
            raise Broken(self.dead) from None
        except BaseException as exc:  # out of step from now on: a timeout, or what is not a frame
            self.dead = self.dead or f"{type(exc).__name__}: {exc}"
            raise

    def listen(self) -> None:
        """Answer requests until the other side closes the channel (the submission's loop)."""
        while True:
            try:
                header, payload = self.receive()
            except EOFError:
                return
            self.send(*self.serve(header, payload))

    def send(self, header: dict, payload: bytes = b"") -> None:
        data = json.dumps(header).encode()
        _write(self.write_fd, HEAD.pack(len(data), len(payload)) + data + payload)

    def receive(self) -> tuple[dict, bytes]:
        size, length = HEAD.unpack(_read(self.read_fd, HEAD.size))
        if size > LIMIT or length > LIMIT:
            raise Broken(f"a frame of {size + length} bytes (at most {2 * LIMIT})")
        try:
            header = json.loads(_read(self.read_fd, size))
        except (ValueError, RecursionError) as err:  # not JSON, or nested past the parser's depth
            raise Broken(f"a frame whose header is not JSON: {str(err)[:200]}") from None
        if not isinstance(header, dict):
            raise Broken("a frame whose header is not an object")
        return header, _read(self.read_fd, length)


def _read(fd: int, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError("the other side closed the channel")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _write(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
