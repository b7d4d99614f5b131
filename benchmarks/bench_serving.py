"""Load-test an OpenAI-compatible server the way vLLM's serving benchmark does.

Requests take their prompt and output lengths from a trace in ``../shared/traces`` (or
ShareGPT-like lengths), arrive as a Poisson process (a gamma process with ``--burstiness``)
at ``--request-rate``, and stream over ``/v1/completions`` through the official ``openai``
client, so the same command measures pagedlab, ``transformers serve``, vLLM or SGLang. Each
prompt has exactly its length in the model's tokenizer, and each output its length: the
server is asked to ignore EOS (``ignore_eos``, as vLLM and SGLang take it, or a
``generation_config`` with ``min_new_tokens``, as ``transformers serve`` takes it).

It reports throughput, TTFT, TPOT, ITL and end-to-end latency (mean, median, p90, p99) and
goodput under an SLO (:mod:`pagedlab.serving_metrics`), and writes JSON and a Markdown table
under ``benchmarks/results/``. ``--launch pagedlab transformers`` starts each server in turn
on a free port, measures it on the same requests and stops it. ``--simulate`` adds the
simulator's prediction of the same workload (same arrivals and lengths) as a column, from a
cost model fitted to the engine's steps on this machine, the engine built from
``--server-args`` as the server builds it::

    python benchmarks/bench_serving.py --launch pagedlab transformers --num-prompts 30 \\
        --request-rate 0.5 --goodput ttft:2000 tpot:200
    python benchmarks/bench_serving.py --launch pagedlab --simulate --num-prompts 30 ...
    python benchmarks/bench_serving.py --base-url http://host:8000 --tokenizer MODEL_DIR

Wall-clock latencies on a shared CPU move with the neighbours' load: compare servers within
one run, and read medians.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from pagedlab.serving_metrics import (FORCE_LENGTH, PERCENTILES, arrival_offsets, benchmark,
                                      calibrate, parse_goodput, predict, summarize)
from pagedlab.sim.traces import load_trace, shared_trace_path, synthetic_requests

RESULTS = Path(__file__).resolve().parent / "results"
LAUNCHERS = ("pagedlab", "transformers", "transformers-cb")


def workload(dataset: str, n: int, max_prompt_len: int, max_output_len: int, seed: int):
    """``n`` (prompt_len, output_len) pairs: a shared trace's first ``n`` requests, or lengths
    drawn like ``sharegpt``/``alpaca`` (:func:`~pagedlab.sim.traces.synthetic_requests`),
    each capped at the given maxima."""
    path = shared_trace_path(dataset)
    if path is not None:
        requests = load_trace(path, limit=n)
    elif dataset in ("sharegpt", "alpaca"):
        requests = synthetic_requests(dataset, n, seed=seed)
    else:
        raise ValueError(f"dataset {dataset!r}: neither a trace in the shared traces folder "
                         f"nor 'sharegpt' or 'alpaca'")
    if len(requests) < n:
        raise ValueError(f"dataset {dataset!r} has {len(requests)} requests, fewer than {n}")
    return [(min(r.prompt_len, max_prompt_len), min(r.output_len, max_output_len))
            for r in requests]


def prompt_words(tokenizer, rng: np.random.Generator, sample: int = 4000) -> list[str]:
    """Words that are one token each with their leading space (`` cat``), drawn from the
    vocabulary: joined, ``k`` of them encode to exactly ``k`` tokens in a byte-level BPE."""
    ids = rng.choice(len(tokenizer), size=min(sample, len(tokenizer)), replace=False)
    words = []
    for i in ids.tolist():
        text = tokenizer.decode([i])
        if (len(text) > 1 and text[0] == " " and text[1:].isascii() and text[1:].isalpha()
                and tokenizer.encode(text, add_special_tokens=False) == [i]):
            words.append(text)
    if len(words) < 50:
        raise ValueError("the tokenizer has too few single-token words (' word') to build "
                         "prompts of exact lengths from")
    return words


def make_prompt(tokenizer, words: list[str], length: int, rng: np.random.Generator) -> str:
    """A random text of exactly ``length`` tokens (checked by encoding it)."""
    picked = [words[i] for i in rng.integers(len(words), size=length)]
    for _ in range(4 * length + 8):
        n = len(tokenizer.encode("".join(picked), add_special_tokens=False))
        if n == length:
            return "".join(picked)
        if n > length:
            picked.pop()
        else:
            picked.append(words[int(rng.integers(len(words)))])
    raise ValueError(f"could not build a prompt of exactly {length} tokens")


def served_model(base_url: str) -> str:
    return httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"][0]["id"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def launch(kind: str, model_dir: str, extra: list[str], timeout: float = 600):
    """Start a server on a free port in a subprocess; yield its base URL; stop it after."""
    port = free_port()
    if kind == "pagedlab":
        command = [sys.executable, "-m", "pagedlab.serve", "--model", model_dir,
                   "--port", str(port)]
    elif kind in ("transformers", "transformers-cb"):
        cli = Path(sys.executable).parent / "transformers"
        command = [str(cli), "serve", model_dir, "--host", "127.0.0.1", "--port", str(port)]
        command += ["--continuous-batching"] if kind == "transformers-cb" else []
    else:
        raise ValueError(f"--launch {kind!r}: expected one of {', '.join(LAUNCHERS)}")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS":
           os.environ.get("OMP_NUM_THREADS", "1")}
    log = open(Path(tempfile.gettempdir()) / f"bench-serving-{kind}-{port}.log", "w")
    proc = subprocess.Popen(command + extra, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the {kind} server exited ({proc.returncode}); see {log.name}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {kind} server did not come up in {timeout:.0f} s")
            time.sleep(0.5)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def simulate(model_dir: str, server_args: str, lengths, offsets, slo) -> dict:
    """The simulator's column: the engine the server would run (``python -m pagedlab.serve``
    given ``server_args``) is built here, its steps timed on the wall clock and fitted, and the
    simulator serves the workload with that cost model, cache and scheduler limits."""
    from pagedlab import serve

    llm = serve.engine(serve.parser().parse_args(["--model", model_dir, *server_args.split()]))
    cost, config = calibrate(llm)
    records, duration = predict(lengths, offsets, cost, config)
    fit = {"constant_ms": cost.constant * 1e3, "rms_relative_error": cost.rms_relative_error,
           **{f"{name}_ms": c * 1e3 for name, c in cost.coefficients.items()}}
    return {"model": model_dir, "summary": summarize(records, duration, slo), "errors": [],
            "wrong_length": 0, "fit": fit}


def run_one(base_url: str, prompts, lengths, offsets, force: str, slo) -> dict:
    """Warm the server with one request, then measure; the summary and the per-request rows."""
    model = served_model(base_url)
    asyncio.run(benchmark(base_url, model, prompts[:1], lengths[:1], [0.0], force))
    records, duration = asyncio.run(benchmark(base_url, model, prompts, lengths, offsets, force))
    failed = [r.error for r in records if r.error]
    short = sum(r.ok and r.output_tokens != r.output_len for r in records)
    return {"model": model, "summary": summarize(records, duration, slo),
            "errors": failed[:5], "wrong_length": short}


ROWS = [("Successful requests", "completed", "{:d}"), ("Failed requests", "failed", "{:d}"),
        ("Duration (s)", "duration_s", "{:.1f}"),
        ("Input tokens", "total_input_tokens", "{:d}"),
        ("Output tokens", "total_output_tokens", "{:d}"),
        ("Request throughput (req/s)", "request_throughput", "{:.3f}"),
        ("Output throughput (tok/s)", "output_throughput", "{:.2f}"),
        ("Goodput (req/s)", "request_goodput", "{:.3f}")]


def markdown(results: dict, settings: dict) -> str:
    names = list(results)
    lines = ["| metric | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for label, key, fmt in ROWS:
        cells = [results[n]["summary"][key] for n in names]
        lines.append(f"| {label} | " + " | ".join(
            "–" if c is None else fmt.format(c) for c in cells) + " |")
    for metric, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"),
                          ("e2el_ms", "E2E latency")):
        for stat in ("mean", "median", *(f"p{p}" for p in PERCENTILES)):
            cells = [results[n]["summary"][metric][stat] for n in names]
            lines.append(f"| {label} {stat} (ms) | " + " | ".join(
                "–" if math.isnan(c) else f"{c:.1f}" for c in cells) + " |")
    body = "\n".join(lines)
    settings_text = "\n".join(f"- {k}: {v}" for k, v in settings.items())
    return f"# Serving benchmark\n\n{body}\n\nSettings:\n\n{settings_text}\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--base-url", default=None,
                       help="a running server (default http://127.0.0.1:8000)")
    where.add_argument("--launch", nargs="+", choices=LAUNCHERS,
                       help="start each server in turn on --model-dir and measure it")
    parser.add_argument("--model-dir", default=None,
                        help="checkpoint for --launch (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--tokenizer", default=None,
                        help="the served model's tokenizer (default: --model-dir)")
    parser.add_argument("--dataset", default="azure_conv_2023",
                        help="a trace in the shared traces folder, or sharegpt or alpaca")
    parser.add_argument("--num-prompts", type=int, default=30)
    parser.add_argument("--max-prompt-len", type=int, default=512)
    parser.add_argument("--max-output-len", type=int, default=128)
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="requests/s (inf: all at once)")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="gamma shape of the gaps: 1 is Poisson")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                        help="SLOs, as vLLM's: ttft:500 tpot:100 e2el:5000")
    parser.add_argument("--force-length", choices=FORCE_LENGTH, default=None,
                        help="how to make outputs their full length (default: generation_"
                             "config for transformers serve, ignore_eos otherwise)")
    parser.add_argument("--simulate", action="store_true",
                        help="add the simulator's prediction of the same workload, calibrated "
                             "on this machine (before any server starts)")
    parser.add_argument("--server-args", default="",
                        help="extra arguments for the launched pagedlab server")
    parser.add_argument("--result-name", default="serving-cpu")
    parser.add_argument("--note", default="", help="a line for the results' settings")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from pagedlab.checkpoints import smollm2

    model_dir = str(args.model_dir or smollm2())
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or model_dir)
    slo = parse_goodput(args.goodput)
    rng = np.random.default_rng(args.seed)
    lengths = workload(args.dataset, args.num_prompts, args.max_prompt_len,
                       args.max_output_len, args.seed)
    words = prompt_words(tokenizer, rng)
    prompts = [make_prompt(tokenizer, words, p, rng) for p, _ in lengths]
    offsets = arrival_offsets(len(lengths), args.request_rate, args.burstiness, rng)

    def force_for(kind):
        return args.force_length or ("generation_config" if kind.startswith("transformers")
                                     else "ignore_eos")

    results = {}
    predicted = None
    if args.simulate:  # first, while no server competes for the cores
        predicted = simulate(model_dir, args.server_args, lengths, offsets, slo)
    if args.launch:
        for kind in args.launch:
            extra = args.server_args.split() if kind == "pagedlab" else []
            with launch(kind, model_dir, extra) as url:
                results[kind] = run_one(url, prompts, lengths, offsets, force_for(kind), slo)
            print(f"{kind}: {json.dumps(results[kind]['summary'])}", flush=True)
    else:
        url = args.base_url or "http://127.0.0.1:8000"
        results[url] = run_one(url, prompts, lengths, offsets, force_for(url), slo)
    servers = list(results)
    if predicted is not None:
        results["simulator"] = predicted
    settings = {
        "dataset": args.dataset, "num_prompts": args.num_prompts,
        "max_prompt_len": args.max_prompt_len, "max_output_len": args.max_output_len,
        "request_rate": args.request_rate, "burstiness": args.burstiness, "seed": args.seed,
        "goodput_slo_ms": {k: v * 1000 for k, v in slo.items()},
        "force_length": {name: force_for(name) for name in servers},
        "server_args": args.server_args, "model": model_dir, "endpoint": "/v1/completions",
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "note": args.note,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    for name, result in results.items():
        if result["errors"] or result["wrong_length"]:
            print(f"{name}: {result['summary']['failed']} failed, {result['wrong_length']} "
                  f"of the wrong length; first errors: {result['errors']}", file=sys.stderr)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.result_name}.json").write_text(
        json.dumps({"settings": settings, "results": results}, indent=1) + "\n")
    table = markdown(results, settings)
    (RESULTS / f"{args.result_name}.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
