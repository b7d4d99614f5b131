"""A small Llama-family decoder that keeps its keys and values in the paged KV cache (chapter 8).

The architecture of Llama and Qwen2: RMSNorm, rotary position embeddings (the default RoPE
with ``rope_theta``), grouped-query attention (MHA and MQA are its ends), a SwiGLU MLP,
optional q/k/v biases (Qwen2) and a tied or separate ``lm_head``. Parameter names follow
transformers', so a checkpoint loads with ``load_state_dict``.

Attention is where paging enters. Every forward pass first writes the new tokens' keys and
values into the cache; then the prefills attend over their tokens (plus any prefix already
cached), and all decodes attend together over theirs. Each layer asks this of an
:class:`AttentionOps` the model builds once per step: :class:`TritonAttention` runs every
prefill in one ``paged_attention_varlen`` launch over the paged cache and the decodes through
``paged_attention``; :class:`ReferenceAttention` runs each prefill through torch's dense causal
SDPA and the decodes through a ``decode_layout`` of slots and mask, built once for every layer.
One pass serves a batch that mixes prefills and decodes: the linear layers run over all tokens
at once, only attention tells the sequences apart.

``kernels`` picks the implementation of the cache operations: ``"triton"``
(:mod:`pagedlab.kernels`) or ``"reference"`` (:mod:`pagedlab.kernels.reference`, plain torch,
much faster on a CPU, where Triton runs through its interpreter). The default follows the
weights: Triton for a model on CUDA, the reference for one on a CPU or Apple's GPU (MPS), and
the reference wherever Triton cannot be imported (macOS, Windows).

Given a ``kv_scale``, the caches are fp8 (e4m3, chapter 11) and :class:`FP8Attention` runs:
writes quantise with ``reshape_and_cache_fp8``, decodes read fp8 with ``paged_attention_fp8``
(from :mod:`pagedlab.kernels.fp8` or :mod:`pagedlab.kernels.fp8_reference`, as ``kernels``
says), and prefills go through SDPA, a cached prefix dequantised first.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pagedlab.device import DEVICE, has_triton, require_triton
from pagedlab.footprint import ModelConfig
from pagedlab.kernels import reference
from pagedlab.kernels.fp8_reference import dequantize
from pagedlab.profiling import scope

KERNELS = {"triton": "pagedlab.kernels", "reference": "pagedlab.kernels.reference"}
FP8_KERNELS = {"triton": "pagedlab.kernels.fp8", "reference": "pagedlab.kernels.fp8_reference"}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

__all__ = [
    "ARCHITECTURES",
    "FP8_KERNELS",
    "KERNELS",
    "AttentionOps",
    "FP8Attention",
    "ForwardBatch",
    "ModelArgs",
    "PagedLlama",
    "Prefill",
    "ReferenceAttention",
    "TritonAttention",
    "UnsupportedModel",
    "default_kernels",
    "from_hf",
    "from_pretrained",
    "load_kernels",
]


class UnsupportedModel(ValueError):
    """A checkpoint asks for something this model does not implement; names the field."""


# --- configuration --------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelArgs:
    """The shape of a Llama-family model: what the engine needs from a transformers config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    qkv_bias: bool = False  # Qwen2: biases on the q, k and v projections
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "llama"
    max_position_embeddings: int | None = None  # the context it was trained for

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModel(
                f"num_key_value_heads={self.num_kv_heads} must divide "
                f"num_attention_heads={self.num_heads}"
            )

    @property
    def num_params(self) -> int:
        """Parameters of a model of this shape (a tied output layer counted once)."""
        h, inner = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = 2 * h * q + 2 * h * kv + (q + 2 * kv if self.qkv_bias else 0)
        layer = attention + 3 * h * inner + 2 * h  # q, k, v, o; gate, up, down; two norms
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + embeddings + h  # and the final norm

    def footprint(self) -> ModelConfig:
        """This shape in chapter 1's vocabulary: what :mod:`pagedlab.footprint` sizes memory
        with (KV bytes per token, weight bytes, capacity)."""
        kind = ("mha" if self.num_kv_heads == self.num_heads
                else "mqa" if self.num_kv_heads == 1 else "gqa")
        return ModelConfig(self.model_type, self.num_layers, self.hidden_size, self.num_heads,
                           self.num_kv_heads, self.head_dim, self.num_params, attention=kind,
                           max_context=self.max_position_embeddings)

    @classmethod
    def from_hf_config(cls, config: dict) -> ModelArgs:
        """Read a transformers ``config.json`` (as a dict); reject what the model lacks."""
        model_type = config.get("model_type")
        if model_type not in ARCHITECTURES:
            raise UnsupportedModel(
                f"model_type={model_type!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
            )
        supported = {"hidden_act": "silu", "mlp_bias": False, "use_sliding_window": False}
        if model_type == "llama":  # Llama's attention_bias also puts a bias on o_proj
            supported["attention_bias"] = False
        for field, value in supported.items():
            if config.get(field, value) != value:
                raise UnsupportedModel(
                    f"{field}={config[field]!r} is not supported (only {value!r})"
                )
        heads = config["num_attention_heads"]
        eos = config.get("eos_token_id")
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(config),
            qkv_bias=model_type == "qwen2",
            tie_word_embeddings=config.get("tie_word_embeddings", False),
            eos_token_ids=tuple([] if eos is None else [eos] if isinstance(eos, int) else eos),
            model_type=model_type,
            max_position_embeddings=config.get("max_position_embeddings"),
        )


def _rope_theta(config: dict) -> float:
    """``rope_theta`` of the default RoPE, from transformers 5's ``rope_parameters`` or the
    older top-level ``rope_theta`` and ``rope_scaling``; any other RoPE variant is an error."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        field = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
        raise UnsupportedModel(f"{field} type {kind!r} is not supported (only the default RoPE)")
    return float(params.get("rope_theta", config.get("rope_theta", 10000.0)))


def default_kernels(device) -> str:
    """``"triton"`` for weights on CUDA where Triton imports, else ``"reference"``."""
    return "triton" if torch.device(device).type == "cuda" and has_triton() else "reference"


def load_kernels(kernels: str | None) -> tuple[str, ModuleType]:
    """(name, module) of the cache operations ``kernels`` names; None: the default for
    :data:`~pagedlab.device.DEVICE`."""
    name = kernels or default_kernels(DEVICE)
    if name not in KERNELS:
        raise ValueError(f"kernels={kernels!r} must be one of {', '.join(KERNELS)}")
    if name == "triton":
        require_triton("kernels='triton'", "kernels='reference' (the default without Triton)")
    return name, importlib.import_module(KERNELS[name])


# --- what one forward pass computes ---------------------------------------------------------


@dataclass
class Prefill:
    """One sequence's prompt chunk in a batch: rows ``[start, end)`` of the batch's tokens,
    following ``num_cached`` tokens already in the cache (a prefix-cache hit)."""

    start: int
    end: int
    num_cached: int
    block_table: Tensor  # int32 [max_blocks]: the sequence's row of the step's block tables


@dataclass
class ForwardBatch:
    """The tokens of one step: every prefill's tokens first, then one token per decode."""

    input_ids: Tensor  # int64 [num_tokens]
    positions: Tensor  # int64 [num_tokens]
    slot_mapping: Tensor  # int64 [num_tokens]: where each token's key and value go
    prefills: list[Prefill]  # in row order, the first from row 0
    block_tables: Tensor  # int32 [num_decodes, max_blocks]
    seq_lens: Tensor  # int32 [num_decodes]: cached tokens, the decoded one included

    @property
    def num_prefill_tokens(self) -> int:
        return self.prefills[-1].end if self.prefills else 0


# --- attention, by kernels ------------------------------------------------------------------


class AttentionOps(Protocol):
    """What a layer asks of the kernels in one step. The model builds one per forward pass
    (:meth:`PagedLlama.attention_ops`) and hands it to every layer, so what all layers would
    compute alike (the varlen kernel's prefill tensors, the reference's decode layout) is
    computed once. ``kv_cache`` is a layer's (key_cache, value_cache), [num_blocks,
    block_size, num_kv_heads, D] each.

    The runner built the batch's slots and block tables from the manager, so the kernels are
    called with ``check_values=False``: checking those values would only cost a device sync
    per call (the shape checks stay).
    """

    def write(self, key: Tensor, value: Tensor, kv_cache: tuple[Tensor, Tensor]) -> None:
        """Store the step's new keys and values, [num_tokens, num_kv_heads, D], in their slots."""

    def prefill(self, q: Tensor, k: Tensor, v: Tensor, kv_cache: tuple[Tensor, Tensor]) -> Tensor:
        """The prefill rows' queries, [num_prefill_tokens, num_heads, D], over each one's
        cached prefix and, causally, its chunk (whose keys and values are k and v, and already
        in the cache) -> [num_prefill_tokens, num_heads, D]."""

    def decode(self, q: Tensor, kv_cache: tuple[Tensor, Tensor]) -> Tensor:
        """Each decode's query, [num_decodes, num_heads, D], over its cached tokens -> the same
        shape."""


def prefill_attention(q: Tensor, k: Tensor, v: Tensor, num_cached: int) -> Tensor:
    """Causal attention of a prompt chunk's queries over the cached prefix and the chunk.

    q [n, num_heads, D]; k, v [num_cached + n, num_kv_heads, D] -> [n, num_heads, D]. Query i
    sits at position num_cached + i, so it sees keys 0..num_cached + i.
    """
    n, length = q.shape[0], k.shape[0]
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [heads, tokens, D]
    mask = None
    if num_cached:
        rows = torch.arange(n, device=q.device)[:, None] + num_cached  # [n, 1]
        mask = torch.arange(length, device=q.device)[None, :] <= rows  # [n, num_cached + n]
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=not num_cached, enable_gqa=True
    )  # [num_heads, n, D]
    return out.transpose(0, 1)


def sdpa_prefills(q, k, v, kv_cache, prefills: list[Prefill], kv_scale=None) -> Tensor:
    """Each prefill through :func:`prefill_attention`, torch's dense causal SDPA: over its
    chunk's k and v when nothing precedes it, else over its whole context read from the cache
    (dequantised from fp8 stored with ``kv_scale``, if given: SDPA needs the query's dtype)."""
    out = torch.empty_like(q)  # [num_prefill_tokens, num_heads, D]
    for p in prefills:
        rows = slice(p.start, p.end)
        if p.num_cached:  # the prefix lives only in the cache: read it with the chunk
            length = p.num_cached + p.end - p.start
            keys, values = (reference.gather_kv(cache, p.block_table, length)
                            for cache in kv_cache)  # [length, num_kv_heads, D] each
            if kv_scale is not None:
                keys, values = (dequantize(t, kv_scale).to(q.dtype) for t in (keys, values))
        else:
            keys, values = k[rows], v[rows]
        out[rows] = prefill_attention(q[rows], keys, values, p.num_cached)
    return out


class TritonAttention:
    """The Triton kernels of ``ops`` (:mod:`pagedlab.kernels`): every prefill in one
    ``paged_attention_varlen`` launch, which reads each one's keys through its block table, and
    every decode in one ``paged_attention``."""

    def __init__(self, batch: ForwardBatch, ops: ModuleType):
        self.batch, self.ops = batch, ops
        if batch.prefills:  # packed once, as the varlen kernel takes them
            prefills, device = batch.prefills, batch.input_ids.device
            self.prefill_start_loc = torch.tensor(  # int32 [num_prefills + 1]: rows, then the end
                [0, *(p.end for p in prefills)], dtype=torch.int32, device=device)
            self.prefill_lens = torch.tensor(  # int32 [num_prefills]: cached + new tokens
                [p.num_cached + p.end - p.start for p in prefills], dtype=torch.int32,
                device=device)
            # int32 [num_prefills, max_blocks]
            self.prefill_tables = torch.stack([p.block_table for p in prefills])

    def write(self, key, value, kv_cache) -> None:
        self.ops.reshape_and_cache(key, value, *kv_cache, self.batch.slot_mapping,
                                   check_values=False)

    def prefill(self, q, k, v, kv_cache) -> Tensor:
        return self.ops.paged_attention_varlen(q, *kv_cache, self.prefill_tables,
                                               self.prefill_start_loc, self.prefill_lens,
                                               check_values=False)

    def decode(self, q, kv_cache) -> Tensor:
        return self.ops.paged_attention(q, *kv_cache, self.batch.block_tables,
                                        self.batch.seq_lens, check_values=False)


class ReferenceAttention:
    """The torch reference kernels (:mod:`pagedlab.kernels.reference`), the fast path on a
    CPU: each prefill through SDPA (:func:`sdpa_prefills`), and the decodes through one
    ``decode_layout`` of token slots and padding mask, built once for every layer."""

    def __init__(self, batch: ForwardBatch, block_size: int):
        self.batch = batch
        self.decode_layout = (  # (slots int64 [S, T], mask fp32 [S, 1, 1, T]); None: no decodes
            reference.decode_layout(batch.block_tables, batch.seq_lens, block_size)
            if len(batch.seq_lens) else None
        )

    def write(self, key, value, kv_cache) -> None:
        reference.reshape_and_cache(key, value, *kv_cache, self.batch.slot_mapping,
                                    check_values=False)

    def prefill(self, q, k, v, kv_cache) -> Tensor:
        return sdpa_prefills(q, k, v, kv_cache, self.batch.prefills)

    def decode(self, q, kv_cache) -> Tensor:
        return reference.attend_by_slot(q, *kv_cache, *self.decode_layout, q.shape[-1] ** -0.5)


class FP8Attention:
    """fp8 caches through ``module``'s operations (:mod:`pagedlab.kernels.fp8` or
    :mod:`~pagedlab.kernels.fp8_reference`), with one per-tensor ``scale`` for keys and values
    (k_scale = v_scale, vLLM's ``kv_scale``). There is no fp8 varlen kernel: prefills go
    through SDPA, a cached prefix dequantised."""

    def __init__(self, batch: ForwardBatch, module: ModuleType, scale: Tensor):
        self.batch, self.module, self.scale = batch, module, scale  # scale: fp32 []

    def write(self, key, value, kv_cache) -> None:
        self.module.reshape_and_cache_fp8(key, value, *kv_cache, self.batch.slot_mapping,
                                          self.scale, self.scale, check_values=False)

    def prefill(self, q, k, v, kv_cache) -> Tensor:
        return sdpa_prefills(q, k, v, kv_cache, self.batch.prefills, self.scale)

    def decode(self, q, kv_cache) -> Tensor:
        return self.module.paged_attention_fp8(q, *kv_cache, self.batch.block_tables,
                                               self.batch.seq_lens, self.scale, self.scale,
                                               check_values=False)


# --- the layers -----------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 as transformers does."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        h = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)  # one op for five
        return self.weight * h.to(x.dtype)


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float, dtype) -> tuple[Tensor, Tensor]:
    """cos and sin of each position's rotation angles, [num_tokens, 1, head_dim] each; the
    sin's first half negated, as :func:`apply_rope` takes it. Once per step, for every layer."""
    dims = torch.arange(0, head_dim, 2, dtype=torch.float, device=positions.device)
    inv_freq = 1.0 / (theta ** (dims / head_dim))  # [head_dim / 2]
    freqs = positions[:, None].float() * inv_freq  # [num_tokens, head_dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [num_tokens, 1, head_dim]
    sin = emb.sin()
    sin[..., : head_dim // 2].neg_()
    return emb.cos().to(dtype), sin.to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, out: Tensor | None = None) -> Tensor:
    """Rotate each head's (i, i + head_dim/2) pairs; x [num_tokens, heads, head_dim].

    x * cos + cat(-x2, x1) * sin (transformers' ``rotate_half``), with the sign folded into
    :func:`rope_cos_sin`'s sin: cat(x2, x1) is a roll by half a head. The same products, so the
    same bits, in four ops rather than six. ``out`` may be ``x`` itself.
    """
    rolled = x.roll(x.shape[-1] // 2, dims=-1)  # [num_tokens, heads, head_dim]
    return torch.add(x * cos, rolled.mul_(sin), out=out)


def _stacked(fused: str, parts: tuple[str, ...]):
    """A ``load_state_dict`` pre-hook: a checkpoint's separate ``parts`` (transformers' q, k and
    v projections) become one ``fused`` matrix, their rows stacked in that order, so a step runs
    one matrix product for three and rotates q and k together (vLLM's ``QKVParallelLinear``
    loads the same way, through ``stacked_params_mapping``)."""

    def hook(module, state_dict, prefix, *_):
        for kind in ("weight", "bias"):
            names = [f"{prefix}{part}.{kind}" for part in parts]
            found = [name in state_dict for name in names]
            if any(found) and not all(found):
                raise UnsupportedModel(f"the checkpoint has {names[found.index(True)]} but "
                                       f"lacks {names[found.index(False)]}")
            if all(found):
                stacked = torch.cat([state_dict.pop(name) for name in names])
                state_dict[f"{prefix}{fused}.{kind}"] = stacked

    return hook


class Attention(nn.Module):
    """Grouped-query attention on the paged cache; q, k and v from one matrix product."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        h, kv, d = args.num_heads, args.num_kv_heads, args.head_dim
        self.qkv_proj = nn.Linear(args.hidden_size, (h + 2 * kv) * d, bias=args.qkv_bias)
        self.o_proj = nn.Linear(h * d, args.hidden_size, bias=False)
        self.register_load_state_dict_pre_hook(_stacked("qkv_proj", ("q_proj", "k_proj", "v_proj")))

    def forward(self, x, cos, sin, kv_cache, batch: ForwardBatch,
                attention: AttentionOps) -> Tensor:
        n, d, h = x.shape[0], self.args.head_dim, self.args.num_heads
        qkv = self.qkv_proj(x).view(n, -1, d)  # [n, num_heads + 2 num_kv_heads, D]
        qk = qkv[:, : -self.args.num_kv_heads]  # q's and k's heads, rotated together, in place
        apply_rope(qk, cos, sin, out=qk)
        q, k, v = qkv.split([h, self.args.num_kv_heads, self.args.num_kv_heads], dim=1)
        with scope("pagedlab::cache_write"):  # scopes pagedlab.profiling reads
            attention.write(k, v, kv_cache)
        with scope("pagedlab::attention"):
            out = self._attend(q, k, v, kv_cache, batch.num_prefill_tokens, attention)
        return self.o_proj(out.view(n, -1))  # [n, hidden]

    @staticmethod
    def _attend(q, k, v, kv_cache, num_prefill_tokens: int, attention: AttentionOps) -> Tensor:
        """Every prefill's queries over its prefix and chunk, then every decode's over its
        cached tokens: [n, num_heads, D]."""
        first = num_prefill_tokens
        if first == 0:  # decodes only
            return attention.decode(q, kv_cache)
        prefilled = attention.prefill(q[:first], k[:first], v[:first], kv_cache)
        if first == q.shape[0]:  # prefills only
            return prefilled
        return torch.cat([prefilled, attention.decode(q[first:], kv_cache)])


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)). Gate and up stay two matrix products: stacked as
    one [2 inner, hidden] matrix they ran slower on a CPU (``benchmarks/results/README.md``)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)).mul_(self.up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP, each around a residual connection."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(self, x, cos, sin, kv_cache, batch, attention) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, batch, attention)
        return x.add_(self.mlp(self.post_attention_layernorm(x)))


class Decoder(nn.Module):
    """Embedding, the decoder layers and the final norm (transformers' ``model.*`` weights)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class PagedLlama(nn.Module):
    """A Llama or Qwen2 causal LM whose attention reads and writes the paged KV cache."""

    def __init__(self, args: ModelArgs, *, kernels: str | None = None):
        super().__init__()
        self.args = args
        self.model = Decoder(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.kernels = kernels

    @property
    def kernels(self) -> str:
        """Which cache operations attention calls: ``"triton"`` or ``"reference"``."""
        return self._kernels

    @kernels.setter
    def kernels(self, name: str | None) -> None:
        self._kernels, self.ops = load_kernels(name)
        self.fp8_ops = importlib.import_module(FP8_KERNELS[self._kernels])

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, kv_caches: list[tuple[Tensor, Tensor]], kv_scale=None
    ) -> Tensor:
        """Hidden states after the final norm, [num_tokens, hidden]; writes the tokens' KV.

        ``kv_scale`` (fp32 []) says the caches are fp8 stored with that scale; None: they are
        in the model's dtype.
        """
        a = self.args
        attention = self.attention_ops(batch, kv_caches[0][0].shape[1], kv_scale)
        x = self.model.embed_tokens(batch.input_ids)  # [num_tokens, hidden]
        cos, sin = rope_cos_sin(batch.positions, a.head_dim, a.rope_theta, x.dtype)
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x = layer(x, cos, sin, kv_cache, batch, attention)
        return self.model.norm(x)

    def attention_ops(self, batch: ForwardBatch, block_size: int, kv_scale=None) -> AttentionOps:
        """The step's attention, for every layer: fp8 given a ``kv_scale``, else the kernels
        :attr:`kernels` names."""
        if kv_scale is not None:
            return FP8Attention(batch, self.fp8_ops, kv_scale)
        if self.kernels == "triton":
            return TritonAttention(batch, self.ops)
        return ReferenceAttention(batch, block_size)

    @torch.inference_mode()
    def compute_logits(self, hidden: Tensor) -> Tensor:
        """[num_rows, hidden] -> fp32 logits [num_rows, vocab_size]."""
        return self.lm_head(hidden).float()


# --- loading --------------------------------------------------------------------------------


def _build(config: dict, state_dict: dict, kernels, dtype, device) -> PagedLlama:
    args = ModelArgs.from_hf_config(config)
    kernels = kernels or default_kernels(device)
    with torch.device("meta"):
        model = PagedLlama(args, kernels=kernels)
    # assign=True adopts the given tensors (no copy); a tied lm_head is re-tied afterwards.
    result = model.load_state_dict(state_dict, strict=False, assign=True)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    unexpected = [k for k in result.unexpected_keys if not k.endswith("rotary_emb.inv_freq")]
    if unexpected:
        raise UnsupportedModel(f"the checkpoint has weights this model lacks: {unexpected}")
    missing = [name for name, p in model.named_parameters() if p.is_meta]
    if missing:
        raise UnsupportedModel(f"the checkpoint lacks weights: {missing}")
    return model.to(device=device, dtype=dtype).eval()


def from_hf(hf_model, *, kernels: str | None = None) -> PagedLlama:
    """The weights of a transformers ``LlamaForCausalLM`` or ``Qwen2ForCausalLM``, on the paged
    cache: same device and dtype, the same tensors (shared, not copied) but for q, k and v,
    stacked into one new matrix per layer."""
    name = type(hf_model).__name__
    if name not in ARCHITECTURES.values():
        raise UnsupportedModel(
            f"{name} is not supported; supported: {', '.join(ARCHITECTURES.values())}"
        )
    weight = hf_model.lm_head.weight
    state = {k: v.detach() for k, v in hf_model.state_dict().items()}
    return _build(hf_model.config.to_dict(), state, kernels, weight.dtype, weight.device)


def from_pretrained(
    path, *, kernels: str | None = None, dtype: torch.dtype | None = None, device=None
) -> PagedLlama:
    """Load a local checkpoint directory (``config.json`` and ``*.safetensors``), no network.

    ``dtype`` defaults to the stored weights' dtype, ``device`` to :data:`pagedlab.device.DEVICE`.
    """
    from safetensors.torch import load_file

    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {path}")
    state = {k: v for f in files for k, v in load_file(f).items()}
    dtype = dtype or state["model.embed_tokens.weight"].dtype
    return _build(config, state, kernels, dtype, device or DEVICE)
