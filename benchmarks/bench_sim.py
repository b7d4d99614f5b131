"""How fast the serving simulator runs: simulated requests and tokens per second of wall time.

    python benchmarks/bench_sim.py [--limit 2000]

Replays the Azure conversation trace (Splitwise; Vidur's processed form) from
``../shared/traces`` through the paged system (the engine's scheduler, OPT-13B on an
A100-40GB), or synthetic ShareGPT requests when the trace is absent, and the baselines on
synthetic ShareGPT. Target: the whole 19,366-request trace in under 60 s on one core.
Nothing is asserted; the table is for the book and for regressions.
"""

from __future__ import annotations

import argparse
import time

from pagedlab.sim import load_trace, shared_trace_path, synthetic_requests
from pagedlab.sim.cost_model import CostModel
from pagedlab.sim.simulator import SYSTEMS, simulate_system


def timed(system, requests, cost) -> list:
    start = time.perf_counter()
    result = simulate_system(system, requests, cost)
    wall = time.perf_counter() - start
    tokens = int(result.output_len.sum())
    return [system, f"{len(requests):,}", f"{len(result.time):,}", f"{wall:.1f}",
            f"{len(requests) / wall:,.0f}", f"{tokens / wall:,.0f}",
            f"{result.normalized_latency:.2f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=None, help="requests of the trace to use")
    args = parser.parse_args()
    cost = CostModel("OPT-13B", "A100-40GB")
    path = shared_trace_path("azure_conv_2023")
    if path is None:
        print("no ../shared/traces/azure_conv_2023.csv: synthetic ShareGPT at 3 req/s instead")
        trace, name = synthetic_requests("sharegpt", args.limit or 5000, rate=3.0), "sharegpt"
    else:
        trace, name = load_trace(path, limit=args.limit), "azure_conv_2023"
    rows = [[name] + timed("paged", trace, cost)]
    sharegpt = synthetic_requests("sharegpt", 1000, rate=2.0, seed=0)
    rows += [["sharegpt, 2 req/s"] + timed(s, sharegpt, cost) for s in SYSTEMS]
    header = ["trace", "system", "requests", "steps", "wall s", "requests/s", "tokens/s",
              "norm. latency s/token"]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    for row in [header, *rows]:
        print("  ".join(str(x).rjust(w) for x, w in zip(row, widths)))


if __name__ == "__main__":
    main()
