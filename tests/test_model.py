"""pagedlab.model against transformers: logits of prefills (fresh and after a prefix-cache hit),
decodes through paged_attention and a batch mixing both; loading; unsupported configs."""

import pytest
import torch
from _tiny import MODELS, random_prompts, tiny_hf

from pagedlab.engine.runner import ModelRunner
from pagedlab.engine.step import Chunk, Step
from pagedlab.engine.sequence import Sequence
from pagedlab.memory import KVCacheManager
from pagedlab.model import (
    ModelArgs,
    PagedLlama,
    UnsupportedModel,
    from_hf,
    from_pretrained,
    load_kernels,
)

# fp32 rounding: up to 2e-4 apart after 4 layers of width 256 (logits reach about 25), the
# same whether the prompt is fresh or a prefix hit.
TOL = dict(atol=2e-4, rtol=1e-5)


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()  # [len(tokens), vocab]


class Forward:
    """A model, a prefix-caching manager and a runner: one forward pass per call."""

    def __init__(self, model, block_size=4, num_blocks=32):
        self.model = model
        self.manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True)
        self.runner = ModelRunner(model, block_size, num_blocks, 0)

    def __call__(self, step: Step) -> torch.Tensor:
        """Logits of every token of the step, [num_tokens, vocab]."""
        batch, *_ = self.runner.prepare(step)
        return self.model.compute_logits(self.model(batch, self.runner.kv_caches))

    def prefill(self, seq_id: int, tokens: list[int]) -> Chunk:
        seq = Sequence(seq_id, tokens)
        cached = self.manager.allocate(seq_id, tokens)
        return Chunk.of(self.manager, seq, cached, len(tokens) - cached)

    def decode(self, seq: Sequence, token: int) -> Chunk:
        seq.output_token_ids.append(token)
        self.manager.append(seq.seq_id, [token])
        return Chunk.of(self.manager, seq, len(seq) - 1, 1)


@pytest.mark.parametrize("name", MODELS)
def test_logits_match_transformers(name):
    hf = tiny_hf(name)
    run = Forward(from_hf(hf))
    a, b, c = random_prompts([7, 12, 5], hf.config.vocab_size)

    # Step 1: two prefills of different lengths in one pass (SDPA, fresh prompts).
    pa, pb = run.prefill(0, a), run.prefill(1, b)
    logits = run(Step(prefills=[pa, pb]))
    torch.testing.assert_close(logits[:7], hf_logits(hf, a), **TOL)
    torch.testing.assert_close(logits[7:], hf_logits(hf, b), **TOL)

    # Step 2: a new prefill mixed with two decodes (paged_attention).
    ta, tb = int(logits[6].argmax()), int(logits[18].argmax())
    sa, sb = run.decode(pa.seq, ta), run.decode(pb.seq, tb)
    pc = run.prefill(2, c)
    logits = run(Step(prefills=[pc], decodes=[sa, sb]))
    torch.testing.assert_close(logits[:5], hf_logits(hf, c), **TOL)
    torch.testing.assert_close(logits[5], hf_logits(hf, a + [ta])[-1], **TOL)
    torch.testing.assert_close(logits[6], hf_logits(hf, b + [tb])[-1], **TOL)

    # Step 3: a prompt sharing b's first two blocks: a prefix hit, the rest attends over them.
    d = b[:9] + c
    pd = run.prefill(3, d)
    assert pd.start == 8  # two full blocks of 4 served from the cache
    logits = run(Step(prefills=[pd]))
    torch.testing.assert_close(logits, hf_logits(hf, d)[8:], **TOL)
    run.manager.check_invariants()


def test_loads_a_saved_checkpoint(tmp_path):
    hf = tiny_hf("qwen2-mqa-d32-tied")
    hf.save_pretrained(tmp_path)
    loaded, direct = from_pretrained(tmp_path, device="cpu"), from_hf(hf)
    assert loaded.args == direct.args and loaded.args.tie_word_embeddings
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    for (name, p), (_, q) in zip(loaded.state_dict().items(), direct.state_dict().items()):
        assert torch.equal(p, q), name


def test_q_k_v_load_as_one_stacked_matrix_and_a_missing_one_is_named():
    hf = tiny_hf("qwen2-gqa-d64")  # biases too
    attn, ours = hf.model.layers[1].self_attn, from_hf(hf).model.layers[1].self_attn
    for kind in ("weight", "bias"):
        parts = [getattr(getattr(attn, f"{p}_proj"), kind) for p in "qkv"]
        assert torch.equal(getattr(ours.qkv_proj, kind), torch.cat(parts)), kind
    missing = "model.layers.1.self_attn.v_proj.bias"
    state = {k: v for k, v in hf.state_dict().items() if k != missing}
    with pytest.raises(UnsupportedModel, match=f"lacks {missing}"):
        PagedLlama(from_hf(hf).args).load_state_dict(state, strict=False)


def test_model_args_read_the_config():
    hf = tiny_hf("llama-gqa-d64", eos_token_id=[3, 5])
    args = from_hf(hf).args
    assert (args.num_heads, args.num_kv_heads, args.head_dim, args.num_layers) == (4, 2, 64, 3)
    assert args.eos_token_ids == (3, 5) and not args.qkv_bias and not args.tie_word_embeddings
    assert from_hf(tiny_hf("qwen2-gqa-d64")).args.qkv_bias
    # transformers 4's layout: rope_theta at the top level, rope_scaling null
    old = {**hf.config.to_dict(), "rope_parameters": None, "rope_theta": 5e5, "rope_scaling": None}
    assert ModelArgs.from_hf_config(old).rope_theta == 5e5


@pytest.mark.parametrize(
    "change, field",
    [
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
         "rope_parameters type 'linear'"),
        ({"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
         "rope_scaling type 'dynamic'"),
        ({"model_type": "gpt2"}, "model_type='gpt2'"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"mlp_bias": True}, "mlp_bias=True"),
        ({"attention_bias": True}, "attention_bias=True"),
    ],
)
def test_unsupported_config_fields_are_named(change, field):
    config = {**tiny_hf("llama-mha-d32").config.to_dict(), **change}
    with pytest.raises(UnsupportedModel, match=field):
        ModelArgs.from_hf_config(config)


def test_unsupported_models_and_kernels_are_named():
    with pytest.raises(UnsupportedModel, match="Linear is not supported"):
        from_hf(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="kernels='cuda'"):
        load_kernels("cuda")
    model = from_hf(tiny_hf("llama-mha-d32"))
    assert model.kernels == "reference"  # the default on a CPU
    model.kernels = "triton"
    assert model.ops.__name__ == "pagedlab.kernels"
    with pytest.raises(UnsupportedModel, match="must divide"):
        PagedLlama(ModelArgs(64, 64, 128, 1, num_heads=4, num_kv_heads=3, head_dim=16))


@pytest.mark.parametrize("name", MODELS)
def test_a_shape_counts_its_parameters_and_its_kv_bytes(name):
    """ModelArgs in chapter 1's vocabulary: the parameter count of the model it builds (a tied
    output layer once, Qwen2's biases included), and a cache block's bytes, K and V of every
    layer's KV heads, as the cache tensors hold them."""
    from pagedlab.engine.runner import block_bytes

    model = from_hf(tiny_hf(name))
    a = model.args
    assert a.num_params == sum(p.numel() for p in model.parameters())
    shape = a.footprint()
    assert (shape.n_layers, shape.d_model, shape.n_kv_heads) == (a.num_layers, a.hidden_size,
                                                                  a.num_kv_heads)
    assert shape.attention == {4: "mha", 2: "gqa", 1: "mqa"}[a.num_kv_heads]
    runner = ModelRunner(model, 4, 3, 0)
    cache_bytes = sum(c.nbytes for layer in runner.kv_caches for c in layer)
    assert block_bytes(model, 4) == cache_bytes // 3
    assert block_bytes(model, 4, "fp8") == cache_bytes // 3 // 4  # one byte instead of fp32's 4
