"""Element storage for the reference machine: float32, int32, and bfloat16 as bit patterns.

bfloat16 is kept as its 16-bit pattern (uint16), so a buffer takes exactly the bytes the
memory plan gives it; values are rounded to nearest, ties to even, when written.
"""

from __future__ import annotations

import numpy as np

from ..core.elements import ELEMENTS, concrete


def to_bfloat16_bits(values: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    result = (rounded >> np.uint32(16)).astype(ELEMENTS["bfloat16"].storage)
    nan = np.isnan(values)
    if nan.any():
        result[nan] = 0x7FC0
    return result


def from_bfloat16_bits(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def round_to_bfloat16(values: np.ndarray) -> np.ndarray:
    return from_bfloat16_bits(to_bfloat16_bits(values))


def storage_dtype(element: str, low: str) -> np.dtype:
    return np.dtype(concrete(element, low).storage)


def decode(raw: np.ndarray, element: str, low: str) -> np.ndarray:
    """Stored values as computed values: bfloat16 patterns widen to float32."""
    if concrete(element, low).name == "bfloat16":
        return from_bfloat16_bits(raw)
    return raw.copy()


def encode(values, element: str, low: str) -> np.ndarray:
    if concrete(element, low).name == "bfloat16":
        return to_bfloat16_bits(np.asarray(values, dtype=np.float32))
    return np.asarray(values, dtype=storage_dtype(element, low))
