"""What a client of an LLM server measures: TTFT, TPOT, ITL, end-to-end latency, throughput
and goodput under an SLO, from the timestamps of each streamed request.

The definitions are those of vLLM's serving benchmark (``calculate_metrics`` in
``benchmarks/benchmark_serving.py`` at commit 0049e29c; the client's stamps as in
``vllm/benchmarks/lib/endpoint_request_func.py``), so numbers from
``benchmarks/bench_serving.py`` read like the ones people quote:

- TTFT: from sending the request to the first streamed chunk with a choice (its text may be
  empty, as for a held-back partial character).
- ITL: the gaps between consecutive chunks with a choice, pooled over all requests.
- TPOT: per request, ``(e2e - ttft) / (output_tokens - 1)``, for requests of two or more
  tokens: the mean time per token after the first, whether tokens came one per chunk or not.
- E2E latency: from sending the request to its last chunk with a choice (the trailing usage
  chunk carries no token).
- Throughput: completed requests and output tokens over the benchmark's duration (first send
  to last completion); goodput counts only the requests that met every SLO given (a request
  of one token has TPOT 0 there).

Percentiles interpolate linearly between order statistics (numpy's default), as vLLM's do.
This client reports the 90th and 99th; vLLM's reports the 99th unless asked for others.

:func:`benchmark` is the client that stamps those times (streaming through the official
``openai`` client); :func:`predict` is the simulator's run of the same workload, with a cost
model from :func:`calibrate`, as the records a client would have kept.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (90, 99)  # besides the median
SLO_METRICS = ("ttft", "tpot", "e2el")
# How a server is told to produce exactly max_tokens tokens (see length_fields).
FORCE_LENGTH = ("ignore_eos", "generation_config", "none")


@dataclass
class RequestRecord:
    """One request as its client saw it. Times are seconds on one monotonic clock."""

    prompt_len: int
    output_len: int  # tokens requested
    sent: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # each chunk with a choice
    done: float | None = None  # when its stream ended (after the usage chunk); None if it failed
    output_tokens: int = 0  # tokens received (the server's usage, or chunks counted)
    text: str = ""  # the streamed text, joined
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.done is not None and bool(self.chunk_times)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.sent

    @property
    def e2el(self) -> float:
        return self.chunk_times[-1] - self.sent

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot(self) -> float | None:
        """None for a one-token request (it has no time per token after the first)."""
        if self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:100"]`` (vLLM's ``--goodput`` shape, milliseconds) as seconds
    by metric."""
    slo: dict[str, float] = {}
    for item in items or ():
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--goodput {item!r}: expected METRIC:MS with METRIC one of "
                             f"{', '.join(SLO_METRICS)}")
        try:
            ms = float(value)
        except ValueError:
            ms = math.nan
        if not ms > 0 or not math.isfinite(ms):
            raise ValueError(f"--goodput {item!r}: the SLO must be a positive number of ms")
        slo[name] = ms / 1000
    return slo


def distribution_ms(values: list[float], percentiles=PERCENTILES) -> dict[str, float]:
    """Mean, median and the given percentiles of ``values`` (seconds), in milliseconds; NaN
    for an empty list."""
    if not values:
        return {"mean": math.nan, "median": math.nan,
                **{f"p{p}": math.nan for p in percentiles}}
    ms = np.asarray(values, dtype=float) * 1000
    return {"mean": float(ms.mean()), "median": float(np.median(ms)),
            **{f"p{p}": float(np.percentile(ms, p)) for p in percentiles}}


def meets(record: RequestRecord, slo: dict[str, float]) -> bool:
    """Whether a completed request met every SLO in ``slo`` (seconds by metric)."""
    seen = {"ttft": record.ttft, "tpot": record.tpot or 0.0, "e2el": record.e2el}
    return all(seen[name] <= limit for name, limit in slo.items())


def summarize(records: list[RequestRecord], duration: float, slo: dict[str, float] | None = None,
              percentiles=PERCENTILES) -> dict:
    """The benchmark's numbers over ``records``, ``duration`` seconds from first send to last
    completion. Failed requests count in ``failed`` and in nothing else."""
    if not duration > 0:
        raise ValueError(f"duration={duration!r} must be positive")
    done = [r for r in records if r.ok]
    total_input = sum(r.prompt_len for r in done)
    total_output = sum(r.output_tokens for r in done)
    good = sum(meets(r, slo) for r in done) if slo else None
    return {
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
        "request_goodput": None if good is None else good / duration,
        "ttft_ms": distribution_ms([r.ttft for r in done], percentiles),
        "tpot_ms": distribution_ms([r.tpot for r in done if r.tpot is not None], percentiles),
        "itl_ms": distribution_ms([gap for r in done for gap in r.itl], percentiles),
        "e2el_ms": distribution_ms([r.e2el for r in done], percentiles),
    }


def simulated_records(requests, result) -> list[RequestRecord]:
    """The records a streaming client would have kept of a simulated run: sent at its arrival,
    a chunk at the end of each step that gave it tokens, done with its last. ``result`` comes
    from :func:`~pagedlab.sim.simulate_paged` with ``PagedConfig(record_token_times=True)``,
    so the simulator's prediction prints in the benchmark's table."""
    if result.token_times is None:
        raise ValueError("the simulation kept no token times: run it with "
                         "PagedConfig(record_token_times=True)")
    return [RequestRecord(r.prompt_len, int(out), sent=float(sent), chunk_times=list(times),
                          done=float(done), output_tokens=int(out))
            for r, sent, times, done, out in zip(requests, result.arrival, result.token_times,
                                                 result.finish, result.output_len)]


def predict(lengths, offsets, cost, config) -> tuple[list[RequestRecord], float]:
    """The simulator's run of a benchmark's workload: request ``i`` of ``lengths[i]`` =
    (prompt_len, output_len) tokens arriving ``offsets[i]`` seconds in, served by the engine's
    scheduler under ``config`` (a :class:`~pagedlab.sim.PagedConfig` with the server's cache
    and limits) with each step priced by ``cost``. Returns the records and the duration as
    :func:`benchmark` measures them, ready for :func:`summarize`."""
    from dataclasses import replace

    from pagedlab.sim import Request, simulate_paged

    if len(lengths) != len(offsets):
        raise ValueError(f"{len(lengths)} requests but {len(offsets)} arrival offsets")
    requests = [Request(i, float(t), int(p), int(o))
                for i, ((p, o), t) in enumerate(zip(lengths, offsets))]
    result = simulate_paged(requests, cost, replace(config, record_token_times=True))
    records = simulated_records(requests, result)
    return records, max(r.done for r in records) - min(r.sent for r in records)


def calibrate(llm, clock=None, **profile_args):
    """A cost model fitted to ``llm``'s own steps on this machine (chapter 10's calibration:
    :func:`~pagedlab.sim.calibration.profile`, then a least-squares fit), and the simulator's
    configuration for ``llm``'s cache and scheduler limits. ``clock`` defaults to the wall
    clock, which is what a client's timestamps are read on."""
    from pagedlab.engine.runner import block_bytes
    from pagedlab.sim.calibration import fit_cost_model, profile
    from pagedlab.sim.replay import EngineSettings
    from pagedlab.timing import copy_bandwidth

    steps = profile(llm, clock=clock or time.monotonic, **profile_args)
    cost = fit_cost_model(steps, kv_bytes_per_token=block_bytes(llm.model, 1),
                          swap_bandwidth=copy_bandwidth(1 << 24, "cpu") / 2)
    return cost, EngineSettings.of(llm).paged_config(cost)


def length_fields(force: str, output_len: int) -> dict:
    """The request's extra fields that make the server generate ``output_len`` tokens."""
    if force == "ignore_eos":
        return {"ignore_eos": True}
    if force == "generation_config":  # transformers serve: a whole GenerationConfig as JSON
        return {"generation_config": json.dumps({"min_new_tokens": output_len,
                                                 "max_new_tokens": output_len})}
    return {}


async def one_request(client, model: str, prompt, record: RequestRecord, force: str):
    """Stream one completion (``prompt``: text or token ids), stamping each chunk on arrival."""
    import httpx
    import openai

    record.sent = time.perf_counter()
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=record.output_len, temperature=0,
            stream=True, stream_options={"include_usage": True},
            extra_body=length_fields(force, record.output_len))
        chunks, usage = 0, None
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
            if chunk.choices:
                chunks += 1
                record.chunk_times.append(now)
                record.text += chunk.choices[0].text or ""
        record.done = time.perf_counter()
        # The server's count when it reports usage (pagedlab, vLLM); else one token per chunk
        # (a held-back partial character comes as an empty chunk).
        record.output_tokens = usage if usage is not None else chunks
    except (openai.APIError, httpx.HTTPError) as failure:
        record.error = f"{type(failure).__name__}: {failure}"


async def benchmark(base_url: str, model: str, prompts: list[str], lengths, offsets,
                    force: str = "ignore_eos") -> tuple[list[RequestRecord], float]:
    """Send ``prompts`` at ``offsets`` seconds from the start; the records and the duration
    (first send to last completion)."""
    import openai

    records = [RequestRecord(p, o) for p, o in lengths]
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0,
                                  timeout=3600) as client:
        start = time.perf_counter()
        tasks = []
        for prompt, record, offset in zip(prompts, records, offsets):
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            tasks.append(asyncio.create_task(one_request(client, model, prompt, record, force)))
        await asyncio.gather(*tasks)
    end = max([r.done for r in records if r.done is not None], default=time.perf_counter())
    return records, end - start


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0,
                    rng: np.random.Generator | None = None) -> np.ndarray:
    """When to send each of ``n`` requests, in seconds from the first (which goes at 0).

    Gaps are gamma-distributed with mean ``1/rate`` and shape ``burstiness``: 1 is a Poisson
    process, below 1 burstier, above 1 more even (vLLM's ``--burstiness``). An infinite rate
    sends everything at once.
    """
    if not rate > 0:
        raise ValueError(f"request rate {rate!r} must be positive (inf: all at once)")
    if not burstiness > 0:
        raise ValueError(f"burstiness {burstiness!r} must be positive")
    if math.isinf(rate):
        return np.zeros(n)
    rng = rng or np.random.default_rng(0)
    gaps = rng.gamma(shape=burstiness, scale=1 / (rate * burstiness), size=max(n - 1, 0))
    return np.concatenate([[0.0], np.cumsum(gaps)])[:n]
