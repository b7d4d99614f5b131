"""MLA over a paged latent cache: the absorbed Triton path against the un-absorbed torch spec.

``mla_reference.mla_attention`` expands every latent into per-head keys and values and runs
plain attention; ``kernels.mla_attention`` absorbs w_uk into the query, runs the kernel over the
latents and applies w_uv afterwards. Their agreement checks the absorption algebra, not only
the kernel. The cache must hold exactly one latent row per token.
"""

import dataclasses

import pytest
import torch

from pagedlab.device import DEVICE
from pagedlab.footprint import ModelConfig, get_model, kv_bytes_per_token
from pagedlab.kernels import cache_latent, mla, mla_attention, mla_decode
from pagedlab.kernels import mla_reference as ref
from pagedlab.kernels.traffic import CAN_COUNT, WHY_NOT, count_traffic, mla_traffic

FP32, FP16, BF16 = torch.float32, torch.float16, torch.bfloat16


def make_inputs(lens, num_heads=8, rank=32, rope=16, nope=16, v_dim=16, block_size=16,
                dtype=FP16, **kw) -> ref.MLADecodeInputs:
    return ref.random_mla_inputs(
        lens, num_heads=num_heads, kv_lora_rank=rank, rope_dim=rope, nope_dim=nope,
        v_head_dim=v_dim, block_size=block_size, dtype=dtype, **kw,
    )


def absorbed_vs_expanded(x, **kw) -> float:
    out = mla_attention(*x.args(), scale=x.scale, **kw)
    assert out.dtype == x.q_nope.dtype and out.shape == (*x.q_nope.shape[:2], x.w_uv.shape[1])
    expanded = ref.mla_attention(*x.args(), scale=x.scale)
    return (out.float() - expanded.float()).abs().max().item()


@pytest.mark.parametrize(
    "dtype, heads, rank, rope, block_size, lens, tol",
    [
        (FP16, 8, 32, 16, 16, [1, 15, 16, 17, 70], 2e-3),  # the acceptance bound in fp16
        (FP16, 20, 24, 8, 8, [3, 40], 2e-3),  # two programs per sequence, the second part-full
        (FP32, 4, 64, 16, 1, [2, 35], 2e-6),  # block size 1
        (FP32, 16, 32, 16, 12, [11, 12, 13, 50], 2e-6),  # a block size that is not 2^k
    ],
)
def test_absorbed_kernel_matches_the_expanded_reference(
    dtype, heads, rank, rope, block_size, lens, tol
):
    x = make_inputs(lens, heads, rank, rope, block_size=block_size, dtype=dtype, layout="random")
    assert absorbed_vs_expanded(x) <= tol


def test_kernel_matches_the_absorbed_reference():
    x = make_inputs([1, 17, 40], num_heads=20, dtype=FP32, layout="random", seed=2)
    query = mla.absorb_query(x.q_nope, x.q_rope, x.w_uk)  # [S, H, C + R]
    args = (query, x.latent_cache, x.block_tables, x.seq_lens)
    out = mla_decode(*args, kv_lora_rank=32, scale=x.scale)
    assert (out - ref.mla_decode(*args, kv_lora_rank=32, scale=x.scale)).abs().max() <= 2e-6
    wide = mla_decode(*args, kv_lora_rank=32, scale=x.scale, heads_per_program=32)
    assert (wide - out).abs().max() <= 2e-6  # one program for all 20 heads instead of two


def test_bf16():
    x = make_inputs([1, 17, 40], dtype=BF16)
    assert absorbed_vs_expanded(x) <= 2e-2


# ---------------------------------------------------------------------------------------------
# The cache: one latent row per token


def test_cache_holds_one_latent_row_per_token():
    """No key cache and value cache: one row of kv_lora_rank + rope_dim values per token, the
    bytes chapter 1's footprint counts for an MLA layer."""
    rank, rope, block_size = 32, 16, 8
    nan = float("nan")
    latent_cache = torch.full((4, block_size, rank + rope), nan, dtype=FP16, device=DEVICE)
    c_kv = torch.randn(5, rank, dtype=FP16, device=DEVICE)
    k_rope = torch.randn(5, rope, dtype=FP16, device=DEVICE)
    slots = torch.tensor([9, 10, -1, 0, 31], device=DEVICE)
    cache_latent(c_kv, k_rope, latent_cache, slots)
    rows = latent_cache.view(-1, rank + rope)  # [slots, C + R]
    assert torch.equal(rows[[9, 10, 0, 31]], torch.cat([c_kv, k_rope], -1)[[0, 1, 3, 4]])
    assert rows.isnan().all(-1).sum() == rows.shape[0] - 4  # nothing else was written
    one_layer = ModelConfig(
        "tiny-MLA", 1, 64, 4, 4, 16, 1e6, "mla", kv_lora_rank=rank, qk_rope_head_dim=rope
    )
    bytes_per_token = latent_cache[0, 0].numel() * latent_cache.element_size()
    assert bytes_per_token == kv_bytes_per_token(one_layer, "fp16") == (rank + rope) * 2


def test_deepseek_v3_latent_rows_are_a_fraction_of_mha_and_gqa():
    v3 = get_model("DeepSeek-V3")
    mha = dataclasses.replace(v3, attention="mha", kv_lora_rank=None, qk_rope_head_dim=None)
    gqa = dataclasses.replace(mha, attention="gqa", n_kv_heads=8)
    mla_bytes = kv_bytes_per_token(v3, "bf16")
    assert mla_bytes == v3.n_layers * (512 + 64) * 2
    assert kv_bytes_per_token(mha, "bf16") / mla_bytes == pytest.approx(2 * 128 * 128 / 576)
    assert kv_bytes_per_token(gqa, "bf16") / mla_bytes == pytest.approx(2 * 8 * 128 / 576)


@pytest.mark.skipif(not CAN_COUNT, reason=f"loads cannot be counted: {WHY_NOT}")
@pytest.mark.parametrize("heads_per_program", [16, 32])
def test_each_program_reads_every_row_once(heads_per_program):
    x = make_inputs([9, 40, 64], num_heads=32)
    query = mla.absorb_query(x.q_nope, x.q_rope, x.w_uk)
    with count_traffic(latent_cache=x.latent_cache, block_tables=x.block_tables) as traffic:
        mla_decode(query, x.latent_cache, x.block_tables, x.seq_lens, kv_lora_rank=32,
                   scale=x.scale, heads_per_program=heads_per_program)
    formula = mla_traffic(x.seq_lens, num_heads=32, kv_lora_rank=32, rope_dim=16,
                          heads_per_program=heads_per_program)
    assert {n: traffic.loaded[n] for n in formula.loaded} == formula.loaded
    assert formula.loaded["latent_cache"] == (32 // heads_per_program) * 113 * 48 * 2


# ---------------------------------------------------------------------------------------------
# Errors, before any launch


@pytest.fixture
def no_launch(monkeypatch):
    # A launch would raise "'NoneType' object is not subscriptable", which no match accepts.
    monkeypatch.setattr(mla, "_mla_decode_kernel", None)


@pytest.mark.parametrize(
    "change, error, name",
    [
        (lambda x: {"w_uk": x.w_uk[:, :, :8]}, ValueError, "w_uk must have shape"),
        (lambda x: {"w_uv": x.w_uv[:3]}, ValueError, "w_uv must have shape"),
        (lambda x: {"q_rope": x.q_rope[:1]}, ValueError, "q_rope must have shape"),
        (lambda x: {"latent_cache": x.latent_cache.float()}, TypeError, "latent_cache"),
        (lambda x: {"block_tables": x.block_tables.long()}, TypeError, "block_tables"),
        (lambda x: {"seq_lens": x.seq_lens * 0}, ValueError, "seq_lens\\[0\\] = 0"),
    ],
)
def test_attention_errors_name_the_argument(no_launch, change, error, name):
    x = dataclasses.replace(make_inputs([3, 20]), **change(make_inputs([3, 20])))
    for impl in (mla_attention, ref.mla_attention):
        with pytest.raises(error, match=name):
            impl(*x.args(), scale=x.scale)


def test_decode_errors_name_the_argument(no_launch):
    x = make_inputs([3, 20])
    query = mla.absorb_query(x.q_nope, x.q_rope, x.w_uk)
    args = (query, x.latent_cache, x.block_tables, x.seq_lens)
    for impl in (mla_decode, ref.mla_decode):
        with pytest.raises(ValueError, match="kv_lora_rank=48"):
            impl(*args, kv_lora_rank=48, scale=0.1)
        with pytest.raises(ValueError, match="scale=-1"):
            impl(*args, kv_lora_rank=32, scale=-1)
        with pytest.raises(ValueError, match="query rows hold 40"):
            impl(query[..., :40], *args[1:], kv_lora_rank=32, scale=0.1)
    with pytest.raises(ValueError, match="heads_per_program=24"):
        mla_decode(*args, kv_lora_rank=32, scale=0.1, heads_per_program=24)


# ---------------------------------------------------------------------------------------------
# GPU: DeepSeek-V3's shapes (512 + 64 latent, 128-dim heads), bf16


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads", [16, 128])
def test_gpu_deepseek_shapes(num_heads):
    x = make_inputs([1, 63, 64, 1000, 4099], num_heads, 512, 64, 128, 128, 64, BF16,
                    device=DEVICE, layout="random")
    assert absorbed_vs_expanded(x) <= 2e-2
