"""An OpenAI-compatible HTTP server over the engine: ``python -m pagedlab.serve``.

``/v1/completions`` and ``/v1/chat/completions`` (whole, or streamed as server-sent events),
``/v1/models``, ``/health`` and ``/metrics`` (Prometheus, vLLM's names), served by FastAPI and
uvicorn over one :class:`~pagedlab.engine.async_llm.AsyncLLM`: every request joins the running
batch at the next step.

One request must never fail another: every request is checked completely before it reaches
the engine (the body's size, its fields' types and ranges in :mod:`pagedlab.protocol`; here the
model, the vocabulary, and the prompt plus ``max_tokens`` against ``max_model_len``), and is
refused alone with OpenAI's error object naming the field; prompts are tokenized in a worker
thread, so a huge one stalls no other client. A client that disconnects has its request
aborted, streamed or not. On SIGTERM or Ctrl-C the requests in flight end at once (after at
most ``--shutdown-timeout`` seconds of draining), each client getting an error it can read,
and the engine is shut down. ``--api-key`` (or ``$PAGEDLAB_API_KEY``) guards ``/v1``, and the
JSON endpoints take only ``application/json``, which a web page cannot send to another origin
without a CORS preflight. By default it serves SmolLM2-135M-Instruct offline, on the loopback
interface (:func:`pagedlab.checkpoints.smollm2`)::

    python -m pagedlab.serve [--model DIR] [--port 8000] [--api-key KEY] ...
"""

import argparse
import asyncio
import itertools
import json
import os
import re
import reprlib
import secrets
import time

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from pagedlab.engine.async_llm import AsyncLLM
from pagedlab.engine.llm import REQUEST_ERRORS, LLM
from pagedlab.engine.params import SamplingParams
from pagedlab.engine.text import InvalidPrompt, chat_prompt, prompt_token_ids
from pagedlab.metrics import ServerMetrics
from pagedlab.protocol import UNSUPPORTED, ChatRequest, CompletionRequest

MAX_BODY_BYTES = 16 << 20  # a prompt of max_model_len tokens is well under 1 MiB
COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for completions; chat runs to the context
GRACE_S = 3  # after the requests were ended, how long uvicorn waits for their connections
ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
               404: "NotFoundError", 413: "invalid_request_error",
               415: "invalid_request_error", 503: "ServiceUnavailableError"}


class ApiError(Exception):
    """A request refused with OpenAI's error object and HTTP ``status``, naming the field
    ``param`` when one is to blame."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status

    def body(self) -> dict:
        return {"message": str(self), "type": ERROR_TYPES.get(self.status, "internal_error"),
                "param": self.param, "code": self.status}

    def response(self) -> JSONResponse:
        return JSONResponse({"error": self.body()}, status_code=self.status)


def shutting_down() -> ApiError:
    return ApiError("the server is shutting down; the request was aborted", status=503)


def invalid(error: ValidationError, request_id: str) -> ApiError:
    """pydantic's complaint about the first bad field as a 400 naming it: where a field may
    take several forms (``stop``: a string or a list of strings), the form that got furthest
    (an item of the list), or one reason per form if none did."""
    def path(problem):  # the location without pydantic's tags for a union's forms
        return [p for p in problem["loc"] if isinstance(p, int) or re.fullmatch(r"\w+", p)]

    problems = error.errors()
    field = path(problems[0])[:1]
    mine = [p for p in problems if path(p)[:1] == field]
    where = max(map(path, mine), key=len)
    first = next(p for p in mine if path(p) == where)
    name, param = ".".join(map(str, where)), str(field[0]) if field else None
    if first["type"] == "missing":
        return ApiError(f"request {request_id!r}: '{name}' is required", param)
    reasons = "; or ".join(dict.fromkeys(p["msg"] for p in mine if path(p) == where))
    return ApiError(f"request {request_id!r}: {name}={reprlib.repr(first['input'])}: "
                    f"{reasons}", param)


def parse(raw: bytes, model, request_id: str):
    """The request body as a ``model`` (run in a thread: a large body takes a while)."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ApiError(f"request {request_id!r}: the body is not valid JSON: it nests too "
                       "deeply") from None
    except ValueError:
        raise ApiError(f"request {request_id!r}: the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise ApiError(f"request {request_id!r}: the body must be a JSON object")
    for name in UNSUPPORTED:
        if body.get(name) is not None:
            raise ApiError(f"request {request_id!r}: '{name}' is not supported by this server",
                           name)
    try:
        return model.model_validate(body)
    except ValidationError as error:
        raise invalid(error, request_id) from None


async def read_body(request: Request, limit: int, request_id: str) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed ``limit`` bytes."""
    declared = request.headers.get("content-length", "")
    too_big = ApiError(f"request {request_id!r}: the body is over {limit} bytes", status=413)
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


def guard(api_key: str | None):
    """The check every ``/v1`` request passes first: the API key, if one is set (vLLM's
    ``--api-key``), and a JSON body's content type (a web page can post ``text/plain`` to
    another origin without asking, but not ``application/json``)."""
    expected = f"Bearer {api_key}".encode() if api_key else None

    async def check(request: Request):
        given = request.headers.get("authorization", "").encode()
        if expected is not None and not secrets.compare_digest(given, expected):
            raise ApiError("a valid API key is required: 'Authorization: Bearer <key>'",
                           status=401)
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if request.method == "POST" and kind != "application/json":
            raise ApiError(f"the body must be sent as 'application/json', not {kind!r}",
                           status=415)

    return check


def logprobs_wanted(req, chat: bool) -> int | None:
    """How many alternatives per token the request wants log-probabilities for, or None:
    ``logprobs: k`` for completions; ``logprobs: true`` with ``top_logprobs: k`` for chat."""
    if not chat:
        return req.logprobs
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


def sampling_params(req, max_tokens: int, logprobs: int | None) -> SamplingParams:
    """The engine's parameters for a checked request."""
    stop = req.stop if isinstance(req.stop, list) else [req.stop] if req.stop else []
    return SamplingParams(
        n=req.n, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=req.seed,
        max_tokens=max_tokens, stop=tuple(stop), stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos, logprobs=logprobs, presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
        logit_bias={int(t): b for t, b in (req.logit_bias or {}).items()})


def logprobs_of(tokenizer, c, start: int, k: int, chat: bool, offset: int = 0):
    """OpenAI's ``logprobs`` object for completion ``c``'s tokens from ``start`` on. Chat: a
    ``content`` list of each token, its log-probability, its UTF-8 bytes and the ``k``
    likeliest. Completions: the parallel lists ``tokens``, ``token_logprobs``,
    ``top_logprobs`` (the ``k`` likeliest and the sampled token, as vLLM returns them) and
    ``text_offset``, counted from ``offset``."""
    ids, alts = c.token_ids[start:], c.logprobs[start:]
    name = [tokenizer.decode([i]) for i in ids]
    if chat:
        def entry(token_id, logprob):
            token = tokenizer.decode([token_id])
            return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

        return {"content": [
            {**entry(i, a[i]), "top_logprobs": [entry(j, lp) for j, lp in sorted(
                a.items(), key=lambda item: -item[1])[:k]]}
            for i, a in zip(ids, alts)]}
    offsets = list(itertools.accumulate([offset, *map(len, name)]))[:-1]
    return {"tokens": name, "token_logprobs": [a[i] for i, a in zip(ids, alts)],
            "top_logprobs": [{tokenizer.decode([j]): lp for j, lp in a.items()} for a in alts],
            "text_offset": offsets}


def build_app(llm: LLM, model_name: str, api_key: str | None = None,
              max_body_bytes: int = MAX_BODY_BYTES):
    """A FastAPI app serving ``llm`` under the model id ``model_name``; with ``api_key``,
    ``/v1`` answers only requests that carry it."""
    numbers = itertools.count()  # request ids
    state: dict = {}
    tokenizer, limit = llm.tokenizer, llm.max_model_len
    vocab = llm.model.args.vocab_size
    # no text longer than this can fit the context: no token is longer than the longest one
    longest = max(map(len, tokenizer.get_vocab()), default=1) if tokenizer is not None else 1

    async def lifespan(app):
        app.state.engine = state["engine"] = AsyncLLM(llm)  # its task lives in this loop
        state["metrics"] = ServerMetrics(state["engine"], model_name)
        yield
        await state["engine"].shutdown()

    app = FastAPI(title="pagedlab", lifespan=lifespan)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(guard(api_key))])

    @app.exception_handler(ApiError)
    async def refused(request, error: ApiError):
        return error.response()

    @app.exception_handler(Exception)
    async def failed(request, error: Exception):  # never a plain-text 500
        return ApiError("internal server error", status=500).response()

    @app.get("/health")
    async def health():
        return {}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(state["metrics"].registry),
                        media_type=CONTENT_TYPE_LATEST)

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": 0, "owned_by": "pagedlab"}]}

    def check(req, chat: bool, request_id: str) -> None:
        """What a request's fields must satisfy on this server's engine."""
        if req.model is not None and req.model != model_name:
            raise ApiError(f"request {request_id!r}: the model {req.model!r} does not exist; "
                           f"this server serves {model_name!r}", "model", 404)
        if req.stream_options is not None and not req.stream:
            raise ApiError(f"request {request_id!r}: 'stream_options' needs 'stream': true",
                           "stream_options")
        if req.n > llm.config.max_num_seqs:
            raise ApiError(f"request {request_id!r}: n={req.n} is over max_num_seqs="
                           f"{llm.config.max_num_seqs}", "n")
        if req.best_of is not None and req.best_of != req.n:
            raise ApiError(f"request {request_id!r}: best_of={req.best_of} must equal n "
                           f"({req.n}): every sample drawn is returned", "best_of")
        if req.top_k > vocab:
            raise ApiError(f"request {request_id!r}: top_k={req.top_k} is over the "
                           f"vocabulary's {vocab} tokens", "top_k")
        bad = [t for t in req.logit_bias or {} if not re.fullmatch(r"[0-9]+", t)
               or int(t) >= vocab]
        if bad:
            raise ApiError(f"request {request_id!r}: logit_bias keys {bad[:3]} are not token "
                           f"ids in [0, {vocab})", "logit_bias")
        if not chat and req.echo and req.logprobs is not None:
            raise ApiError(f"request {request_id!r}: 'echo' with 'logprobs' is not supported "
                           "(prompt log-probabilities are not computed)", "echo")

    def fits(text: str, request_id: str, field: str) -> str:
        """``text``, refused before tokenizing if no tokenization can fit the context."""
        if len(text) > limit * longest:
            raise ApiError(f"request {request_id!r}: a prompt of {len(text)} characters is "
                           f"over max_model_len={limit} tokens", field)
        return text

    def tokenized(req, chat: bool, request_id: str) -> list[tuple[list[int], str | None]]:
        """Each prompt's token ids and text (chat: the conversation under the template); run
        in a worker thread."""
        field = "messages" if chat else "prompt"
        try:
            if chat:
                messages = [{"role": m.role, "content": m.text()} for m in req.messages]
                prompts = [fits(chat_prompt(messages, request_id, tokenizer), request_id, field)]
            else:
                prompt = req.prompt
                single = isinstance(prompt, str) or isinstance(prompt[0], int)
                prompts = [prompt] if single else prompt
                prompts = [fits(p, request_id, field) if isinstance(p, str) else p
                           for p in prompts]
            return [prompt_token_ids(p, request_id, tokenizer) for p in prompts]
        except InvalidPrompt as error:
            raise ApiError(str(error), field) from None

    def max_tokens(req, chat: bool, prompt_len: int, request_id: str) -> int:
        """What the request may generate: as asked, if it fits ``max_model_len`` with the
        prompt (vLLM answers 400 otherwise); by default 16 for completions and the rest of
        the context for chat (OpenAI's and vLLM's defaults)."""
        name = "max_completion_tokens" if chat and req.max_completion_tokens else "max_tokens"
        asked, room = getattr(req, name), limit - prompt_len
        if room <= 0:
            raise ApiError(f"request {request_id!r}: its prompt of {prompt_len} tokens leaves "
                           f"no room to generate within max_model_len={limit}",
                           "messages" if chat else "prompt")
        if asked is None:
            return room if chat else min(COMPLETIONS_MAX_TOKENS, room)
        if asked > room:
            raise ApiError(f"request {request_id!r}: {name}={asked} and a prompt of "
                           f"{prompt_len} tokens are over max_model_len={limit}: at most "
                           f"{room} tokens can be generated", name)
        return asked

    async def timed(stream, arrival: float):
        """A request's outputs; the metrics record it once it finished."""
        times, tokens = [], 0
        try:
            async for out in stream:
                now = sum(len(c.token_ids) for c in out.outputs)
                if now > tokens:
                    times.append(time.monotonic())
                    tokens = now
                if out.finished:
                    state["metrics"].finished(out, arrival, times)
                yield out
        finally:  # also when the client went away: abort the request, free its blocks
            await stream.aclose()

    async def serve(request: Request, chat: bool):
        arrival = time.monotonic()
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{next(numbers)}"
        raw = await read_body(request, max_body_bytes, request_id)
        req = await asyncio.to_thread(parse, raw, ChatRequest if chat else CompletionRequest,
                                      request_id)
        check(req, chat, request_id)
        k = logprobs_wanted(req, chat)
        prompts = await asyncio.to_thread(tokenized, req, chat, request_id)
        params = [sampling_params(req, max_tokens(req, chat, len(ids), request_id), k)
                  for ids, _ in prompts]
        engine = state["engine"]
        names = [request_id] if len(prompts) == 1 else [
            f"{request_id}-{i}" for i in range(len(prompts))]
        streams = await started([
            timed(engine.generate({"prompt_token_ids": ids}, p, name), arrival)
            for (ids, _), p, name in zip(prompts, params, names)], chat)
        kind = "chat.completion" if chat else "text_completion"
        head = {"id": request_id, "created": int(time.time()), "model": model_name}
        texts = [text if text is not None else tokenizer.decode(ids) if tokenizer else ""
                 for ids, text in prompts] if not chat and req.echo else None

        def choices(i: int, out, deltas: bool, seen: dict) -> list[dict]:
            """Prompt ``i``'s choices (index ``i * n + c.index``, as vLLM numbers a batch's);
            ``seen`` maps a choice to the tokens and characters earlier chunks carried."""
            made = []
            for c in out.outputs:
                index = i * req.n + c.index
                text = c.delta if deltas else c.text
                if texts is not None and index not in seen:  # echo: the prompt first
                    text = texts[i] + text
                if chat:
                    choice = {"index": index, ("delta" if deltas else "message"): {
                        "role": "assistant", "content": text}, "finish_reason": c.finish_reason}
                else:
                    choice = {"index": index, "text": text, "finish_reason": c.finish_reason}
                tokens, chars = seen.get(index, (0, 0))
                if k is not None:
                    choice["logprobs"] = logprobs_of(tokenizer, c, tokens, k, chat, chars)
                    new = choice["logprobs"]["content" if chat else "tokens"]
                    chars += sum(len(t["token"] if chat else t) for t in new)
                seen[index] = (len(c.token_ids), chars)
                made.append(choice)
            return made

        def usage(outs) -> dict:
            prompt = sum(len(out.prompt_token_ids) for out in outs)
            completion = sum(len(c.token_ids) for out in outs for c in out.outputs)
            return {"prompt_tokens": prompt, "completion_tokens": completion,
                    "total_tokens": prompt + completion}

        if not req.stream:
            async def whole():
                return {i: out async for i, out in merged(streams)}  # the last of each

            last = await unless_disconnected(request, whole())
            if last is None:  # the client left; its requests were aborted
                return Response(status_code=499)
            return {**head, "object": kind, "usage": usage(last.values()), "choices": [
                choice for i in sorted(last) for choice in choices(i, last[i], False, {})]}

        async def events():
            seen, last = {}, {}
            chunk_kind = f"{kind}.chunk" if chat else kind
            try:
                async for i, out in merged(streams):
                    last[i] = out
                    yield sse({**head, "object": chunk_kind,
                               "choices": choices(i, out, True, seen)})
                if req.stream_options is not None and req.stream_options.include_usage:
                    # OpenAI's last chunk: no choices, the usage
                    yield sse({**head, "object": chunk_kind, "choices": [],
                               "usage": usage(last.values())})
            except Exception as failure:  # noqa: BLE001  (the client reads why, then [DONE])
                yield sse({"error": refusal(failure, chat).body()})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @v1.post("/completions")
    async def completions(request: Request):
        return await serve(request, chat=False)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        return await serve(request, chat=True)

    app.include_router(v1)
    return app


def sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


def refusal(error: Exception, chat: bool) -> ApiError:
    """What a client is told of an error the engine raised for its request: 400 for a request
    it refused, 503 for one ended by the shutdown, 500 for a failed step."""
    if isinstance(error, ApiError):
        return error
    if isinstance(error, (*REQUEST_ERRORS, ValueError, TypeError)):
        field = ("messages" if chat else "prompt") if isinstance(error, InvalidPrompt) else None
        return ApiError(str(error), field)
    return ApiError(f"the request failed in the engine: {error}", status=500)


async def started(streams: list, chat: bool) -> list:
    """Each stream with its first output awaited, so that a request the engine refuses is
    answered with an error before any reply starts; on a refusal every stream is closed."""
    firsts = await asyncio.gather(*(anext(s) for s in streams), return_exceptions=True)
    failed = [f for f in firsts if isinstance(f, BaseException)]
    if failed:
        for stream in streams:
            await stream.aclose()
        raise refusal(failed[0], chat)
    return [_chain(first, stream) for first, stream in zip(firsts, streams)]


async def _chain(first, rest):
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()


async def merged(streams: list):
    """(i, output) from every stream as its outputs come; the first error ends them all, and
    so does closing this (each stream's request is then aborted)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, stream):
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except Exception as error:  # noqa: BLE001  (handed to the reader)
            queue.put_nowait((i, error))
        queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item is None:
                left -= 1
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def unless_disconnected(request: Request, work):
    """``work``'s result, or None if the client disconnected first: ``work`` is cancelled
    then, which aborts its requests (vLLM's ``with_cancellation``)."""
    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, gone = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    gone.cancel()
    if not task.done():
        task.cancel()
    await asyncio.gather(task, gone, return_exceptions=True)
    return None if task.cancelled() else task.result()


class Server(uvicorn.Server):
    """uvicorn's server, stopped in vLLM's shape: on SIGTERM or Ctrl-C it stops accepting
    connections, lets the requests in flight run for at most ``shutdown_timeout`` seconds (0,
    the default: not at all), ends the rest with an error their clients read (a 503, or an
    error event and ``[DONE]`` in a stream), and always shuts the engine down."""

    def __init__(self, config: uvicorn.Config, shutdown_timeout: float = 0.0):
        super().__init__(config)
        self.shutdown_timeout = shutdown_timeout

    async def shutdown(self, sockets=None) -> None:
        engine = getattr(self.config.app.state, "engine", None)
        if engine is None:  # the app never started
            return await super().shutdown(sockets)
        for server in self.servers:
            server.close()
        deadline = time.monotonic() + self.shutdown_timeout
        while engine.num_requests and not self.force_exit and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        engine.fail_all(shutting_down())
        try:
            await super().shutdown(sockets)
        finally:
            await engine.shutdown()
            # its worker processes too (tensor parallelism), before uvicorn re-raises the
            # signal that stopped it, which ends this process without running its finally
            engine.llm.shutdown()


def parser() -> argparse.ArgumentParser:
    """The server's command line (also read by ``bench_serving.py --simulate``, which builds
    the same engine in its own process to calibrate the simulator)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None,
                        help="a checkpoint directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-gpu-blocks", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--enable-prefix-caching", action="store_true")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="processes the model is split over by its heads (vLLM's name)")
    parser.add_argument("--distributed-init-method", default=None, choices=["env://"],
                        help="'env://': the workers are started apart (python -m "
                             "pagedlab.engine.tensor_parallel, on this machine or others) and "
                             "meet this server, rank 0, through MASTER_ADDR, MASTER_PORT, "
                             "WORLD_SIZE and RANK (default: the server starts them itself)")
    parser.add_argument("--speculative-config", type=json.loads, default=None,
                        help='JSON, as vLLM\'s: \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    parser.add_argument("--api-key", default=os.environ.get("PAGEDLAB_API_KEY"),
                        help="answer /v1 only with 'Authorization: Bearer KEY' (default: "
                             "$PAGEDLAB_API_KEY; unset: no key)")
    parser.add_argument("--shutdown-timeout", type=float, default=0.0,
                        help="on SIGTERM or Ctrl-C, seconds to let requests in flight finish "
                             "before they are aborted (default 0: at once, as vLLM)")
    return parser


def engine(args: argparse.Namespace) -> LLM:
    """The engine the server runs for parsed ``args``, on one thread on a CPU (see the
    Makefile: spinning threads on a shared CPU)."""
    import torch

    from pagedlab.device import HAS_CUDA
    from pagedlab.checkpoints import smollm2

    if not HAS_CUDA:
        torch.set_num_threads(1)
    return LLM(args.model or smollm2(), block_size=args.block_size,
               num_gpu_blocks=args.num_gpu_blocks, max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=args.max_num_batched_tokens,
               max_model_len=args.max_model_len, enable_prefix_caching=args.enable_prefix_caching,
               speculative_config=args.speculative_config,
               tensor_parallel_size=args.tensor_parallel_size,
               distributed_init_method=args.distributed_init_method)


def main(argv=None) -> None:
    from pagedlab.checkpoints import smollm2

    args = parser().parse_args(argv)
    llm = engine(args)
    name = args.served_model_name or str(args.model or smollm2()).rstrip("/").split("/")[-1]
    app = build_app(llm, name, api_key=args.api_key)
    config = uvicorn.Config(app, host=args.host, port=args.port,
                            timeout_graceful_shutdown=GRACE_S)
    try:
        Server(config, args.shutdown_timeout).run()
    except KeyboardInterrupt:  # Ctrl-C, re-raised once the server stopped (as uvicorn.run)
        pass
    finally:
        llm.shutdown()  # tensor parallelism: its worker processes end with the server


if __name__ == "__main__":
    main()
