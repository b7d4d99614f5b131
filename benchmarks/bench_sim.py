"""How fast the serving simulator runs: simulated requests and tokens per second of wall time.

    python benchmarks/bench_sim.py [--limit N] [--requests 100000] [--out PATH]

Every trace goes through the paged system (the engine's own scheduler and KV-cache manager,
OPT-13B on an A100-40GB, costed by ``CostModel``):

- the Azure conversation trace (Splitwise's, in Vidur's processed form: 19,366 requests over
  an hour, mean prompt 1,155 and output 211 tokens) from ``../shared/traces``, skipped with a
  message when that folder is absent. At its own arrival times it overloads this GPU: the
  queue grows all hour and requests are preempted;
- 100,000 synthetic requests with Alpaca's lengths (the paper's Fig. 11 means, 19 prompt and
  58 output tokens) arriving as Poisson at 50 requests/s, below this setup's knee (between 60
  and 100 requests/s), so the batch holds about 90 requests;
- 10,000 synthetic requests with ShareGPT's lengths (161 and 338 tokens) at 2 requests/s, near
  its knee: as many output tokens as 58,000 Alpaca requests.

Then the baselines on 1,000 ShareGPT requests. The simulator's work is per output token (each
running sequence is scheduled, appended to and updated every step), so requests per second
depend on the trace's output lengths; microseconds per output token compare traces. Target:
100,000 requests in under 2 minutes on one core. Nothing is asserted; the table is for
regressions.
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

from bench_decode import save

from pagedlab.sim import SYSTEMS, load_trace, shared_trace_path, synthetic_requests
from pagedlab.sim.cost_model import CostModel
from pagedlab.sim.simulator import simulate_system

SYNTHETIC = (("alpaca", 50.0), ("sharegpt", 2.0))  # (dataset, requests/s)


def timed(trace: str, system: str, requests, cost) -> dict:
    """Simulate ``requests`` under ``system``; what it cost in wall and CPU time."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = simulate_system(system, requests, cost)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    tokens = int(result.output_len.sum())
    return {"trace": trace, "system": system, "requests": len(requests),
            "steps": len(result.time), "mean_batch": result.mean_batch, "output_tokens": tokens,
            "preemptions": result.preemptions, "wall_s": wall, "cpu_s": cpu,
            "requests_per_s": len(requests) / wall, "tokens_per_s": tokens / wall,
            "us_per_token": 1e6 * cpu / tokens,
            "normalized_latency": result.normalized_latency}


def markdown(rows: list[dict]) -> str:
    lines = ["| trace | system | requests | steps | mean batch | preempted | wall s | CPU s | "
             "requests/s | tokens/s | CPU us/token | norm. latency s/token |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(
            f"| {r['trace']} | {r['system']} | {r['requests']:,} | {r['steps']:,} | "
            f"{r['mean_batch']:.1f} | {r['preemptions']:,} | {r['wall_s']:.1f} | "
            f"{r['cpu_s']:.1f} | {r['requests_per_s']:,.0f} | {r['tokens_per_s']:,.0f} | "
            f"{r['us_per_token']:.1f} | {r['normalized_latency']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=None,
                        help="requests of the Azure trace to use")
    parser.add_argument("--requests", type=int, default=100_000,
                        help="synthetic Alpaca requests (ShareGPT: a tenth of them)")
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "sim-cpu.json",
                        help="JSON path (a .md table is written beside it)")
    args = parser.parse_args()
    cost = CostModel("OPT-13B", "A100-40GB")
    rows = []
    path = shared_trace_path("azure_conv_2023")
    if path is None:
        print("skipped the Azure trace: no ../shared/traces/azure_conv_2023.csv")
    else:
        rows.append(timed("azure_conv_2023", "paged", load_trace(path, limit=args.limit), cost))
        print(markdown(rows[-1:]), flush=True)
    for (dataset, rate), count in zip(SYNTHETIC, (args.requests, max(1, args.requests // 10))):
        requests = synthetic_requests(dataset, count, rate=rate, seed=0)
        rows.append(timed(f"{dataset}, {rate:g} req/s", "paged", requests, cost))
        print(markdown(rows[-1:]), flush=True)
    sharegpt = synthetic_requests("sharegpt", 1000, rate=2.0, seed=0)
    rows += [timed("sharegpt, 2 req/s", s, sharegpt, cost) for s in SYSTEMS]
    meta = {"date": time.strftime("%Y-%m-%d"), "python": platform.python_version(),
            "machine": platform.machine(), "model": "OPT-13B", "gpu": "A100-40GB"}
    save(args.out, {"meta": meta, "runs": rows},
         f"# Simulator benchmark, {meta['date']}\n\nPython {meta['python']}; OPT-13B on an "
         "A100-40GB (cost model); one process, one core.\n\n" + markdown(rows))


if __name__ == "__main__":
    main()
