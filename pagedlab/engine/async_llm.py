"""The engine online: requests arrive while others run, and tokens stream back (vLLM's
``AsyncLLM`` shape).

One background task owns the :class:`~pagedlab.engine.llm.LLM`: between steps it adds the
requests that arrived and aborts the ones that were cancelled, then runs one step in a worker
thread (a step is seconds of CPU work that must not stall the event loop) and hands each
request its new output. :meth:`AsyncLLM.generate` is an async iterator of those outputs; each
completion carries ``delta``, the text that is new since the last one, held back while it
could still change: an unfinished multi-byte character decodes to U+FFFD, and the start of a
stop string must not be sent before the engine knows whether it completes. A request that
fails (refused when added, or failed alone in a step) raises its error in its own consumer;
the others go on.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

from pagedlab.engine.llm import REQUEST_ERRORS, LLM
from pagedlab.engine.outputs import RequestOutput

REPLACEMENT = "\ufffd"  # what a tokenizer decodes an incomplete UTF-8 sequence to


class AsyncLLM:
    """An :class:`LLM` served from a background task. Create it inside a running event loop."""

    def __init__(self, llm: LLM):
        self.llm = llm
        self._queues: dict[str, asyncio.Queue] = {}  # request id -> its outputs, then None
        self._pending: list[tuple] = []  # (request id, prompt, params): added between steps
        self._aborted: set[str] = set()
        self._wake = asyncio.Event()
        self._stopping = False
        self.num_preemptions = 0  # since start, for the server's metrics
        self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def generate(self, prompt, params, request_id: str) -> AsyncIterator[RequestOutput]:
        """Queue a request; yield its output after every step that advanced it, the last one
        finished. An invalid request raises at once; leaving the loop early aborts it."""
        if request_id in self._queues:
            raise ValueError(f"request {request_id!r} is already running")
        queue = self._queues[request_id] = asyncio.Queue()
        self._pending.append((request_id, prompt, params))
        self._wake.set()
        sent: dict[int, str] = {}  # completion index -> text already sent as deltas
        stops = getattr(params, "stop", ())
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.error is not None:  # failed alone in a step
                    raise item.error
                out = _with_deltas(item, sent, stops)
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:  # the consumer left early, or the request failed
                await self.abort(request_id)
            self._queues.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        """Stop a request; its blocks are freed before the next step."""
        self._aborted.add(request_id)
        self._wake.set()

    def fail_all(self, error: Exception) -> None:
        """End every request now: each consumer raises ``error`` (a server shutting down)."""
        for request_id, queue in self._queues.items():
            queue.put_nowait(error)
            self._aborted.add(request_id)
        self._wake.set()

    async def shutdown(self) -> None:
        """Stop the background task once its step in flight is done (a step runs in a thread
        that cannot be cancelled); requests still running are aborted. Idempotent."""
        self._stopping = True
        self._wake.set()
        await self._loop_task
        for request_id in list(self.llm.scheduler.unfinished):
            self.llm.abort_request(request_id)

    @property
    def num_requests(self) -> int:
        """Requests whose consumers are still reading (a server drains until there are none)."""
        return len(self._queues)

    async def _run(self) -> None:
        """Admit, abort, step, deliver; sleep while there is nothing to do."""
        llm = self.llm
        while not self._stopping:
            self._admit()
            if not llm.has_unfinished_requests():
                self._wake.clear()
                if not self._pending and not self._aborted and not self._stopping:
                    await self._wake.wait()
                continue
            in_flight = list(llm.scheduler.unfinished)
            try:
                outputs = await asyncio.to_thread(llm.step)
            except Exception as error:  # noqa: BLE001  (the step aborted all it was serving)
                for request_id in in_flight:
                    if request_id in self._queues:
                        self._queues[request_id].put_nowait(error)
                continue
            self.num_preemptions += len(llm.last_step.preempted)
            for out in outputs:
                queue = self._queues.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)

    def _admit(self) -> None:
        """Apply what arrived since the last step: aborts first, then new requests."""
        llm = self.llm
        for request_id in self._aborted:
            if request_id in llm.scheduler.unfinished:
                llm.abort_request(request_id)
        pending = [p for p in self._pending if p[0] not in self._aborted]
        self._aborted.clear()
        self._pending = []
        for request_id, prompt, params in pending:
            try:
                llm.add_request(request_id, prompt, params)
            except (*REQUEST_ERRORS, TypeError, ValueError) as error:  # this request alone
                self._queues[request_id].put_nowait(error)


def _with_deltas(out: RequestOutput, sent: dict[int, str], stops) -> RequestOutput:
    """``out`` with each completion's ``delta``: its text past what was sent, less a tail that
    may still change (an incomplete character; a possible start of a stop string)."""
    hold = max(map(len, stops), default=1) - 1
    completions = []
    for c in out.outputs:
        text, before = c.text, sent.get(c.index, "")
        end = len(text)
        if c.finish_reason is None:
            end = len(text.rstrip(REPLACEMENT)) if text.endswith(REPLACEMENT) else end
            end = max(len(before), end - hold)
        sent[c.index] = text[:end]
        completions.append(dataclasses.replace(c, delta=text[len(before):end]))
    return dataclasses.replace(out, outputs=completions)
