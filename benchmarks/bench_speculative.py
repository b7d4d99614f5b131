"""Speculative decoding with n-gram prompt lookup against plain decoding, on SmolLM2.

Two chat workloads, greedy: *editing* (the reply copies a given paragraph with its spelling
fixed, so the prompt predicts most of the output) and *open* questions (it predicts little).
Each is served at batch 1 (one request at a time) and at batch 16, with and without
speculation (``{"method": "ngram", "num_speculative_tokens": K}``), the two taking turns over
``--repeats`` repeats after a warm-up. Reported: output tokens per second of process CPU time
(one torch thread), median and range, the speed-up repeat by repeat, the acceptance rate and
tokens per verification step; and whether the replies were identical (greedy speculation must
not change a token).

    python benchmarks/bench_speculative.py [--k K] [--max-tokens N] [--repeats R] [--out DIR]
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
from pagedlab.device import describe
from pagedlab.checkpoints import smollm2
from pagedlab.prompts import conversations

def serve(llm: LLM, chats, params) -> dict:
    start = time.process_time()
    outs = llm.chat(chats, params, use_tqdm=False)
    seconds = time.process_time() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": seconds, "tokens": tokens, "rate": tokens / seconds,
            "replies": [o.outputs[0].token_ids for o in outs], "steps": llm.stats.num_steps}


def bench(model_dir, kind: str, batch: int, k: int, max_tokens: int, repeats: int) -> dict:
    chats = conversations(kind, max(batch, 4))
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    engines = {
        "plain": LLM(model_dir, max_num_seqs=batch),
        "ngram": LLM(model_dir, max_num_seqs=batch,
                     speculative_config={"method": "ngram", "num_speculative_tokens": k}),
    }
    for llm in engines.values():  # warm-up, not timed
        llm.chat(chats[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    runs = {key: [] for key in engines}
    for _ in range(repeats):  # interleaved, so a change in load hits both alike
        for key, llm in engines.items():
            runs[key].append(serve(llm, chats, params))
    spec = engines["ngram"].scheduler.spec_stats
    speedups = [s["rate"] / p["rate"] for s, p in zip(runs["ngram"], runs["plain"])]

    def rates(key):
        values = [r["rate"] for r in runs[key]]
        return {"median": statistics.median(values), "range": [min(values), max(values)]}

    return {
        "workload": kind, "batch": batch, "requests": len(chats), "k": k,
        "plain": rates("plain"), "ngram": rates("ngram"),
        "speedup": {"median": statistics.median(speedups),
                    "range": [min(speedups), max(speedups)]},
        "acceptance_rate": spec.acceptance_rate,
        "mean_acceptance_length": spec.mean_acceptance_length,
        "steps": {"plain": runs["plain"][-1]["steps"], "ngram": runs["ngram"][-1]["steps"]},
        "identical": all(p["replies"] == s["replies"]
                         for p, s in zip(runs["plain"], runs["ngram"])),
    }


def markdown(results: list[dict], meta: dict) -> str:
    r0 = results[0]
    lines = [f"# Speculative decoding benchmark, {meta['date']}", "",
             f"{meta['device']}; torch {meta['torch']}; SmolLM2-135M-Instruct, fp32, greedy, "
             f"{meta['max_tokens']} tokens at most per reply; n-gram prompt lookup with "
             f"k = {r0['k']}. Output tokens per second of process CPU time (one thread), "
             f"median [range] of {meta['repeats']} interleaved repeats; speed-up per repeat.", "",
             "| workload | batch | plain tokens/CPU s | n-gram tokens/CPU s | speed-up | "
             "acceptance | tokens per verify step | steps plain / n-gram | same replies |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    def span(v, f="{:.1f}"):
        return f"{f.format(v['median'])} [{f.format(v['range'][0])}, {f.format(v['range'][1])}]"

    for r in results:
        lines.append(
            f"| {r['workload']} | {r['batch']} | {span(r['plain'])} | {span(r['ngram'])} | "
            f"{span(r['speedup'], '{:.2f}')} | {r['acceptance_rate']:.0%} | "
            f"{r['mean_acceptance_length']:.2f} | {r['steps']['plain']} / {r['steps']['ngram']} "
            f"| {'yes' if r['identical'] else 'NO'} |")
    lines += ["", READING]
    return "\n".join(lines) + "\n"


READING = (
    "Where it wins and where it loses, and why: a step's cost is mostly its matrix products. "
    "At batch 1 they are matrix-vector products, bound by reading the weights, so verifying "
    "k + 1 tokens per sequence costs little more than one, and speed follows the tokens each "
    "verification step yields: a large gain where the reply copies the prompt, none where "
    "lookup rarely proposes a token the model accepts. At batch 16 the products already have "
    "16 rows and the CPU's arithmetic is the limit, so every proposal costs nearly what a "
    "token of plain decoding does: the editing workload still gains a little, because most "
    "proposals are accepted, and open questions lose, because most of the extra arithmetic "
    "is spent on rejected proposals. Chapter 12 draws the same line for a GPU with the cost "
    "model, at a much larger batch.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model_dir = smollm2()
    results = []
    for kind in ("editing", "open"):
        for batch in map(int, args.batches.split(",")):
            results.append(bench(model_dir, kind, batch, args.k, args.max_tokens, args.repeats))
            print(json.dumps({k: v for k, v in results[-1].items()}), flush=True)
    meta = {"device": describe(), "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
            "python": platform.python_version(), "max_tokens": args.max_tokens,
            "repeats": args.repeats}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "speculative-cpu.json").write_text(
        json.dumps({"meta": meta, "results": results}, indent=2))
    text = markdown(results, meta)
    (args.out / "speculative-cpu.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
