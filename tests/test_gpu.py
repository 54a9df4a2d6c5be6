"""On an NVIDIA GPU (marker gpu; skipped where there is none): every kernel against its
NumPy reference, the whole step against the reference machine and the PyTorch model,
graph replay against eager launches, and the standalone program against the CuPy run."""

from __future__ import annotations

import io
import os
import re
import subprocess

import numpy as np
import pytest

from cgc.training.data import Batches, load_corpus
from cgc.frontend.api import analyse
from cgc.core.ir import View
from cgc.checking.memory import element_bytes, storage_home
from cgc.backends.numerics import decode, storage_dtype
from cgc.training.loop import train
from cgc.pipeline import open_run
from cgc.backends.cuda.emit import emit_program
from cgc.backends.cuda.toolchain import nvcc_build

from conftest import HOPPER, SCHEDULES
from test_reference import BFLOAT16_TOLERANCES, relative
from torch_model import Gpt

pytestmark = pytest.mark.gpu
PATH = str(SCHEDULES / "train.cg")
WRITES = ("write", "readwrite", "accumulate")


def runs(config: str, seed: int = 0, overrides: dict | None = None):
    frontend = analyse([PATH])
    return (open_run("cupy", frontend, PATH, config, overrides or {}, seed),
            open_run("numpy", frontend, PATH, config, overrides or {}, seed))


def tokens(run, seed: int = 0):
    program = run.program
    return Batches(load_corpus(None), program.role("batch"), program.role("context"),
                   seed).next()


def to_gpu(gpu, machine) -> None:
    for name, host in machine.memory.items():
        gpu.memory[name][:host.size].set(host)


def view_values(memory: dict, program, plan, view: View, point, low) -> np.ndarray:
    home, start = storage_home(program, plan, view.storage)
    size = element_bytes(view.storage.element, low)
    offset = view.offset.at(point) if hasattr(view.offset, "at") else int(view.offset)
    first = start + offset * size
    raw = memory[home][first:first + view.count * size]
    raw = raw.get() if hasattr(raw, "get") else raw
    return decode(raw.view(storage_dtype(view.storage.element, low)), view.storage.element, low)


@pytest.mark.parametrize("config,overrides,tolerance", [
    ("tiny32", None, 1e-4), ("tiny", None, 2e-2),
    ("tiny", HOPPER, 2e-2),  # the attention forward on wgmma, TMA and mbarrier (sm_90a)
    ("tiny", {**HOPPER, "cgWidth": 128, "cgHeads": 2, "cgContext": 192, "cgBatch": 2}, 2e-2)],
    ids=["tiny32", "tiny", "tiny-hopper", "tiny-hopper-heads-64"])
def test_every_kernel_matches_its_reference_with_outputs_poisoned(config, overrides, tolerance):
    gpu, cpu = runs(config, overrides=overrides)
    ids, targets = tokens(cpu)
    cpu.store(cpu.program.role("ids"), ids)
    cpu.store(cpu.program.role("targets"), targets)
    program, plan, program_low = cpu.program, cpu.plan, cpu.program.low
    for (launch, phase, point), call in zip(program.unrolled(), gpu.calls):
        to_gpu(gpu, cpu.machine)
        written = [b for b in launch.pointers if launch.image.pointers[b.index].access in WRITES]
        for binding in written:
            if launch.image.pointers[binding.index].access == "write":  # poison what is written
                home, start = storage_home(program, plan, binding.view.storage)
                size = element_bytes(binding.view.storage.element, program_low)
                offset = binding.view.offset.at(point) if hasattr(binding.view.offset, "at") \
                    else int(binding.view.offset)
                gpu.memory[home][start + offset * size:
                                 start + (offset + binding.view.count) * size] = 0xFF
        with gpu.stream:
            call()
        gpu.stream.synchronize()
        cpu.machine.launch(launch, phase, point)
        for binding in written:
            ours = view_values(gpu.memory, program, plan, binding.view, point, program_low)
            expected = view_values(cpu.machine.memory, program, plan, binding.view, point,
                                   program_low)
            where = f"{launch.image.name} pointer {binding.index} ({binding.view.label})"
            assert np.isfinite(ours[np.isfinite(expected)]).all(), f"{where}: not all written"
            if np.linalg.norm(expected) > 0:
                assert relative(ours, expected) <= tolerance, where
            else:
                assert np.abs(ours).max() <= tolerance, where


def test_the_float32_step_matches_the_reference_machine():
    gpu, cpu = runs("tiny32")
    ids, targets = tokens(cpu)
    gpu_loss = gpu.step(ids, targets).loss  # the first step runs eagerly
    cpu_loss = cpu.step(ids, targets).loss
    assert abs(gpu_loss - cpu_loss) / cpu_loss <= 1e-4
    for role in ("gradients", "parameters", "state"):
        ours, theirs = gpu.bank_values(role), cpu.bank_values(role)
        for name in theirs:
            if np.linalg.norm(theirs[name]) > 0:
                assert relative(ours[name], theirs[name]) <= 1e-4, (role, name)


def test_the_bfloat16_step_matches_the_pytorch_model_on_the_gpu():
    gpu, cpu = runs("tiny")
    before = gpu.bank_values("parameters")
    ids, targets = tokens(cpu)
    loss = gpu.step(ids, targets).loss
    model = Gpt(gpu.program.constants, before, device="cuda")
    expected = model.loss(ids, targets)
    expected.backward()
    assert abs(loss - float(expected)) / float(expected) <= BFLOAT16_TOLERANCES["loss"]
    ours = gpu.bank_values("gradients")
    for name, gradient in model.flat(gradients=True).items():
        assert relative(ours[name], gradient) <= BFLOAT16_TOLERANCES["gradient"], name


def test_graph_replay_equals_eager_launches_bit_for_bit():
    frontend = analyse([PATH])
    eager, graphed = (open_run("cupy", frontend, PATH, "tiny", {}, 0) for _ in range(2))
    eager.replay = False  # every step launch by launch
    ids, targets = tokens(eager)
    warm = tokens(eager, seed=1)
    for run in (eager, graphed):  # the same first step on both, eagerly; graphed captures it
        run.step(*warm)
    assert graphed.graph is not None and eager.graph is None
    # capture records without running: both now take the same second step
    eager.step(ids, targets)
    graphed.step(ids, targets)
    for name in eager.memory:
        assert (eager.memory[name] == graphed.memory[name]).all(), name


def test_the_branches_on_streams_give_the_bits_of_the_serial_step(tmp_path):
    """The step's concurrent branches on streams of their own, captured as a graph's
    parallel branches and replayed, against the same step with every cgConcurrently written
    cgThen: the same bits in every bank (tests/test_concurrency.py does it on the CPU)."""
    import shutil
    for path in SCHEDULES.glob("*.cg"):
        shutil.copy(path, tmp_path / path.name)
        (tmp_path / path.name).write_text(path.read_text().replace("(cgConcurrently", "(cgThen"))
    serial_path = str(tmp_path / "train.cg")
    concurrent = open_run("cupy", analyse([PATH]), PATH, "tiny", {}, 0)
    serial = open_run("cupy", analyse([serial_path]), serial_path, "tiny", {}, 0)
    assert len(concurrent.streams) > 1 and len(serial.streams) == 1
    for seed in range(3):  # eager, captured, replayed
        batch = tokens(concurrent, seed=seed)
        assert concurrent.step(*batch).loss == serial.step(*batch).loss, seed
    for role in ("parameters", "gradients", "state"):
        for name, values in concurrent.bank_values(role).items():
            assert values.tobytes() == serial.bank_values(role)[name].tobytes(), (role, name)


def test_the_standalone_program_prints_the_losses_of_the_cupy_run(tmp_path):
    frontend = analyse([PATH])
    reference = open_run("numpy", frontend, PATH, "tiny", {}, 0)
    batches = Batches(load_corpus(None), 4, 64, 0)
    train(reference, batches, 2, dump=str(tmp_path / "dump"), out=io.StringIO())
    gpu = open_run("cupy", frontend, PATH, "tiny", {}, 0)
    batches = Batches(load_corpus(None), 4, 64, 0)
    gpu.replay = False
    losses = [gpu.step(*batches.next()).loss for _ in range(2)]
    source = tmp_path / "train.cu"
    source.write_text(gpu.emitted.text)
    ok, log = nvcc_build(str(source), str(tmp_path / "train"))
    assert ok, log
    result = subprocess.run([str(tmp_path / "train"), str(tmp_path / "dump"), "2"],
                            capture_output=True, text=True, check=True,
                            env={**os.environ})
    printed = [float(x) for x in re.findall(r"loss (\S+)", result.stdout)]
    assert len(printed) == 2
    for ours, theirs in zip(printed, losses):
        assert abs(ours - theirs) / theirs <= 1e-5


def test_the_api_gives_torch_the_gpus_parameters_without_a_copy():
    """cgc.open_training on the cupy backend: parameters() are CuPy arrays over the run's
    own device memory, which torch.from_dlpack takes as they are (the same device pointer);
    a write through torch is what the next step trains on."""
    import cupy
    import torch

    import cgc
    run = cgc.open_training(str(SCHEDULES / "train.cg"), "cupy", steps=2, config="tiny32")
    weights = run.parameters()["cgQkvWeight"]
    assert isinstance(weights, cupy.ndarray) and weights.dtype == np.float32
    tensor = torch.from_dlpack(weights)
    assert tensor.is_cuda and tensor.data_ptr() == weights.data.ptr
    tensor.mul_(0.5)
    torch.cuda.synchronize()
    assert np.array_equal(run.run.fetch("cgBankP.cgQkvWeight"), cupy.asnumpy(weights))
    record = run.step()
    assert np.isfinite(record.loss)
    gradient = torch.from_dlpack(run.gradients()["cgQkvWeight"])
    assert float(gradient.abs().max()) > 0


def test_the_shard_collectives_run_on_nccls_own_one_rank_communicator(tmp_path):
    """tests/zero/shards.cg (an all-reduce sum, a reduce-scatter and an all-gather, no kernel)
    on the CuPy backend with NCCL's own one-rank communicator: every buffer as it was, eagerly
    and replayed from the graph; compiled for rank 1 of 2, refused. The standalone program
    (nvcc, NCCL's libnccl) replays on one rank only the program compiled for one."""
    from cgc.backends.base import RunFault
    from cgc.pipeline import checked
    from test_zero_cuda import ENTRY, SHARDS, _dump
    frontend = analyse([SHARDS])
    run = open_run("cupy", frontend, SHARDS, "tiny32", {}, 0, ENTRY, ranks=(0, 1))
    run.store("cgSums", np.arange(6))
    before = {name: run.memory[name].get() for name in ("cgBankG", "cgBankP")}
    for _ in range(3):  # eager, captured, replayed
        run.run_step(None)
    run.stream.synchronize()
    for name, values in before.items():
        assert run.memory[name].get().tobytes() == values.tobytes(), name
    assert run.fetch("cgSums").tolist() == list(range(6))
    other = open_run("cupy", frontend, SHARDS, "tiny32", {}, 0, ENTRY, ranks=(1, 2))
    with pytest.raises(RunFault, match="compiled for rank 1 of 2 ranks, but runs as rank 0 "
                                       "of 1"):
        other.run_step(None)
    for (rank, ranks), status in (((0, 1), 0), ((1, 2), 1)):
        result = checked(frontend, SHARDS, ENTRY, "tiny32", {}, (), (rank, ranks))
        source = tmp_path / f"shards-{rank}-{ranks}.cu"
        source.write_text(emit_program(result.program, result.plan).text)
        ok, log = nvcc_build(str(source), str(source.with_suffix("")))
        assert ok, log
        dump = _dump(tmp_path / f"dump-{rank}-{ranks}", result.program)
        done = subprocess.run([str(source.with_suffix("")), str(dump), "1"], capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == status, done.stderr
        if status:
            assert "replaying a dump: this program was compiled for rank 1 of 2 ranks" in \
                done.stderr, done.stderr
        else:
            assert done.stdout.startswith("step 1: loss "), done.stdout
