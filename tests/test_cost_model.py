"""The GPU cost model against hand-computed step and swap times."""

import pytest

from pagedlab.footprint import MODELS, step_cost
from pagedlab.hardware import GPUS, INTERCONNECTS, Interconnect, get_interconnect
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


LLAMA8 = MODELS["Llama-3-8B"]  # 32 layers, d_model 4,096


def test_without_an_interconnect_communication_is_free():
    """The default prices no all-reduce, so chapter 10's simulations keep their numbers."""
    for n in (1, 4):
        free = CostModel("OPT-66B", "A100-40GB", num_gpus=n)
        assert free.interconnect is None and free.allreduce_time(1000) == 0.0
        linked = CostModel("OPT-66B", "A100-40GB", num_gpus=n, interconnect="NVLink-3")
        lens = [500] * 16
        extra = linked.step_time(decode_lens=lens) - free.step_time(decode_lens=lens)
        assert extra == (0.0 if n == 1 else pytest.approx(linked.allreduce_time(16)))


def test_a_decode_steps_all_reduces_by_hand():
    link = Interconnect("test link", 100e9, 20e-6)  # 100 GB/s each way, 20 us per all-reduce
    cost = CostModel("Llama-3-8B", "H100-SXM", num_gpus=4, interconnect=link)
    # 64 decodes: one all-reduce moves 64 tokens x 4,096 values x 2 bytes = 524,288 bytes;
    # a ring of 4 sends 2 * 3/4 of it from each GPU; two all-reduces in each of 32 layers.
    assert cost.allreduce_bytes(64) == 64 * 4096 * 2 == 524_288
    one = 1.5 * 524_288 / 100e9 + 20e-6
    assert link.allreduce_time(524_288, 4) == pytest.approx(one)
    assert cost.allreduce_time(64) == pytest.approx(64 * one)  # = 1.7833 ms
    assert cost.allreduce_time(64) == pytest.approx(64 * (7.86432e-6 + 20e-6))
    alone = CostModel("Llama-3-8B", "H100-SXM", num_gpus=4)
    lens = [1000] * 64
    assert cost.step_time(decode_lens=lens) == pytest.approx(
        alone.step_time(decode_lens=lens) + 64 * one)


def test_a_prefill_over_pcie_by_hand():
    # 2,048 prompt tokens on 8 GPUs over PCIe 4.0 x16: 16 GT/s x 16 lanes x 128/130 / 8 bits
    # = 31.5077 GB/s each way; a ring of 8 sends 14/8 of 16 MiB per all-reduce.
    cost = CostModel("Llama-3-8B", "A100-80GB", num_gpus=8, interconnect="PCIe-4-x16")
    pcie4 = 16e9 * 16 * 128 / 130 / 8
    assert get_interconnect("PCIe-4-x16").bandwidth_bytes_per_s == pytest.approx(pcie4)
    nbytes = 2048 * 4096 * 2
    expected = 2 * 32 * (14 / 8 * nbytes / pcie4 + 25e-6)
    assert cost.allreduce_time(2048) == pytest.approx(expected)
    assert expected == pytest.approx(0.06121, rel=1e-3)  # 61 ms: more than the step's compute


def test_the_ring_sends_two_n_minus_one_over_n():
    assert Interconnect.ring_bytes(800, 1) == 0
    assert Interconnect.ring_bytes(800, 2) == 800  # half reduced, then half gathered
    assert Interconnect.ring_bytes(800, 8) == 1400
    assert get_interconnect("NVLink-4").allreduce_time(10**6, 1) == 0.0


def test_interconnect_presets_are_the_datasheets_per_direction():
    per_direction = {"NVLink-4": 900e9 / 2, "NVLink-3": 600e9 / 2,
                     "PCIe-4-x16": 16e9 * 16 * 128 / 130 / 8,
                     "PCIe-5-x16": 32e9 * 16 * 128 / 130 / 8}
    assert sorted(INTERCONNECTS) == sorted(per_direction)
    for name, rate in per_direction.items():
        assert get_interconnect(name).bandwidth_bytes_per_s == pytest.approx(rate)
    assert round(per_direction["PCIe-5-x16"] / 1e9) == 63
    with pytest.raises(ValueError, match="interconnect='InfiniBand'"):
        CostModel("OPT-13B", "A100-40GB", interconnect="InfiniBand")
    with pytest.raises(ValueError, match="latency_s"):
        Interconnect("bad", 1e9, -1.0)


@pytest.mark.parametrize("kwargs, message", [
    ({"bandwidth_efficiency": 0}, "bandwidth_efficiency=0 must be in"),
    ({"compute_efficiency": 1.5}, "compute_efficiency=1.5 must be in"),
    ({"step_overhead": -1}, "step_overhead"),
    ({"gpu": "V100"}, "V100"),
])
def test_bad_parameters_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CostModel(**({"model": "OPT-13B", "gpu": "A100-40GB"} | kwargs))


def test_the_all_reduce_format_can_differ_from_the_caches():
    """A CPU engine all-reduces fp32 hidden states; an fp8 cache still sends fp16 ones."""
    fp32 = CostModel("Llama-3-8B", "H100-SXM", num_gpus=2, interconnect="NVLink-4",
                     allreduce_dtype="fp32")
    assert fp32.allreduce_bytes(3) == 3 * 4096 * 4
    with pytest.raises(ValueError, match="allreduce_dtype"):
        CostModel("Llama-3-8B", "H100-SXM", allreduce_dtype="int3")
