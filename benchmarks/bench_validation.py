"""The simulator against the engine it simulates: per-request TTFT, TPOT and latency of a timed
replay, predicted with a cost model fitted to the engine's own step times (issue 16).

The engine (SmolLM2-135M-Instruct on the CPU; a tiny random model if its wheel is absent) times
its steps over a spread of shapes, a least-squares fit prices a step from them, and the
simulator estimates the engine's capacity (requests/s flat out). The same requests then arrive
as a Poisson process at a low, a middle and a near-saturation share of that capacity: the
engine serves them (timed by its CPU time on a CPU, the wall clock on a GPU) and the simulator
predicts the same run. The errors are the predicted median and p90 over the measured ones,
minus one.

    python benchmarks/bench_validation.py [--requests N] [--threads T] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import pagedlab  # noqa: F401  (first: on a CPU it switches Triton to its interpreter)
import numpy as np
import torch

from pagedlab import LLM
from pagedlab.device import describe
from pagedlab.engine.runner import block_bytes
from pagedlab.sim.calibration import fit_cost_model, profile, relative_errors
from pagedlab.sim.replay import (
    METRICS, EngineSettings, capacity, errors, percentiles, predict, replay,
)
from pagedlab.sim.traces import LengthStats, synthetic_requests
from pagedlab.timing import copy_bandwidth, step_clock

SHORT = LengthStats("short chats", mean_prompt=48, mean_output=16, sigma_prompt=0.6,
                    sigma_output=0.5)  # small enough for a CPU to serve tens in a minute
LOADS = {"low": 0.25, "middle": 0.5, "near saturation": 0.85}  # shares of the capacity


def load_llm() -> tuple[LLM, str]:
    from pagedlab.checkpoints import ModelNotInstalled, smollm2

    try:
        return LLM(smollm2(), num_gpu_blocks=512), "SmolLM2-135M-Instruct, fp32"
    except ModelNotInstalled:
        import sys

        sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
        from _tiny import tiny_hf

        from pagedlab.model import from_hf

        return LLM(from_hf(tiny_hf("qwen2-gqa-d64")), num_gpu_blocks=512), "tiny random Qwen2"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: steadier steps on a shared machine)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    llm, model = load_llm()
    clock, sleep = step_clock()  # CPU time on a CPU (a neighbour's load hardly moves it)
    steps = profile(llm, batch_sizes=(1, 2, 4, 8, 16), prompt_lens=(16, 64, 128), clock=clock)
    fit = fit_cost_model(steps, kv_bytes_per_token=block_bytes(llm.model, 1),
                         swap_bandwidth=copy_bandwidth(1 << 26, "cpu") / 2)
    print(f"fit over {len(steps)} steps: {fit.constant * 1e3:.1f} ms + "
          + ", ".join(f"{c * 1e3:.3f} ms/{n}" for n, c in fit.coefficients.items())
          + f"; residuals {fit.rms_relative_error:.1%} rms", flush=True)
    settings = EngineSettings.of(llm)
    lengths = synthetic_requests(SHORT, args.requests, seed=args.seed, max_context=256)
    full = capacity(lengths, fit, settings)
    print(f"predicted capacity {full:.2f} requests/s", flush=True)
    points = []
    for load, share in LOADS.items():
        requests = synthetic_requests(SHORT, args.requests, rate=share * full, seed=args.seed,
                                      max_context=256)
        start = time.perf_counter()
        measured = replay(llm, requests, seed=args.seed, clock=clock, sleep=sleep)
        # the honest prediction uses the profile's fit; a fit to this replay's own steps
        # shows what is left when the step times are right: the simulation of the schedule
        own = fit_cost_model(measured.steps, kv_bytes_per_token=fit.kv_bytes_per_token,
                             swap_bandwidth=fit.swap_bandwidth)
        point = {"load": load, "rate": share * full, "share_of_capacity": share,
                 "seconds": time.perf_counter() - start, "steps": len(measured.steps),
                 "measured": {m: percentiles(measured, m) for m in METRICS}}
        for name, cost in (("profile", fit), ("own_steps", own)):
            predicted = predict(measured, cost)
            point[name] = {
                "step_time_error_rms": float(np.sqrt(np.mean(np.square(
                    relative_errors(cost, measured.steps))))),
                "predicted": {m: percentiles(predicted, m) for m in METRICS},
                "errors": errors(measured, predicted),
            }
            print(f"{load} ({point['rate']:.2f} req/s), {name} fit: " + ", ".join(
                f"{m} median {e['median']:+.0%} p90 {e['p90']:+.0%}"
                for m, e in point[name]["errors"].items()), flush=True)
        points.append(point)
    meta = {"device": describe(), "model": model, "date": time.strftime("%Y-%m-%d"),
            "torch": torch.__version__, "python": platform.python_version(),
            "threads": torch.get_num_threads(), "requests": args.requests,
            "clock": "wall" if torch.cuda.is_available() else "process CPU time",
            "load_average": [load_before, os.getloadavg()[0]], "cpus": os.cpu_count()}
    result = {"meta": meta, "capacity": full,
              "fit": {"constant": fit.constant, "coefficients": fit.coefficients,
                      "residual_rms": fit.rms_relative_error, "steps": len(steps)},
              "points": points}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "validation-cpu.json").write_text(json.dumps(result, indent=2))
    text = markdown(result)
    (args.out / "validation-cpu.md").write_text(text)
    print(text)


def markdown(result: dict) -> str:
    meta, fit = result["meta"], result["fit"]
    lines = [f"# Simulator against engine, {meta['date']}", "",
             f"{meta['device']}; {meta['model']}; torch {meta['torch']}, {meta['threads']} "
             f"thread(s); load average {meta['load_average'][0]:.1f} before, "
             f"{meta['load_average'][1]:.1f} after, on {meta['cpus']} CPUs.", "",
             f"Fit over {fit['steps']} profiled steps: {fit['constant'] * 1e3:.1f} ms + "
             + ", ".join(f"{c * 1e3:.3f} ms x {n}" for n, c in fit["coefficients"].items())
             + f"; residuals {fit['residual_rms']:.1%} rms. Predicted capacity "
             f"{result['capacity']:.2f} requests/s; {meta['requests']} requests per rate.", "",
             "| load | req/s | fitted on | step time error (rms) | "
             + " | ".join(f"{m} median | {m} p90" for m in METRICS) + " |",
             "| --- | --- | --- | --- | " + " | ".join("--- | ---" for _ in METRICS) + " |"]
    for p in result["points"]:
        for name, label in (("profile", "profile"), ("own_steps", "the replay's steps")):
            cells = []
            for m in METRICS:
                for stat in ("median", "p90"):
                    measured, predicted = p["measured"][m][stat], p[name]["predicted"][m][stat]
                    error = p[name]["errors"][m][stat]
                    cells.append(f"{measured:.3f} -> {predicted:.3f} s ({error:+.0%})")
            lines.append(f"| {p['load']} | {p['rate']:.2f} | {label} | "
                         f"{p[name]['step_time_error_rms']:.0%} | " + " | ".join(cells) + " |")
    lines += ["", "Each cell: measured -> predicted (predicted / measured - 1). \"profile\": the "
              "fit to the profiling run (the prediction); \"the replay's steps\": a fit to the "
              "replay's own steps (what is left when the step times are right)."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
