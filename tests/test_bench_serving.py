"""``benchmarks/bench_serving.py`` against the tiny-model server of ``test_serve``: its prompts
have exactly their token lengths, every request comes back whole, and what the load generator
counts agrees with the server's own ``/metrics``; then 100 concurrent streaming clients of
mixed lengths all get their full greedy outputs and no block is leaked."""

import asyncio
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from test_serve import NAME, idle, server, tiny  # noqa: F401  (the tiny-model server fixture)

import httpx  # noqa: E402
from pagedlab import SamplingParams  # noqa: E402
from pagedlab.serving_metrics import arrival_offsets, summarize  # noqa: E402

_spec = importlib.util.spec_from_file_location(
    "bench_serving", Path(__file__).resolve().parents[1] / "benchmarks" / "bench_serving.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def prompts_of(tokenizer, lengths, seed=0):
    rng = np.random.default_rng(seed)
    words = bench.prompt_words(tokenizer, rng)
    return [bench.make_prompt(tokenizer, words, p, rng) for p, _ in lengths]


def scrape(url):
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {s.name: s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.labels.get("model_name") == NAME}


def test_prompts_have_exactly_their_token_lengths(server):  # noqa: F811
    _, llm, _ = server
    lengths = [(n, 1) for n in (1, 2, 7, 33, 120)]
    for prompt, (n, _) in zip(prompts_of(llm.tokenizer, lengths), lengths):
        assert len(llm.tokenizer.encode(prompt, add_special_tokens=False)) == n


def test_the_load_generator_s_counts_agree_with_the_server_s_metrics(server):  # noqa: F811
    url, llm, _ = server
    lengths = bench.workload("sharegpt", 6, max_prompt_len=40, max_output_len=12, seed=3)
    prompts = prompts_of(llm.tokenizer, lengths)
    offsets = arrival_offsets(len(lengths), 20.0, 1.0, np.random.default_rng(0))
    before = scrape(url)
    records, duration = asyncio.run(bench.benchmark(url, NAME, prompts, lengths, offsets))
    after = scrape(url)
    assert idle(llm) == 0
    assert all(r.ok for r in records), [r.error for r in records]
    assert [r.output_tokens for r in records] == [o for _, o in lengths]
    s = summarize(records, duration)
    delta = {k: after[k] - before[k] for k in ("vllm:request_success_total",
                                               "vllm:prompt_tokens_total",
                                               "vllm:generation_tokens_total",
                                               "vllm:time_to_first_token_seconds_count")}
    assert s["completed"] == 6 and s["failed"] == 0
    assert delta == {"vllm:request_success_total": 6,
                     "vllm:prompt_tokens_total": s["total_input_tokens"],
                     "vllm:generation_tokens_total": s["total_output_tokens"],
                     "vllm:time_to_first_token_seconds_count": 6}
    assert s["total_input_tokens"] == sum(p for p, _ in lengths)


@pytest.mark.slow
def test_100_concurrent_streaming_clients_get_full_outputs_and_leak_no_block(server):  # noqa: F811
    url, llm, reference = server
    rng = np.random.default_rng(7)
    lengths = list(zip(rng.integers(1, 40, 100).tolist(), rng.integers(1, 30, 100).tolist()))
    prompts = prompts_of(llm.tokenizer, lengths, seed=7)
    records, _ = asyncio.run(bench.benchmark(url, NAME, prompts, lengths, np.zeros(100)))
    assert idle(llm) == 0
    assert all(r.ok for r in records), [r.error for r in records if not r.ok][:3]
    assert [r.output_tokens for r in records] == [o for _, o in lengths]
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in lengths]
    want = reference.generate(prompts, params, use_tqdm=False)
    assert [r.text for r in records] == [w.outputs[0].text for w in want]


def test_the_command_line_writes_tables_and_settings(server, tmp_path, monkeypatch):  # noqa: F811
    url, llm, _ = server
    monkeypatch.setattr(bench, "RESULTS", tmp_path)
    bench.main(["--base-url", url, "--dataset", "sharegpt", "--num-prompts", "3",
                "--max-prompt-len", "16", "--max-output-len", "4", "--request-rate", "50",
                "--goodput", "ttft:600000", "--result-name", "serving-test"])
    saved = json.loads((tmp_path / "serving-test.json").read_text())
    result = saved["results"][url]
    assert result["model"] == NAME and result["wrong_length"] == 0 and not result["errors"]
    summary = result["summary"]
    assert summary["completed"] == 3 and summary["request_goodput"] == summary[
        "request_throughput"]  # a 10-minute TTFT bound: every request is good
    assert saved["settings"]["goodput_slo_ms"] == {"ttft": 600000.0}
    table = (tmp_path / "serving-test.md").read_text()
    assert "| Successful requests | 3 |" in table and "request_rate: 50.0" in table
    assert idle(llm) == 0


def test_simulate_builds_the_servers_engine_and_predicts_the_same_workload(server, monkeypatch):  # noqa: F811
    """``--simulate``: the engine is built from the server's own command line (its flags
    reach it), calibrated, and the simulator serves every request to its full length."""
    from pagedlab import LLM, serve

    _, llm, _ = server
    built = []

    def tiny_engine(args):  # the tiny model in place of the checkpoint the flags name
        built.append(args)
        return LLM(llm.model, tokenizer=llm.tokenizer, block_size=args.block_size,
                   num_gpu_blocks=128, max_num_seqs=args.max_num_seqs,
                   max_num_batched_tokens=args.max_num_batched_tokens)

    monkeypatch.setattr(serve, "engine", tiny_engine)
    lengths = [(12, 3), (30, 5), (7, 1), (20, 4)]
    column = bench.simulate("unused-dir", "--block-size 8 --max-num-seqs 8 --max-num-batched-tokens 64",
                            lengths, arrival_offsets(4, 2.0), {"ttft": 60.0})
    assert (built[0].block_size, built[0].max_num_batched_tokens) == (8, 64)
    summary = column["summary"]
    assert summary["completed"] == 4 and summary["total_output_tokens"] == 13
    assert summary["total_input_tokens"] == 69 and summary["request_goodput"] is not None
    assert column["fit"]["constant_ms"] > 0
