"""pagedlab: the companion package of the pagedlab book on PagedAttention."""

from pagedlab import device  # first: it routes Triton through the interpreter on a CPU

__all__ = ["device"]
__version__ = "0.1.0"
