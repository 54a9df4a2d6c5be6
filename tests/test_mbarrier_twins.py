"""The asynchronous-barrier and bulk-copy twins (cgc/backends/cuda_cpu/include/cgcpu/mbarrier.h:
mbarrier.init, arrive, arrive.expect_tx, try_wait.parity, cp.async.bulk with complete_tx), run
by cgc/backends/cuda_cpu/tests/mbarrier.cu in the producer and consumer ring Hopper kernels
build on them: the sums right through 8 phases of each stage, plain and under racecheck with
nothing reported; a consumer that reads before it waits is a race with the bulk copy; bytes
declared and copied that differ, a copy not a multiple of 16, a barrier never initialised are
each reported as the PTX ISA makes them (undefined there: a fault or a deadlock here). The
emitted file's own versions (templates/common.cuh.j2) are inline PTX for sm_90: a kernel that
uses each of them, built by nvcc with the emitted file's device code, gives the SASS of
Hopper's barrier and copy engine (SYNCS, UBLKCP).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import probe_sass

from cgc.backends.cuda.emulated import (HEADERS, RACECHECK_ENVIRONMENT, RACECHECK_FLAGS,
                                        STANDALONE_FLAGS, build, compiler_missing,
                                        parse_racecheck)

SOURCE = HEADERS.parent / "tests" / "mbarrier.cu"
INCLUDE = (f"-I{SOURCE.parent}",)

pytestmark = pytest.mark.skipif(compiler_missing() is not None, reason=str(compiler_missing()))


@pytest.fixture(scope="module")
def programs():
    text = SOURCE.read_text()
    return {"plain": build(text, "mbarrier", STANDALONE_FLAGS, INCLUDE),
            "racecheck": build(text, "mbarrier-racecheck", RACECHECK_FLAGS, INCLUDE)}


def _run(binary: Path, mode: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CG_CPU_")}
    env.update(RACECHECK_ENVIRONMENT)
    return subprocess.run([str(binary), mode], capture_output=True, text=True, env=env,
                          timeout=120)


def test_the_ring_of_bulk_copies_gives_every_sum_with_nothing_reported(programs):
    for name, binary in programs.items():
        done = _run(binary, "pipeline")
        assert done.returncode == 0 and "pipeline: ok" in done.stdout, done.stdout + done.stderr
        assert "ThreadSanitizer" not in done.stderr and "cuda_cpu" not in done.stderr, done.stderr


def _line(text: str) -> int:
    """The line of mbarrier.cu that holds `text` (once)."""
    found = [i + 1 for i, line in enumerate(SOURCE.read_text().splitlines()) if text in line]
    assert len(found) == 1, text
    return found[0]


def test_a_read_before_the_wait_races_the_bulk_copy(programs):
    done = _run(programs["racecheck"], "early-read")
    assert "early-read: launch cudaSuccess" in done.stdout, done.stdout + done.stderr
    assert done.returncode == 66, done.stderr[-3000:]  # ThreadSanitizer reported
    races = parse_racecheck(done.stderr, programs["racecheck"], "mbarrier-racecheck.cpp")
    assert races, done.stderr[-3000:]
    copy, early = _line("cg_bulk_copy_to_shared(stage[s]"), _line("early = stage[s][thread]")
    assert {race.lines for race in races} == {(copy, early)}, "\n".join(map(str, races))
    assert all(race.memory == "static shared" and "stage" in race.variable for race in races)


@pytest.mark.parametrize("mode,said", [
    ("short-tx", r"deadlock: threads 0-63 wait at mbarrier\.try_wait\.parity \([^()]*mbarrier\.cpp?:\d+\) "
                 r"for phase parity 0 of the barrier 0x[0-9a-f]+ \(0 of 1 arrivals pending, "
                 r"tx-count 16\)"),
    ("over-tx", r"thread 64: cp\.async\.bulk \([^()]*mbarrier\.cpp?:\d+\): the barrier 0x[0-9a-f]+'s phase "
                r"completed 16 bytes more than it expected"),
    ("unaligned", r"thread 64: cp\.async\.bulk \([^()]*mbarrier\.cpp?:\d+\): .* and 24 bytes are not all "
                  r"multiples of 16"),
    ("no-init", r"thread 0: mbarrier\.try_wait\.parity \([^()]*mbarrier\.cpp?:\d+\): the barrier "
                r"0x[0-9a-f]+ was never initialised"),
])
def test_what_the_isa_leaves_undefined_is_reported(programs, mode, said):
    done = _run(programs["plain"], mode)
    assert f"{mode}: launch cudaErrorLaunchFailure" in done.stdout, done.stdout + done.stderr
    assert re.search(said, done.stderr), done.stderr


def test_a_twin_that_hides_the_bulk_copy_from_racecheck_is_caught(tmp_path):
    """The copies made inside the emulator's bookkeeping (hidden from ThreadSanitizer), as a
    first version of the twin made them: the ring still sums right, and the early read no
    longer races anything, so the race test above is what tells the two twins apart."""
    copy = tmp_path / "include"
    shutil.copytree(HEADERS, copy)
    header = copy / "cgcpu" / "mbarrier.h"
    text = header.read_text()
    old = "  mbarrier_make_copies(due);\n  FiberIgnore ignore(*w.current);"
    assert text.count(old) == 1
    header.write_text(text.replace(old, "  FiberIgnore ignore(*w.current);\n  mbarrier_make_copies(due);"))
    binary = tmp_path / "mbarrier"
    subprocess.run(["g++", *RACECHECK_FLAGS, f"-I{copy}", *INCLUDE, "-x", "c++", str(SOURCE), "-o",
                    str(binary)], check=True, capture_output=True)
    done = _run(binary, "pipeline")
    assert "pipeline: ok" in done.stdout, done.stdout + done.stderr
    early = _run(binary, "early-read")
    assert "early-read: launch cudaSuccess" in early.stdout, early.stdout + early.stderr
    assert early.returncode == 0 and "ThreadSanitizer" not in early.stderr, early.stderr[-2000:]


PROBE = """
extern "C" __global__ void cg_probe_ring(float* out, const float* in) {
  __shared__ __align__(16) float stage[256];
  __shared__ __align__(8) unsigned long long full;
  if (threadIdx.x == 0) cg_mbarrier_init(&full, 1);
  __syncthreads();
  if (threadIdx.x == 0) {
    cg_mbarrier_arrive_expect_tx(&full, 1024);
    cg_bulk_copy_to_shared(stage, in, 1024, &full);
  }
  cg_mbarrier_wait(&full, 0);
  out[threadIdx.x] = stage[threadIdx.x];
  __syncthreads();
  if (threadIdx.x == 0) cg_mbarrier_arrive(&full);
}
"""


def test_the_gpu_versions_assemble_to_hopper_barrier_and_copy_instructions():
    probe = probe_sass(PROBE, "cg_probe_ring")
    text = " ".join(instruction.opcode for instruction in probe.instructions)
    for opcode in ("SYNCS.EXCH.64", "SYNCS.ARRIVE.TRANS64", "UBLKCP.S.G",
                   "SYNCS.PHASECHK.TRANS64.TRYWAIT"):
        assert opcode in text, opcode
