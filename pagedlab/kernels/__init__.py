"""Kernels on the paged KV cache: Triton implementations, with torch references beside them.

``pagedlab.kernels.paged_attention`` and friends are the Triton kernels (through the
interpreter on a CPU); ``pagedlab.kernels.reference`` holds the same functions in plain torch,
the spec the kernels are tested against. Arguments are checked before any launch
(``pagedlab.kernels.validate``). Chapter 11's kernels (a two-pass decode, an fp8 cache, MLA over
a latent cache) have their specs in ``fp8_reference`` and ``mla_reference``; the mixed-batch
(prefill chunks and decodes) ``paged_attention_varlen`` has its spec in ``varlen_reference``.

Each kernel is imported on first use, so that the references import where Triton does not
(macOS, Windows); there, asking for a kernel raises an ImportError that names its reference,
:func:`kernel_or_reference` returns the reference instead, and a Triton module such as
``pagedlab.kernels.decode`` can still be read: it is its source run with a stand-in for Triton
(:mod:`pagedlab.kernels.stand_in`), so the book shows every kernel's source on any machine.
"""

import pkgutil
from importlib import import_module

from pagedlab.device import has_triton, require_triton

from pagedlab.kernels.catalog import KERNELS as _KERNELS, TRITON_MODULES

__all__ = list(_KERNELS)
_MODULES = {module.name for module in pkgutil.iter_modules(__path__)}


def kernel_or_reference(name: str):
    """``pagedlab.kernels.<name>``, the Triton kernel, where Triton imports; else its torch
    reference, which takes the same arguments and says once, when it first runs, that it ran
    in the kernel's place. For code that must run on any machine (the book's chapters)."""
    if name not in _KERNELS:
        raise ValueError(f"{name!r} is not a kernel of pagedlab.kernels: {', '.join(_KERNELS)}")
    if has_triton():
        return getattr(import_module(__name__), name)
    from pagedlab.kernels.stand_in import reference_for

    return reference_for(name)


def __getattr__(name):
    """A kernel, or a module of this package (``pagedlab.kernels.reference`` after ``import
    pagedlab.kernels``, as when the package imported every kernel), imported on first use:
    importing this package must not need Triton."""
    if name in TRITON_MODULES and not has_triton():
        from pagedlab.kernels.stand_in import source_only

        return source_only(name)  # readable, not launchable
    if name in _MODULES:
        return import_module(f"{__name__}.{name}")
    if name not in _KERNELS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, reference = _KERNELS[name]
    require_triton(f"{__name__}.{name}", f"{__name__}.{reference}")
    globals()[name] = getattr(import_module(f"{__name__}.{module}"), name)
    return globals()[name]
