"""Which module defines each Triton kernel and which torch reference stands for it: a table the
package's lazy imports and the stand-in for Triton (:mod:`pagedlab.kernels.stand_in`) both read,
in a module that imports neither."""

# Each kernel -> (the module that defines it, its torch reference)
KERNELS = {
    "paged_attention": ("decode", "reference.paged_attention"),
    "paged_attention_varlen": ("varlen", "varlen_reference.paged_attention_varlen"),
    "reshape_and_cache": ("cache_ops", "reference.reshape_and_cache"),
    "copy_blocks": ("cache_ops", "reference.copy_blocks"),
    "swap_blocks": ("cache_ops", "reference.swap_blocks"),
    "paged_attention_two_pass": ("two_pass", "reference.paged_attention"),
    "paged_attention_fp8": ("fp8", "fp8_reference.paged_attention_fp8"),
    "reshape_and_cache_fp8": ("fp8", "fp8_reference.reshape_and_cache_fp8"),
    "cache_latent": ("mla", "mla_reference.cache_latent"),
    "mla_decode": ("mla", "mla_reference.mla_decode"),
    "mla_attention": ("mla", "mla_reference.mla_attention"),
}

# The modules that import Triton to define kernels.
TRITON_MODULES = frozenset({"cache_ops", "decode", "fp8", "mla", "tiles", "two_pass", "varlen"})
