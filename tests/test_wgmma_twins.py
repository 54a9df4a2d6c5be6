"""Hopper's warpgroup products and tensor copies in the CPU emulation
(cgc/backends/cuda_cpu/include/cgcpu/wgmma.h and tensor_map.h), lane by lane against NumPy.

Each product case is laid out here, independently of the twin: the operand tiles are placed in
shared memory by evaluating the PTX ISA's canonical layouts as the ISA writes them (CuTe's
notation, "Asynchronous Warpgroup Level Canonical Layouts", copied below as text and parsed),
then CuTe's Swizzle<B, 4, 3> on the byte address; the A registers and the accumulators are
dealt to the 128 threads by the thread-value layouts of the ISA's fragment figures (CuTe's
((4,8,4),(2,2,N/8)):((128,1,16),(64,8,512)) over a column-major 64 x N). The twin decodes the
descriptors with its own formulas (wgmma.h); the products must agree exactly (small integers:
every sum exact in float). Every majorness and swizzle of A and B, A from registers, N = 8, 16,
64, 256, scale-d 0 and 1. Then commit groups, each swizzle through a tensor copy, the NaN fill,
the attention-shaped ring (TMA with a 128-byte swizzle, a
partial last tile, the descriptor advanced along the swizzled row), plain and under racecheck,
a stage freed before the product's wait caught by racecheck, and the faults. The emitted file's
own versions, inline PTX for sm_90a, assemble to HGMMA, UTMALDG and WARPGROUP instructions.
"""

from __future__ import annotations

import os
import re
import struct
import subprocess
import sys
import zlib
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

from conftest import probe_sass

from cgc.backends.cuda.emulated import (HEADERS, RACECHECK_ENVIRONMENT, RACECHECK_FLAGS,
                                        SANITIZER_ENVIRONMENT, SANITIZER_FLAGS, STANDALONE_FLAGS,
                                        build, compiler_missing, parse_racecheck)

SOURCE = HEADERS.parent / "tests" / "wgmma.cu"
INCLUDE = (f"-I{SOURCE.parent}",)

pytestmark = pytest.mark.skipif(compiler_missing() is not None, reason=str(compiler_missing()))

# ---- the ISA's canonical layouts, as text -------------------------------------------------------
CANONICAL = {  # (majorness, swizzle bytes): layout; T = 8 bfloat16 elements (16 bytes)
    ("MN", 0): "((T,1,m),(8,k)):((1,T,SBO),(1T,LBO))",
    ("MN", 32): "((T,2,m),(8,k)):((1,T,LBO),(2T,SBO))",
    ("MN", 64): "((T,4,m),(8,k)):((1,T,LBO),(4T,SBO))",
    ("MN", 128): "((T,8,m),(8,k)):((1,T,LBO),(8T,SBO))",
    ("K", 0): "((8,m),(T,2k)):((1T,SBO),(1,LBO))",
    ("K", 32): "((8,m),(T,2k)):((2T,SBO),(1,T))",
    ("K", 64): "((8,m),(T,2k)):((4T,SBO),(1,T))",
    ("K", 128): "((8,m),(T,2k)):((8T,SBO),(1,T))",
}
DESCRIPTOR_SWIZZLE = {0: 0, 128: 1, 64: 2, 32: 3}  # the descriptor's bits 62-63
T = 8


def _modes(text: str) -> list[list[str]]:
    return [re.findall(r"[^,()]+", mode) for mode in re.findall(r"\(([^()]*(?:\([^()]*\))?[^()]*)\)", text)]


def _value(token: str, names: dict[str, int]) -> int:
    match = re.fullmatch(r"(\d*)([A-Za-z]*)", token.strip())
    count, name = match.groups()
    return (int(count) if count else 1) * (names[name] if name else 1)


@lru_cache(maxsize=None)
def _layout(text: str, names: tuple) -> tuple:
    """The layout `text`'s (shapes, strides), each a list a mode, with `names` (sorted
    (name, value) pairs) put in: parsed once, not once an element."""
    shape_text, stride_text = text.split(":")
    values = dict(names)
    shapes = [[_value(s, values) for s in mode] for mode in _modes(shape_text[1:-1])]
    strides = [[_value(s, values) for s in mode] for mode in _modes(stride_text[1:-1])]
    return shapes, strides


def layout_offset(text: str, names: dict[str, int], mn: int, k: int) -> int:
    """Element offset of (mn, k) in the CuTe layout `text`: each mode's coordinate split
    colexicographically over its shape, dotted with its strides."""
    shapes, strides = _layout(text, tuple(sorted(names.items())))
    offset = 0
    for coordinate, shape, stride in zip((mn, k), shapes, strides):
        for size, step in zip(shape, stride):
            offset += (coordinate % size) * step
            coordinate //= size
        assert coordinate == 0, (text, mn, k)
    return offset


def swizzle(address: int, swizzle_bytes: int) -> int:
    """CuTe's Swizzle<B, 4, 3>: the B bits above bit 7 XORed onto the B bits above bit 4."""
    bits = {0: 0, 32: 1, 64: 2, 128: 3}[swizzle_bytes]
    mask = ((1 << bits) - 1) << 7
    return address ^ ((address & mask) >> 3)


def place(image: np.ndarray, matrix: np.ndarray, start: int, majorness: str, swizzle_bytes: int,
          leading: int, stride: int) -> None:
    """Writes `matrix` (rows mn, columns k: 16) as bfloat16 bits into `image` at byte `start`."""
    rows = matrix.shape[0]
    per_atom = T * (swizzle_bytes // 16 if swizzle_bytes else 1)
    names = {"T": T, "LBO": leading // 2, "SBO": stride // 2,
             "m": max(1, rows // (per_atom if majorness == "MN" else 8)),
             "k": 1 if majorness == "K" else 2}
    text = CANONICAL[(majorness, swizzle_bytes)]
    bits = (matrix.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    written = set()
    for mn in range(rows):
        for k in range(16):
            at = swizzle(start + 2 * layout_offset(text, names, mn, k), swizzle_bytes)
            assert at not in written and at + 2 <= image.size, (majorness, swizzle_bytes, mn, k)
            written.add(at)
            image[at:at + 2] = np.frombuffer(bits[mn, k].tobytes(), np.uint8)


def thread_values(n: int) -> list[list[tuple[int, int]]]:
    """(row, column) of each thread's values in a 64 x n fragment: CuTe's
    ((4,8,4),(2,2,n/8)):((128,1,16),(64,8,512)) over a column-major 64 x n."""
    text = f"((4,8,4),(2,2,{n // 8})):((128,1,16),(64,8,512))"
    out = []
    for thread in range(128):
        row = []
        for value in range(n // 2):
            index = layout_offset(text, {}, thread, value)
            row.append((index % 64, index // 64))
        out.append(row)
    return out


def registers_of_a(a: np.ndarray) -> np.ndarray:
    """Each thread's four A registers: pairs of bfloat16 (the lower-numbered in the low half)."""
    bits = (a.astype(np.float32).view(np.uint32) >> 16).astype(np.uint32)
    out = np.zeros((128, 4), np.uint32)
    for thread, values in enumerate(thread_values(16)):
        for r in range(4):
            (r0, c0), (r1, c1) = values[2 * r], values[2 * r + 1]
            out[thread, r] = bits[r0, c0] | (bits[r1, c1] << 16)
    return out


# Byte offsets (LBO, SBO) that lay a 64-row operand out compactly, padded where nothing repeats.
def strides_for(majorness: str, swizzle_bytes: int, rows: int) -> tuple[int, int]:
    if majorness == "K":
        return (128, 288) if swizzle_bytes == 0 else (16, 8 * swizzle_bytes)
    if swizzle_bytes == 0:
        return (rows * 16 + 32, 128)           # LBO: the next 8 k; SBO: the next 8 mn
    atom = 8 * swizzle_bytes                   # one swizzle atom: (swizzle / 2) mn by 8 k
    atoms = max(1, rows // (swizzle_bytes // 2))
    return (atom, atom * atoms)                # LBO: the next atom along mn; SBO: the next 8 k


def _case_bytes(fields, image, a_registers, c):
    return struct.pack("<14i", *fields) + image.tobytes() + a_registers.tobytes() + c.tobytes()


CASES = [  # (n, a: "reg" or (majorness, swizzle), b: (majorness, swizzle), scale_d)
    *[(64, (am, s), (bm, s), 1) for am in ("K", "MN") for bm in ("K", "MN") for s in (0, 32, 64, 128)],
    (64, "reg", ("K", 128), 1), (64, "reg", ("MN", 128), 0), (64, "reg", ("MN", 0), 1),
    (64, ("K", 128), ("MN", 32), 0),
    (8, ("K", 0), ("K", 0), 1), (16, ("K", 32), ("MN", 32), 1), (256, ("K", 128), ("K", 128), 1),
]


def _name(case) -> str:
    n, a, b, scale = case
    side = lambda s: "reg" if s == "reg" else f"{s[0]}{s[1]}"  # noqa: E731
    return f"n{n}-a{side(a)}-b{side(b)}-scale{scale}"


@pytest.fixture(scope="module")
def programs():
    text = SOURCE.read_text()
    return {"plain": build(text, "wgmma", STANDALONE_FLAGS, INCLUDE),
            "racecheck": build(text, "wgmma-racecheck", RACECHECK_FLAGS, INCLUDE),
            "sanitizers": build(text, "wgmma-sanitizers", SANITIZER_FLAGS, INCLUDE)}


def _run(binary: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CG_CPU_")}
    env.update(RACECHECK_ENVIRONMENT)
    env.update(SANITIZER_ENVIRONMENT)
    return subprocess.run([str(binary), *args], capture_output=True, text=True, env=env, timeout=300)


def make_case(case) -> tuple[bytes, np.ndarray, np.ndarray]:
    """The case file wgmma.cu's `product` reads, each thread's accumulators as they go in, and
    what each thread's must be after the wait (scripts/hopper_twins_on_gpu.py runs the same
    cases on a GPU)."""
    n, a_side, (b_major, b_swizzle), scale_d = case
    rng = np.random.default_rng(zlib.crc32(_name(case).encode()))  # the same on every run
    a = rng.integers(-8, 9, (64, 16)).astype(np.float32)
    b = rng.integers(-8, 9, (16, n)).astype(np.float32)     # k x n
    c = rng.integers(-64, 65, (64, n)).astype(np.float32)
    image = np.zeros(64 * 1024, np.uint8)
    b_start = 32 * 1024
    b_leading, b_stride = strides_for(b_major, b_swizzle, n)
    place(image, b.T, b_start, b_major, b_swizzle, b_leading, b_stride)
    fields = [n, a_side == "reg", 0, b_major == "MN", scale_d, image.size, 0, 0, 0, 0,
              b_start, b_leading, b_stride, DESCRIPTOR_SWIZZLE[b_swizzle]]
    if a_side != "reg":
        a_major, a_swizzle = a_side
        a_leading, a_stride = strides_for(a_major, a_swizzle, 64)
        place(image, a, 0, a_major, a_swizzle, a_leading, a_stride)
        fields[2] = a_major == "MN"
        fields[6:10] = [0, a_leading, a_stride, DESCRIPTOR_SWIZZLE[a_swizzle]]
    layout = thread_values(n)
    c_threads = np.array([[c[r, col] for r, col in values] for values in layout], np.float32)
    expected = a.astype(np.float64) @ b + (c if scale_d else 0)
    want = np.array([[expected[r, col] for r, col in values] for values in layout], np.float32)
    return _case_bytes([int(f) for f in fields], image, registers_of_a(a), c_threads), c_threads, want


@pytest.mark.parametrize("case", CASES, ids=_name)
def test_a_product_matches_numpy_lane_by_lane(programs, tmp_path, case):
    data, c_threads, want = make_case(case)
    path = tmp_path / "case.bin"
    path.write_bytes(data)
    done = _run(programs["plain"], "product", str(path), str(tmp_path / "out.bin"))
    assert done.returncode == 0 and "product: ok" in done.stdout, done.stdout + done.stderr
    out = np.fromfile(tmp_path / "out.bin", np.float32).reshape(2, 128, case[0] // 2)
    wrong = np.argwhere(out[0] != want)
    assert wrong.size == 0, f"{len(wrong)} registers differ, first (thread, register) {wrong[0].tolist()}"
    assert np.array_equal(out[1], c_threads), "the accumulators changed before the wait"


def test_the_layout_evaluator_reads_the_isa_examples():
    """The ISA's worked examples (bfloat16, m = k = 2) against the canonical text: MN-major
    without swizzle is ((8,1,2),(8,2)):((1,8,64),(8,128)) at LBO 256 bytes, SBO 128; with the
    32-byte swizzle ((8,2,2),(8,2)):((1,8,128),(16,256)) at LBO 256, SBO 512."""
    for (swizzle_bytes, leading, stride, exact) in (
            (0, 256, 128, "((8,1,2),(8,2)):((1,8,64),(8,128))"),
            (32, 256, 512, "((8,2,2),(8,2)):((1,8,128),(16,256))"),
            (64, 512, 1024, "((8,4,2),(8,2)):((1,8,256),(32,512))")):
        names = {"T": T, "LBO": leading // 2, "SBO": stride // 2, "m": 2, "k": 2}
        text = CANONICAL[("MN", swizzle_bytes)]
        rows = 2 * T * (swizzle_bytes // 16 or 1)
        for mn in range(rows):
            for k in range(16):
                assert layout_offset(text, names, mn, k) == layout_offset(exact, {}, mn, k)


def test_the_attention_ring_of_tensor_copies_gives_every_score(programs):
    for name, binary in programs.items():
        done = _run(binary, "pipeline")
        assert done.returncode == 0 and "pipeline: ok" in done.stdout, done.stdout + done.stderr[-3000:]
        for report in ("ThreadSanitizer", "AddressSanitizer", "runtime error", "cuda_cpu"):
            assert report not in done.stderr, (name, done.stderr[-3000:])


def _line(text: str) -> int:
    found = [i + 1 for i, line in enumerate(SOURCE.read_text().splitlines()) if text in line]
    assert len(found) == 1, text
    return found[0]


def test_a_stage_freed_before_the_products_wait_races_the_next_copy(programs):
    done = _run(programs["racecheck"], "release-early")
    assert "release-early: launch cudaSuccess" in done.stdout, done.stdout + done.stderr[-3000:]
    assert done.returncode == 66, done.stderr[-3000:]  # ThreadSanitizer reported
    races = parse_racecheck(done.stderr, programs["racecheck"], "wgmma-racecheck.cpp")
    assert races, done.stderr[-3000:]
    copy = _line("cg_tma_load_2d(stage + s * kTileBytes")
    assert all(race.memory == "dynamic shared" for race in races), "\n".join(map(str, races))
    assert any(copy in race.lines for race in races), "\n".join(map(str, races))


@pytest.mark.parametrize("mode,said", [
    ("static-tile", r"wgmma descriptor \([^()]*wgmma\.cpp?:\d+\): 0x[0-9a-f]+ is not in this block's dynamic "
                    r"shared memory"),
    ("lanes-differ", r"wgmma\.mma_async \([^()]*wgmma\.cpp?:\d+\): lanes 0 and 5 of the warp issued "
                     r"different products"),
    ("base-offset", r"wgmma\.mma_async \([^()]*wgmma\.cpp?:\d+\): matrix base offset 1: only 0"),
    ("off-repeat", r"wgmma\.mma_async \([^()]*wgmma\.cpp?:\d+\): a swizzled tile at shared address \d+ is "
                   r"not on its swizzle's 1024-byte repeat"),
    ("written-accumulator", r"wgmma\.wait_group \([^()]*wgmma\.cpp?:\d+\): lane 6's accumulators of the "
                            r"product at [^ ]*wgmma\.cpp?:\d+ were written between its issue and this wait"),
    ("exit-pending", r"thread \d+: the thread exited with 1 warpgroup products pending, the first issued at "
                     r"[^ ]*wgmma\.cpp?:\d+"),
    ("partial-warpgroup", r"wgmma\.mma_async \([^()]*wgmma\.cpp?:\d+\): thread 0's warpgroup \(threads 0-127\) "
                          r"is not whole in a block of 96 threads"),
    ("tma-overflow", r"cp\.async\.bulk\.tensor\.2d \([^()]*wgmma\.cpp?:\d+\): the box's 8192 bytes at shared "
                     r"address \d+ end past the block's \d+ bytes of dynamic shared memory"),
])
def test_what_the_twin_does_not_allow_is_a_fault(programs, mode, said):
    done = _run(programs["plain"], mode)
    assert f"{mode}: launch cudaErrorLaunchFailure" in done.stdout, done.stdout + done.stderr
    assert re.search(said, done.stderr), done.stderr


@pytest.mark.parametrize("mode", ["groups", "swizzles", "nan-fill"])
def test_groups_swizzled_tensor_copies_and_the_fill(programs, mode):
    """wait_group 1 completes the older of two groups on one accumulator and wait_group 0 the
    other; a box starting above the tensor, copied with each swizzle and multiplied by itself
    through descriptors of that swizzle, gives the exact X X^T (its missing rows zero); the NaN
    fill puts NaN in exactly those rows."""
    done = _run(programs["plain"], mode)
    assert done.returncode == 0 and f"{mode}: ok" in done.stdout, done.stdout + done.stderr[-3000:]


def test_the_driver_refuses_invalid_tensor_maps(programs):
    done = _run(programs["plain"], "bad-map")
    assert done.returncode == 0 and "bad-map: ok" in done.stdout, done.stdout + done.stderr


PROBE = r"""
extern "C" __global__ void __launch_bounds__(128) cg_probe_wgmma(float* out,
    const __grid_constant__ CUtensorMap map) {
  CG_DYNAMIC_SHARED(memory);
  __shared__ __align__(8) unsigned long long full;
  if (threadIdx.x == 0) {
    cg_mbarrier_init(&full, 1);
    cg_mbarrier_arrive_expect_tx(&full, 8192);
    cg_tma_load_2d(memory, &map, 0, 0, &full);
  }
  __syncthreads();
  cg_mbarrier_wait(&full, 0);
  float d[32];
  for (int i = 0; i < 32; ++i) d[i] = 0.0f;
  cg_wgmma_fence();
  for (int k = 0; k < 4; ++k)
    cg_wgmma_bf16_ss<64, 0, 0>(d, cg_wgmma_descriptor(memory + 32 * k, 16, 1024, 1),
                               cg_wgmma_descriptor(memory + 32 * k, 16, 1024, 1), 1);
  cg_wgmma_commit();
  cg_wgmma_wait<0>();
  cg_wgmma_fence_operand(d);
  const unsigned a[4] = {1u, 2u, 3u, 4u};
  cg_wgmma_fence();
  cg_wgmma_bf16_rs<64, 1>(d, a, cg_wgmma_descriptor(memory, 1024, 2048, 1), 1);
  cg_wgmma_commit();
  cg_wgmma_wait<0>();
  cg_wgmma_fence_operand(d);
  for (int i = 0; i < 32; ++i) out[threadIdx.x * 32 + i] = d[i];
}
"""


def test_the_gpu_versions_assemble_to_hoppers_warpgroup_and_tensor_instructions():
    probe = probe_sass(PROBE, "cg_probe_wgmma", "sm_90a", preamble="#include <cuda.h>\n")
    text = " ".join(f"{i.opcode} {i.operands}" for i in probe.instructions)
    for opcode in ("UTMALDG.2D", "WARPGROUP.ARRIVE", "WARPGROUP.DEPBAR.LE", "FENCE.VIEW.ASYNC.S"):
        assert opcode in text, opcode
    assert [i.opcode for i in probe.instructions].count("HGMMA.64x64x16.F32.BF16") == 5, text


@pytest.mark.parametrize("old,new", [
    # MN-major without swizzle: LBO and SBO trade places there (the ISA's quirk), taken as elsewhere
    ("    offset = (mn % 8) + (mn / 8) * sbo + (k % 8) * T + (k / 8) * lbo;",
     "    offset = (mn % 8) + (mn / 8) * lbo + (k % 8) * T + (k / 8) * sbo;"),
    # the swizzle's bits taken from the descriptor's code as if it were the bytes' count
    ("  static const int bits[4] = {0, 3, 2, 1};", "  static const int bits[4] = {0, 1, 2, 3};"),
    # the accumulator's second row pair from the wrong register
    ("    for (int i = 0; i < n / 2; ++i) ops[lane]->d[i] = D[g + 8 * ((i / 2) % 2)]",
     "    for (int i = 0; i < n / 2; ++i) ops[lane]->d[i] = D[g + 8 * (i % 2)]"),
    # a wait that completes every product, its N most recent groups and uncommitted ones too
    ("    for (const Fiber::WgmmaOp& op : f.wgmma_ops) count += op.group + pending < f.wgmma_groups;",
     "    for (const Fiber::WgmmaOp& op : f.wgmma_ops) count += op.group <= f.wgmma_groups;"),
])
def test_a_mistaken_twin_fails_the_lane_by_lane_check(tmp_path, old, new):
    """Each mutation of wgmma.h's layouts is caught by the cases above (the test's own layouts are
    evaluated from the ISA's text, not from the twin's formulas)."""
    import shutil
    copy = tmp_path / "include"
    shutil.copytree(HEADERS, copy)
    header = copy / "cgcpu" / "wgmma.h"
    text = header.read_text()
    assert text.count(old) == 1, old
    header.write_text(text.replace(old, new))
    binary = tmp_path / "wgmma"
    subprocess.run(["g++", *STANDALONE_FLAGS, f"-I{copy}", *INCLUDE, "-x", "c++", str(SOURCE), "-o",
                    str(binary)], check=True, capture_output=True)
    failed = [mode for mode in ("groups", "swizzles") if _run(binary, mode).returncode != 0]
    for case in CASES:
        try:
            test_a_product_matches_numpy_lane_by_lane({"plain": binary}, tmp_path, case)
        except AssertionError:
            failed.append(_name(case))
    assert failed, "no case caught the mutation"


SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "hopper_twins_on_gpu.py"


def test_the_gpu_check_script_runs_its_checks_on_the_twins(programs):
    """scripts/hopper_twins_on_gpu.py, rehearsed on the twins' program: every check it would run
    on a GPU passes here (and a failing program would fail it: the mutations above)."""
    done = subprocess.run([sys.executable, str(SCRIPT), "--binary", str(programs["plain"])],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "25 passed, 0 failed" in done.stdout, done.stdout + done.stderr


def test_the_gpu_check_script_builds_the_program_for_sm_90a(tmp_path):
    sys.path.insert(0, str(SCRIPT.parent))
    import sass_audit
    from cgc.backends.cuda.toolchain import ToolchainMissing
    try:
        sass_audit.check_versions()
    except ToolchainMissing as missing:
        pytest.skip(str(missing))
    done = subprocess.run([sys.executable, str(SCRIPT), "--build-only", "--folder", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "built wgmma_gpu for sm_90a" in done.stdout, done.stdout + done.stderr
