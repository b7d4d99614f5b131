"""The step profile's classes add up to what the profiler saw, and the bound on continuous
batching's gain follows the arithmetic of padded and unpadded steps."""

import pytest
from _tiny import random_prompts, tiny_hf

from pagedlab import LLM, SamplingParams
from pagedlab.model import from_hf
from pagedlab.profiling import ROWS, decode_gemms, decode_work, floor_speedup, profile_steps


def test_a_step_costing_its_rows_gains_what_padding_wastes():
    """Cost b at batch b: padded decoding computes n x longest rows, continuous batching the
    sum of the outputs."""
    costs = {b: float(b) for b in (1, 2, 4, 8)}
    lens = [1, 2, 3, 10]
    assert floor_speedup(costs, lens) == pytest.approx(4 * 10 / 16)
    assert floor_speedup(costs, lens, batch_size=2) == pytest.approx((2 * 2 + 2 * 10) / 16)


def test_a_step_costing_the_same_at_any_batch_gains_nothing():
    costs = {1: 5.0, 8: 5.0}
    assert floor_speedup(costs, [3, 7, 7, 1, 2]) == pytest.approx(1.0)


def test_the_gemm_floor_counts_two_flops_per_weight_and_row():
    model = from_hf(tiny_hf("llama-gqa-d64"))
    _, flops = decode_gemms(model, 3)
    weights = sum(p.numel() for name, p in model.named_parameters()
                  if name.endswith("proj.weight")) + model.lm_head.weight.numel()
    assert flops == 2 * 3 * weights


def test_a_decode_steps_work_counts_its_weights_and_every_context_token():
    """Attention reads K and V of each context token in every layer (4 bytes a value in
    fp32) and does q.k and p.v for each query head; the products read each weight once."""
    model = from_hf(tiny_hf("llama-gqa-d64"))
    a, lens = model.args, [5, 9, 2]
    work = decode_work(model, lens)
    weights = sum(p.numel() for name, p in model.named_parameters()
                  if name.endswith("proj.weight")) + model.lm_head.weight.numel()
    assert work.context_tokens == 16 and work.weight_bytes == 4 * weights
    assert work.kv_bytes == 16 * a.num_layers * 2 * a.num_kv_heads * a.head_dim * 4
    assert work.attention_flops == 16 * a.num_layers * a.num_heads * 2 * 2 * a.head_dim
    assert work.gemm_flops == 2 * len(lens) * weights


def test_every_class_of_a_decode_step_is_seen(capfd):
    model = from_hf(tiny_hf("llama-gqa-d64"))
    llm = LLM(model, block_size=4, num_gpu_blocks=64)
    for i, prompt in enumerate(random_prompts([5, 7, 9], model.args.vocab_size)):
        llm.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=8,
                                                       ignore_eos=True))
    llm.step()  # the prefills
    profile = profile_steps(llm, 2)
    assert len(llm.last_step.decodes) == 3 and profile.steps == 2
    assert [row for row, *_ in profile.rows()] == list(ROWS)
    for row in ("matrix products", "attention", "cache writes", "sampler", "scheduler",
                "runner: inputs"):
        assert profile.ms[row] > 0, row
    assert profile.ops_per_step > 3 * 10  # a few ops per layer at least
    assert sum(share for *_, share in profile.rows()) == pytest.approx(1.0)
    assert "profiler_start" not in capfd.readouterr().err  # Kineto's log kept out of chapters
