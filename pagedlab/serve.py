"""An OpenAI-compatible HTTP server over the engine: ``python -m pagedlab.serve``.

``/v1/completions`` and ``/v1/chat/completions`` (whole, or streamed as server-sent events),
``/v1/models``, ``/health`` and ``/metrics`` (Prometheus, vLLM's names), served by FastAPI and uvicorn over one
:class:`~pagedlab.engine.async_llm.AsyncLLM`: every request joins the running batch at the next
step, and a client that disconnects mid-stream has its request aborted and its blocks freed.
Bad input gets OpenAI's error object with HTTP 400, and the others are served on. By default
it serves SmolLM2-135M-Instruct offline (:func:`pagedlab.checkpoints.smollm2`)::

    python -m pagedlab.serve [--model DIR] [--port 8000] [--block-size 16] ...
"""

import argparse
import dataclasses
import itertools
import json
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pagedlab.engine.async_llm import AsyncLLM
from pagedlab.engine.llm import LLM
from pagedlab.engine.sampling import SamplingParams
from pagedlab.engine.text import InvalidPrompt, chat_prompt
from pagedlab.metrics import ServerMetrics

SAMPLING_FIELDS = {  # OpenAI request field -> SamplingParams field (same meaning)
    "n": "n", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "seed": "seed",
    "max_tokens": "max_tokens", "stop": "stop", "ignore_eos": "ignore_eos",
}


MAX_LOGPROBS = 20  # the most alternatives per token a request may ask for (vLLM's default)


class BadRequest(ValueError):
    """Input the server refuses with HTTP 400, naming the field when it can."""

    def __init__(self, message: str, param=None):
        super().__init__(message)
        self.param = param


def sampling_params(body: dict, defaults: dict) -> SamplingParams:
    """The request's sampling parameters (OpenAI's defaults where it gives none)."""
    given = {ours: body[theirs] for theirs, ours in SAMPLING_FIELDS.items()
             if body.get(theirs) is not None}
    if isinstance(given.get("stop"), str):
        given["stop"] = (given["stop"],)
    try:
        return SamplingParams(**{**defaults, **given})
    except (TypeError, ValueError) as error:
        raise BadRequest(str(error)) from None


def logprobs_asked(body: dict, chat: bool) -> int | None:
    """How many alternatives per token the request wants log-probabilities for, or None:
    ``logprobs: k`` for completions; ``logprobs: true`` with ``top_logprobs: k`` for chat."""
    def count(name):
        k = body.get(name)
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS:
            raise BadRequest(f"'{name}' must be an integer from 0 to {MAX_LOGPROBS}, "
                             f"not {k!r}", name)
        return k

    if not chat:
        return None if body.get("logprobs") is None else count("logprobs")
    wanted = body.get("logprobs") or False
    if not isinstance(wanted, bool):
        raise BadRequest(f"'logprobs' must be true or false, not {wanted!r}", "logprobs")
    if body.get("top_logprobs") is not None and not wanted:
        raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (0 if body.get("top_logprobs") is None else count("top_logprobs")) if wanted else None


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


def build_app(llm: LLM, model_name: str):
    """A FastAPI app serving ``llm`` under the model id ``model_name``."""
    ids = itertools.count()
    state: dict = {}

    async def lifespan(app):
        state["engine"] = AsyncLLM(llm)  # its loop task lives in the server's event loop
        state["metrics"] = ServerMetrics(state["engine"], model_name)
        yield
        await state["engine"].shutdown()

    app = FastAPI(title="pagedlab", lifespan=lifespan)

    def error(message: str, param=None, status: int = 400):
        kind = "invalid_request_error" if status == 400 else "internal_error"
        return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                       "code": status}}, status_code=status)

    @app.get("/health")
    async def health():
        return {}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(state["metrics"].registry),
                        media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": 0, "owned_by": "pagedlab"}]}

    async def serve(request: Request, chat: bool):
        try:
            body = await request.json()
        except ValueError:
            return error("the request body is not valid JSON")
        if not isinstance(body, dict):
            return error("the request body must be a JSON object")
        kind = "chat.completion" if chat else "text_completion"
        arrival = time.monotonic()
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{next(ids)}"
        try:
            if body.get("model", model_name) != model_name:
                raise BadRequest(f"model {body.get('model')!r} is not served here; "
                                 f"this server serves {model_name!r}", "model")
            if chat:
                prompt = chat_prompt(body.get("messages"), request_id, llm.tokenizer)
            else:
                prompt = body.get("prompt")
                if prompt is None:
                    raise BadRequest("'prompt' is required", "prompt")
                if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
                    prompt = {"prompt_token_ids": prompt}
            params = sampling_params(body, {"temperature": 1.0, "max_tokens": 16})
            k = logprobs_asked(body, chat)
            if k is not None:
                params = dataclasses.replace(params, logprobs=k)
            options = body.get("stream_options") or {}
            if not isinstance(options, dict):
                raise BadRequest("'stream_options' must be an object", "stream_options")
            if params.n > llm.config.max_num_seqs:
                raise BadRequest(f"n={params.n} is over max_num_seqs="
                                 f"{llm.config.max_num_seqs}", "n")
            stream = state["engine"].generate(prompt, params, request_id)
            first = await anext(stream)  # an invalid request raises here, before any reply
        except (BadRequest, InvalidPrompt, ValueError, TypeError) as failure:
            return error(str(failure), getattr(failure, "param", None))
        created = int(time.time())

        def choices(out, deltas: bool, seen: dict):
            """Each completion's choice; ``seen`` maps a completion's index to the tokens and
            characters whose log-probabilities earlier chunks carried."""
            made = []
            for c in out.outputs:
                text = c.delta if deltas else c.text
                if chat:
                    content = {"role": "assistant", "content": text}
                    choice = {"index": c.index, ("delta" if deltas else "message"): content,
                              "finish_reason": c.finish_reason}
                else:
                    choice = {"index": c.index, "text": text, "finish_reason": c.finish_reason}
                if k is not None:
                    tokens, chars = seen.get(c.index, (0, 0))
                    choice["logprobs"] = logprobs_of(llm.tokenizer, c, tokens, k, chat, chars)
                    new = choice["logprobs"]["content" if chat else "tokens"]
                    seen[c.index] = (len(c.token_ids), chars + sum(
                        len(t["token"] if chat else t) for t in new))
                made.append(choice)
            return made

        def usage(out):
            completion = sum(len(c.token_ids) for c in out.outputs)
            prompt_tokens = len(out.prompt_token_ids)
            return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                    "total_tokens": prompt_tokens + completion}

        head = {"id": request_id, "created": created, "model": model_name}

        async def timed():
            """The request's outputs; the metrics record it once it finished."""
            times, tokens = [], 0
            async for out in _chain(first, stream):
                now = sum(len(c.token_ids) for c in out.outputs)
                if now > tokens:
                    times.append(time.monotonic())
                    tokens = now
                if out.finished:
                    state["metrics"].finished(out, arrival, times)
                yield out

        if not body.get("stream"):
            async for last in timed():
                pass
            return {**head, "object": kind, "choices": choices(last, False, {}),
                    "usage": usage(last)}

        async def events():
            seen: dict = {}
            try:
                async for out in timed():
                    chunk = {**head, "object": f"{kind}.chunk" if chat else kind,
                             "choices": choices(out, True, seen)}
                    yield f"data: {json.dumps(chunk)}\n\n"
                if options.get("include_usage"):  # OpenAI's last chunk: no choices, the usage
                    chunk = {**head, "object": f"{kind}.chunk" if chat else kind,
                             "choices": [], "usage": usage(out)}
                    yield f"data: {json.dumps(chunk)}\n\n"
                yield "data: [DONE]\n\n"
            finally:  # also when the client went away: abort the request, free its blocks
                await stream.aclose()

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serve(request, chat=True)

    return app


async def _chain(first, rest):
    yield first
    async for item in rest:
        yield item


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
    parser.add_argument("--speculative-config", type=json.loads, default=None,
                        help='JSON, as vLLM\'s: \'{"method": "ngram", "num_speculative_tokens": 4}\'')
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
               speculative_config=args.speculative_config)


def main(argv=None) -> None:
    import uvicorn

    from pagedlab.checkpoints import smollm2

    args = parser().parse_args(argv)
    llm = engine(args)
    name = args.served_model_name or str(args.model or smollm2()).rstrip("/").split("/")[-1]
    uvicorn.run(build_app(llm, name), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
