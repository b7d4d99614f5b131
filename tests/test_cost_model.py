"""The GPU cost model against hand-computed step and swap times."""

import pytest

from pagedlab.footprint import MODELS, step_cost
from pagedlab.hardware import GPUS
from pagedlab.sim.cost_model import CostModel

OPT13 = MODELS["OPT-13B"]
WEIGHTS = 2 * OPT13.n_params  # fp16 bytes
KV = 4 * 40 * 5120  # bytes per token: 4 * layers * d_model = 800 KiB
BW = 1555e9 * 0.8  # A100-40GB at the default efficiency
PEAK = 312e12 * 0.6


def test_a_decode_step_is_bandwidth_bound_by_hand():
    cost = CostModel("OPT-13B", "A100-40GB")
    # 10 sequences with 100 tokens each, the new one included: weights once, KV of 1,000.
    expected = (WEIGHTS + 1000 * KV) / BW + 0.005
    assert cost.step_time(decode_lens=[100] * 10) == pytest.approx(expected)


def test_a_long_prefill_is_compute_bound_by_hand():
    cost = CostModel("OPT-13B", "A100-40GB", step_overhead=0.0)
    n = 2048
    flops = 2 * OPT13.n_params * n + 4 * 40 * 40 * 128 * n * (n + 1) // 2
    assert flops / PEAK > (WEIGHTS + n * KV) / BW  # compute-bound indeed
    assert cost.step_time(prefill_lens=[n]) == pytest.approx(flops / PEAK)


def test_blocks_read_whole_and_at_least_a_tile():
    cost = CostModel("OPT-13B", "A100-40GB", kv_tile_tokens=16)
    assert cost.kv_read_tokens(100, None) == 100
    assert cost.kv_read_tokens(100, 16) == 7 * 16  # the last block is read whole
    assert cost.kv_read_tokens(100, 4) == 25 * 16  # each 4-token block costs a 16-token tile
    contiguous = cost.step_time(decode_lens=[100])
    assert cost.step_time(decode_lens=[100], block_size=4) - contiguous == pytest.approx(
        (400 - 100) * KV / BW)


def test_uniform_batches_agree_with_footprint_step_cost():
    for model in ("OPT-66B", "Llama-3-8B", "DeepSeek-V3"):
        cost = CostModel(model, "H200", step_overhead=0.0, bandwidth_efficiency=1,
                         compute_efficiency=1)
        for batch, ctx in [(1, 0), (32, 500), (256, 2000)]:
            c = step_cost(model, batch, ctx)
            expected = GPUS["H200"].step_time(c.flops, c.bytes_moved)
            assert cost.step_time(decode_lens=[ctx + 1] * batch) == pytest.approx(expected)


def test_swap_time_by_hand():
    cost = CostModel("OPT-13B", "A100-40GB")
    # 10 blocks of 16 tokens: bytes over PCIe, plus a copy per block, layer, K and V.
    expected = 10 * 16 * KV / 25e9 + 10 * 2 * 40 * 5e-6
    assert cost.swap_time(10, 16) == pytest.approx(expected)
    assert cost.swap_time(0, 16) == 0.0


def test_every_preset_pair_builds_and_more_work_takes_longer():
    for gpu in ("A100-40GB", "A100-80GB", "H100-SXM", "H200"):
        for model in ("OPT-13B", "OPT-66B", "OPT-175B", "Llama-2-7B", "Llama-3-70B"):
            cost = CostModel(model, gpu, num_gpus=8 if "175" in model else 1)
            assert cost.step_time() == 0.0
            assert 0 < cost.step_time(decode_lens=[10]) < cost.step_time(decode_lens=[10] * 64)


@pytest.mark.parametrize("kwargs, message", [
    ({"bandwidth_efficiency": 0}, "bandwidth_efficiency=0 must be in"),
    ({"compute_efficiency": 1.5}, "compute_efficiency=1.5 must be in"),
    ({"step_overhead": -1}, "step_overhead"),
    ({"gpu": "V100"}, "V100"),
])
def test_bad_parameters_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CostModel(**({"model": "OPT-13B", "gpu": "A100-40GB"} | kwargs))
