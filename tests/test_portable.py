"""The reference machine gives the same bits at any BLAS thread count, with any BLAS kernel and
on any of NumPy's SIMD paths (cgc/backends/numpy/portable.py), and its products and functions
are the correctly rounded ones they stand for."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import ml_dtypes
import mpmath
import numpy as np
import pytest

from cgc.backends.numpy import portable
from conftest import ROOT

F32 = np.float32
THREADS = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_CORETYPE",
           "NPY_DISABLE_CPU_FEATURES")


def _numpy_simd_paths() -> list[str]:
    """The SIMD targets NumPy dispatches to on this CPU (disabling them all: its baseline)."""
    try:
        from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__
    except ImportError:  # NumPy 1.x
        from numpy.core._multiarray_umath import __cpu_dispatch__, __cpu_features__
    return [name for name in __cpu_dispatch__ if __cpu_features__.get(name)]


def _variants() -> dict[str, dict[str, str]]:
    variants = {f"{n} BLAS threads": {"OPENBLAS_NUM_THREADS": str(n)} for n in (1, 2)}
    # OpenBLAS's kernels for other cores, that run on any x86-64 with AVX (this build has
    # DYNAMIC_ARCH; a core it does not know falls back to the detected one): an AVX kernel on
    # four threads and an SSE one on two. SkylakeX's AVX-512 kernels need an AVX-512 CPU.
    variants["4 BLAS threads, OpenBLAS Sandybridge kernels"] = {
        "OPENBLAS_NUM_THREADS": "4", "OPENBLAS_CORETYPE": "Sandybridge"}
    variants["2 BLAS threads, OpenBLAS Nehalem kernels"] = {
        "OPENBLAS_NUM_THREADS": "2", "OPENBLAS_CORETYPE": "Nehalem"}
    paths = _numpy_simd_paths()
    if paths:  # NumPy's exp, log and tanh differ between these paths (portable.py)
        variants["NumPy baseline, no " + " ".join(paths)] = {
            "NPY_DISABLE_CPU_FEATURES": " ".join(paths), "OPENBLAS_NUM_THREADS": "1"}
    return variants


def _dump(folder: Path, settings: dict[str, str]) -> dict[str, bytes]:
    env = {name: value for name, value in os.environ.items() if name not in THREADS}
    env.update(settings)
    subprocess.run([sys.executable, "-m", "cgc", "run", "schedules/train.cg", "--steps", "1",
                    "--dump", str(folder)], cwd=ROOT, env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return {str(path.relative_to(folder)): path.read_bytes()
            for path in sorted(folder.rglob("*")) if path.is_file()}


def test_the_same_dump_bytes_at_any_thread_count_blas_kernel_and_simd_path(tmp_path):
    """A quick-start step (bfloat16, tiny) dumped under each setting: every file of every
    dump (loss, gradients, parameters after the step) byte for byte the same. (Before
    portable.py, 2 threads against 1 differed in every gradient.)"""
    dumps = {name: _dump(tmp_path / str(i), settings)
             for i, (name, settings) in enumerate(_variants().items())}
    (first, expected), *rest = dumps.items()
    for name, files in rest:
        assert files.keys() == expected.keys()
        differing = [path for path in files if files[path] != expected[path]]
        assert not differing, f"{name} against {first}: {differing}"


def test_the_reference_calls_nothing_that_depends_on_the_machine():
    """The reference's kernels reach BLAS and NumPy's SIMD functions only through portable:
    no matmul, dot, einsum, tensordot, @, exp, log, tanh, power, sin or cos of NumPy's own."""
    banned = {"matmul", "dot", "vdot", "inner", "einsum", "tensordot", "exp", "exp2", "expm1",
              "log", "log2", "log1p", "log10", "tanh", "sinh", "cosh", "power", "sin", "cos",
              "tan", "arctan", "float_power"}
    source = (ROOT / "cgc" / "backends" / "numpy" / "reference.py").read_text()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in banned and \
                isinstance(node.value, ast.Name) and node.value.id == "np":
            found.append(f"np.{node.attr} (line {node.lineno})")
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.MatMult, ast.Pow)):
            found.append(f"{type(node.op).__name__} (line {node.lineno})")
    assert not found


def _nearest_float32(x: Fraction) -> F32:
    """The float32 nearest the rational x, ties to even."""
    guess = F32(float(x))
    candidates = [np.nextafter(guess, F32(-np.inf)), guess, np.nextafter(guess, F32(np.inf))]
    return min(candidates, key=lambda c: (abs(Fraction(float(c)) - x),
                                          int(np.array(c).view(np.int32)) & 1))


def _exact_product(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    out = np.zeros((a.shape[0], b.shape[1]), dtype=F32)
    for i in range(a.shape[0]):
        for j in range(b.shape[1]):
            out[i, j] = _nearest_float32(sum(Fraction(float(a[i, k])) * Fraction(float(b[k, j]))
                                             for k in range(a.shape[1])))
    return out


@pytest.mark.parametrize("kind", ["float32", "wide", "bfloat16", "cancelling"])
def test_every_product_is_the_nearest_float32_to_the_exact_sum(kind):
    """The fast path (BLAS's float64 sum inside its error bound), the exact path for operands
    of few bits, and math.fsum's for the rest, against exact rational arithmetic."""
    rng = np.random.default_rng(["float32", "wide", "bfloat16", "cancelling"].index(kind))
    for _ in range(12):
        m, k, n = rng.integers(1, 9, 3)
        a, b = rng.standard_normal((m, k)), rng.standard_normal((k, n))
        if kind == "wide":
            a = a * np.exp2(rng.integers(-60, 60, (m, k)))
        if kind == "bfloat16":  # sums of few bits: often exactly a float32 midpoint
            a, b = a.astype(ml_dtypes.bfloat16), b.astype(ml_dtypes.bfloat16)
        if kind == "cancelling":
            a = rng.integers(-3, 4, (m, k)) * 2.0 ** 24
            b = rng.integers(-3, 4, (k, n)) + 2.0 ** -5
        a, b = a.astype(F32), b.astype(F32)
        assert np.array_equal(portable.matmul(a, b), _exact_product(a, b))


def test_a_sum_on_a_float32_midpoint_is_rounded_once():
    """1 + 2^-24 + 2^-60: rounding it to float64 first lands on the midpoint 1 + 2^-24, which
    rounds to even (1.0); the exact sum is above it, so its nearest float32 is 1 + 2^-23."""
    a, b = np.array([[1, 2.0 ** -24, 2.0 ** -60]], dtype=F32), np.ones((3, 1), dtype=F32)
    assert np.matmul(a.astype(np.float64), b.astype(np.float64)).astype(F32)[0, 0] == 1
    assert portable.matmul(a, b)[0, 0] == F32(1 + 2.0 ** -23)


def test_products_with_inf_and_nan_are_ieees():
    rng = np.random.default_rng(5)
    a, b = rng.standard_normal((5, 6)).astype(F32), rng.standard_normal((6, 7)).astype(F32)
    a[0, 1], a[1, 2], a[2, 3], a[3, 3], a[4] = np.inf, np.nan, np.inf, 0, 0
    b[3, 4], b[2, 0], b[:, 5], b[3, 6] = -np.inf, 0, 0, np.inf
    with np.errstate(invalid="ignore"):
        expected = np.matmul(a.astype(np.float64), b.astype(np.float64)).astype(F32)
    assert np.array_equal(portable.matmul(a, b), expected, equal_nan=True)


def test_batched_products_broadcast_as_matmul_does():
    rng = np.random.default_rng(6)
    q, k = rng.standard_normal((2, 3, 8, 4)).astype(F32), rng.standard_normal((2, 1, 4, 8))
    k = k.astype(F32)
    expected = np.matmul(q.astype(np.float64), k.astype(np.float64)).astype(F32)
    assert np.array_equal(portable.matmul(q, k), expected)
    assert not np.signbit(portable.matmul(np.array([[-0.0, 1]], F32),
                                          np.array([[1], [-0.0]], F32))).any()


def _values() -> np.ndarray:
    rng = np.random.default_rng(7)
    values = np.concatenate([rng.standard_normal(200_000) * scale
                             for scale in (1e-6, 0.1, 1, 10, 40)]).astype(F32)
    return np.concatenate([values, np.array([0, -0.0, 88.7, 88.8, -103, -104, -110, 1e-40,
                                             -1e-40, 3e38], dtype=F32)])


@pytest.mark.parametrize("name", ["exp", "exp2", "log", "tanh"])
def test_functions_are_float64s_correctly_rounded_to_float32(name):
    """A million values, each the float32 nearest NumPy's float64 function (an error below
    2^-52, so their float32 roundings can differ only within 2^-28 ulp of a midpoint); the
    special values as IEEE's, every NaN the one quiet NaN (NumPy's own NaN signs vary with
    its SIMD path, portable's may not)."""
    x = _values()
    if name == "log":
        x = np.abs(x)
    with np.errstate(over="ignore", divide="ignore"):
        expected = getattr(np, name)(x.astype(np.float64)).astype(F32)
        assert np.array_equal(getattr(portable, name)(x), expected)
    special = np.array([np.inf, -np.inf, np.nan, -1, 0, -0.0], dtype=F32)
    with np.errstate(all="ignore"):
        expected = getattr(np, name)(special.astype(np.float64)).astype(F32)
    got = getattr(portable, name)(special)
    assert np.array_equal(got, expected, equal_nan=True)
    number = ~np.isnan(got)
    assert np.array_equal(np.signbit(got[number]), np.signbit(expected[number]))
    assert set(got[~number].view(np.uint32).tolist()) <= {0x7FC00000}


@pytest.mark.parametrize("name", ["exp", "exp2", "log", "tanh", "power_of_10000",
                                  "cos_sin_pi"])
def test_functions_in_pieces_give_the_whole_arrays_bits(name, monkeypatch):
    """The functions run PIECE elements at a time (portable._elementwise): on a 2-D array
    of 2.5 pieces with special values, the same shape, dtype and bits as with the whole
    array in one piece."""
    rng = np.random.default_rng(9)
    x = (rng.standard_normal(5 * portable.PIECE // 2) * 30).astype(F32)
    if name in ("power_of_10000", "cos_sin_pi"):  # finite arguments (rotary's)
        x = np.clip(x, -60, 60) / F32(32)
    else:
        x[::997], x[1::1009], x[2::1013], x[3::331] = np.nan, np.inf, -np.inf, 0
    x = x.reshape(-1, 5)
    function = getattr(portable, name)
    with np.errstate(all="ignore"):
        pieces = function(x)
        monkeypatch.setattr(portable, "PIECE", x.size)
        whole = function(x)
    for got, expected in zip(*(r if isinstance(r, tuple) else (r,) for r in (pieces, whole))):
        assert got.shape == expected.shape == x.shape and got.dtype == expected.dtype == F32
        assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))


def test_cos_and_sin_of_half_turns_are_correctly_rounded():
    rng = np.random.default_rng(8)
    turns = np.concatenate([(rng.random(300) * 700 - 350), [0, 0.5, 1, -0.25, 0.75, 1e-7]])
    turns = turns.astype(F32)
    cos, sin = portable.cos_sin_pi(turns)
    for t, c, s in zip(turns, cos, sin):
        exact = mpmath.mpf(float(t))
        assert c == F32(float(mpmath.cospi(exact))) and s == F32(float(mpmath.sinpi(exact)))


def test_adams_powers_and_the_rotary_frequencies():
    for base in (0.9, 0.95, 0.999, 0.5):
        for exponent in (0, 1, 2, 10, 1000, 100_000):
            nearest = F32(float(mpmath.mpf(float(F32(base))) ** exponent))
            assert abs(portable.power(F32(base), exponent) - nearest) <= np.spacing(nearest)
    y = -np.arange(32, dtype=F32) * F32(2) / F32(64)
    assert np.array_equal(portable.power_of_10000(y),
                          np.power(10000.0, y.astype(np.float64)).astype(F32))


def test_cgc_runs_numpy_on_one_blas_thread_unless_told_otherwise():
    """Set before NumPy loads (cgc/__init__.py); a user's own setting is kept."""
    def threads(extra: dict[str, str]) -> str:
        env = {name: value for name, value in os.environ.items() if name not in THREADS}
        env.update(extra)
        return subprocess.run([sys.executable, "-c", "import cgc.cli, os; "
                               "print(os.environ.get('OPENBLAS_NUM_THREADS'))"],
                              cwd=ROOT, env=env, check=True, capture_output=True,
                              text=True).stdout.strip()
    assert threads({}) == "1"
    assert threads({"OPENBLAS_NUM_THREADS": "3"}) == "3"
    assert threads({"OMP_NUM_THREADS": "2"}) == "None"
