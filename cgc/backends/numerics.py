"""Element storage for the reference machine: float32, int32, and bfloat16 as bit patterns.

bfloat16 is kept as its 16-bit pattern (uint16), so a buffer takes exactly the bytes the
memory plan gives it; values are rounded to nearest, ties to even, when written. The
conversions are ml_dtypes' (its bfloat16 type): measured bit-identical to the hand-written
rounding cgc had before over all 2^32 float32 patterns (a NaN is written as the one quiet NaN
0x7FC0, as before), and about 4x faster to encode (tests/test_data.py keeps the check).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from ..core.elements import ELEMENTS, concrete

QUIET_NAN_BFLOAT16 = 0x7FC0  # what every NaN is written as


def to_bfloat16_bits(values: np.ndarray) -> np.ndarray:
    values = np.ascontiguousarray(values, dtype=np.float32)
    with np.errstate(invalid="ignore"):  # a NaN is a value like any other here
        result = values.astype(ml_dtypes.bfloat16).view(ELEMENTS["bfloat16"].storage)
    nan = np.isnan(values)
    if nan.any():
        result[nan] = QUIET_NAN_BFLOAT16
    return result


def from_bfloat16_bits(bits: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(bits, dtype=ELEMENTS["bfloat16"].storage) \
        .view(ml_dtypes.bfloat16).astype(np.float32)


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
