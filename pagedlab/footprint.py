"""Model presets and what they cost in memory: KV bytes per token, weights, what fits on GPUs.

The KV cache holds, for every token of every sequence, a key and a value vector per layer and
per KV head: ``2 * n_layers * n_kv_heads * head_dim`` values (``4 * n_layers * d_model`` bytes
for fp16 multi-head attention). MLA caches one compressed latent per layer instead.
Chapter 1 derives these formulas; the allocator and simulator size their caches with them.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedlab._checks import check_positive, lookup_preset
from pagedlab.dtypes import dtype_bytes, dtype_name
from pagedlab.hardware import get_gpu

ATTENTION_KINDS = ("mha", "gqa", "mqa", "mla")


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder-only transformer, as far as memory and FLOPs are concerned."""

    name: str
    n_layers: int
    d_model: int
    n_heads: int  # query heads
    n_kv_heads: int  # key/value heads: n_heads (MHA), 1 (MQA), a divisor between (GQA)
    head_dim: int  # per head; MLA: the per-head dimension after up-projection
    n_params: float  # all parameters (MoE: every expert)
    attention: str = "mha"  # one of ATTENTION_KINDS
    kv_lora_rank: int | None = None  # MLA only: width of the cached KV latent
    qk_rope_head_dim: int | None = None  # MLA only: the decoupled RoPE key, cached beside it
    n_active_params: float | None = None  # MoE: parameters one token uses; None: dense
    max_context: int | None = None  # longest sequence the model was trained for, if known

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name={self.name!r} must be a non-empty string")
        for field in ("n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim"):
            check_positive(field, getattr(self, field), integer=True)
        check_positive("n_params", self.n_params)
        for field in ("n_active_params", "max_context"):
            if getattr(self, field) is not None:
                check_positive(field, getattr(self, field), integer=field == "max_context")
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"attention={self.attention!r} must be one of {ATTENTION_KINDS}")
        n_kv, h = self.n_kv_heads, self.n_heads
        if h % n_kv:
            raise ValueError(f"n_kv_heads={n_kv} must divide n_heads={h}")
        ok, rule = {  # what each attention kind requires of n_kv_heads
            "mha": (n_kv == h, f"equal n_heads={h}"),
            "mqa": (n_kv == 1, "be 1"),
            "gqa": (1 < n_kv < h, f"lie strictly between 1 and n_heads={h}"),
            "mla": (True, ""),
        }[self.attention]
        if not ok:
            raise ValueError(f"n_kv_heads={n_kv} must {rule} for attention={self.attention!r}")
        for field in ("kv_lora_rank", "qk_rope_head_dim"):
            value = getattr(self, field)
            if self.attention == "mla":
                check_positive(field, value, integer=True)
            elif value is not None:
                raise ValueError(f"{field}={value!r} is only meaningful for attention='mla'")


# Architectures from each model's Hugging Face config.json and paper.
MODELS: dict[str, ModelConfig] = {
    m.name: m
    for m in (
        # OPT (Zhang et al. 2022, Table 1). n_params counted from the architecture:
        # 12 d^2 + 13 d per layer, token and learned position (2,050) embeddings, tied head.
        ModelConfig("OPT-13B", 40, 5120, 40, 40, 128, 12_853_473_280, max_context=2048),
        ModelConfig("OPT-66B", 64, 9216, 72, 72, 128, 65_719_701_504, max_context=2048),
        ModelConfig("OPT-175B", 96, 12288, 96, 96, 128, 174_604_468_224, max_context=2048),
        # Llama 2 (Touvron et al. 2023); counts as published with the Hugging Face weights.
        ModelConfig("Llama-2-7B", 32, 4096, 32, 32, 128, 6_738_415_616, max_context=4096),
        ModelConfig("Llama-2-13B", 40, 5120, 40, 40, 128, 13_015_864_320, max_context=4096),
        # Llama 3 (Llama Team 2024, Table 3): GQA with 8 KV heads.
        ModelConfig("Llama-3-8B", 32, 4096, 32, 8, 128, 8_030_261_248, "gqa", max_context=8192),
        ModelConfig("Llama-3-70B", 80, 8192, 64, 8, 128, 70_553_706_496, "gqa", max_context=8192),
        # Qwen2.5 (Qwen Team 2024, Table 1): 7.61B parameters, GQA with 4 KV heads.
        ModelConfig("Qwen2.5-7B", 28, 3584, 28, 4, 128, 7_615_616_512, "gqa", max_context=32768),
        # DeepSeek-V3 (DeepSeek-AI 2024): 671B parameters, 37B active per token, 128K context.
        # MLA caches a 512-wide latent plus a 64-wide RoPE key per layer; the 128 heads have
        # 128-dim (non-RoPE) keys and values once up-projected.
        ModelConfig(
            "DeepSeek-V3", 61, 7168, 128, 128, 128, 671e9, "mla",
            kv_lora_rank=512, qk_rope_head_dim=64, n_active_params=37e9, max_context=131072,
        ),
    )
}


def get_model(model) -> ModelConfig:
    """The preset named ``model``; a :class:`ModelConfig` passes through unchanged."""
    return lookup_preset("model", model, MODELS, ModelConfig, "models")


def kv_bytes_per_token(model, dtype="fp16") -> int:
    """Bytes of KV cache one token occupies, summed over all layers."""
    m = get_model(model)
    b = dtype_bytes(dtype)  # bytes per cached value
    if m.attention == "mla":
        return m.n_layers * (m.kv_lora_rank + m.qk_rope_head_dim) * b  # one latent per layer
    return 2 * m.n_layers * m.n_kv_heads * m.head_dim * b  # K and V, per layer, per KV head


def kv_bytes(model, num_tokens: int, dtype="fp16") -> int:
    """Bytes of KV cache ``num_tokens`` tokens occupy (one long request or many short ones)."""
    check_positive("num_tokens", num_tokens, integer=True, allow_zero=True)
    return num_tokens * kv_bytes_per_token(model, dtype)


def weight_bytes(model, dtype="fp16") -> int:
    """Bytes of all the model's parameters stored in ``dtype``."""
    return round(get_model(model).n_params * dtype_bytes(dtype))


@dataclass(frozen=True)
class KVCapacity:
    """How GPU memory splits between weights and KV cache, in bytes."""

    budget_bytes: int  # gpu_memory_utilization x memory, over all GPUs
    weight_bytes: int
    kv_bytes: int  # what the weights leave of the budget (0 if they do not fit)
    kv_bytes_per_token: int
    kv_copies: int = 1  # GPUs that each hold a token's whole KV (replication under parallelism)

    @property
    def token_slots(self) -> int:
        """How many tokens' KV the cache holds."""
        return self.kv_bytes // (self.kv_bytes_per_token * self.kv_copies)

    @property
    def weights_fit(self) -> bool:
        """False when the weights alone exceed the budget (kv_bytes is then 0)."""
        return self.weight_bytes <= self.budget_bytes


def kv_copies(model, num_gpus: int = 1, decode_context_parallel: int = 1) -> int:
    """How many of ``num_gpus`` tensor-parallel GPUs hold each token's KV.

    Tensor parallelism splits the KV heads across GPUs; with fewer KV heads than GPUs each head
    is replicated, and MLA's latent, shared by all heads, is replicated on every GPU. Decode
    context parallelism (vLLM's ``-dcp``, SGLang's ``--dcp-size``) spreads a sequence's tokens
    over ``decode_context_parallel`` of those replicas instead, so it must divide their count.
    """
    m = get_model(model)
    check_positive("num_gpus", num_gpus, integer=True)
    check_positive("decode_context_parallel", decode_context_parallel, integer=True)
    heads = 1 if m.attention == "mla" else m.n_kv_heads  # KV "heads" that can be split
    if heads % num_gpus and num_gpus % heads:
        raise ValueError(f"num_gpus={num_gpus} must divide or be a multiple of {m.name}'s "
                         f"{heads} KV heads for tensor parallelism")
    replicas = max(1, num_gpus // heads)
    if replicas % decode_context_parallel:
        raise ValueError(f"decode_context_parallel={decode_context_parallel} must divide the "
                         f"{replicas} copies of {m.name}'s KV on {num_gpus} GPUs")
    return replicas // decode_context_parallel


def kv_capacity(
    model, gpu, num_gpus: int = 1, dtype="fp16", gpu_memory_utilization: float = 0.9,
    weight_dtype="fp16", decode_context_parallel: int = 1,
) -> KVCapacity:
    """KV room left on ``num_gpus`` GPUs once the weights are loaded.

    Like vLLM, an instance may use ``gpu_memory_utilization`` of each GPU (default 0.9) for
    weights, activations and KV cache together. We subtract only the weights; vLLM also
    subtracts the peak activations it profiles, so these counts are upper bounds. Weights
    shard evenly across the GPUs (tensor parallelism); the KV memory pools only as far as
    :func:`kv_copies` allows. ``dtype`` is the KV cache's; weights stay in ``weight_dtype``,
    as with vLLM's ``kv_cache_dtype``.
    """
    check_positive("gpu_memory_utilization", gpu_memory_utilization)
    if gpu_memory_utilization > 1:
        raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization!r} must be <= 1")
    copies = kv_copies(model, num_gpus, decode_context_parallel)
    budget = int(gpu_memory_utilization * get_gpu(gpu).memory_bytes * num_gpus)
    weights = weight_bytes(model, dtype_name(weight_dtype, "weight_dtype"))
    return KVCapacity(budget, weights, max(0, budget - weights), kv_bytes_per_token(model, dtype),
                      copies)


def max_sequences(model, gpu, context_len: int, **capacity_kwargs) -> int:
    """How many sequences of ``context_len`` tokens fit in the KV cache at once.

    ``capacity_kwargs`` go to :func:`kv_capacity` (num_gpus, dtype, ...).
    """
    check_positive("context_len", context_len, integer=True)
    return kv_capacity(model, gpu, **capacity_kwargs).token_slots // context_len


def attention_flops_per_pair(model) -> int:
    """FLOPs of attention for one (query token, key token) pair, summed over layers and heads."""
    m = get_model(model)
    if m.attention == "mla":  # absorbed MLA: scores over latent+rope, values in the latent
        return 2 * m.n_layers * m.n_heads * (2 * m.kv_lora_rank + m.qk_rope_head_dim)
    return 4 * m.n_layers * m.n_heads * m.head_dim  # q.k and p.v: 2 FLOPs per multiply-add


@dataclass(frozen=True)
class StepCost:
    """FLOPs and HBM bytes of one forward step: weights, KV reads and writes (not activations)."""

    flops: float
    bytes_moved: float

    @property
    def intensity(self) -> float:
        """Arithmetic intensity in FLOP/byte."""
        return self.flops / self.bytes_moved


def step_cost(
    model, batch_size: int, context_len: int, new_tokens: int = 1, dtype="fp16"
) -> StepCost:
    """Cost of one step in which each of ``batch_size`` sequences, with ``context_len`` tokens
    already cached, processes ``new_tokens`` tokens.

    Decode is ``new_tokens=1``; prefilling a prompt of P tokens is ``context_len=0,
    new_tokens=P``. Weights are read once per step whatever the batch; every sequence reads its
    own cached K and V and writes the new tokens'. Weights and KV are both in ``dtype``.
    """
    m = get_model(model)
    check_positive("batch_size", batch_size, integer=True)
    check_positive("context_len", context_len, integer=True, allow_zero=True)
    check_positive("new_tokens", new_tokens, integer=True)
    tokens = batch_size * new_tokens
    # Attention pairs (query token, cached or causal key): new token i sees context_len + i + 1.
    pairs = batch_size * (new_tokens * context_len + new_tokens * (new_tokens + 1) // 2)
    active = m.n_active_params or m.n_params
    flops = 2 * active * tokens + attention_flops_per_pair(m) * pairs  # 2 per weight per token
    kv_per_token = kv_bytes_per_token(m, dtype)
    bytes_moved = weight_bytes(m, dtype) + batch_size * (context_len + new_tokens) * kv_per_token
    return StepCost(flops, bytes_moved)
