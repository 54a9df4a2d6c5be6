"""Tensor maps for the CuPy backend: a launch's 2D map (emit.TensorMap) made by the driver's
cuTensorMapEncodeTiled through ctypes, as the value the kernel takes by value (CgTensorMap, a
numpy scalar of 128 bytes). The emitted host program makes the same map the same way
(cg_tensor_map_2d in program.cu.j2); the CPU build's twin is cgcpu/tensor_map.h.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

# cuda.h's enumerations, as the driver numbers them
BFLOAT16 = 9  # CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
INTERLEAVE_NONE = 0
SWIZZLES = {32: 1, 64: 2, 128: 3}  # CU_TENSOR_MAP_SWIZZLE_32B, _64B, _128B
L2_PROMOTION_128B = 2  # CU_TENSOR_MAP_L2_PROMOTION_L2_128B
OOB_FILL_NONE = 0
CUDA_SUCCESS = 0

# CUtensorMap: 16 opaque 64-bit words (the kernel's CgTensorMap)
MAP_WORDS = 16
MAP_DTYPE = np.dtype([("opaque", np.uint64, (MAP_WORDS,))])

_ARGUMENTS = (ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
              ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
              ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32), ctypes.c_int,
              ctypes.c_int, ctypes.c_int, ctypes.c_int)


class TensorMapError(RuntimeError):
    pass


@functools.cache
def driver_encoder():
    """The driver's cuTensorMapEncodeTiled (libcuda, which every CUDA driver installs)."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError as error:
        raise TensorMapError(f"cannot load the CUDA driver (libcuda.so.1) for a tensor map: "
                             f"{error}") from None
    return _typed(driver.cuTensorMapEncodeTiled)


def _typed(function):
    function.argtypes = _ARGUMENTS
    function.restype = ctypes.c_int
    return function


def encode_2d(encode, address: int, width: int, rows: int, box_width: int, box_rows: int,
              swizzle: int) -> np.void:
    """The map of a row-major bfloat16 matrix of `rows` x `width` at `address`, in boxes of
    box_width x box_rows swizzled by `swizzle` bytes, made by `encode` (driver_encoder(), or
    a twin with its signature): the kernel parameter's 128 bytes."""
    raw = np.zeros(MAP_DTYPE.itemsize + 64, dtype=np.uint8)  # the driver wants 64-byte alignment
    start = -raw.ctypes.data % 64
    aligned = raw[start:start + MAP_DTYPE.itemsize]
    dims = (ctypes.c_uint64 * 2)(width, rows)
    strides = (ctypes.c_uint64 * 1)(width * 2)
    box = (ctypes.c_uint32 * 2)(box_width, box_rows)
    unit = (ctypes.c_uint32 * 2)(1, 1)
    status = encode(aligned.ctypes.data, BFLOAT16, 2, address, dims, strides, box, unit,
                    INTERLEAVE_NONE, SWIZZLES[swizzle], L2_PROMOTION_128B, OOB_FILL_NONE)
    if status != CUDA_SUCCESS:
        raise TensorMapError(f"cuTensorMapEncodeTiled refused a {rows} x {width} map (box "
                             f"{box_width} x {box_rows}, {swizzle}-byte swizzle): error {status}")
    return np.frombuffer(aligned.tobytes(), dtype=MAP_DTYPE)[0]
