"""One decode step against its matrix-product roofline: the same GEMMs timed alone.

A decode step at batch B runs, in every layer, the q, k, v, o, gate, up and down projections
on B rows, and the output layer on B rows: 2 B (weights) FLOPs, the step's floor. Everything
else (attention over the paged cache, cache writes, norms, rotary, activations, sampling,
scheduling, input preparation) is what the engine adds. For each batch size this script times
decode steps of SmolLM2-135M-Instruct and those GEMMs alone, interleaved in repeats so that a
change in the machine's load hits both, by process CPU time on a CPU (one thread), by the wall
clock on a GPU; it reports medians with their range, and a profile of one batch's steps by
class (:mod:`pagedlab.profiling`).

    python benchmarks/bench_step.py [--batches 1,8,32,64] [--steps 6] [--repeats 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import pagedlab  # noqa: F401  (first: on a CPU it switches Triton to its interpreter)
import torch

from pagedlab import LLM, SamplingParams
from pagedlab.device import HAS_CUDA, describe
from pagedlab.model import from_pretrained
from pagedlab.checkpoints import smollm2
from pagedlab.profiling import decode_gemms, decode_work, profile_steps, what_is_left
from pagedlab.timing import stopwatch

PROMPT_TOKENS = 48


def seconds(fn) -> float:
    """One call's CPU seconds on a CPU, wall seconds (synchronized) on a GPU."""
    with stopwatch() as t:
        fn()
    return t.wall if HAS_CUDA else t.cpu


def decoding(model, batch: int, max_tokens: int) -> LLM:
    """An engine whose ``batch`` requests have all been prefilled: every next step decodes."""
    llm = LLM(model, max_num_seqs=max(batch, 1))
    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        ids = torch.randint(10, model.args.vocab_size - 10, (PROMPT_TOKENS,), generator=g)
        llm.add_request(str(i), {"prompt_token_ids": ids.tolist()}, params)
    while not llm.last_step or llm.last_step.prefills or not llm.last_step.decodes:
        llm.step()
    return llm


def bench(model, batch: int, steps: int, repeats: int) -> dict:
    llm = decoding(model, batch, max_tokens=(steps + 1) * repeats + 8)
    roof, flops = decode_gemms(model, batch)
    roof()  # warm-up
    step_s, roof_s = [], []
    for _ in range(repeats):  # interleaved: the engine's steps, then the GEMMs alone
        for _ in range(steps):
            step_s.append(seconds(llm.step))
            assert len(llm.last_step.decodes) == batch and not llm.last_step.prefills
        roof_s += [seconds(roof) for _ in range(steps)]
    step, gemm = statistics.median(step_s), statistics.median(roof_s)
    return {"batch": batch, "step_ms": 1e3 * step, "step_range_ms": [1e3 * min(step_s),
            1e3 * max(step_s)], "gemm_ms": 1e3 * gemm, "gemm_range_ms": [1e3 * min(roof_s),
            1e3 * max(roof_s)], "ratio": step / gemm, "gflop": flops / 1e9,
            "gemm_gflops": flops / gemm / 1e9, "llm": llm}


def markdown(results: list[dict], profile, profile_batch: int, meta: dict, work) -> str:
    clock = "wall-clock" if HAS_CUDA else "process CPU"
    lines = [f"# Decode step against its GEMM roofline, {meta['date']}", "",
             f"{meta['device']}; torch {meta['torch']}, {meta['threads']} thread(s); "
             f"{meta['model']}; prompts of {PROMPT_TOKENS} tokens; {clock} time, median "
             f"[range] of {meta['samples']} steps and as many GEMM runs, interleaved.", "",
             "| batch | step ms | GEMMs alone ms | step / GEMMs | GFLOP | GEMM GFLOPS |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in results:
        lines.append(
            f"| {r['batch']} | {r['step_ms']:.1f} [{r['step_range_ms'][0]:.1f}, "
            f"{r['step_range_ms'][1]:.1f}] | {r['gemm_ms']:.1f} [{r['gemm_range_ms'][0]:.1f}, "
            f"{r['gemm_range_ms'][1]:.1f}] | {r['ratio']:.2f} | {r['gflop']:.2f} | "
            f"{r['gemm_gflops']:.0f} |")
    lines += ["", f"Profile of {profile.steps} decode steps at batch {profile_batch} "
              "(torch.profiler, which slows small ops down):", "",
              "| class | ms per step | share |", "| --- | --- | --- |"]
    lines += [f"| {row} | {ms:.1f} | {share:.1%} |" for row, ms, share in profile.rows()]
    lines += ["", *what_is_left(profile, work, profile_batch)]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--steps", type=int, default=6, help="timed decode steps per repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile-batch", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    if not HAS_CUDA:
        torch.set_num_threads(1)  # CPU time counts every thread's spinning too
    model = from_pretrained(smollm2())
    results = []
    for batch in map(int, args.batches.split(",")):
        results.append(bench(model, batch, args.steps, args.repeats))
        r = results[-1]
        print(f"batch {batch}: step {r['step_ms']:.1f} ms, GEMMs {r['gemm_ms']:.1f} ms, "
              f"ratio {r['ratio']:.2f}", flush=True)
    llms = {r["batch"]: r.pop("llm") for r in results}
    profile_batch = args.profile_batch if args.profile_batch in llms else max(llms)
    profile = profile_steps(llms[profile_batch], 3)
    work = decode_work(model, [c.context_len for c in llms[profile_batch].last_step.decodes])
    meta = {"device": describe(), "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
            "python": platform.python_version(), "threads": torch.get_num_threads(),
            "model": "SmolLM2-135M-Instruct (fp32)" if not HAS_CUDA else
            f"SmolLM2-135M-Instruct ({model.dtype})", "samples": args.steps * args.repeats}
    where = "gpu" if HAS_CUDA else "cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"step-{where}.json").write_text(json.dumps(
        {"meta": meta, "results": results, "profile_batch": profile_batch,
         "profile": {row: ms for row, ms, _ in profile.rows()},
         "ops_per_step": profile.ops_per_step, "work": vars(work)}, indent=2))
    text = markdown(results, profile, profile_batch, meta, work)
    (args.out / f"step-{where}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
