"""Argument checks shared by the package: each error names the field that is wrong."""

from __future__ import annotations

from numbers import Integral, Real


def check_positive(field: str, value, *, integer: bool = False, allow_zero: bool = False) -> None:
    """Raise ValueError naming ``field`` unless ``value`` is a positive (or zero) number."""
    kind = Integral if integer else Real
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ValueError(f"{field}={value!r} must be {'an integer' if integer else 'a number'}")
    if not (value > 0 or (allow_zero and value == 0)):  # also rejects NaN
        raise ValueError(f"{field}={value!r} must be {'>= 0' if allow_zero else '> 0'}")


def lookup_preset(field: str, value, presets: dict, kind: type, plural: str):
    """``value`` itself if it is a ``kind``, else the preset of that name; errors name ``field``."""
    if isinstance(value, kind):
        return value
    if not isinstance(value, str) or value not in presets:
        raise ValueError(f"{field}={value!r} is not a preset; known {plural}: {', '.join(presets)}")
    return presets[value]
