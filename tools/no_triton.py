"""Make Triton unimportable in this process, as it is on macOS and Windows (Linux wheels only).

``PAGEDLAB_BLOCK_TRITON=1`` asks ``tests/conftest.py`` and ``tools/run_chapters.py`` to call
:func:`block` before anything imports Triton, so that a Linux machine runs the tests and the
chapters as a Mac would:

    PAGEDLAB_BLOCK_TRITON=1 python -m pytest tests/test_engine.py

A ``None`` in ``sys.modules`` is how Python records a module that cannot be imported:
``import triton`` (and ``triton.language``) raises ModuleNotFoundError and
``importlib.util.find_spec("triton")`` returns None, so libraries that probe for Triton before
importing it (transformers, torch) find it absent too.
"""

import os
import sys

VARIABLE = "PAGEDLAB_BLOCK_TRITON"


def block() -> None:
    """Triton unimportable from now on; an error if it is imported already (too late)."""
    if sys.modules.get("triton") is not None:
        raise RuntimeError("triton is already imported: block it before anything imports it")
    sys.modules["triton"] = None


def block_if_asked() -> bool:
    """:func:`block` where ``$PAGEDLAB_BLOCK_TRITON`` is set (and not 0); whether it did."""
    asked = os.environ.get(VARIABLE, "") not in ("", "0")
    if asked:
        block()
    return asked
