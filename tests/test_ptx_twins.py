"""The CPU twins of the inline-PTX primitives (cgc/backends/cuda_cpu/include/cgcpu/ptx.h)
against the PTX ISA's fragment layouts, written out again here, and against NumPy.

cgc/backends/cuda_cpu/tests/ptx.cu runs ldmatrix.x4 (and .trans) over a tile whose element
(r, c) is r * 16 + c and prints every lane's registers; it runs mma.m16n8k16 on random bfloat16
A and B (each lane's registers from ldmatrix), C read and D written by the accumulator layout,
and prints A, B, C, D. Here: each lane's registers are the elements the PTX ISA names ("Warp-
level matrix load instruction: ldmatrix", "Matrix fragments for mma.m16n8k16 with floating
point type"), and D = A B + C as NumPy computes it. The same checks fail on a twin with a
wrong layout (the header is mutated in a copy: two A registers swapped in the mma, the
transpose's row and column swapped in ldmatrix), so they can catch one.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
INCLUDE = ROOT / "cgc" / "backends" / "cuda_cpu" / "include"
SOURCE = ROOT / "cgc" / "backends" / "cuda_cpu" / "tests" / "ptx.cu"
GXX = shutil.which("g++")

pytestmark = pytest.mark.skipif(GXX is None, reason="needs g++")


def _build_and_run(include: Path, folder: Path) -> str:
    binary = folder / "ptx"
    subprocess.run([GXX, "-std=c++17", "-O1", "-pthread", "-I", str(include), "-I", str(SOURCE.parent),
                    "-x", "c++", str(SOURCE), "-o", str(binary)], check=True, capture_output=True)
    done = subprocess.run([str(binary)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _rows(text: str, tag: str) -> np.ndarray:
    return np.array([[float(x) for x in line.split()[1:]] for line in text.splitlines()
                     if line.split()[0] == tag])


def _ldmatrix_expected(trans: bool) -> np.ndarray:
    """[lane, register, half]: the element of the tile each lane holds, by the PTX ISA. The
    test's addresses make matrix i rows 8 * (i % 2) .. and columns 8 * (i // 2) .. of the tile."""
    expected = np.zeros((32, 4, 2))
    for lane in range(32):
        for i in range(4):
            r0, c0 = 8 * (i % 2), 8 * (i // 2)
            for e in range(2):
                if trans:   # thread l: (2 (l % 4) + e, l / 4) of the matrix
                    r, c = r0 + 2 * (lane % 4) + e, c0 + lane // 4
                else:       # thread l: (l / 4, 2 (l % 4) + e)
                    r, c = r0 + lane // 4, c0 + 2 * (lane % 4) + e
                expected[lane, i, e] = r * 16 + c
    return expected


def ldmatrix_problems(text: str) -> list[str]:
    problems = []
    for tag, trans in (("ldmatrix", False), ("ldmatrix.trans", True)):
        rows = _rows(text, tag)
        got = rows[:, 1:].reshape(32, 4, 2)
        wrong = np.argwhere(got != _ldmatrix_expected(trans))
        if len(wrong):
            lane, register, half = wrong[0]
            problems.append(f"{tag}: {len(wrong)} elements in the wrong register, first lane {lane} "
                            f"register {register} half {half}")
    return problems


def mma_problems(text: str) -> list[str]:
    a, b, c, d = (_rows(text, tag) for tag in "ABCD")
    assert a.shape == (16, 16) and b.shape == (16, 8) and c.shape == d.shape == (16, 8)
    expected = a.astype(np.float64) @ b.astype(np.float64) + c
    # Products of bfloat16 are exact in float32; 16 float32 additions round: each at most half an
    # ulp of a partial sum, bounded by the sum of the magnitudes (2^-24 * 17 * sum |terms|).
    bound = 17 * 2.0 ** -24 * (np.abs(a) @ np.abs(b) + np.abs(c))
    error = np.abs(d - expected)
    if np.any(error > bound):
        i, j = np.unravel_index(np.argmax(error - bound), error.shape)
        return [f"mma: D[{i}][{j}] = {d[i, j]}, NumPy {expected[i, j]} (bound {bound[i, j]:.3g}); "
                f"{int(np.sum(error > bound))} of 128 wrong"]
    return []


def _flushed(x: np.ndarray) -> np.ndarray:
    """A subnormal float32 as zero (the .ftz of the PTX ISA)."""
    return np.where(np.abs(x) < np.finfo(np.float32).tiny, np.float32(0), x).astype(np.float32)


def ex2_problems(text: str) -> list[str]:
    """ex2.approx.ftz.f32 (PTX ISA, "ex2"): 2^x within 2 ulp, a subnormal argument read as
    zero and a subnormal result written as zero."""
    rows = _rows(text, "ex2").astype(np.float32)
    assert len(rows) == 16
    x, got = rows[:, 0], rows[:, 1]
    with np.errstate(over="ignore"):
        expected = _flushed(np.exp2(_flushed(x)))
    close = np.isclose(got, expected, rtol=2.0 ** -22, atol=0) | (got == expected)
    return [f"ex2: 2^{a:.9g} = {g:.9g}, expected {e:.9g}"
            for a, g, e, ok in zip(x, got, expected, close) if not ok]


@pytest.fixture(scope="module")
def output(tmp_path_factory) -> str:
    return _build_and_run(INCLUDE, tmp_path_factory.mktemp("ptx"))


def test_ldmatrix_twin_gives_each_lane_the_documented_elements(output):
    assert ldmatrix_problems(output) == []


def test_mma_twin_equals_numpy(output):
    assert mma_problems(output) == []


def test_ex2_twin_flushes_subnormals_as_the_isa_says(output):
    assert ex2_problems(output) == []


def test_an_ex2_that_keeps_subnormals_is_caught(tmp_path):
    text = _mutated(tmp_path, "return std::fpclassify(y) == FP_SUBNORMAL ? 0.0f : y;", "return y;")
    assert ldmatrix_problems(text) == [] and mma_problems(text) == []
    assert any("2^-127" in p for p in ex2_problems(text))


def test_cp_async_lands_at_its_wait(output):
    assert "ptx: ok" in output  # the program's own checks (ptx.cu: async_copies)


def _mutated(tmp_path: Path, old: str, new: str) -> str:
    copy = tmp_path / "include"
    shutil.copytree(INCLUDE, copy)
    header = copy / "cgcpu" / "ptx.h"
    text = header.read_text()
    assert text.count(old) == 1, old
    header.write_text(text.replace(old, new))
    return _build_and_run(copy, tmp_path)


def test_a_wrong_mma_layout_is_caught(tmp_path):
    # A's registers 1 and 2 swapped (rows g + 8 and columns 2t + 8 confused): the classic slip.
    text = _mutated(tmp_path, "A[g + 8][2 * t + e] = register_half(a[1], e);\n      A[g][2 * t + 8 + e] = "
                    "register_half(a[2], e);",
                    "A[g + 8][2 * t + e] = register_half(a[2], e);\n      A[g][2 * t + 8 + e] = "
                    "register_half(a[1], e);")
    assert ldmatrix_problems(text) == []
    assert mma_problems(text) != []


def test_a_wrong_ldmatrix_layout_is_caught(tmp_path):
    text = _mutated(tmp_path, "trans ? M[i][2 * t][g] : M[i][g][2 * t]", "trans ? M[i][g][2 * t] : M[i][g][2 * t]")
    assert any(p.startswith("ldmatrix.trans") for p in ldmatrix_problems(text))
