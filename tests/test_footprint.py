"""KV bytes, weights and capacity against the paper, hand counts and transformers' own cache."""

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pagedlab.footprint import (
    MODELS,
    ModelConfig,
    get_model,
    kv_bytes,
    kv_bytes_per_token,
    kv_capacity,
    kv_copies,
    max_sequences,
    step_cost,
    weight_bytes,
)
from pagedlab.hardware import get_gpu

# --- the paper's numbers (Kwon et al. 2023) ---------------------------------------------------


def test_opt13b_kv_per_token_is_the_papers_800_kib():
    # 2 (K, V) x 5120 (hidden) x 40 (layers) x 2 (fp16 bytes) = 819,200 = 800 * 1024
    assert kv_bytes_per_token("OPT-13B", "fp16") == 819_200 == 800 * 1024


def test_opt13b_full_request_is_the_papers_1_6_gb():
    assert kv_bytes("OPT-13B", 2048, "fp16") == 1_677_721_600  # = 1,600 MiB = 1.5625 GiB


@pytest.mark.parametrize(
    "model, gpu, num_gpus, paper_kv_gib, paper_slots, tolerance",
    [
        ("OPT-13B", "A100-40GB", 1, 12, 15_700, 0.05),
        ("OPT-66B", "A100-40GB", 4, 21, 9_700, 0.05),
        # The paper kept less than 10% back on this configuration: we land 5.1% below it.
        ("OPT-175B", "A100-80GB", 8, 264, 60_100, 0.06),
    ],
)
def test_table1_kv_room_and_slots(model, gpu, num_gpus, paper_kv_gib, paper_slots, tolerance):
    cap = kv_capacity(model, gpu, num_gpus=num_gpus)
    assert cap.token_slots == pytest.approx(paper_slots, rel=tolerance)
    assert cap.kv_bytes / 2**30 == pytest.approx(paper_kv_gib, rel=tolerance)


def test_opt13b_on_one_a100_by_hand():
    cap = kv_capacity("OPT-13B", "A100-40GB")
    assert cap.budget_bytes == 38_654_705_664  # 0.9 * 40 GiB
    assert cap.weight_bytes == 25_706_946_560  # 12,853,473,280 parameters * 2 bytes
    assert cap.kv_bytes == 12_947_759_104
    assert cap.token_slots == 15_805
    assert max_sequences("OPT-13B", "A100-40GB", 2048) == 7


# --- the formula, for every attention kind ------------------------------------------------------

MHA_PRESETS = [name for name, m in MODELS.items() if m.attention == "mha"]


@pytest.mark.parametrize("name", MHA_PRESETS)
def test_fp16_mha_is_four_layers_d_model(name):
    m = get_model(name)
    assert kv_bytes_per_token(m, "fp16") == 4 * m.n_layers * m.d_model


@pytest.mark.parametrize(
    "name, dtype, expected",
    [
        ("Llama-3-8B", "bf16", 131_072),  # 2 * 32 layers * 8 KV heads * 128 * 2 bytes
        ("Llama-3-70B", "bf16", 327_680),  # 2 * 80 * 8 * 128 * 2
        ("Qwen2.5-7B", "bf16", 57_344),  # 2 * 28 * 4 * 128 * 2
        ("DeepSeek-V3", "bf16", 70_272),  # 61 layers * (512 + 64) * 2
        ("DeepSeek-V3", "fp8", 35_136),
        ("OPT-175B", "fp8", 2_359_296),  # 2 * 96 * 12288 * 1
        ("Llama-2-7B", "fp32", 1_048_576),  # 2 * 32 * 4096 * 4
        ("Llama-3-8B", torch.bfloat16, 131_072),
        ("Llama-3-8B", torch.float8_e4m3fn, 65_536),
    ],
)
def test_hand_computed_sizes(name, dtype, expected):
    assert kv_bytes_per_token(name, dtype) == expected


@pytest.mark.parametrize("n_heads, n_kv_heads", [(8, 8), (8, 2), (8, 1)])
def test_matches_the_cache_transformers_allocates(n_heads, n_kv_heads):
    """A tiny Llama's own KV cache, measured in bytes, agrees for MHA, GQA and MQA."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=n_heads, num_key_value_heads=n_kv_heads, head_dim=4,
    )
    num_tokens = 5
    with torch.no_grad():
        out = LlamaForCausalLM(cfg).eval()(torch.arange(num_tokens)[None], use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values  # "cache" in newer transformers
    layers = cache.layers
    tensors = [t for layer in layers for t in (layer.keys, layer.values)]
    measured = sum(t.numel() * t.element_size() for t in tensors)
    kind = {n_heads: "mha", 1: "mqa"}.get(n_kv_heads, "gqa")
    ours = ModelConfig("tiny", 3, 32, n_heads, n_kv_heads, 4, 1e5, kind)
    assert kv_bytes(ours, num_tokens, layers[0].keys.dtype) == measured


@st.composite
def grouped_models(draw):
    n_kv = draw(st.integers(1, 16))
    group = draw(st.integers(1, 8))
    return dict(
        n_layers=draw(st.integers(1, 128)), head_dim=draw(st.sampled_from([32, 64, 128, 256])),
        n_heads=n_kv * group, n_kv_heads=n_kv,
    )


def _model(n_layers, head_dim, n_heads, n_kv_heads):
    kind = "mha" if n_kv_heads == n_heads else "mqa" if n_kv_heads == 1 else "gqa"
    return ModelConfig("m", n_layers, n_heads * head_dim, n_heads, n_kv_heads, head_dim, 1e9, kind)


@given(grouped_models())
def test_grouping_divides_the_mha_cache_by_the_group_size(shape):
    grouped = _model(**shape)
    full = _model(**{**shape, "n_kv_heads": shape["n_heads"]})
    group = shape["n_heads"] // shape["n_kv_heads"]
    assert kv_bytes_per_token(grouped) * group == kv_bytes_per_token(full)
    assert kv_bytes_per_token(grouped, "fp8") * 2 == kv_bytes_per_token(grouped, "fp16")
    assert kv_bytes_per_token(grouped, "fp32") == 2 * kv_bytes_per_token(grouped, "bf16")


@given(st.integers(0, 10**6), st.integers(0, 10**6))
def test_kv_bytes_adds_up(a, b):
    m = get_model("Qwen2.5-7B")
    assert kv_bytes(m, a) + kv_bytes(m, b) == kv_bytes(m, a + b)


def test_mla_ignores_heads():
    v3 = get_model("DeepSeek-V3")
    assert kv_bytes_per_token(dataclasses.replace(v3, n_heads=16, n_kv_heads=16)) == 70_272


# --- presets ------------------------------------------------------------------------------------

# (name, vocab, ffn, tied embeddings, qkv bias): enough to count a dense model's parameters.
ARCH = [
    ("Llama-2-7B", 32000, 11008, False, False),
    ("Llama-2-13B", 32000, 13824, False, False),
    ("Llama-3-8B", 128256, 14336, False, False),
    ("Llama-3-70B", 128256, 28672, False, False),
    ("Qwen2.5-7B", 152064, 18944, False, True),
]


@pytest.mark.parametrize("name, vocab, ffn, tied, bias", ARCH)
def test_llama_family_counts_match_the_architecture(name, vocab, ffn, tied, bias):
    m = get_model(name)
    d, kv = m.d_model, m.n_kv_heads * m.head_dim
    attention = 2 * d * d + 2 * d * kv + (d + 2 * kv if bias else 0)
    per_layer = attention + 3 * d * ffn + 2 * d  # gated MLP, two RMSNorms
    total = m.n_layers * per_layer + d + vocab * d * (1 if tied else 2)
    assert m.n_params == total


def test_opt13b_parameter_count():
    assert get_model("OPT-13B").n_params == pytest.approx(12.85e9, abs=5e6)
    assert weight_bytes("OPT-13B", "fp16") == 25_706_946_560


def test_custom_models_work_everywhere():
    toy = ModelConfig("toy", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16,
                      n_params=1e6, attention="gqa")
    assert kv_bytes_per_token(toy) == 256  # 2 * 2 * 2 * 16 * 2
    assert kv_capacity(toy, "A100-40GB").token_slots == (int(0.9 * 40 * 2**30) - 2_000_000) // 256


def test_capacity_grows_with_gpus_and_shrinks_with_wider_dtypes():
    one, four = (kv_capacity("Llama-3-70B", "H100-SXM", num_gpus=n) for n in (1, 4))
    assert not one.weights_fit and one.kv_bytes == 0 and one.token_slots == 0
    assert four.weights_fit and four.token_slots > 0
    fp8 = kv_capacity("Llama-3-70B", "H100-SXM", num_gpus=4, dtype="fp8")
    assert fp8.token_slots == 2 * four.token_slots or fp8.token_slots == 2 * four.token_slots + 1


def test_tensor_parallelism_replicates_the_mla_latent_on_every_gpu():
    # Under TP each rank caches the whole latent, so 8 GPUs hold what one GPU's share of the
    # pooled room holds: the per-GPU KV room over the full per-token latent (vLLM DCP docs).
    v3 = dict(model="DeepSeek-V3", gpu="H200", num_gpus=8, weight_dtype="fp8")
    tp = kv_capacity(**v3)
    per_gpu_room = (int(0.9 * get_gpu("H200").memory_bytes * 8) - 671 * 10**9) / 8
    assert tp.token_slots == int(per_gpu_room // kv_bytes_per_token("DeepSeek-V3"))
    assert max_sequences(context_len=131072, **v3) == 5
    # Decode context parallelism over all 8 ranks splits the tokens instead: the room pools.
    dcp = kv_capacity(decode_context_parallel=8, **v3)
    assert dcp.token_slots == dcp.kv_bytes // kv_bytes_per_token("DeepSeek-V3")
    assert max_sequences(context_len=131072, decode_context_parallel=8, **v3) == 45


@pytest.mark.parametrize(
    "model, num_gpus, copies",
    [("Llama-3-70B", 4, 1), ("Llama-3-70B", 8, 1), ("Llama-3-70B", 16, 2), ("Qwen2.5-7B", 8, 2),
     ("OPT-13B", 8, 1), ("DeepSeek-V3", 1, 1), ("DeepSeek-V3", 8, 8)],
)
def test_kv_heads_are_replicated_only_when_gpus_outnumber_them(model, num_gpus, copies):
    assert kv_copies(model, num_gpus) == copies
    cap = kv_capacity(model, "H200", num_gpus=num_gpus, weight_dtype="fp8")
    assert cap.token_slots == cap.kv_bytes // (copies * kv_bytes_per_token(model))


# --- arithmetic intensity ---------------------------------------------------------------------

TINY = ModelConfig("tiny", n_layers=2, d_model=8, n_heads=2, n_kv_heads=2, head_dim=4,
                   n_params=1000)


def test_decode_step_by_hand():
    # 3 sequences with 5 cached tokens each decode one token: each attends to 6 tokens.
    cost = step_cost(TINY, batch_size=3, context_len=5)
    assert cost.flops == 2 * 1000 * 3 + 4 * 2 * 2 * 4 * (3 * 6)  # weights + attention
    assert cost.bytes_moved == 2 * 1000 + 3 * 6 * 64  # weights; read 5, write 1 token of 64 B


def test_prefill_step_by_hand():
    # A 4-token prompt: causal attention covers 1 + 2 + 3 + 4 = 10 pairs.
    cost = step_cost(TINY, batch_size=1, context_len=0, new_tokens=4)
    assert cost.flops == 2 * 1000 * 4 + 64 * 10
    assert cost.bytes_moved == 2000 + 4 * 64


def test_mla_step_by_hand():
    mla = ModelConfig("mla", 1, 8, 2, 2, 4, 100, "mla", kv_lora_rank=4, qk_rope_head_dim=2,
                      n_active_params=50)
    cost = step_cost(mla, batch_size=1, context_len=0)
    assert cost.flops == 2 * 50 + 2 * 2 * (2 * 4 + 2)  # active weights; latent scores + values
    assert cost.bytes_moved == 200 + 6 * 2


def test_decode_intensity_is_one_at_batch_one_and_bounded():
    """fp16 MHA decode moves one byte per FLOP at batch 1; batching cannot pass 1 + W / KV."""
    m = get_model("OPT-13B")
    assert step_cost(m, 1, 1024).intensity == pytest.approx(1.0)
    ceiling = 1 + weight_bytes(m) / kv_bytes(m, 1025)
    intensities = [step_cost(m, b, 1024).intensity for b in (1, 4, 16, 64, 256, 4096)]
    assert intensities == sorted(intensities) and intensities[-1] < ceiling
    assert step_cost(m, 10**7, 1024).intensity == pytest.approx(ceiling, rel=1e-3)


def test_prefill_is_compute_bound_everywhere():
    cost = step_cost("Llama-3-8B", batch_size=1, context_len=0, new_tokens=2048)
    assert cost.intensity > max(get_gpu(g).ridge_point() for g in ("A100-80GB", "H100-SXM", "H200"))


# --- bad inputs name their field ----------------------------------------------------------------

BASE = dict(name="m", n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, head_dim=128,
            n_params=8e9, attention="gqa")


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(name=""), "name"),
        (dict(n_layers=0), "n_layers=0"),
        (dict(d_model=-1), "d_model=-1"),
        (dict(head_dim=64.0), "head_dim"),
        (dict(n_heads=0), "n_heads=0"),
        (dict(n_kv_heads=0), "n_kv_heads=0"),
        (dict(n_kv_heads=3), "n_kv_heads=3 must divide n_heads=32"),
        (dict(n_params=0), "n_params"),
        (dict(n_active_params=-1.0), "n_active_params"),
        (dict(max_context=0), "max_context"),
        (dict(attention="sliding"), "attention='sliding'"),
        (dict(attention="mha"), "n_kv_heads=8 must equal n_heads=32"),
        (dict(attention="mqa"), "n_kv_heads=8 must be 1"),
        (dict(n_kv_heads=32), "n_kv_heads=32 must lie strictly between"),
        (dict(kv_lora_rank=512), "kv_lora_rank"),
        (dict(attention="mla", qk_rope_head_dim=64), "kv_lora_rank"),
        (dict(attention="mla", kv_lora_rank=512), "qk_rope_head_dim"),
    ],
)
def test_bad_model_fields(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**{**BASE, **change})


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: get_model("GPT-5"), "model='GPT-5'"),
        (lambda: kv_bytes_per_token("OPT-13B", "int4"), "dtype='int4'"),
        (lambda: kv_bytes_per_token("OPT-13B", torch.int8), "dtype=torch.int8"),
        (lambda: kv_bytes("OPT-13B", -1), "num_tokens=-1"),
        (lambda: weight_bytes("OPT-13B", "fp4"), "dtype='fp4'"),
        (lambda: kv_capacity("OPT-13B", "B200"), "gpu='B200'"),
        (lambda: kv_capacity("OPT-13B", "A100-40GB", num_gpus=0), "num_gpus=0"),
        (lambda: kv_capacity("OPT-13B", "A100-40GB", gpu_memory_utilization=1.5), "utilization"),
        (lambda: kv_capacity("OPT-13B", "A100-40GB", gpu_memory_utilization=0), "utilization"),
        (lambda: kv_capacity("OPT-13B", "A100-40GB", weight_dtype="int3"), "weight_dtype='int3'"),
        (lambda: kv_capacity("OPT-13B", "A100-40GB", num_gpus=3), "num_gpus=3 .* 40 KV heads"),
        (lambda: kv_capacity("DeepSeek-V3", "H200", 8, decode_context_parallel=3),
         "decode_context_parallel=3 .* 8 copies"),
        (lambda: kv_copies("Llama-3-8B", 8, decode_context_parallel=2),
         "decode_context_parallel=2 .* 1 copies"),
        (lambda: max_sequences("OPT-13B", "A100-40GB", 0), "context_len=0"),
        (lambda: step_cost("OPT-13B", 0, 10), "batch_size=0"),
        (lambda: step_cost("OPT-13B", 1, -1), "context_len=-1"),
        (lambda: step_cost("OPT-13B", 1, 0, new_tokens=0), "new_tokens=0"),
    ],
)
def test_bad_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_unknown_model_lists_the_presets():
    with pytest.raises(ValueError) as info:
        get_model("GPT-5")
    assert all(name in str(info.value) for name in MODELS)
