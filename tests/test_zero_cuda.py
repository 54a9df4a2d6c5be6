"""ZeRO-1's collectives on the CUDA backends: the all-reduce sum, the reduce-scatter and the
all-gather, each in place over one float32 buffer, a shard each rank (docs/parallel.md).

- The emitted host functions: each form's NCCL call (NCCL_CALLS), the shard's pointer
  arithmetic from the rank the program was compiled for, and the rank guard (the program
  refuses a communicator of another size or rank) only where a collective shards.
- NCCL's CPU twin (cgc/backends/cuda_cpu/include/cgcpu/nccl.h, its C++ test
  cgc/backends/cuda_cpu/tests/nccl.cu): what each collective hands the transport, the values
  it leaves, the overlapping buffers it refuses, what it declares to the shadow; the emitted
  program's guard and its one-rank replay; two MPI ranks through the emulated backend with
  the expected values.
- The CuPy backend through tests/fake_cupy.py: the NcclCommunicator calls, their addresses and
  counts, eager and replayed from the graph.
- Marked slow: schedules/train_zero.cg on two ranks of the emulated backend against the numpy
  backend's two ranks.

The small schedule tests/zero/shards.cg has one collective of each form and no kernel: each
test stores the ranks' values, runs the step and reads what the collectives made of them.
"""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cgc.backends import parallel
from cgc.backends.base import RunFault
from cgc.backends.cuda.emit import NCCL_CALLS, NcclCall, emit_program, rank_mismatch, shards
from cgc.backends.cuda.emulated import (HEADERS, SHADOW_FLAGS, SHADOW_LINK, STANDALONE_FLAGS,
                                        build, compiler_missing, parse_shadow, replay,
                                        standalone)
from cgc.pipeline import analyse, checked, open_run

from conftest import ROOT, SCHEDULES
from test_parallel import MPI_ENVIRONMENT, needs_mpi

SHARDS = str(ROOT / "tests" / "zero" / "shards.cg")
ENTRY = "cgShardStep"
CONFIG = "tiny32"
ZERO = SCHEDULES / "train_zero.cg"
TWIN = HEADERS.parent / "tests" / "nccl.cu"

needs_compiler = pytest.mark.skipif(compiler_missing() is not None,
                                    reason=str(compiler_missing()))


def _checked(rank: int, ranks: int, path: str = SHARDS, entry: str | None = ENTRY):
    return checked(analyse([path]), path, entry, CONFIG, {}, (), (rank, ranks))


def _emitted(rank: int, ranks: int, path: str = SHARDS, entry: str | None = ENTRY) -> str:
    result = _checked(rank, ranks, path, entry)
    return emit_program(result.program, result.plan).text


def _function(text: str, name: str) -> str:
    """The emitted host function `name`, from its signature to its closing brace."""
    match = re.search(rf"^static void {name}\(cudaStream_t stream.*?^}}$", text,
                      re.MULTILINE | re.DOTALL)
    assert match, name
    return match.group(0)


def _open(rank: int, ranks: int, backend: str = "emulated"):
    return open_run(backend, analyse([SHARDS]), SHARDS, CONFIG, {}, 0, ENTRY, ranks=(rank, ranks))


def _data(run) -> dict[str, tuple]:
    """The three collectives' buffers: (storage, count), by image."""
    return {launch.image.name: (launch.pointers[0].view.storage, launch.pointers[0].view.count)
            for launch, _, _ in run.program.launches()}


# ---- the table and the emitted host functions ------------------------------------------

def test_each_collective_form_has_its_nccl_call():
    assert NCCL_CALLS[("allReduce", "average")] == NcclCall("ncclAllReduce", "ncclAvg")
    assert NCCL_CALLS[("allReduce", "sum")] == NcclCall("ncclAllReduce", "ncclSum")
    assert NCCL_CALLS[("reduceScatter", "average")] == \
        NcclCall("ncclReduceScatter", "ncclAvg", shard="receive")
    assert NCCL_CALLS[("allGather", None)] == NcclCall("ncclAllGather", None, shard="send")


def test_the_emitted_collectives_call_nccl_in_place_with_this_ranks_shard():
    text = _emitted(1, 2)
    scatter = _function(text, "cgImageReduceScatter")
    gather = _function(text, "cgImageAllGather")
    summed = _function(text, "cgImageAllReduceSum")
    assert "static const int cg_rank = 1;\nstatic const int cg_ranks = 2;\n" in text
    for function in (scatter, gather):
        assert "const size_t shard = static_cast<size_t>(count) / cg_ranks;" in function
        # the guard first, before the shard is taken
        assert function.index("cg_nccl_expect(where);") < function.index("cg_check(nccl")
    assert "cg_check(ncclReduceScatter(data, data + cg_rank * shard, shard, ncclFloat32, " \
           "ncclAvg, cg_nccl, stream), where);" in scatter
    assert "cg_check(ncclAllGather(data + cg_rank * shard, data, shard, ncclFloat32, " \
           "cg_nccl, stream), where);" in gather
    assert "cg_check(ncclAllReduce(data, data, static_cast<size_t>(count), ncclFloat32, " \
           "ncclSum, cg_nccl, stream), where);" in summed
    assert "cg_nccl_expect" not in summed and "shard" not in summed
    # the guard: once defined, asking NCCL itself, and called by the two shard collectives
    # and by the dump replayer's main after its one-rank communicator
    assert text.count("static void cg_nccl_expect(const char* where) {") == 1
    assert "ncclCommCount(cg_nccl, &ranks)" in text and "ncclCommUserRank(cg_nccl, &rank)" in text
    assert text.count("cg_nccl_expect(where);") == 2
    main = text[text.index("int main(int argc, char** argv) {"):]
    assert main.index("\"the one-rank NCCL communicator\"") < \
        main.index("cg_nccl_expect(\"replaying a dump\");") < main.index("cg_load_entry(")
    one = _emitted(0, 1)
    assert "static const int cg_rank = 0;\nstatic const int cg_ranks = 1;\n" in one


def test_only_a_program_that_shards_has_the_rank_guard():
    """An all-reduce runs on any number of ranks: the data-parallel step's CUDA is as it was
    (tests/test_parallel.py checks its call); and train.cg's names no NCCL at all."""
    for path in (SCHEDULES / "train_parallel.cg", SCHEDULES / "train.cg"):
        result = checked(analyse([str(path)]), str(path), None, CONFIG)
        text = emit_program(result.program, result.plan).text
        assert "cg_nccl_expect" not in text and "cg_rank" not in text, path.name
        assert not shards(result.program)
        assert rank_mismatch(result.program, 3, 4) is None  # runs on any communicator
    program = _checked(1, 2).program
    assert shards(program) and rank_mismatch(program, 1, 2) is None
    assert "compiled for rank 1 of 2 ranks, but runs as rank 0 of 1" in \
        rank_mismatch(program, 0, 1)
    assert rank_mismatch(program, 1, 3) is not None


def _nccl_missing() -> str | None:
    from cgc.backends.cuda.toolchain import ToolchainMissing, nccl_root, nvcc
    try:
        nvcc()
    except ToolchainMissing as error:
        return str(error)
    if nccl_root() is None:
        return "NCCL's header and library are not installed (nvidia-nccl-cu13, the parallel extras)"
    return None


@pytest.mark.skipif(_nccl_missing() is not None, reason=str(_nccl_missing()))
def test_nvcc_builds_a_program_that_shards_against_nccls_own_header(tmp_path):
    """The emitted calls as NCCL's nccl.h declares them (no GPU needed to compile and link)."""
    from cgc.backends.cuda.toolchain import nvcc_build
    source = tmp_path / "shards.cu"
    source.write_text(_emitted(1, 2))
    ok, log = nvcc_build(str(source), str(tmp_path / "shards"))
    assert ok, log


# ---- NCCL's CPU twin: its own C++ test ---------------------------------------------------

@needs_compiler
def test_the_twin_carries_each_collective_whole_and_refuses_overlaps_not_in_place():
    """nccl.cu "values": on rank 1 of 2 with a transport of its own (the other rank holds
    this rank's values plus 2), the reduce-scatter and the all-gather hand the transport the
    whole buffer and leave the expected values, in place and apart; overlapping buffers that
    are not NCCL's in-place form are refused before anything is carried, and said; on one
    rank each is the identity (or a copy)."""
    binary = build(TWIN.read_text(), "nccl", STANDALONE_FLAGS, (f"-I{TWIN.parent}",))
    done = subprocess.run([str(binary), "values"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "values: ok" in done.stdout, done.stdout + done.stderr
    refusals = done.stderr.split("nccl: refusals\n")[1].split("nccl: refusals end\n")[0]
    assert refusals.splitlines() == [
        "cuda_cpu: ncclReduceScatter on rank 1 of 2: the buffers overlap but are not in place "
        "(recvbuff == sendbuff + rank * recvcount): the shard is 0 bytes from the start of "
        "the whole buffer, not 1024",
        "cuda_cpu: ncclReduceScatter on rank 1 of 2: the buffers overlap but are not in place "
        "(recvbuff == sendbuff + rank * recvcount): the shard is 1028 bytes from the start of "
        "the whole buffer, not 1024",
        "cuda_cpu: ncclAllGather on rank 1 of 2: the buffers overlap but are not in place "
        "(sendbuff == recvbuff + rank * sendcount): the shard is 0 bytes from the start of "
        "the whole buffer, not 1024",
        "cuda_cpu: ncclAllGather on rank 1 of 2: the buffers overlap but are not in place "
        "(sendbuff == recvbuff + rank * sendcount): the shard is 1020 bytes from the start of "
        "the whole buffer, not 1024"]


# Each case of nccl.cu "shadow": the one conflict expected ((op, site, access) of the
# collective, then the kernel's; allocation bytes, offset, extent), or None.
SHADOW_EXPECTED = {
    "scatter-read-write": (("ncclReduceScatter", "nccl.cu:reduce-scatter", "read"),
                           ("write_range", "nccl.cu:shard 0 writer", "write"), 3072, 0, 1024),
    "scatter-read-read": None,
    "scatter-write-read": (("ncclReduceScatter", "nccl.cu:reduce-scatter", "write"),
                           ("read_range", "nccl.cu:shard 1 reader", "read"), 3072, 1024, 1024),
    "gather-write-read": (("ncclAllGather", "nccl.cu:all-gather", "write"),
                          ("read_range", "nccl.cu:shard 0 reader", "read"), 3072, 0, 1024),
    "gather-past": None, "ordered": None, "end": None,
}


@needs_compiler
def test_the_twin_declares_the_byte_ranges_each_collective_touches_to_the_shadow():
    """A reduce-scatter reads the whole send buffer and writes only this rank's shard; an
    all-gather writes the whole receive buffer and nothing past it: a kernel beside them on
    another stream conflicts exactly where those ranges say."""
    binary = build(TWIN.read_text(), "nccl-shadow", SHADOW_FLAGS, (f"-I{TWIN.parent}",),
                   SHADOW_LINK)
    done = subprocess.run([str(binary), "shadow"], capture_output=True, text=True,
                          timeout=120, env={**{k: v for k, v in os.environ.items()
                                               if not k.startswith("CG_CPU_")},
                                            "CG_CPU_THREADS": "2"})
    assert done.returncode == 0 and "shadow: ok" in done.stdout, done.stdout + done.stderr
    cases, name, lines = {}, None, []
    for line in done.stderr.splitlines() + ["nccl: case <end>"]:
        if line.startswith("nccl: case "):
            if name is not None:
                cases[name] = parse_shadow("\n".join(lines))
            name, lines = line.split("case ", 1)[1], []
        else:
            lines.append(line)
    assert set(cases) == set(SHADOW_EXPECTED), cases
    for case, expected in SHADOW_EXPECTED.items():
        got = [((c.first.kernel, c.first.site, c.first.access),
                (c.second.kernel, c.second.site, c.second.access), c.size, c.offset, c.bytes)
               for c in cases[case]]
        assert got == ([expected] if expected else []), (case, got)


# ---- the emitted program on the CPU: one rank, the guard, the replay ------------------------

@needs_compiler
def test_on_one_rank_each_collective_leaves_its_buffer_as_it_is():
    run = _open(0, 1)
    before = {name: bytes(run.memory[name]) for name in ("cgBankG", "cgBankP")}
    run.store("cgSums", np.arange(6))
    sums = run.fetch("cgSums").copy()
    run.run_step(None)
    assert run.fetch("cgSums").tobytes() == sums.tobytes()
    for name in ("cgBankG", "cgBankP"):
        assert bytes(run.memory[name]) == before[name], name


@needs_compiler
def test_a_program_for_another_rank_is_refused_before_it_joins():
    run = _open(1, 2)  # the run's communicator: one rank alone
    with pytest.raises(RunFault, match="compiled for rank 1 of 2 ranks, but runs as rank 0 "
                                       "of 1: its reduce-scatters and all-gathers would take "
                                       "another rank's shard"):
        run.run_step(None)


GUARD = """
import ctypes, sys
sys.path.insert(0, {root!r})
from cgc.pipeline import analyse, open_run
run = open_run("emulated", analyse([{path!r}]), {path!r}, {config!r}, {{}}, 0, {entry!r},
               ranks=(1, 2))
identifier = ctypes.create_string_buffer(128)
assert run.library.cg_nccl_unique_id(identifier) == 0
assert run.library.cg_nccl_join(0, 1, identifier) == 0  # past the backend's own check
run.joined = True
run.run_step(None)
print("the step went on")
"""


@needs_compiler
def test_the_emitted_guard_stops_a_shard_collective_on_a_communicator_of_another_size():
    """The host function itself asks NCCL for the communicator's rank and size: a program
    compiled for rank 1 of 2 on a one-rank communicator stops at its reduce-scatter (after
    the all-reduce, which runs on any communicator), saying why."""
    _open(1, 2)  # built here, once
    script = GUARD.format(root=str(ROOT), path=SHARDS, config=CONFIG, entry=ENTRY)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 1 and "the step went on" not in done.stdout, done.stderr
    assert re.search(r"cgImageReduceScatter: this program was compiled for rank 1 of 2 ranks, "
                     r"but its NCCL communicator is rank 0 of 1: its shards would be another "
                     r"rank's", done.stderr), done.stderr


def _dump(folder: Path, program) -> Path:
    """The least a dump needs for the replayer: one step's tokens and learning rate, and the
    parameters before it (zeros)."""
    rows = program.storages[program.roles["ids"]].count
    (folder / "before").mkdir(parents=True)
    np.save(folder / "ids.npy", np.zeros((1, rows), dtype=np.int32))
    np.save(folder / "targets.npy", np.zeros((1, rows), dtype=np.int32))
    np.save(folder / "learning_rates.npy", np.zeros(1, dtype=np.float32))
    for entry in program.entries:
        count = program.storages[f"cgBankP.{entry.name}"].count
        np.save(folder / "before" / f"{entry.name}.npy", np.zeros(count, dtype=np.float32))
    return folder


@needs_compiler
def test_the_standalone_program_replays_on_one_rank_only_if_compiled_for_one(tmp_path):
    alone = _checked(0, 1).program
    status, output, errors = replay(standalone(alone), str(_dump(tmp_path / "one", alone)), 1,
                                    timeout=120)
    assert status == 0 and output.startswith("step 1: loss "), errors
    second = _checked(1, 2).program
    status, output, errors = replay(standalone(second), str(_dump(tmp_path / "two", second)),
                                    1, timeout=120)
    assert status == 1 and "step 1" not in output
    assert "replaying a dump: this program was compiled for rank 1 of 2 ranks, but its NCCL " \
           "communicator is rank 0 of 1" in errors, errors


# ---- two MPI ranks through the emulated backend ----------------------------------------------

RANK = """
import sys
sys.path.insert(0, {root!r})
import numpy as np
from cgc.backends import parallel
from cgc.pipeline import analyse, open_run
communicator = parallel.world()
rank, size = communicator.rank, communicator.size
run = open_run("emulated", analyse([{path!r}]), {path!r}, {config!r}, {{}}, 0, {entry!r},
               ranks=(rank, size))
run.communicator = communicator
gradients = run.memory["cgBankG"].view(np.float32)
parameters = run.memory["cgBankP"].view(np.float32)
index = np.arange(gradients.size, dtype=np.float32)
gradients[:] = index * np.float32(0.25) + np.float32(1000 * rank)
parameters[:] = -index - np.float32(100 * rank)
run.store("cgSums", np.arange(6) + 10 * rank)
run.run_step(None)
np.savez({out!r} + f"/rank-{{rank}}.npz", gradients=gradients, parameters=parameters,
         sums=run.fetch("cgSums"))
"""


@needs_compiler
@needs_mpi
def test_two_ranks_reduce_scatter_and_all_gather_through_the_twin_of_nccl(tmp_path):
    """Rank r starts with gradients g + 1000 r, parameters -i - 100 r, sums s + 10 r: after
    the step its shard of the gradients is their mean over both ranks (the other shard as it
    was), every rank holds each rank's shard of the parameters, and the sums are summed."""
    for rank in (0, 1):  # each rank's program built here, once, not twice at once in ranks
        run = _open(rank, 2)
    # the collectives take the whole of each bank's allocation, which the ranks write
    whole = run.memory["cgBankG"].size // 4
    assert _data(run)["cgImageReduceScatter"][1] == _data(run)["cgImageAllGather"][1] == whole
    script = RANK.format(root=str(ROOT), path=SHARDS, config=CONFIG, entry=ENTRY,
                         out=str(tmp_path))
    done = subprocess.run(["mpirun", "-n", "2", "--oversubscribe", sys.executable, "-c", script],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, **MPI_ENVIRONMENT})
    assert done.returncode == 0, done.stdout + done.stderr
    ranks = [dict(np.load(tmp_path / f"rank-{rank}.npz")) for rank in (0, 1)]
    count = ranks[0]["gradients"].size
    shard = count // 2
    index = np.arange(count, dtype=np.float32)
    start = [index * np.float32(0.25) + np.float32(1000 * rank) for rank in (0, 1)]
    mean = (start[0] + start[1]) / np.float32(2)
    for rank, arrays in enumerate(ranks):
        mine = slice(rank * shard, (rank + 1) * shard)
        other = slice((1 - rank) * shard, (2 - rank) * shard)
        assert arrays["gradients"][mine].tobytes() == mean[mine].tobytes(), rank
        assert arrays["gradients"][other].tobytes() == start[rank][other].tobytes(), rank
        gathered = np.concatenate([-index[:shard], -index[shard:] - np.float32(100)])
        assert arrays["parameters"].tobytes() == gathered.tobytes(), rank
        assert arrays["sums"].tolist() == [2 * s + 10 for s in range(6)], rank


# ---- the CuPy backend through the fake CuPy ----------------------------------------------------

def _fake_cupy_run(monkeypatch, rank: int, ranks: int):
    import fake_cupy
    result = _checked(rank, ranks)
    fake_cupy.install(monkeypatch, result.program.images, result.program.low, {})
    return fake_cupy, _open(rank, ranks, "cupy")


class _RankOf(parallel.SingleRank):
    """A rank of a run of several that never talks to the others: the id it is given is the
    one rank 0 draws (the fake's)."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def broadcast_object(self, value, root: int = 0):
        import fake_cupy
        return fake_cupy.UNIQUE_ID


def test_the_cupy_backend_calls_each_collective_in_place_with_this_ranks_shard(monkeypatch):
    """Rank 1 of 2: the sum, the reduce-scatter into the second half of the gradient bank and
    the all-gather from the second half of the parameter bank, on the run's stream, eagerly
    and from the replayed graph; the fake's other rank holds this rank's values minus 1."""
    fake_cupy, run = _fake_cupy_run(monkeypatch, 1, 2)
    run.communicator = _RankOf(1, 2)
    buffers = _data(run)
    gradients = run.memory["cgBankG"].view(np.float32)
    parameters = run.memory["cgBankP"].view(np.float32)
    count = gradients.size
    shard = count // 2
    assert buffers["cgImageReduceScatter"][1] == count == parameters.size
    gradients[:] = np.arange(count, dtype=np.float32)
    parameters[:] = np.arange(count, dtype=np.float32) * np.float32(2)
    run.store("cgSums", np.arange(6))
    address = {name: run.address(storage) for name, (storage, _) in buffers.items()}
    stream = run.stream.ptr
    summed = address["cgImageAllReduceSum"]
    expected = [("allReduce", summed, summed, 6, 7, 0, stream),
                ("reduceScatter", address["cgImageReduceScatter"],
                 address["cgImageReduceScatter"] + 4 * shard, shard, 7, 4, stream),
                ("allGather", address["cgImageAllGather"] + 4 * shard,
                 address["cgImageAllGather"], shard, 7, None, stream)]
    run.run_step(None)  # eager, then captured
    assert run.graph is not None and fake_cupy.nccl_calls == expected
    run.run_step(None)  # the graph replayed
    assert fake_cupy.nccl_calls == expected * 2 and len(fake_cupy.nccl_communicators) == 1
    index = np.arange(count, dtype=np.float32)
    # twice: rank 1's shard the mean of x and x - 1, each step; rank 0's as it was
    once = (index + (index - np.float32(1))) / np.float32(2)
    twice = (once + (once - np.float32(1))) / np.float32(2)
    assert gradients[shard:].tobytes() == twice[shard:].tobytes()
    assert gradients[:shard].tobytes() == index[:shard].tobytes()
    # rank 0's shard from rank 0 (this rank's minus 1, each step); rank 1's its own
    assert parameters[:shard].tobytes() == (index[:shard] * 2 - 2).tobytes()
    assert parameters[shard:].tobytes() == (index[shard:] * 2).tobytes()
    sums = np.arange(6, dtype=np.float32)
    sums = sums + (sums - 1)
    assert run.fetch("cgSums").tolist() == (sums + (sums - 1)).tolist()


def test_the_cupy_backend_refuses_a_communicator_the_program_was_not_compiled_for(monkeypatch):
    _, run = _fake_cupy_run(monkeypatch, 1, 2)  # the run's communicator: one rank alone
    with pytest.raises(RunFault, match="compiled for rank 1 of 2 ranks, but runs as rank 0 of "
                                       "1"):
        run.run_step(None)
    _, run = _fake_cupy_run(monkeypatch, 0, 1)  # one rank, compiled for one: each the identity
    before = bytes(run.memory["cgBankP"])
    run.run_step(None)
    assert bytes(run.memory["cgBankP"]) == before


# ---- ZeRO-1 training on two ranks: the emulated backend against the numpy backend --------------

TRAINING = """
import io, sys
sys.path.insert(0, {root!r})
import numpy as np
from cgc.backends import parallel
from cgc.training import ranks as training_ranks
from cgc.training.data import Batches, load_corpus
from cgc.training.loop import train
from cgc.pipeline import analyse, open_run
communicator = parallel.world()
rank, size = communicator.rank, communicator.size
run = open_run({backend!r}, analyse([{path!r}]), {path!r}, "tiny32", {{"cgBatch": 1}}, 0,
               ranks=(rank, size))
run.communicator = communicator
batches = training_ranks.ShardedBatches(Batches(load_corpus(None), size, 64, 0), rank, size)
training = train(run, batches, {steps}, out=io.StringIO())
arrays = {{"losses": np.array(training.losses, dtype=np.float64)}}
for name, values in run.bank_values("parameters").items():
    arrays["parameters/" + name] = values
np.savez({out!r} + f"/{backend}-{{rank}}.npz", **arrays)
"""


@pytest.mark.slow
@needs_compiler
@needs_mpi
@pytest.mark.skipif(not ZERO.exists(), reason="schedules/train_zero.cg is not there yet")
def test_zero_training_on_two_emulated_ranks_gives_the_numpy_backends_losses(tmp_path):
    """schedules/train_zero.cg, 3 steps of tiny32 on two ranks of each backend: the emulated
    ranks hold the same parameters bit for bit (the all-gather), and their losses are the
    numpy backend's within 1e-5 relative (the emulated backend's float32 products differ
    from the reference's by a few ulps)."""
    path = str(ZERO)
    for rank in (0, 1):  # each rank's program built here, once
        open_run("emulated", analyse([path]), path, "tiny32", {"cgBatch": 1}, 0,
                 ranks=(rank, 2))
    for backend in ("numpy", "emulated"):
        script = TRAINING.format(root=str(ROOT), backend=backend, path=path, steps=3,
                                 out=str(tmp_path))
        done = subprocess.run(["mpirun", "-n", "2", "--oversubscribe", sys.executable, "-c",
                               script], capture_output=True, text=True, timeout=600,
                              env={**os.environ, **MPI_ENVIRONMENT})
        assert done.returncode == 0, done.stdout + done.stderr
    runs = {(backend, rank): dict(np.load(tmp_path / f"{backend}-{rank}.npz"))
            for backend in ("numpy", "emulated") for rank in (0, 1)}
    for backend in ("numpy", "emulated"):
        first, second = runs[(backend, 0)], runs[(backend, 1)]
        for name in first:
            same = first[name].tobytes() == second[name].tobytes()
            assert same, (backend, name)
    emulated, reference = runs[("emulated", 0)]["losses"], runs[("numpy", 0)]["losses"]
    assert len(emulated) == 3
    np.testing.assert_allclose(emulated, reference, rtol=1e-5)
