"""Kernels on the paged KV cache: Triton implementations, with torch references beside them.

``pagedlab.kernels.paged_attention`` and friends are the Triton kernels (through the
interpreter on a CPU); ``pagedlab.kernels.reference`` holds the same functions in plain torch,
the spec the kernels are tested against. Arguments are checked before any launch
(``pagedlab.kernels.validate``).
"""

from pagedlab.kernels.cache_ops import copy_blocks, reshape_and_cache, swap_blocks
from pagedlab.kernels.decode import paged_attention

__all__ = ["paged_attention", "reshape_and_cache", "copy_blocks", "swap_blocks"]
