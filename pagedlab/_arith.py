"""Integer arithmetic the package repeats: one ceiling division for blocks, tiles and chunks."""


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints, exactly (no float): blocks that hold ``a`` tokens of ``b``."""
    return -(-a // b)
