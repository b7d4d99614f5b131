"""Helpers the chapters share: numbers computed in a cell and quoted in the prose.

In the book build, :func:`glue` hands a value to MyST-NB so the prose can quote it with
``{glue}`name```; in Colab or plain Jupyter (no MyST-NB) it just returns the value.
"""

from __future__ import annotations

try:
    from myst_nb import glue as _myst_glue
except ImportError:  # Colab, plain Jupyter
    _myst_glue = None


def glue(name: str, value, display: bool = False):
    """Register ``value`` under ``name`` for the prose; return it unchanged."""
    if _myst_glue is not None:
        _myst_glue(name, value, display=display)
    return value
