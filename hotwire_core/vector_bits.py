"""The wire dtypes of steering vectors and their bit-level checks, in numpy (no torch: cheap in any process).

Shared by the API's upload decoder and the engine's registry, so both accept and refuse exactly the same bytes.
"""

from __future__ import annotations

import numpy as np

ITEMSIZE: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}
# The raw bits of each format as unsigned ints, and its exponent field: all set means NaN or infinity.
_BITS = {
    "float32": (np.dtype("<u4"), 0x7F800000),
    "float16": (np.dtype("<u2"), 0x7C00),
    "bfloat16": (np.dtype("<u2"), 0x7F80),
}


def non_finite(bits: np.ndarray, dtype: str) -> np.ndarray:
    """Flat indices of the NaN or infinite values in ``bits`` (the raw bits, as ``as_bits`` returns them)."""
    exponent = _BITS[dtype][1]
    return np.flatnonzero((bits & exponent) == exponent)


def as_bits(data: bytes | bytearray | memoryview, dtype: str) -> np.ndarray:
    """The values of ``data`` as unsigned ints of their width (a view, no copy)."""
    return np.frombuffer(data, dtype=_BITS[dtype][0])


def as_float32(bits: np.ndarray, dtype: str) -> np.ndarray:
    """The values of ``bits`` as float32 (exact for every format)."""
    if dtype == "bfloat16":
        return (bits.astype(np.uint32) << 16).view(np.float32)
    return bits.view(np.float16 if dtype == "float16" else np.float32).astype(np.float32, copy=False)
