"""A stand-in for CuPy on the CPU: enough of its API for the CuPy backend (cgc/backends/cuda/backend.py) to run a step.

"Device" memory is host memory and device pointers are host addresses. A kernel launch
runs the image's NumPy reference kernel on the memory its pointer arguments address (with
the reference machine's bounds checks); cuBLASLt's matmul (the CuPy backend's ctypes
binding, cgc/backends/cuda/cublaslt.py, replaced by FakeCublasLt) and cuBLAS's gemmEx are
computed from their definitions, column-major, as NVIDIA documents them; NCCL's all-reduce,
reduce-scatter and all-gather (cupy.cuda.nccl's NcclCommunicator) are computed from theirs,
the other ranks standing in as this one's values shifted (NcclCommunicator); a stream
capture records calls and the graph replays them. This checks everything the CuPy backend does with addresses, argument
order, scalar types and cuBLAS's operands, without a GPU; it says nothing of the CUDA
kernels themselves.
"""

from __future__ import annotations

import ctypes
import re
import sys
import types

import numpy as np

from cgc.backends.numerics import storage_dtype

from cgc.backends.numpy import portable
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
        drain()
        self[...] = np.asarray(host).reshape(self.shape)

    def get(self, stream=None):
        drain()
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


# ---- streams and events, as late as CUDA allows ---------------------------------------
# Work given to a stream is queued, and runs only when something waits for it: the first
# stream made (the run's own) goes first; another stream's work runs only when the first
# waits on an event it records, or when the host synchronises. So a branch whose join is
# missing runs after the work that should have waited for it, and the values come out
# wrong; a stream capture records the same operations, and a graph launch submits them again.
_streams: dict[int, "Stream"] = {}
_done: set[int] = set()  # the event records that have run
_tokens = iter(range(1, 1 << 62))


def _submit(stream, operation) -> None:
    if _capture is not None:
        _capture.append((stream, operation))
    else:
        _enqueue(stream, operation)


def _enqueue(stream, operation) -> None:
    stream = _streams[stream] if isinstance(stream, int) else stream or _first_stream()
    kind, thing = operation
    if kind == "record":
        thing.token = next(_tokens)
        operation = ("record", thing.token)
    elif kind == "wait":
        operation = ("wait", getattr(thing, "token", 0))
    stream.queue.append(operation)


def _first_stream():
    return next(iter(_streams.values()))


def _runnable(stream) -> bool:
    kind, thing = stream.queue[0]
    return kind != "wait" or thing == 0 or thing in _done


def _step(stream) -> None:
    kind, thing = stream.queue.pop(0)
    if kind == "run":
        thing()
    elif kind == "record":
        _done.add(thing)


def drain() -> None:
    """Runs every queued operation: the first stream whenever it can go on, the others
    (in the order they were made) only while it waits or when it is done."""
    while True:
        ordered = [s for s in _streams.values() if s.queue]
        if not ordered:
            return
        ready = [s for s in ordered if _runnable(s)]
        assert ready, "fake CUDA: every stream waits on an event nothing records"
        _step(ready[0])


def _run_or_record(action, stream=None) -> None:
    _submit(stream, ("run", action))


class _Kernel:
    def __init__(self, name: str):
        self.name = name
        self.max_dynamic_shared_size_bytes = 0

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        assert shared_mem <= max(self.max_dynamic_shared_size_bytes, 48 * 1024), self.name
        _run_or_record(lambda: self._run(tuple(grid), tuple(block), tuple(args)), stream)

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
        assert code.startswith("// @generated by cgc") and "#ifndef __CUDACC_RTC__" in code
        self.code = code

    def get_function(self, name):
        assert re.search(rf'^extern "C" __global__ .*\b{name}\(', self.code, re.MULTILINE), name
        return _Kernel(name)


class Stream:
    def __init__(self, non_blocking=False):
        self.ptr = len(_streams) + 1
        self.queue: list = []
        _streams[self.ptr] = self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def synchronize(self):
        drain()

    def is_capturing(self):
        return _capture is not None

    def wait_event(self, event):
        _submit(self, ("wait", event))

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
        for queue, operation in self.calls:
            _enqueue(queue, operation)


class Event:
    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self.at = 0

    def record(self, stream=None):
        self.at = len(cublaslt.algorithms) if cublaslt is not None else 0
        _submit(stream, ("record", self))

    def synchronize(self):
        drain()


# A test's: the milliseconds each algorithm of the fake cuBLASLt takes a run (by its index), so
# that the time between two events is the products run between them; None: every span 1 ms.
algorithm_milliseconds: dict | None = None
cublaslt = None


def _elapsed(start, end):
    if algorithm_milliseconds is None:
        return 1.0
    return sum(algorithm_milliseconds[algo[1]] for algo in cublaslt.algorithms[start.at:end.at])


def _gemm(handle, transa, transb, m, n, k, alpha, a, a_type, lda, b, b_type, ldb, beta, c,
          c_type, ldc, compute_type, algorithm):
    """C = alpha op(A) op(B) + beta C, every matrix column-major, as cuBLAS defines it."""
    assert compute_type == 68 and a_type == b_type

    alpha_value = ctypes.c_float.from_address(alpha).value
    beta_value = ctypes.c_float.from_address(beta).value

    def run():
        left = _matrix(a, a_type, *((m, k) if transa == 0 else (k, m)), lda)
        right = _matrix(b, b_type, *((k, n) if transb == 0 else (n, k)), ldb)
        left = left if transa == 0 else left.T
        right = right if transb == 0 else right.T
        product = portable.matmul(left, right)  # exactly rounded: any BLAS
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


_GELU = np.float32(np.sqrt(2.0 / np.pi))


def _gelu(x):
    return np.float32(0.5) * x * (np.float32(1) + np.tanh(_GELU * (x + np.float32(0.044715) * x ** 3)))


def _gelu_slope(x):
    t = np.tanh(_GELU * (x + np.float32(0.044715) * x * x * x))
    return np.float32(0.5) * (np.float32(1) + t) + np.float32(0.5) * x * (np.float32(1) - t * t) * \
        _GELU * (np.float32(1) + np.float32(3 * 0.044715) * x * x)


def _matrix(address, kind, rows, columns, leading):
    """A column-major rows x columns matrix at `address`, as float32 values (a view of the
    raw memory: bfloat16 decoded into a copy)."""
    dtype = np.uint16 if kind == 14 else np.float32
    raw = _at(address, dtype)
    needed = (columns - 1) * leading + rows
    flat = raw[:needed]
    values = from_bfloat16_bits(flat) if kind == 14 else flat.astype(np.float32)
    return np.lib.stride_tricks.as_strided(values, (rows, columns),
                                           (values.itemsize, values.itemsize * leading))


class FakeCublasLt:
    """cgc/backends/cuda/cublaslt.CublasLt's calls, computed from cuBLASLt's definition:
    D = epilogue(alpha op(A) op(B) + beta C), column-major, C and D of one layout (C may be D
    or another matrix; not read when beta is 0), GELU_AUX writing the value before GELU to
    aux and DGELU multiplying it by GELU'(aux), the epilogue on the float32 value before it
    is rounded to D's type. Descriptors are dicts; what cuBLASLt refuses fails an assert."""

    def __init__(self):
        self.matmuls = []  # (epilogue, c is d) of every matmul run, for the tests
        self.algorithms = []  # the algorithm of every matmul run
        self.split_k_unlabelled = False  # a test's: the split-K algorithm said to be one pass

    def create(self):
        return 0x1e

    def matmul_desc(self, transa, transb, epilogue, aux_ld):
        from cgc.backends.cuda.cublaslt import EPILOGUES
        assert transa in "NT" and transb in "NT" and epilogue in EPILOGUES
        assert (aux_ld is None) == (epilogue == "DEFAULT")
        assert aux_ld is None or aux_ld % 8 == 0, "cuBLASLt: aux ld must be divisible by 8"
        return {"transa": transa, "transb": transb, "epilogue": epilogue, "aux_ld": aux_ld,
                "aux": None}

    def set_aux(self, desc, pointer):
        desc["aux"] = pointer

    def layout(self, data_type, rows, columns, ld):
        assert ld >= rows
        return (data_type, rows, columns, ld)

    def heuristic(self, handle, desc, layouts, workspace_bytes, alignments, requested=1):
        """Three algorithms, as the CPU twin's: two summing k in one pass (the same bits), the
        third split-K (k's halves summed apart, then added: other bits)."""
        assert all(a in (1, 2, 4, 8, 16, 32, 64, 128, 256) for a in alignments)
        return [types.SimpleNamespace(algo=("the fake's", i)) for i in range(min(requested, 3))]

    def one_pass(self, result):
        return result.algo[1] != 2 or self.split_k_unlabelled

    def matmul(self, handle, desc, alpha, a, a_layout, b, b_layout, beta, c, c_layout, d,
               d_layout, algo, workspace, workspace_bytes, stream):
        assert c_layout == d_layout and a_layout[0] == b_layout[0]
        assert workspace_bytes == 0 or _at(workspace, np.uint8).size >= workspace_bytes
        d_type, m, n, ldd = d_layout
        ta, tb = desc["transa"] == "T", desc["transb"] == "T"
        k = a_layout[1] if ta else a_layout[2]  # op(A) is m x k, op(B) k x n
        assert (a_layout[2] if ta else a_layout[1]) == m and (b_layout[1] if tb else b_layout[2]) == n
        assert (b_layout[2] if tb else b_layout[1]) == k
        epilogue, aux, aux_ld = desc["epilogue"], desc["aux"], desc["aux_ld"]
        assert epilogue == "DEFAULT" or aux, "cuBLASLt: an aux epilogue without its pointer"
        alpha_value = ctypes.c_float.from_address(alpha).value
        beta_value = ctypes.c_float.from_address(beta).value
        self.matmuls.append((epilogue, c == d))
        self.algorithms.append(algo.algo)
        split = k // 2 if algo.algo[1] == 2 else 0

        def run():
            left = _matrix(a, a_layout[0], a_layout[1], a_layout[2], a_layout[3])
            right = _matrix(b, b_layout[0], b_layout[1], b_layout[2], b_layout[3])
            left = left.T if ta else left
            right = right.T if tb else right
            if split:  # split-K: each half exactly rounded, then added (other bits)
                product = (portable.matmul(left[:, :split], right[:split])
                           + portable.matmul(left[:, split:], right[split:]))
            else:
                product = portable.matmul(left, right)  # exactly rounded: any BLAS
            value = np.float32(alpha_value) * product
            if beta_value != 0.0:
                value = value + np.float32(beta_value) * _matrix(c, d_type, m, n, ldd)
            value = value.astype(np.float32)
            dtype = np.uint16 if d_type == 14 else np.float32
            if epilogue == "GELU_AUX":
                raw = _at(aux, dtype)
                for column in range(n):
                    target = raw[column * aux_ld:column * aux_ld + m]
                    target[:] = to_bfloat16_bits(value[:, column]) if d_type == 14 else value[:, column]
                value = _gelu(value)
            elif epilogue == "DGELU":
                value = value * _gelu_slope(_matrix(aux, d_type, m, n, aux_ld))
            raw = _at(d, dtype)
            for column in range(n):
                target = raw[column * ldd:column * ldd + m]
                target[:] = to_bfloat16_bits(value[:, column]) if d_type == 14 else value[:, column]

        _run_or_record(run, stream)


def _memcpy(destination, source, size, kind, stream):
    def run():
        _at(destination, np.uint8)[:size] = _at(source, np.uint8)[:size].copy()
    _run_or_record(run, stream)


class NcclCommunicator:
    """CuPy's NCCL communicator (cupy.cuda.nccl.NcclCommunicator's calls, float32 only). Each
    collective is recorded, as it is called or replayed from a graph, in `nccl_calls`, and
    computed from NCCL's definition on the memory its pointers address. One rank is alone (each
    collective the identity, or a copy, as NCCL's own); of several, the fake stands for ranks
    whose buffers are this rank's plus (q - rank) for rank q, so that a collective on a wrong
    address or count gives other values than on the right one. What NCCL leaves undefined (an
    overlap of the buffers other than the in-place form) fails an assert."""

    def __init__(self, ranks: int, identifier, rank: int):
        assert 0 <= rank < ranks and identifier == UNIQUE_ID
        self.ranks, self.rank = ranks, rank
        nccl_communicators.append(self)

    def rank_id(self):
        return self.rank

    def size(self):
        return self.ranks

    def _peers(self, values):
        """Each rank's copy of `values`, the buffer every rank passes at one address (this
        rank's own is `values`)."""
        return [values + np.float32(q - self.rank) for q in range(self.ranks)]

    def _reduce(self, values, operator):
        assert operator in (0, 4), operator  # NCCL_SUM, NCCL_AVG
        total = np.sum(self._peers(values), axis=0, dtype=np.float32)
        return total / np.float32(self.ranks) if operator == 4 else total

    def _in_place_or_apart(self, whole, shard, shard_count):
        """NCCL's in-place form (the shard at rank * count of the whole), or no overlap."""
        size = 4 * shard_count
        apart = shard + size <= whole or whole + size * self.ranks <= shard
        assert apart or shard == whole + self.rank * size, \
            f"NCCL: the buffers overlap but are not in place ({shard - whole} bytes, not " \
            f"{self.rank * size})"

    def allReduce(self, send, receive, count, datatype, operator, stream):  # noqa: N802
        assert datatype == 7  # NCCL_FLOAT32

        def run():
            nccl_calls.append(("allReduce", send, receive, count, datatype, operator, stream))
            _at(receive, np.float32)[:count] = self._reduce(
                _at(send, np.float32)[:count].copy(), operator)
        _run_or_record(run, stream)

    def reduceScatter(self, send, receive, count, datatype, operator, stream):  # noqa: N802
        assert datatype == 7
        self._in_place_or_apart(send, receive, count)

        def run():
            nccl_calls.append(("reduceScatter", send, receive, count, datatype, operator,
                               stream))
            whole = _at(send, np.float32)[:count * self.ranks].copy()
            reduced = self._reduce(whole, operator)
            _at(receive, np.float32)[:count] = reduced[self.rank * count:(self.rank + 1) * count]
        _run_or_record(run, stream)

    def allGather(self, send, receive, count, datatype, stream):  # noqa: N802
        assert datatype == 7
        self._in_place_or_apart(receive, send, count)

        def run():
            nccl_calls.append(("allGather", send, receive, count, datatype, None, stream))
            gathered = _at(receive, np.float32)[:count * self.ranks]
            if send == receive + 4 * self.rank * count:
                # in place: rank q sends its shard of its own buffer, q's place in the whole
                sent = [gathered[q * count:(q + 1) * count] + np.float32(q - self.rank)
                        for q in range(self.ranks)]
            else:  # apart: rank q's send buffer, where this rank's is
                sent = self._peers(_at(send, np.float32)[:count].copy())
            for q, values in enumerate(sent):
                gathered[q * count:(q + 1) * count] = values
        _run_or_record(run, stream)


UNIQUE_ID = tuple(range(128))  # what get_unique_id draws: each rank must get rank 0's
nccl_calls: list = []
nccl_communicators: list = []
cublaslt: FakeCublasLt | None = None  # set by install


DEVICE_BYTES = 16 << 30  # the "device" memory the fake reports (cudaMemGetInfo: free, total)


def get_default_memory_pool():
    return types.SimpleNamespace(free_bytes=lambda: 0)


def install(monkeypatch, image_declarations, low_type, kernel_constants) -> None:
    """Makes `import cupy` and `from cupy_backends.cuda.libs import cublas` find this."""
    global images, low, constants, _capture, algorithm_milliseconds
    algorithm_milliseconds = None
    _allocations.clear()
    _streams.clear()
    _done.clear()
    _capture = None
    images, low, constants = image_declarations, low_type, kernel_constants
    cupy = sys.modules[__name__]
    global cublaslt
    cublaslt = FakeCublasLt()
    monkeypatch.setattr("cgc.backends.cuda.cublaslt.load", lambda: cublaslt)
    runtime = types.SimpleNamespace(getDeviceCount=lambda: 1, memcpyAsync=_memcpy,
                                    memcpyDeviceToDevice=3, getDevice=lambda: 0,
                                    memGetInfo=lambda: (DEVICE_BYTES, DEVICE_BYTES))
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
