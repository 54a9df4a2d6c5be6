"""A small ctypes binding of cuBLASLt, for the CuPy backend (CuPy 14 has none).

Only what the products need: a handle, a matmul descriptor (operations, epilogue, aux), the
matrix layouts, a heuristic query and cublasLtMatmul. The library is the nvidia-cublas
wheel's libcublasLt (what the `cuda` extra brings), else the system's. The numbers
are cublasLt.h's (CUDA 13). tests/fake_cupy.py stands in for this class on the CPU, computing
each matmul from cuBLASLt's definition.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from pathlib import Path

from ...core.elements import ELEMENTS

# cublasLt.h
EPILOGUES = {"DEFAULT": 1, "GELU_AUX": 160, "DGELU": 192}  # cublasLtEpilogue_t
OPERATIONS = {"N": 0, "T": 1}  # cublasOperation_t
COMPUTE_32F = 68  # CUBLAS_COMPUTE_32F
DESC_TRANSA, DESC_TRANSB, DESC_EPILOGUE = 3, 4, 7
DESC_AUX_POINTER, DESC_AUX_LD = 11, 12
PREF_MAX_WORKSPACE_BYTES = 1
PREF_MIN_ALIGNMENT = (5, 6, 7, 8)  # A, B, C, D bytes
ALGO_CONFIG_SPLITK_NUM, ALGO_CONFIG_REDUCTION_SCHEME = 2, 3  # int32, uint32
REDUCTION_SCHEME_NONE = 0


class CublasLtError(RuntimeError):
    """cuBLASLt is missing, or refused a call (its status)."""


class _HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspaceSize", ctypes.c_size_t),
                ("state", ctypes.c_int), ("wavesCount", ctypes.c_float),
                ("reserved", ctypes.c_int * 4)]


def _library_paths() -> list[str]:
    """libcublasLt from the nvidia-cublas wheel first, then whatever the loader finds."""
    found = []
    try:
        from .toolchain import ToolchainMissing, cuda_root
        try:
            found.append(str(cuda_root() / "lib" / "libcublasLt.so.13"))
        except ToolchainMissing:
            pass
    except ImportError:
        pass
    system = ctypes.util.find_library("cublasLt")
    found += [p for p in (system, "libcublasLt.so.13", "libcublasLt.so") if p]
    return found


def load() -> "CublasLt":
    """cuBLASLt, or a CublasLtError saying where it was looked for."""
    tried = []
    for path in _library_paths():
        if "/" in path and not Path(path).exists():
            tried.append(path)
            continue
        try:
            return CublasLt(ctypes.CDLL(path))
        except OSError as error:
            tried.append(f"{path} ({error})")
    from ...resources import install_hint
    raise CublasLtError(f"cuBLASLt (libcublasLt) is not installed: {install_hint('cuda')} "
                        f"brings the nvidia-cublas wheel (looked for: {', '.join(tried)})")


class CublasLt:
    """cuBLASLt's calls, each checked: a status other than 0 raises CublasLtError."""

    def __init__(self, library):
        self.library = library

    def _call(self, name: str, *arguments) -> None:
        status = getattr(self.library, name)(*arguments)
        if status != 0:
            raise CublasLtError(f"{name} failed: cuBLAS status {status}")

    def create(self) -> int:
        handle = ctypes.c_void_p()
        self._call("cublasLtCreate", ctypes.byref(handle))
        return handle.value

    def _set(self, desc: int, attribute: int, value) -> None:
        self._call("cublasLtMatmulDescSetAttribute", ctypes.c_void_p(desc), ctypes.c_int(attribute),
                   ctypes.byref(value), ctypes.c_size_t(ctypes.sizeof(value)))

    def matmul_desc(self, transa: str, transb: str, epilogue: str, aux_ld: int | None) -> int:
        """A descriptor: float32 compute and scale, cuBLASLt's operations on its A and B."""
        desc = ctypes.c_void_p()
        scale = ELEMENTS["float32"].cuda_data_type_code
        self._call("cublasLtMatmulDescCreate", ctypes.byref(desc), ctypes.c_int(COMPUTE_32F),
                   ctypes.c_int(scale))
        self._set(desc.value, DESC_TRANSA, ctypes.c_int32(OPERATIONS[transa]))
        self._set(desc.value, DESC_TRANSB, ctypes.c_int32(OPERATIONS[transb]))
        self._set(desc.value, DESC_EPILOGUE, ctypes.c_uint32(EPILOGUES[epilogue]))
        if aux_ld is not None:
            self._set(desc.value, DESC_AUX_LD, ctypes.c_int64(aux_ld))
        return desc.value

    def set_aux(self, desc: int, pointer: int) -> None:
        self._set(desc, DESC_AUX_POINTER, ctypes.c_void_p(pointer))

    def layout(self, data_type: int, rows: int, columns: int, ld: int) -> int:
        layout = ctypes.c_void_p()
        self._call("cublasLtMatrixLayoutCreate", ctypes.byref(layout), ctypes.c_int(data_type),
                   ctypes.c_uint64(rows), ctypes.c_uint64(columns), ctypes.c_int64(ld))
        return layout.value

    def heuristic(self, handle: int, desc: int, layouts: tuple[int, int, int, int],
                  workspace_bytes: int, alignments: tuple[int, int, int, int],
                  requested: int = 1) -> list:
        """The heuristic's algorithms for these layouts (A, B, C, D), best first, up to
        `requested`, told the workspace and the operands' alignments: opaque values for
        matmul (those it offers in a state other than success left out)."""
        preference = ctypes.c_void_p()
        self._call("cublasLtMatmulPreferenceCreate", ctypes.byref(preference))
        try:
            value = ctypes.c_uint64(workspace_bytes)
            self._call("cublasLtMatmulPreferenceSetAttribute", preference,
                       ctypes.c_int(PREF_MAX_WORKSPACE_BYTES), ctypes.byref(value),
                       ctypes.c_size_t(8))
            for attribute, alignment in zip(PREF_MIN_ALIGNMENT, alignments):
                value32 = ctypes.c_uint32(alignment)
                self._call("cublasLtMatmulPreferenceSetAttribute", preference,
                           ctypes.c_int(attribute), ctypes.byref(value32), ctypes.c_size_t(4))
            results, count = (_HeuristicResult * requested)(), ctypes.c_int(0)
            self._call("cublasLtMatmulAlgoGetHeuristic", ctypes.c_void_p(handle),
                       ctypes.c_void_p(desc), *(ctypes.c_void_p(x) for x in layouts), preference,
                       ctypes.c_int(requested), results, ctypes.byref(count))
        finally:
            self.library.cublasLtMatmulPreferenceDestroy(preference)
        if count.value < 1:
            raise CublasLtError("cuBLASLt's heuristic has no algorithm for this product")
        return [results[0]] + [r for r in results[1:count.value] if r.state == 0]

    def one_pass(self, result) -> bool:
        """Whether the algorithm sums each element's k products in one pass (one split of k,
        no reduction scheme); one whose configuration cannot be read is not."""
        splits, reduction = ctypes.c_int32(0), ctypes.c_uint32(1)
        written = ctypes.c_size_t(0)
        for attribute, value in ((ALGO_CONFIG_SPLITK_NUM, splits),
                                 (ALGO_CONFIG_REDUCTION_SCHEME, reduction)):
            status = self.library.cublasLtMatmulAlgoConfigGetAttribute(
                ctypes.byref(result.algo), ctypes.c_int(attribute), ctypes.byref(value),
                ctypes.c_size_t(ctypes.sizeof(value)), ctypes.byref(written))
            if status != 0:
                return False
        return splits.value == 1 and reduction.value == REDUCTION_SCHEME_NONE

    def matmul(self, handle: int, desc: int, alpha: int, a: int, a_layout: int, b: int,
               b_layout: int, beta: int, c: int, c_layout: int, d: int, d_layout: int, algo,
               workspace: int, workspace_bytes: int, stream: int) -> None:
        """cublasLtMatmul; alpha and beta are host addresses of float32 values."""
        pointer = ctypes.c_void_p
        self._call("cublasLtMatmul", pointer(handle), pointer(desc), pointer(alpha), pointer(a),
                   pointer(a_layout), pointer(b), pointer(b_layout), pointer(beta), pointer(c),
                   pointer(c_layout), pointer(d), pointer(d_layout), ctypes.byref(algo.algo),
                   pointer(workspace), ctypes.c_size_t(workspace_bytes), pointer(stream))


def alignment(address: int) -> int:
    """The largest power of two, up to 256, that divides the address (what the heuristic is
    told, as the emitted program's cg_alignment tells it)."""
    value = 1
    while value < 256 and address % (2 * value) == 0:
        value *= 2
    return value
