"""pagedlab: the companion package of the pagedlab book on PagedAttention."""

from pagedlab import device  # first: it routes Triton through the interpreter on a CPU

__all__ = ["device", "LLM", "AsyncLLM", "SamplingParams", "BeamSearchParams"]
__version__ = "0.1.0"

_ENGINE = ("LLM", "AsyncLLM", "SamplingParams", "BeamSearchParams")


def __getattr__(name):
    """``from pagedlab import LLM, SamplingParams``, importing the engine only when asked."""
    if name in _ENGINE:
        from pagedlab import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'pagedlab' has no attribute {name!r}")
