"""Kernels on the paged KV cache: Triton implementations, with torch references beside them.

``pagedlab.kernels.paged_attention`` and friends are the Triton kernels (through the
interpreter on a CPU); ``pagedlab.kernels.reference`` holds the same functions in plain torch,
the spec the kernels are tested against. Arguments are checked before any launch
(``pagedlab.kernels.validate``). Chapter 11's kernels (a two-pass decode, an fp8 cache, MLA over
a latent cache) have their specs in ``fp8_reference`` and ``mla_reference``; the mixed-batch
(prefill chunks and decodes) ``paged_attention_varlen`` has its spec in ``varlen_reference``.
"""

from pagedlab.kernels.cache_ops import copy_blocks, reshape_and_cache, swap_blocks
from pagedlab.kernels.decode import paged_attention
from pagedlab.kernels.fp8 import paged_attention_fp8, reshape_and_cache_fp8
from pagedlab.kernels.mla import cache_latent, mla_attention, mla_decode
from pagedlab.kernels.two_pass import paged_attention_two_pass
from pagedlab.kernels.varlen import paged_attention_varlen

__all__ = [
    "paged_attention",
    "paged_attention_varlen",
    "reshape_and_cache",
    "copy_blocks",
    "swap_blocks",
    "paged_attention_two_pass",
    "paged_attention_fp8",
    "reshape_and_cache_fp8",
    "cache_latent",
    "mla_decode",
    "mla_attention",
]
