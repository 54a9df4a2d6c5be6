"""A stand-in for CuPy on the CPU: enough of its API for the CuPy backend (cgc/backends/cuda/backend.py) to run a step.

"Device" memory is host memory and device pointers are host addresses. A kernel launch
runs the image's NumPy reference kernel on the memory its pointer arguments address (with
the reference machine's bounds checks); cuBLAS's gemmEx is computed from its definition,
column-major, as cuBLAS documents it; a stream capture records calls and the graph
replays them. This checks everything the CuPy backend does with addresses, argument
order, scalar types and cuBLAS's operands, without a GPU; it says nothing of the CUDA
kernels themselves.
"""

from __future__ import annotations

import ctypes
import sys
import types

import numpy as np

from cgc.backends.numerics import storage_dtype

from cgc.backends.numpy.machine import Kernel, Pointer
from cgc.backends.numerics import from_bfloat16_bits, to_bfloat16_bits
from cgc.backends.numpy.reference import KERNELS

uint8 = np.uint8
_allocations: list[np.ndarray] = []
_capture: list | None = None
images: dict = {}  # set by install: the images of the program that launches
low = "float32"
constants: dict = {}


class FakeArray(np.ndarray):
    """A NumPy array whose `.data.ptr` is its address, with CuPy's set and get."""

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.__array_interface__["data"][0])

    def set(self, host, stream=None):
        self[...] = np.asarray(host).reshape(self.shape)

    def get(self, stream=None):
        return np.array(self)


def zeros(size, dtype=np.uint8):
    array = np.zeros(size, dtype=dtype).view(FakeArray)
    _allocations.append(array)
    return array


def _at(address: int, dtype) -> np.ndarray:
    """The rest of the allocation from `address`, as `dtype`."""
    for allocation in _allocations:
        start = allocation.__array_interface__["data"][0]
        if start <= address < start + allocation.nbytes:
            raw = np.asarray(allocation)[address - start:]
            usable = raw.size - raw.size % np.dtype(dtype).itemsize
            return raw[:usable].view(dtype)
    raise AssertionError(f"address {address:#x} is in no allocation")


def _run_or_record(action) -> None:
    if _capture is not None:
        _capture.append(action)
    else:
        action()


class _Kernel:
    def __init__(self, name: str):
        self.name = name
        self.max_dynamic_shared_size_bytes = 0

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        assert shared_mem <= max(self.max_dynamic_shared_size_bytes, 48 * 1024), self.name
        _run_or_record(lambda: self._run(tuple(grid), tuple(block), tuple(args)))

    def _run(self, grid, block, args):
        image = images[self.name]
        pointers, scalars, position = {}, {}, 0
        for index in sorted(image.pointers):
            parameter = image.pointers[index]
            assert isinstance(args[position], np.uint64), (self.name, index)
            array = _at(int(args[position]), storage_dtype(parameter.element, low))
            pointers[parameter.name] = Pointer(f"fake launch of {self.name}", index,
                                               parameter.name, parameter.access,
                                               parameter.element, low, array, None, "", 0, 0)
            position += 1
        for index in sorted(image.scalars):
            parameter = image.scalars[index]
            value = args[position]
            expected = np.float32 if parameter.type == "float32" else np.int32
            assert isinstance(value, expected), (self.name, parameter.name, type(value))
            scalars[parameter.name] = float(value) if parameter.type == "float32" else int(value)
            position += 1
        assert position == len(args)
        KERNELS[self.name](Kernel(pointers, scalars, grid, block, constants))


class RawModule:
    def __init__(self, code=None, backend="nvrtc", options=()):
        assert "extern \"C\" __global__" in code

    def get_function(self, name):
        return _Kernel(name)


class Stream:
    def __init__(self, non_blocking=False):
        self.ptr = 1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def synchronize(self):
        pass

    def begin_capture(self):
        global _capture
        _capture = []

    def end_capture(self):
        global _capture
        recorded, _capture = _capture, None
        return _Graph(recorded)


class _Graph:
    def __init__(self, calls):
        self.calls = calls

    def launch(self, stream=None):
        for call in self.calls:
            call()


class Event:
    def record(self, stream=None):
        pass

    def synchronize(self):
        pass


def _elapsed(start, end):
    return 1.0


def _gemm(handle, transa, transb, m, n, k, alpha, a, a_type, lda, b, b_type, ldb, beta, c,
          c_type, ldc, compute_type, algorithm):
    """C = alpha op(A) op(B) + beta C, every matrix column-major, as cuBLAS defines it."""
    assert compute_type == 68 and a_type == b_type

    def matrix(address, kind, rows, columns, leading):
        dtype = np.uint16 if kind == 14 else np.float32
        raw = _at(address, dtype)
        needed = (columns - 1) * leading + rows
        flat = raw[:needed]
        values = from_bfloat16_bits(flat) if kind == 14 else flat.astype(np.float32)
        return np.lib.stride_tricks.as_strided(values, (rows, columns),
                                               (values.itemsize, values.itemsize * leading))

    alpha_value = ctypes.c_float.from_address(alpha).value
    beta_value = ctypes.c_float.from_address(beta).value

    def run():
        left = matrix(a, a_type, *((m, k) if transa == 0 else (k, m)), lda)
        right = matrix(b, b_type, *((k, n) if transb == 0 else (n, k)), ldb)
        left = left if transa == 0 else left.T
        right = right if transb == 0 else right.T
        product = np.matmul(np.ascontiguousarray(left), np.ascontiguousarray(right),
                            dtype=np.float32)
        dtype = np.uint16 if c_type == 14 else np.float32
        raw = _at(c, dtype)
        for column in range(n):
            target = raw[column * ldc:column * ldc + m]
            current = from_bfloat16_bits(target) if c_type == 14 else target.astype(np.float32)
            value = np.float32(alpha_value) * product[:, column]
            if beta_value != 0.0:
                value = value + np.float32(beta_value) * current
            target[:] = to_bfloat16_bits(value) if c_type == 14 else value

    _run_or_record(run)


def _memcpy(destination, source, size, kind, stream):
    def run():
        _at(destination, np.uint8)[:size] = _at(source, np.uint8)[:size].copy()
    _run_or_record(run)


class NcclCommunicator:
    """CuPy's NCCL communicator, of one rank: each collective is the identity (NCCL's own, on
    one rank) and is recorded, as it is called or replayed from a graph, in `nccl_calls`."""

    def __init__(self, ranks: int, identifier, rank: int):
        assert (ranks, rank) == (1, 0) and identifier == UNIQUE_ID
        nccl_communicators.append(self)

    def allReduce(self, send, receive, count, datatype, operator, stream):  # noqa: N802
        def run():
            nccl_calls.append(("allReduce", send, receive, count, datatype, operator, stream))
        _run_or_record(run)


UNIQUE_ID = tuple(range(128))  # what get_unique_id draws: each rank must get rank 0's
nccl_calls: list = []
nccl_communicators: list = []


def install(monkeypatch, image_declarations, low_type, kernel_constants) -> None:
    """Makes `import cupy` and `from cupy_backends.cuda.libs import cublas` find this."""
    global images, low, constants, _capture
    _allocations.clear()
    _capture = None
    images, low, constants = image_declarations, low_type, kernel_constants
    cupy = sys.modules[__name__]
    runtime = types.SimpleNamespace(getDeviceCount=lambda: 1, memcpyAsync=_memcpy,
                                    memcpyDeviceToDevice=3)
    cupy.cuda = types.SimpleNamespace(runtime=runtime, Stream=Stream, Event=Event,
                                      get_elapsed_time=_elapsed,
                                      device=types.SimpleNamespace(get_cublas_handle=lambda: 0))
    cublas = types.SimpleNamespace(CUBLAS_OP_N=0, CUBLAS_OP_T=1, CUBLAS_COMPUTE_32F=68,
                                   CUBLAS_GEMM_DEFAULT=-1, setStream=lambda handle, stream: None,
                                   gemmEx=_gemm)
    libs = types.ModuleType("cupy_backends.cuda.libs")
    libs.cublas = cublas
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy_backends", types.ModuleType("cupy_backends"))
    monkeypatch.setitem(sys.modules, "cupy_backends.cuda", types.ModuleType("cupy_backends.cuda"))
    monkeypatch.setitem(sys.modules, "cupy_backends.cuda.libs", libs)
    nccl_calls.clear()
    nccl_communicators.clear()
    nccl = types.ModuleType("cupy.cuda.nccl")
    nccl.NCCL_FLOAT32, nccl.NCCL_SUM, nccl.NCCL_AVG = 7, 0, 4  # NCCL's own values
    nccl.get_unique_id = lambda: UNIQUE_ID
    nccl.NcclCommunicator = NcclCommunicator
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", nccl)
