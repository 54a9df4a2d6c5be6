"""The emitted CUDA, run on the CPU (the emulated backend, cgc/backends/cuda/emulated.py):
every kernel against its NumPy reference with its outputs poisoned, the whole step against
the NumPy backend, and the standalone program replaying a dump.

Tolerances, and why:
- float32 (tiny32): 1e-4 relative (||a - b|| / ||b||). Both sides compute in float32 but
  not in the same order: the kernels reduce with warp butterflies and per-block partials,
  NumPy with pairwise sums; `__expf`/`exp2f` and `tanhf` are the C library's here, NumPy's
  there. Measured differences are around 1e-6.
- bfloat16 (tiny): 2e-2 relative per kernel output. Outputs stored in bfloat16 carry 8
  bits of mantissa (a relative step of 2^-8 = 0.4%); a value computed in a different order
  can land on the neighbouring bfloat16, and so can everything downstream of it.
- the whole bfloat16 step: the loss within 1e-3 and gradients within 1e-2 relative, the
  tolerances tests/test_reference.py justifies between this project's bfloat16 step and
  PyTorch's.
"""

from __future__ import annotations

import ctypes
import fcntl
import io
import os
import re
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from cgc.backends.cuda.emulated import (COMPILER, FLAGS, HEADERS, OPTIMISED_FLAGS, build,
                                        compiler_missing)
from cgc.training.data import Batches, load_corpus
from cgc.backends.numerics import decode, encode, storage_dtype
from cgc.training.loop import train
from cgc.checking.memory import storage_home
from cgc.core.elements import element_bytes
from cgc.pipeline import analyse, open_run

from conftest import HOPPER, SCHEDULES, seeded_build_cache
from test_reference import BFLOAT16_TOLERANCES, relative

PATH = str(SCHEDULES / "train.cg")
WRITES = ("write", "readwrite", "accumulate")
# An awkward shape: 3 sequences of 128, vocabulary 384, width 96 in 2 heads of 48, 3 layers.
AWKWARD = {"cgBatch": 3, "cgContext": 128, "cgVocab": 384, "cgWidth": 96, "cgHeads": 2,
           "cgLayers": 3}

pytestmark = pytest.mark.skipif(compiler_missing() is not None,
                                reason="needs the host C++ compiler (g++)")


def pair(config: str, overrides=None, seed: int = 0, path: str = PATH):
    frontend = analyse([path])
    return (open_run("emulated", frontend, path, config, overrides or {}, seed),
            open_run("numpy", frontend, path, config, overrides or {}, seed))


def tokens(run, seed: int = 0):
    program = run.program
    return Batches(load_corpus(None), program.role("batch"), program.role("context"),
                   seed).next()


def written_view(memory, program, plan, binding, point, low):
    view = binding.view
    home, start = storage_home(program, plan, view.storage)
    size = element_bytes(view.storage.element, low)
    offset = view.offset.at(point) if hasattr(view.offset, "at") else int(view.offset)
    return home, start + offset * size, (start + (offset + view.count) * size)


# A vocabulary smaller than the loss kernel's block of 128 threads: threads that see no
# logit merge a maximum of -inf (the merge once made that NaN).
SMALL_VOCABULARY = {"cgVocab": 64, "cgThreads": 64}


# The Hopper attention (cgAttentionHopper 1: wgmma, TMA, mbarrier) at heads of 16 (32-byte
# swizzle, one tile a sequence) and 64 (128-byte, three tiles: a stage refilled after its
# consumers freed it); heads of 32 (64-byte) are tests/test_llama.py's grouped case.
HOPPER_HEADS_64 = {**HOPPER, "cgWidth": 128, "cgHeads": 2, "cgContext": 192, "cgBatch": 2}


@pytest.mark.parametrize("config,overrides,tolerance", [
    ("tiny32", None, 1e-4), ("tiny", None, 2e-2), ("tiny32", AWKWARD, 1e-4),
    ("tiny32", SMALL_VOCABULARY, 1e-4), ("tiny", HOPPER, 2e-2),
    ("tiny", HOPPER_HEADS_64, 2e-2)],
    ids=["tiny32", "tiny", "tiny32-awkward", "tiny32-small-vocabulary", "tiny-hopper",
         "tiny-hopper-heads-64"])
def test_every_kernel_matches_its_reference_with_outputs_poisoned(config, overrides,
                                                                   tolerance):
    checked = every_kernel_against_its_reference(PATH, config, overrides, tolerance)
    assert len(checked) >= 18  # every kernel and product image of the step
    # the cuBLASLt products: epilogues (pre included: every written pointer is compared) and
    # the residual read as C, distinct from D (D poisoned first: a copy skipped shows as NaN)
    assert {"cgImageProductGelu", "cgImageProductTransposedGeluBackward",
            "cgImageProductResidual"} <= checked


def every_kernel_against_its_reference(path, config, overrides, tolerance) -> set[str]:
    """Launch by launch through one step of `path`, from the same memory: the emulated kernel
    (its outputs first filled with NaN, so that an element never written fails) against the
    image's NumPy reference function. The images compared."""
    emulated, reference = pair(config, overrides, path=path)
    ids, targets = tokens(reference)
    vocab = reference.program.role("vocab")
    ids, targets = ids % vocab, targets % vocab  # byte tokens, folded into a small vocabulary
    reference.store(reference.program.role("ids"), ids)
    reference.store(reference.program.role("targets"), targets)
    program, plan, low = reference.program, reference.plan, reference.program.low
    machine = reference.machine
    checked = set()
    for (launch, phase, point), call in zip(program.unrolled(), emulated.calls):
        for name, memory in machine.memory.items():
            emulated.memory[name][:memory.size] = memory
        written = [b for b in launch.pointers if launch.image.pointers[b.index].access in WRITES]
        for binding in written:
            in_place = any(other.view.storage == binding.view.storage
                           for other in launch.pointers if other is not binding)
            if launch.image.pointers[binding.index].access == "write" and not in_place:
                home, first, last = written_view(emulated.memory, program, plan, binding,
                                                 point, low)
                emulated.memory[home][first:last] = 0xFF  # NaN in float32 and bfloat16
        call()
        machine.launch(launch, phase, point)
        for binding in written:
            home, first, last = written_view(machine.memory, program, plan, binding, point, low)
            where = f"{launch.image.name} pointer {binding.index} ({binding.view.label})"
            element = binding.view.storage.element
            dtype = storage_dtype(element, low)
            ours = decode(emulated.memory[home][first:last].view(dtype), element, low)
            theirs = decode(machine.memory[home][first:last].view(dtype), element, low)
            if element == "int32":
                assert (ours == theirs).all(), where
                continue
            assert np.isfinite(ours[np.isfinite(theirs)]).all(), f"{where}: not all written"
            if np.linalg.norm(theirs) > 0:
                assert relative(ours, theirs) <= tolerance, (where, relative(ours, theirs))
            else:
                assert np.abs(ours).max() <= tolerance, where
        checked.add(launch.image.name)
    return checked


@pytest.mark.parametrize("config", ["tiny", "tiny32"])
def test_the_classifier_keeps_ties_and_ignored_rows_as_the_reference(config):
    """The classifier on logits made to tie (values on a grid of quarters: each row's
    maximum held by several columns, in several threads and groups) and on targets of
    which some are ignored (the image's ignoreIndex, -1) or out of range: each row's hit
    (the smallest tied column, as np.argmax) and loss exactly as the reference's (the
    loss within float32 rounding), an ignored row's loss and gradient zero, every
    gradient within the bfloat16 or float32 tolerance."""
    emulated, reference = pair(config)
    program, plan, low = reference.program, reference.plan, reference.program.low
    rows, vocab = program.role("batch") * program.role("context"), program.role("vocab")
    rng = np.random.default_rng(5)
    logits = (rng.integers(-8, 9, size=(rows, vocab)) / 4).astype(np.float32)
    logits[:, vocab - 1] = logits.max()  # the last column ties the top of every row
    targets = rng.integers(0, vocab, size=rows).astype(np.int32)
    targets[::7] = -1                    # ignored
    targets[3::11] = vocab + 2           # out of range: not counted either
    tied = np.flatnonzero(logits[0] == logits[0].max())
    targets[0], targets[1] = tied[0], tied[-1]  # the first tied column hits; the last not
    launches = [(launch, phase, point, call) for (launch, phase, point), call
                in zip(program.unrolled(), emulated.calls)]
    for launch, phase, point, call in launches:
        if launch.image.name != "cgImageClassifier":
            continue
        for binding in launch.pointers:
            name = launch.image.pointers[binding.index].name
            values = {"logits": logits, "targets": targets}.get(name)
            if values is None:
                continue
            for memory in (emulated.memory, reference.machine.memory):
                home, first, last = written_view(memory, program, plan, binding, point, low)
                memory[home][first:last] = encode(values.ravel(), binding.view.storage.element,
                                                  low).view(np.uint8)
        call()
        reference.machine.launch(launch, phase, point)
        got, want = {}, {}
        for binding in launch.pointers:
            name = launch.image.pointers[binding.index].name
            element = binding.view.storage.element
            for memory, into in ((emulated.memory, got), (reference.machine.memory, want)):
                home, first, last = written_view(memory, program, plan, binding, point, low)
                into[name] = decode(memory[home][first:last].view(storage_dtype(element, low)),
                                    element, low)
        counted = (targets >= 0) & (targets < vocab)
        assert np.array_equal(got["correct"], want["correct"])
        assert got["correct"][0] == 1 and got["correct"][1] == 0
        assert np.allclose(got["loss"], want["loss"], rtol=1e-5, atol=1e-5)
        assert (got["loss"][~counted] == 0).all()
        gradient, expected = got["logits"].reshape(rows, vocab), want["logits"].reshape(rows, vocab)
        assert (gradient[~counted] == 0).all()
        tolerance = 2e-2 if config == "tiny" else 1e-4
        assert relative(gradient, expected) <= tolerance, relative(gradient, expected)
        return
    raise AssertionError("the step launches no cgImageClassifier")


def test_the_float32_step_matches_the_numpy_backend():
    one_float32_step_matches_the_numpy_backend()


def one_float32_step_matches_the_numpy_backend(path: str = PATH):
    """One tiny32 step of `path`: the loss, and every gradient, parameter and optimizer
    state, within 1e-4 of the NumPy machine's."""
    emulated, reference = pair("tiny32", seed=3, path=path)
    ids, targets = tokens(reference, 3)
    ours, theirs = emulated.step(ids, targets).loss, reference.step(ids, targets).loss
    assert abs(ours - theirs) <= 1e-4 * theirs
    for role in ("gradients", "parameters", "state"):
        mine, expected = emulated.bank_values(role), reference.bank_values(role)
        for name, values in expected.items():
            if np.linalg.norm(values) > 0:
                assert relative(mine[name], values) <= 1e-4, (role, name)


def test_ten_float32_steps_follow_the_numpy_backend():
    emulated, reference = pair("tiny32", seed=1)
    losses = []
    for run in (emulated, reference):
        losses.append(train(run, Batches(load_corpus(None), 4, 64, 1), 10,
                            out=io.StringIO()).losses)
    assert relative(np.array(losses[0]), np.array(losses[1])) <= 1e-4
    assert losses[0][-1] < losses[0][0]


@pytest.mark.parametrize("overrides", [None, HOPPER], ids=["mma.sync", "hopper"])
def test_the_bfloat16_step_matches_the_numpy_backend(overrides):
    emulated, reference = pair("tiny", overrides, seed=2)
    ids, targets = tokens(reference, 2)
    ours, theirs = emulated.step(ids, targets).loss, reference.step(ids, targets).loss
    assert abs(ours - theirs) <= BFLOAT16_TOLERANCES["loss"] * theirs
    mine, expected = emulated.bank_values("gradients"), reference.bank_values("gradients")
    for name, values in expected.items():
        assert relative(mine[name], values) <= BFLOAT16_TOLERANCES["gradient"], name


def test_the_host_program_and_launch_by_launch_agree_bit_for_bit():
    """cg_step (the emitted host program) and the backend's own launches of the same
    kernels are the same computation."""
    first, second = pair("tiny")[0], pair("tiny")[0]
    second.through_host_program = False
    ids, targets = tokens(first)
    assert first.step(ids, targets).loss == second.step(ids, targets).loss
    for name in first.memory:
        assert (first.memory[name] == second.memory[name]).all(), name


@pytest.mark.parametrize("config,tolerance", [("tiny32", 1e-5), ("tiny", 1e-5)])
def test_the_standalone_program_replays_a_dump(config, tolerance, tmp_path):
    """The emitted file's own main, built for the host, replays a dumped run and prints the
    losses the emulated backend computed. Built at -O2 (OPTIMISED_FLAGS): the suite's one
    step built with the optimiser's strict-aliasing and overflow assumptions, which the
    other builds (-O1) leave out."""
    emulated = open_run("emulated", analyse([PATH]), PATH, config, {}, 0)
    result = train(emulated, Batches(load_corpus(None), 4, 64, 0), 2, out=io.StringIO(),
                   dump=str(tmp_path / "dump"))
    program = build(emulated.emitted.text, f"standalone-{config}",
                    flags=OPTIMISED_FLAGS)
    printed = subprocess.run([str(program), str(tmp_path / "dump"), "2"], capture_output=True,
                             text=True, check=True, timeout=300).stdout
    losses = [float(x) for x in re.findall(r"loss (\S+)", printed)]
    assert len(losses) == 2
    for ours, theirs in zip(losses, result.losses):
        assert abs(ours - theirs) <= tolerance * theirs, (losses, result.losses)


def test_the_build_is_cached_by_content(tmp_path, monkeypatch):
    seeded_build_cache(tmp_path, monkeypatch)
    source = '#include <cuda_runtime.h>\nextern "C" int answer() { return 42; }\n'
    first = build(source, "probe")
    built = first.stat()
    assert build(source, "probe") == first
    again = first.stat()  # the same file, not a copy built again and renamed over it
    assert (again.st_ino, again.st_mtime_ns) == (built.st_ino, built.st_mtime_ns)
    assert build(source + "// changed\n", "probe") != first
    assert HEADERS.is_dir() and COMPILER and "-shared" in FLAGS


def test_one_builder_at_a_time_makes_a_file_of_the_cache(tmp_path, monkeypatch):
    """Threads (or processes: the lock is a file's) that want the same new file of the cache at
    once: one compiles it, the others wait and load it; a file of another name is built beside
    them, not after them; a builder that holds the lock too long is not waited for forever."""
    import threading
    from cgc.backends.cuda import emulated
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    compiles, b_started, started = [], threading.Event(), threading.Barrier(5)

    def compile_to(built, scratch):
        if "/.b.o." in built:
            b_started.set()
        else:  # a.o's build lasts until b.o's has begun
            assert b_started.wait(timeout=60)
            time.sleep(0.2)
        Path(built).write_bytes(b"built")
        compiles.append(built)
        return subprocess.CompletedProcess([], 0, "", "")

    def want(name):
        started.wait()
        found.append(emulated._cached(name, compile_to, "a test file"))

    found = []
    threads = [threading.Thread(target=want, args=(name,)) for name in ["a.o"] * 4 + ["b.o"]]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(compiles) == 2  # a.o once, b.o beside it (a.o's build waited for b.o's)
    assert sorted(path.name for path in set(found)) == ["a.o", "b.o"] and len(found) == 5
    # a lock held by a stuck builder: the wait gives up after its patience, and builds
    lock = tmp_path / "held.lock"
    holder = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(holder, fcntl.LOCK_EX)
    began = time.monotonic()
    with emulated._one_builder(lock, patience=0.5):
        waited = time.monotonic() - began
    os.close(holder)
    assert 0.5 <= waited < 5

# A program of the runtime's functions: allocation, copies, a stream, a kernel launch.
_RUNTIME_PROBE = """#include <cuda_runtime.h>
__global__ void twice(int* x) { x[threadIdx.x] *= 2; }
extern "C" int probe() {
  int host[32], *device = nullptr;
  for (int i = 0; i < 32; ++i) host[i] = i;
  cudaStream_t stream;
  if (cudaStreamCreate(&stream) || cudaMalloc(&device, sizeof host)) return -1;
  cudaMemcpy(device, host, sizeof host, cudaMemcpyHostToDevice);
  CG_LAUNCH(twice, dim3(1), dim3(32), 0, stream)(device);
  cudaStreamSynchronize(stream);
  cudaMemcpy(host, device, sizeof host, cudaMemcpyDeviceToHost);
  cudaFree(device);
  cudaStreamDestroy(stream);
  int sum = 0;
  for (int i = 0; i < 32; ++i) sum += host[i];
  return cudaGetLastError() == cudaSuccess ? sum : -2;
}
"""
# Functions of the runtime the probe calls, directly or through CG_LAUNCH's template.
_RUNTIME_FUNCTIONS = ("cudaMalloc(void**, unsigned long)", "cudaStreamSynchronize(CUstream_st*)",
                      "cudaStreamCreateWithFlags(", "cgcpu::detail::launch(")


def _defined(path: Path) -> dict[str, str]:
    """The runtime's functions in an object or library, each with nm's letter for it."""
    listing = subprocess.run(["nm", "-C", str(path)], capture_output=True, text=True,
                             check=True).stdout
    found = {}
    for line in listing.splitlines():
        letter, name = line[17:18], line[19:]
        for function in _RUNTIME_FUNCTIONS:
            if name.startswith(function) and letter in "TWU":  # code, not its statics
                found[function] = letter
    return found


def test_the_runtime_is_linked_not_compiled_into_each_program(tmp_path):
    """The emulator's host runtime is compiled once per flag set (runtime_object) and linked
    into each program (cgcpu/linkage.h): the program's own compile leaves the runtime's
    functions undefined, where the header-only compile of the same source compiles each (a
    weak copy, or inlined); the library holds the object's one definition, and runs."""
    from cgc.backends.cuda.emulated import runtime_object
    source = tmp_path / "probe.cpp"
    source.write_text(_RUNTIME_PROBE)
    objects = {}
    for mode, define in [("separate", ["-DCGCPU_SEPARATE_RUNTIME"]), ("header-only", [])]:
        objects[mode] = tmp_path / f"{mode}.o"
        subprocess.run([COMPILER, *FLAGS, *define, f"-I{HEADERS}", "-c", str(source), "-o",
                        str(objects[mode])], check=True)
    assert _defined(objects["separate"]) == dict.fromkeys(_RUNTIME_FUNCTIONS, "U")
    # header-only: each compiled here, as a weak copy or inlined into its caller
    assert set(_defined(objects["header-only"]).values()) == {"W"}
    assert objects["separate"].stat().st_size * 2 < objects["header-only"].stat().st_size
    assert _defined(runtime_object(FLAGS)) == dict.fromkeys(_RUNTIME_FUNCTIONS, "T")
    library = build(_RUNTIME_PROBE, "probe")
    assert _defined(library) == dict.fromkeys(_RUNTIME_FUNCTIONS, "T")
    assert ctypes.CDLL(str(library)).probe() == 2 * sum(range(32))
    # The runtime's state stays one per process however many libraries a process loads (each
    # run loads its own copy), as in the header-only build: its holders are inline functions,
    # so their statics are STB_GNU_UNIQUE ("u"), never the copy's own.
    listing = subprocess.run(["nm", "-C", str(library)], capture_output=True, text=True,
                             check=True).stdout
    statics = {line[19:]: line[17:18] for line in listing.splitlines()
               if re.match(r"(guard variable for )?cgcpu::.*\)::\w+$", line[19:])
               and line[17:18] not in "TtWwU"}  # data, not a lambda's code
    assert "cgcpu::detail::pool()::instance" in statics and len(statics) >= 20
    assert all(letter == "u" for letter in statics.values()), statics


def test_the_sorted_scatter_is_right_for_a_block_narrower_than_its_window(tmp_path):
    """cgImageScatterSorted looks a run's rows up 32 at a time; a block of 16 threads (an
    image a user may declare) fills the window in two turns. The step's runs (52 and 45 rows
    of the space and the letter e) refill the window. Filling only the first 16 entries once
    made the embedding's gradient wrong (the step-1 norm 3.41 against 2.02)."""
    import shutil
    folder = tmp_path / "schedules"
    shutil.copytree(SCHEDULES, folder)
    images = folder / "images.cg"
    text = images.read_text()
    assert "image cgImageScatterSorted (block 128 1 1)" in text
    images.write_text(text.replace("image cgImageScatterSorted (block 128 1 1)",
                                   "image cgImageScatterSorted (block 16 1 1)"))
    path = str(folder / "train.cg")
    frontend = analyse([path])
    emulated = open_run("emulated", frontend, path, "tiny32", {}, 0)
    reference = open_run("numpy", frontend, path, "tiny32", {}, 0)
    ids, targets = tokens(reference)
    emulated.step(ids, targets)
    reference.step(ids, targets)
    mine, expected = emulated.bank_values("gradients"), reference.bank_values("gradients")
    for name, values in expected.items():
        assert relative(mine[name], values) <= 1e-4, name
