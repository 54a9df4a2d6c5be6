"""The CPU emulation of CUDA (cgc/backends/cuda_cpu): headers that let g++ build an emitted .cu
file unchanged and run it on the CPU with CUDA's semantics.

The C++ test programs in cgc/backends/cuda_cpu/tests/ check one part each (barriers, warp
collectives, shared memory, WMMA, bfloat16, cuBLAS, cuBLASLt, launch errors, atomics) and exit
1 when a check fails; the emitted files are built with the command the project uses, and the
tiny step's losses are compared with the NumPy reference machine's. Everything is compiled once
per session, all at once, in parallel.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from cgc.backends.numerics import to_bfloat16_bits

ROOT = Path(__file__).resolve().parent.parent
EMULATOR = ROOT / "cgc" / "backends" / "cuda_cpu"
INCLUDE = EMULATOR / "include"
SOURCES = EMULATOR / "tests"
GXX = shutil.which("g++")

pytestmark = pytest.mark.skipif(GXX is None, reason="needs g++ (Debian's g++ 12)")

# The project's commands (README.md in cgc/backends/cuda_cpu).
BUILD = ["-std=c++17", "-O1", "-pthread", "-I", str(INCLUDE), "-x", "c++"]
SANITIZE = ["-std=c++17", "-Og", "-g1", "-fsanitize=address,undefined", "-fno-omit-frame-pointer",
            "-pthread", "-I", str(INCLUDE), "-x", "c++"]
UNIT_TESTS = ["barrier", "warp", "shared", "wmma", "bf16", "cublas", "cublaslt", "launch",
              "atomics"]
# (schedule, config, how): every emitted file is compiled; "syntax" only checks it.
EMITTED = [("train", "tiny", "build"), ("train", "tiny32", "build"), ("backward", "tiny", "build"),
           ("backward", "tiny32", "syntax"), ("train", "gpt2", "syntax"), ("backward", "gpt2", "syntax")]
TOLERANCE = {"tiny": 1e-2, "tiny32": 1e-4}  # relative, against the NumPy reference's losses


def _run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, **kwargs)


def _compile(flags: list[str], source: Path, output: Path, syntax_only: bool = False) -> Path:
    command = [GXX, *flags, str(source)] + (["-fsyntax-only"] if syntax_only else ["-o", str(output)])
    done = _run(command)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-4000:]}")
    return output


def _emit(schedule: str, config: str, output: Path) -> Path:
    done = _run([sys.executable, "-m", "cgc", "compile", str(ROOT / "schedules" / f"{schedule}.cg"),
                 "--config", config, "-o", str(output)], cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"cgc compile {schedule}.cg --config {config} failed:\n{done.stderr}")
    return output


# Two steps of a schedule that is a part of a step (backward.cg) on the numpy backend, dumped:
# `cgc run` trains only whole steps, but the library runs any checked schedule.
_PART_DUMP = """
import io, sys
from cgc.training.data import Batches, load_corpus
from cgc.training.loop import train
from cgc.pipeline import analyse, open_run
path, config, folder = sys.argv[1:4]
run = open_run("numpy", analyse([path]), path, config, {}, seed=0)
batches = Batches(load_corpus(None), run.constants["cgBatch"], run.constants["cgContext"], 0)
train(run, batches, 2, out=io.StringIO(), dump=folder)
"""


def _dump(schedule: str, config: str, folder: Path) -> list[float]:
    path = str(ROOT / "schedules" / f"{schedule}.cg")
    if schedule == "train":
        command = [sys.executable, "-m", "cgc", "run", path, "--backend", "numpy", "--config", config,
                   "--steps", "2", "--dump", str(folder)]
    else:
        command = [sys.executable, "-c", _PART_DUMP, path, config, str(folder)]
    done = _run(command, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"cgc run --dump failed:\n{done.stderr}")
    return json.loads((folder / "run.json").read_text())["losses"]


class Builds:
    """Every program the tests need, compiled (and every dump made) once, in parallel."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.pool = ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2))
        self.jobs: dict[str, Future] = {}
        # The longest first: the sanitizer build of the tiny step.
        self._emitted("train", "tiny")
        self.job("sanitized", lambda: _compile(SANITIZE, self.emitted("train", "tiny"),
                                               folder / "train_tiny_sanitized"))
        for name in UNIT_TESTS:
            self.job(f"unit:{name}", lambda name=name: _compile(BUILD, SOURCES / f"{name}.cu", folder / name))
        for schedule, config, how in EMITTED:
            self._emitted(schedule, config)
            self.job(f"program:{schedule}:{config}", lambda s=schedule, c=config, h=how: _compile(
                BUILD, self.emitted(s, c), folder / f"{s}_{c}", syntax_only=h == "syntax"))
        for schedule, config in [("train", "tiny"), ("train", "tiny32"), ("backward", "tiny")]:
            self.job(f"dump:{schedule}:{config}",
                     lambda s=schedule, c=config: _dump(s, c, folder / f"dump_{s}_{c}"))

    def job(self, key: str, work) -> None:
        if key not in self.jobs:
            self.jobs[key] = self.pool.submit(work)

    def _emitted(self, schedule: str, config: str) -> None:
        self.job(f"emit:{schedule}:{config}",
                 lambda: _emit(schedule, config, self.folder / f"{schedule}_{config}.cu"))

    def get(self, key: str):
        return self.jobs[key].result()

    def emitted(self, schedule: str, config: str) -> Path:
        return self.get(f"emit:{schedule}:{config}")

    def unit(self, name: str) -> Path:
        return self.get(f"unit:{name}")

    def program(self, schedule: str, config: str) -> Path:
        return self.get(f"program:{schedule}:{config}")

    def dump(self, schedule: str, config: str) -> tuple[Path, list[float]]:
        return self.folder / f"dump_{schedule}_{config}", self.get(f"dump:{schedule}:{config}")


@pytest.fixture(scope="session")
def builds(tmp_path_factory) -> Builds:
    b = Builds(tmp_path_factory.mktemp("cuda_cpu"))
    yield b
    b.pool.shutdown(wait=True)


def _unit(builds: Builds, name: str, *args: str, threads: int | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    for variable in ("CG_CPU_SCHEDULE_SEED", "CG_CPU_SHARED_FILL", "CG_CPU_ABORT", "CG_CPU_STACK_KIB"):
        env.pop(variable, None)
    if threads is not None:
        env["CG_CPU_THREADS"] = str(threads)
    return _run([str(builds.unit(name)), *args], env=env, timeout=120)


def _passes(done: subprocess.CompletedProcess, name: str) -> None:
    assert done.returncode == 0, f"{name} failed:\n{done.stdout}\n{done.stderr}"
    assert f"{name}: ok" in done.stdout


# ---- barriers --------------------------------------------------------------------------------

def test_block_reduction_needs_its_barrier(builds):
    """A block-wide sum through shared memory is exact with __syncthreads, in thread order and in
    20 shuffled orders; without the barrier, thread 0 reads stale slots in every order."""
    done = _unit(builds, "barrier", threads=2)
    _passes(done, "barrier")
    wrong = [int(m) for m in re.findall(r"without the barrier, seed \d+: (\d+) of 64 blocks wrong", done.stdout)]
    assert wrong and all(w > 0 for w in wrong), done.stdout


def test_divergent_barrier_with_exited_threads_is_a_deadlock(builds):
    done = _unit(builds, "barrier", "exit", threads=2)
    _passes(done, "exit")  # the launch failed with a sticky cudaErrorLaunchFailure
    # The lowest faulting block is reported, whatever the number of workers.
    assert re.search(r"cuda_cpu: kernel divergent_exit, block \(0,0,0\) of grid \(2,1,1\), blockDim \(64,1,1\): "
                     r"deadlock: threads 0-31 wait at __syncthreads \(\S*barrier\.cu:\d+\); "
                     r"threads 32-63 have exited", done.stderr), done.stderr


def test_barriers_at_two_call_sites_are_a_fault(builds):
    done = _unit(builds, "barrier", "sites")
    _passes(done, "sites")
    assert re.search(r"kernel divergent_sites, .*thread 16: divergent barriers: this thread reached "
                     r"__syncthreads \(\S*barrier\.cu:(\d+)\) while threads 0-15 wait at __syncthreads "
                     r"\(\S*barrier\.cu:(\d+)\)", done.stderr), done.stderr


# ---- warps -----------------------------------------------------------------------------------

def test_warp_collectives(builds):
    """Butterfly sums with __shfl_xor_sync (float and int, every lane gets the total), the four
    shuffles with widths, votes, __syncwarp exchanges, exited lanes and a 16-lane warp."""
    _passes(_unit(builds, "warp"), "warp")


def test_warp_barrier_against_block_barrier_is_a_deadlock(builds):
    done = _unit(builds, "warp", "deadlock")
    _passes(done, "deadlock")
    assert re.search(r"kernel warp_deadlock, block \(0,0,0\).*deadlock: threads 0-15 wait at __syncwarp "
                     r"\(\S*warp\.cu:\d+\) with mask 0xffffffff \(warp 0\); threads 16-31, 48-63 wait at "
                     r"__syncthreads", done.stderr), done.stderr


def test_mismatched_collectives_are_a_fault(builds):
    done = _unit(builds, "warp", "mismatch")
    _passes(done, "mismatch")
    assert "mismatched warp collectives on mask 0xffffffff" in done.stderr
    assert "__shfl_xor_sync" in done.stderr and "__shfl_down_sync" in done.stderr


# ---- shared memory ------------------------------------------------------------------------------

def test_shared_memory_is_per_block(builds):
    """Static __shared__ in a device function (and a template) is per block with blocks running
    at once on 4 OS threads; dynamic shared memory is per block, 128-byte aligned, up to 100 KiB
    once the kernel allows it."""
    done = _unit(builds, "shared", threads=4)
    _passes(done, "shared")
    workers = int(re.search(r"on (\d+) OS threads", done.stdout).group(1))
    assert workers >= 2


# ---- WMMA ------------------------------------------------------------------------------------

def test_wmma_tile_product_is_exact(builds):
    _passes(_unit(builds, "wmma"), "wmma")


def test_wmma_misaligned_pointer_is_a_fault(builds):
    done = _unit(builds, "wmma", "misaligned")
    _passes(done, "misaligned")
    assert "wmma::load_matrix_sync" in done.stderr and "is not 32-byte aligned" in done.stderr


# ---- bfloat16 ------------------------------------------------------------------------------------

def test_bfloat16_conversions(builds):
    """2^26 float patterns and the edge cases (ties, subnormals, infinities, NaN, the largest
    finite rounding to infinity) through every conversion path; widening is exact."""
    done = _unit(builds, "bf16")
    _passes(done, "bf16")
    assert "67108864 patterns, 0 wrong" in done.stdout


def test_bfloat16_agrees_with_the_numpy_reference(builds, tmp_path):
    """The emulator's float -> bfloat16 (in a kernel) against cgc.backends.numerics itself."""
    rng = np.random.default_rng(0)
    patterns = np.concatenate([
        rng.integers(0, 2**32, size=1 << 20, dtype=np.uint64).astype(np.uint32),
        np.array([0x00000000, 0x80000000, 0x00000001, 0x00008000, 0x00018000, 0x007FFFFF, 0x3F808000,
                  0x3F818000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F800000, 0xFF800000, 0x7F800001,
                  0x7FC00000, 0xFFC00000, 0xFFFFFFFF], dtype=np.uint32),
    ])
    source, target = tmp_path / "in.bin", tmp_path / "out.bin"
    patterns.tofile(source)
    done = _unit(builds, "bf16", "convert", str(source), str(target))
    assert done.returncode == 0, done.stderr
    got = np.fromfile(target, dtype=np.uint16)
    with np.errstate(invalid="ignore"):
        expected = to_bfloat16_bits(patterns.view(np.float32))
    mismatch = np.flatnonzero(got != expected)
    assert mismatch.size == 0, [(hex(patterns[i]), hex(got[i]), hex(expected[i])) for i in mismatch[:5]]


# ---- cuBLAS and launches ------------------------------------------------------------------------

def test_cublas_gemm_ex(builds):
    """All four operation pairs, bfloat16 and float32 inputs, float32 and bfloat16 outputs,
    padded leading dimensions, alpha and beta, against a straightforward reference."""
    done = _unit(builds, "cublas", threads=2)
    _passes(done, "cublas")
    assert "48 gemm shapes checked" in done.stdout


def test_cublaslt_matmul(builds):
    """cublasLtMatmul as the emitted program calls it: all four operation pairs, C distinct from
    D (a residual), C == D in place, the GELU_AUX and DGELU epilogues with their aux matrix,
    against a plain reference; the reference of a mutated epilogue does not match, and
    arguments cuBLASLt refuses are refused."""
    done = _unit(builds, "cublaslt", threads=2)
    _passes(done, "cublaslt")
    assert "96 cuBLASLt products checked" in done.stdout
    assert "mutated epilogues caught" in done.stdout


def test_atomics_across_blocks_on_two_workers(builds):
    """atomicInc and atomicDec as the CUDA Programming Guide defines them (the wrap at the
    limit included); a ticket a thread over a grid on two workers, each taken once and the
    counter back at zero; the last-block pattern of the layer-norm backward: one last block a
    launch, which sees every block's partial sum, 20 launches in a row."""
    _passes(_unit(builds, "atomics", threads=2), "atomics")


def test_launch_errors(builds):
    """Too much dynamic shared memory (48 KiB default, 227 KiB at most) and oversized blocks fail
    the launch with the error cudaGetLastError returns once; memory calls check arguments."""
    _passes(_unit(builds, "launch"), "launch")


# ---- the emitted files ---------------------------------------------------------------------------

@pytest.mark.parametrize("schedule, config, how", EMITTED)
def test_emitted_file_compiles_unchanged(builds, schedule, config, how):
    builds.program(schedule, config)  # raises with g++'s messages if it does not compile


def _losses(output: str) -> list[float]:
    return [float(x) for x in re.findall(r"^step \d+: loss (\S+)$", output, re.MULTILINE)]


def _run_step(program: Path, dump: Path, steps: int, threads: int | None = None, seed: int | None = None):
    env = dict(os.environ)
    if threads is not None:
        env["CG_CPU_THREADS"] = str(threads)
    if seed is not None:
        env["CG_CPU_SCHEDULE_SEED"] = str(seed)
    start = time.perf_counter()
    done = _run([str(program), str(dump), str(steps)], env=env, timeout=300)
    return done, time.perf_counter() - start


@pytest.mark.parametrize("schedule, config", [("train", "tiny"), ("train", "tiny32"), ("backward", "tiny")])
def test_standalone_program_matches_the_numpy_run(builds, schedule, config):
    dump, reference = builds.dump(schedule, config)
    done, seconds = _run_step(builds.program(schedule, config), dump, 2)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "", done.stderr
    losses = _losses(done.stdout)
    assert len(losses) == 2, done.stdout
    relative = [abs(a - b) / abs(b) for a, b in zip(losses, reference)]
    print(f"\n{schedule}.cg {config}: emulated {losses}, numpy {reference}, relative differences "
          f"{[f'{r:.2e}' for r in relative]}, {seconds:.2f} s for 2 steps")
    assert max(relative) <= TOLERANCE[config], (losses, reference)


def test_results_do_not_depend_on_threads_or_fiber_order(builds):
    """Blocks are independent and no kernel uses atomics: the same bits with 1 or 3 workers and
    with shuffled fiber orders (every barrier in the kernels is where it must be)."""
    dump, _ = builds.dump("train", "tiny")
    program = builds.program("train", "tiny")
    outputs = set()
    for threads, seed in [(1, None), (3, None), (2, 12345)]:
        done, _ = _run_step(program, dump, 2, threads=threads, seed=seed)
        assert done.returncode == 0, done.stderr
        outputs.add(done.stdout)
    assert len(outputs) == 1, outputs


def test_the_separate_runtime_prints_the_header_only_builds_bits(builds):
    """cgc's emulated builds link the runtime, compiled once per flag set, instead of compiling
    it into each program (cgcpu/linkage.h): the tiny step built that way (the emulated
    backend's build, at the same -O1) prints the same bits as the header-only build."""
    from cgc.backends.cuda.emulated import STANDALONE_FLAGS, build
    dump, _ = builds.dump("train", "tiny")
    separate = build(builds.emitted("train", "tiny").read_text(), "standalone-tiny",
                     STANDALONE_FLAGS)
    ours, _ = _run_step(separate, dump, 2)
    theirs, _ = _run_step(builds.program("train", "tiny"), dump, 2)
    assert ours.returncode == 0 and theirs.returncode == 0, (ours.stderr, theirs.stderr)
    assert len(_losses(ours.stdout)) == 2 and ours.stdout == theirs.stdout


@pytest.mark.slow
def test_sanitizer_build_of_the_tiny_step_is_clean(builds):
    """-fsanitize=address,undefined: the tiny step runs with no report (ASan is told about every
    fiber switch), and prints the same losses as the plain build."""
    dump, _ = builds.dump("train", "tiny")
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1", UBSAN_OPTIONS="print_stacktrace=1")
    done = _run([str(builds.get("sanitized")), str(dump), "1"], env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "", done.stderr
    plain, _ = _run_step(builds.program("train", "tiny"), dump, 1)
    assert _losses(done.stdout) == _losses(plain.stdout)
