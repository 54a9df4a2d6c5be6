"""Checkpoints (cgc/training/checkpoint.py, docs/checkpoint-format.md): a resumed run is the
run that never stopped, byte for byte; a killed writer never leaves a checkpoint that does
not load; a checkpoint of another run, or a broken file, is a one-line error."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

from cgc.training import checkpoint
from cgc.cli import main

from conftest import ROOT, SCHEDULES

TRAIN = str(SCHEDULES / "train.cg")
# A warm-up and a cosine decay, so that a resumed run must also take up the learning-rate
# schedule where it was (a rate recomputed from step 1 would change every later loss).
RATES = ["--lr", "0.004", "--lr-min", "0.0004", "--warmup", "2", "--decay-steps", "6"]


def cgc(capsys, *arguments) -> tuple[int, str, str]:
    status = main([str(a) for a in arguments])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


STEP = re.compile(r"^step +(\d+)/\d+ \[[#.]+\] (loss \S+  norm \S+  lr \S+)  ")


def step_lines(out: str) -> list[tuple[int, str]]:
    """Each printed step's number, loss, gradient norm and learning rate, as printed (not its
    timings, which differ run to run, nor its progress bar, drawn against --steps)."""
    return [(int(m.group(1)), m.group(2)) for m in map(STEP.match, out.splitlines()) if m]


def final(folder) -> dict[str, np.ndarray]:
    values, _ = checkpoint.load(checkpoint.latest(str(folder)))
    return values


@pytest.mark.parametrize("backend, steps, stop", [("numpy", 6, 2), ("emulated", 3, 1)])
def test_a_resumed_run_is_bit_identical_to_one_that_never_stopped(backend, steps, stop,
                                                                  tmp_path, capsys):
    """N steps straight equal k steps, a stop, a resume and N - k steps: every printed loss,
    gradient norm and learning rate, and every byte of the final parameters, moments, 16-bit
    copies and step counter. (Restoring no step counter, or restarting the windows or the
    rate schedule from step 1, makes this fail: the counter changes the bias correction, the
    windows the losses, the schedule the rates.)"""
    common = [TRAIN, "--backend", backend, *RATES]
    status, straight, _ = cgc(capsys, "run", *common, "--steps", steps,
                              "--checkpoint-dir", tmp_path / "straight")
    assert status == 0
    status, first, _ = cgc(capsys, "run", *common, "--steps", stop,
                           "--checkpoint-dir", tmp_path / "parts")
    assert status == 0
    status, second, err = cgc(capsys, "run", TRAIN, "--backend", backend, "--steps", steps,
                              "--resume", tmp_path / "parts",
                              "--checkpoint-dir", tmp_path / "parts")
    assert status == 0, err
    assert f"at step {stop}" in err
    assert step_lines(first) + step_lines(second) == step_lines(straight)
    assert len(step_lines(straight)) == steps
    assert second.splitlines()[-1] == straight.splitlines()[-1]  # the summary: first -> last
    ours, theirs = final(tmp_path / "parts"), final(tmp_path / "straight")
    assert sorted(ours) == sorted(theirs)
    for label in theirs:
        assert np.array_equal(ours[label].view(np.uint8), theirs[label].view(np.uint8)), label


def test_a_checkpoint_keeps_every_bank_of_the_program_and_the_step_counter(tmp_path, capsys):
    assert cgc(capsys, "run", TRAIN, "--backend", "numpy", "--steps", 2,
               "--checkpoint-dir", tmp_path)[0] == 0
    values, manifest = checkpoint.load(checkpoint.latest(str(tmp_path)))
    banks = {label.split(".")[0] for label in values if "." in label}
    assert banks == {"cgBankP", "cgBankM", "cgBankV", "cgBankHalf"}  # not the gradients
    assert values["cgOptimizerStep"].tolist() == [2]
    assert values["cgBankHalf.cgQkvWeight"].dtype.name == "bfloat16"  # through ml_dtypes
    # the 16-bit copies are the parameters rounded, as the optimizer writes them
    np.testing.assert_array_equal(
        values["cgBankHalf.cgQkvWeight"].astype(np.float32),
        values["cgBankP.cgQkvWeight"].astype(values["cgBankHalf.cgQkvWeight"].dtype)
        .astype(np.float32))
    assert manifest["format"] == checkpoint.FORMAT and manifest["step"] == 2
    identity = manifest["identity"]
    assert identity["config"] == "tiny" and identity["seed"] == 0
    assert set(identity["schedule"]["sources"]) >= {"train.cg", "model.cg", "optimizer.cg"}
    assert identity["constants"]["cgWidth"] == 64
    assert manifest["data_position"]["bit_generator"] == "PCG64"


# ---- a killed writer ---------------------------------------------------------------------

_KILLED_WRITER = """
import os, signal, sys
sys.path.insert(0, {root!r})
from cgc import outputs
from cgc.cli import main
saves = []
original = outputs._write_all
def write(handle, data):
    saves.append(1)
    if len(saves) == 2:  # the second checkpoint: half of it, then kill -9
        handle.write(data[:len(data) // 2])
        handle.flush()
        os.fsync(handle.fileno())
        os.kill(os.getpid(), signal.SIGKILL)
    original(handle, data)
outputs._write_all = write
main({arguments!r})
"""


def test_kill_9_during_a_write_leaves_the_previous_checkpoint_loadable(tmp_path, capsys):
    """The writer is killed (SIGKILL) half way through the second checkpoint: the folder's
    latest checkpoint is still the first one, whole, and a run resumed from it ends as the
    run that was never killed. (Written straight to its name, the half file would be the
    latest and fail to load: this test fails if save() stops going through a temporary file.)"""
    folder = tmp_path / "run"
    arguments = ["run", TRAIN, "--backend", "numpy", "--steps", "3", "--checkpoint-every", "1",
                 "--checkpoint-dir", str(folder)]
    killed = subprocess.run([sys.executable, "-c", _KILLED_WRITER.format(
        root=str(ROOT), arguments=arguments)], capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    names = sorted(os.listdir(folder))
    assert names[-1] == "step-00000001.safetensors"  # the partial one is a hidden .cgc-tmp
    assert any(name.endswith(".cgc-tmp") for name in names)
    assert checkpoint.latest(str(folder)).endswith("step-00000001.safetensors")
    values, manifest = checkpoint.load(checkpoint.latest(str(folder)))
    assert manifest["step"] == 1
    status, resumed, _ = cgc(capsys, "run", TRAIN, "--backend", "numpy", "--steps", 3,
                             "--resume", folder)
    assert status == 0
    status, straight, _ = cgc(capsys, "run", TRAIN, "--backend", "numpy", "--steps", 3)
    assert step_lines(resumed) == step_lines(straight)[1:]


def test_sigterm_stops_after_the_step_and_writes_a_final_checkpoint(tmp_path):
    folder = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "cgc", "run", TRAIN, "--backend", "numpy", "--steps", "100000",
         "--checkpoint-dir", str(folder)], cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = []
    while len(lines) < 3:
        line = process.stdout.readline()
        assert line, process.stderr.read()
        lines.append(line)
    process.send_signal(signal.SIGTERM)
    # the rest through the same reader (communicate reads the pipe itself, past what readline
    # read ahead), whole lines (joined without their ends, two steps' lines read as one)
    lines.append(process.stdout.read())
    err = process.stderr.read()
    process.wait(timeout=120)
    assert process.returncode == 143, err  # 128 + SIGTERM, not Ctrl-C's 130
    last = step_lines("".join(lines))[-1][0]
    values, manifest = checkpoint.load(checkpoint.latest(str(folder)))
    assert manifest["step"] == last >= 3
    assert values["cgOptimizerStep"].tolist() == [last]
    assert "Traceback" not in err and "wrote the checkpoint" in err


# ---- errors ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("saved")
    assert main(["run", TRAIN, "--backend", "numpy", "--steps", "2", "--checkpoint-dir",
                 str(folder)]) == 0
    return checkpoint.latest(str(folder))


@pytest.mark.parametrize("options, named", [
    (["--config", "tiny32"], 'config: "tiny" in the checkpoint, "tiny32" now'),
    (["--seed", "5"], "seed: 0 in the checkpoint, 5 now"),
    (["--lr", "0.01"], "learning_rate.peak: 0.003 in the checkpoint, 0.01 now"),
    (["--set", "cgWidth=128"], "constants.cgWidth: 64 in the checkpoint, 128 now"),
])
def test_resuming_another_run_names_what_differs(saved, options, named, capsys):
    status, _, err = cgc(capsys, "run", TRAIN, "--backend", "numpy", "--steps", 4,
                         "--resume", saved, *options)
    assert status == 1
    assert named in err and "differs from the checkpoint" in err
    assert "Traceback" not in err


def test_resuming_with_a_changed_schedule_names_the_file(saved, tmp_path, capsys):
    copy = tmp_path / "schedules"
    shutil.copytree(SCHEDULES, copy)
    with open(copy / "library.cg", "a", encoding="utf-8") as handle:
        handle.write("-- a comment changes the sources' hash\n")
    status, _, err = cgc(capsys, "run", copy / "train.cg", "--backend", "numpy", "--steps", 4,
                         "--resume", saved)
    assert status == 1
    assert "schedule.sources.library.cg" in err


def _truncated(path, tmp_path):
    data = open(path, "rb").read()
    target = tmp_path / "truncated.safetensors"
    target.write_bytes(data[:len(data) // 2])
    return target


def _flipped_header(path, tmp_path):
    data = bytearray(open(path, "rb").read())
    data[10:20] = b"\xff" * 10  # inside the JSON header
    target = tmp_path / "flipped.safetensors"
    target.write_bytes(bytes(data))
    return target


def _garbage(path, tmp_path):
    target = tmp_path / "garbage.safetensors"
    target.write_bytes(os.urandom(4096))
    return target


def _empty(path, tmp_path):
    target = tmp_path / "empty.safetensors"
    target.write_bytes(b"")
    return target


def _flipped_tensor(path, tmp_path):
    """One bit of one float of the data, the header untouched: once resumed silently."""
    data = bytearray(open(path, "rb").read())
    data[-100] ^= 0x01
    target = tmp_path / "flipped-tensor.safetensors"
    target.write_bytes(bytes(data))
    return target


def _other_safetensors(path, tmp_path):
    from safetensors.numpy import save_file
    target = tmp_path / "other.safetensors"
    save_file({"weight": np.zeros(4, np.float32)}, str(target))
    return target


@pytest.mark.parametrize("broken", [_truncated, _flipped_header, _flipped_tensor, _garbage,
                                    _empty, _other_safetensors])
def test_a_broken_checkpoint_is_a_one_line_error(saved, broken, tmp_path, capsys):
    status, _, err = cgc(capsys, "run", TRAIN, "--backend", "numpy", "--steps", 4,
                         "--resume", broken(saved, tmp_path))
    assert status == 1, err
    assert err.startswith("cgc: error: ") and "is not a whole cgc checkpoint" in err
    assert "Traceback" not in err and "internal error" not in err


def test_a_damaged_header_says_what_is_wrong(saved, tmp_path, capsys):
    """The header's JSON or its cgc manifest damaged: the reason, not a bare key name."""
    data = bytearray(open(saved, "rb").read())
    size = int.from_bytes(data[:8], "little")
    header = data[8:8 + size].decode()
    cases = {"not-json": header.replace("{", "[", 1),
             "no-manifest": header.replace('"cgc"', '"cgx"', 1)}
    for name, text in cases.items():
        target = tmp_path / f"{name}.safetensors"
        target.write_bytes(bytes(data[:8]) + text.encode() + bytes(data[8 + size:]))
        status, _, err = cgc(capsys, "run", TRAIN, "--backend", "numpy", "--steps", 4,
                             "--resume", target)
        assert status == 1, err
        reason = "is not JSON" if name == "not-json" else "has no 'cgc' manifest"
        assert reason in err and "Traceback" not in err, err


@pytest.mark.parametrize("validation", [False, True])
def test_a_diverged_run_stops_with_an_error_and_keeps_no_checkpoint_of_it(validation, tmp_path,
                                                                        capsys):
    """The loss, the gradient norm or the validation loss not finite: the run stops at that
    step, exit 1, and writes no checkpoint of it, even one a --checkpoint-every step would
    write (the step-1 update at this rate already makes the validation loss NaN); its log
    is strict JSON (null, not a bare NaN)."""
    folder, log = tmp_path / "run", tmp_path / "log.jsonl"
    more = ["--checkpoint-every", 1, "--val-every", 1, "--val-steps", 1] if validation else []
    status, out, err = cgc(capsys, "run", TRAIN, "--backend", "numpy", "--steps", 40,
                           "--lr", "1e30", "--checkpoint-dir", folder, "--log", log, *more)
    assert status == 1, err
    assert "training diverged" in err and "a lower --lr" in err and "Traceback" not in err
    steps = step_lines(out)
    assert len(steps) < 40  # it stopped at the first step whose loss was not finite
    assert not os.path.exists(folder) or not [n for n in os.listdir(folder)
                                              if n.endswith(".safetensors")]

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    records = [json.loads(line, parse_constant=refuse) for line in log.read_text().splitlines()]
    assert records and None in [r.get("loss") for r in records]


def test_a_folder_without_checkpoints_and_a_missing_path_are_errors(tmp_path, capsys):
    status, _, err = cgc(capsys, "run", TRAIN, "--backend", "numpy", "--resume", tmp_path)
    assert status == 1 and "holds no checkpoint" in err
    status, _, err = cgc(capsys, "run", TRAIN, "--backend", "numpy", "--resume",
                         tmp_path / "nothing")
    assert status == 2 and "cannot read" in err


def test_a_checkpoint_at_or_past_steps_is_a_usage_error(saved, capsys):
    status, _, err = cgc(capsys, "run", TRAIN, "--backend", "numpy", "--steps", 2,
                         "--resume", saved)
    assert status == 2 and "at step 2" in err


def test_checkpoint_every_needs_a_folder(capsys):
    status, _, err = cgc(capsys, "run", TRAIN, "--backend", "numpy", "--checkpoint-every", 2)
    assert status == 2 and "--checkpoint-dir" in err


def test_an_unusable_checkpoint_folder_is_told_before_any_step(capsys):
    status, out, err = cgc(capsys, "run", TRAIN, "--backend", "numpy", "--checkpoint-dir",
                           "/dev/zero")
    assert status == 2 and "not a folder" in err and out == ""


def test_a_validation_pass_leaves_the_run_as_it_was(tmp_path, capsys):
    """Validation every step must not change training: the losses equal a run that validates
    only at the end (the same held-out documents, so the same training windows). Run.evaluate
    puts the state back; without that, each held-out step's update would show in every
    later loss."""
    status, often, _ = cgc(capsys, "run", TRAIN, "--backend", "numpy", "--steps", 4,
                           "--val-every", 1, "--val-steps", 1)
    assert status == 0
    status, once, _ = cgc(capsys, "run", TRAIN, "--backend", "numpy", "--steps", 4,
                          "--val-every", 4, "--val-steps", 1)
    assert status == 0
    assert step_lines(often) == step_lines(once)
    assert often.count(": validation loss") == 4 and once.count(": validation loss") == 1
    assert "validation loss" in often.splitlines()[-1]


# ---- the CuPy backend, through the fake CuPy (tests/fake_cupy.py) --------------------------


def test_the_cupy_backend_takes_each_rate_through_its_graph_and_resumes_bit_identically(
        monkeypatch, tmp_path):
    """On the CuPy backend the step is captured once as a graph and replayed: the warm-up
    and decay reach the optimizer through the learning-rate buffer (the losses follow the
    numpy backend's, which reads the same rates), the graph is never rebuilt, and a run
    resumed from a checkpoint ends as the run that never stopped, byte for byte."""
    import io

    import fake_cupy
    from cgc.training.data import Batches, load_corpus
    from cgc.training.loop import Checkpointing, LearningRate, train
    from cgc.frontend.api import analyse
    from cgc.pipeline import open_run
    frontend = analyse([TRAIN])
    reference = open_run("numpy", frontend, TRAIN, "tiny32", {}, seed=2)
    fake_cupy.install(monkeypatch, reference.program.images, reference.program.low,
                      reference.machine.constants)
    rate = LearningRate(0.01, 0.001, warmup=2, decay_steps=4)
    corpus = load_corpus(None)

    def run_cupy():
        return open_run("cupy", frontend, TRAIN, "tiny32", {}, seed=2)

    straight = run_cupy()
    result = train(straight, Batches(corpus, 4, 64, 2), 4, out=io.StringIO(),
                   learning_rate=rate, checkpointing=Checkpointing(str(tmp_path / "a"), 0, {}))
    graph = straight.graph
    expected = train(reference, Batches(corpus, 4, 64, 2), 4, out=io.StringIO(),
                     learning_rate=rate).losses
    for ours, theirs in zip(result.losses, expected):
        assert abs(ours - theirs) <= 1e-5 * theirs  # TOLERANCES of test_cupy_backend.py
    assert straight.graph is graph and straight.steps_run == 4  # captured once

    first = run_cupy()
    batches = Batches(corpus, 4, 64, 2)
    train(first, batches, 2, out=io.StringIO(), learning_rate=rate,
          checkpointing=Checkpointing(str(tmp_path / "b"), 0, {}))
    values, manifest = checkpoint.load(checkpoint.latest(str(tmp_path / "b")))
    second = run_cupy()
    checkpoint.restore(second, values)
    resumed_batches = Batches(corpus, 4, 64, 2)
    resumed_batches.restore(manifest["data_position"])
    resumed = train(second, resumed_batches, 4, out=io.StringIO(), learning_rate=rate,
                    start=2, history=manifest["losses"],
                    checkpointing=Checkpointing(str(tmp_path / "b"), 0, {}))
    assert resumed.losses == result.losses
    ours, theirs = final(tmp_path / "b"), final(tmp_path / "a")
    for label in theirs:
        assert np.array_equal(ours[label].view(np.uint8), theirs[label].view(np.uint8)), label


def test_sampling_refuses_a_schedule_that_changes_the_parameters(saved, capsys):
    """`cgc sample --schedule train.cg` ran the backward and the optimizer between tokens."""
    status, _, err = cgc(capsys, "sample", saved, "--schedule", TRAIN, "--tokens", 2)
    assert status == 1, err
    assert "cannot sample" in err and "writes the bank" in err and "forward-only" in err


# ---- what a checkpoint file may be, and every field of its manifest ------------------------


def _subprocess_cgc(*arguments, timeout=120, memory=None):
    """`python -m cgc ARGUMENTS` in a process of its own: a hang fails the test (timeout)
    rather than blocking it; `memory` limits its address space."""
    import resource
    limit = None
    if memory:
        def limit():
            resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    return subprocess.run([sys.executable, "-m", "cgc", *map(str, arguments)], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=timeout, preexec_fn=limit)


def _folder_whose_latest_is(saved, tmp_path, make) -> str:
    """A checkpoint folder with the saved checkpoint and, as its latest, what `make` puts
    at step-99999999.safetensors."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    shutil.copy(saved, folder / os.path.basename(saved))
    make(folder / checkpoint.file_name(99999999))
    return str(folder)


@pytest.mark.parametrize("command", ["resume", "sample"])
@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "folder"])
def test_a_latest_checkpoint_that_is_no_regular_file_is_refused_without_waiting(
        saved, tmp_path, command, kind):
    """Once a FIFO in the folder hung --resume and sample (open() waits for a writer), and
    a link to /dev/zero was read until memory ran out: now each is refused, in one line,
    before a byte is read (2 GB of address space, a timeout)."""
    make = {"fifo": os.mkfifo, "dev-zero": lambda path: path.symlink_to("/dev/zero"),
            "folder": os.mkdir}[kind]
    folder = _folder_whose_latest_is(saved, tmp_path, make)
    arguments = (["run", TRAIN, "--backend", "numpy", "--steps", 4, "--resume", folder]
                 if command == "resume" else ["sample", folder, "--backend", "numpy",
                                             "--tokens", 2])
    result = _subprocess_cgc(*arguments, timeout=60, memory=2 << 30)
    assert result.returncode == 1, result.stderr[-2000:]
    assert result.stderr.startswith("cgc: error: cannot read the checkpoint ")
    assert "not a regular file" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("how", ["appended", "all-zero"])
def test_a_huge_sparse_checkpoint_is_refused_unread(saved, tmp_path, how):
    """8 GiB (sparse): a checkpoint grown past what its header declares, or zeros. Once read
    whole (in 2 GB of address space: a MemoryError, exit 3); now its size is checked against
    its header's before the tensors are read."""
    target = tmp_path / "huge.safetensors"
    if how == "appended":
        shutil.copy(saved, target)
    with open(target, "ab") as handle:
        handle.truncate(8 << 30)
    result = _subprocess_cgc("run", TRAIN, "--backend", "numpy", "--steps", 4, "--resume",
                             target, timeout=60, memory=2 << 30)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "is not a whole cgc checkpoint" in result.stderr
    assert ("bytes after its tensors" if how == "appended" else "not JSON") in result.stderr


def test_a_checkpoint_that_declares_more_than_the_machine_has_is_refused_unread(tmp_path):
    """A header whose one tensor ends past the machine's memory, in a sparse file of that
    size: the bytes the header declares are never read."""
    from cgc.backends.base import host_memory
    size = host_memory()[0] + (1 << 30)
    header = json.dumps({"__metadata__": {"cgc": "{}"},
                         "x": {"dtype": "U8", "shape": [size], "data_offsets": [0, size]}})
    target = tmp_path / "big.safetensors"
    with open(target, "wb") as handle:
        handle.write(len(header).to_bytes(8, "little") + header.encode())
        handle.truncate(8 + len(header) + size)
    with pytest.raises(checkpoint.CheckpointError) as error:
        checkpoint.load(str(target))
    assert "its tensors take" in error.value.message and "more than this" in error.value.message


def _rewritten(path, target, edit, rehash=True):
    """The checkpoint at `path` with its manifest edited by `edit`, written to `target`;
    its manifest's SHA-256 recomputed unless not `rehash` (the tensors untouched)."""
    data = open(path, "rb").read()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    manifest = json.loads(header["__metadata__"]["cgc"])
    edit(manifest)
    if rehash and "manifest_sha256" in manifest:
        manifest["manifest_sha256"] = checkpoint.manifest_sha256(manifest)
    header["__metadata__"]["cgc"] = json.dumps(manifest)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads its header to 8 bytes
    target.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + size:])
    return target


def _set(*keys_and_value):
    *keys, value = keys_and_value

    def edit(manifest):
        place = manifest
        for key in keys[:-1]:
            place = place[key]
        if value is _DELETE:
            del place[keys[-1]]
        else:
            place[keys[-1]] = value
    return edit


_DELETE = object()
_BIG = 1 << 200


@pytest.mark.parametrize("edit, named", [
    (_set("step", -5), "step is -5"),
    (_set("step", "2"), "step is \"2\""),
    (_set("step", 2.5), "step is 2.5"),
    (_set("step", True), "step is true"),
    (_set("step", 3), "a list of 3 numbers"),  # the losses no longer match
    (_set("step", _DELETE), "step is null"),
    (_set("losses", "x"), "losses is \"x\""),
    (_set("losses", [1.0, "a"]), "losses is"),
    (_set("losses", [1.0]), "a list of 2 numbers"),
    (_set("losses", None), "losses is null"),
    (_set("data_position", {"bit_generator": "PCG64"}), "data_position is"),
    (_set("data_position", "state", "state", -1), "data_position is"),
    (_set("data_position", "state", "state", _BIG), "data_position is"),
    (_set("data_position", "state", "inc", 2), "data_position is"),
    (_set("data_position", "bit_generator", "MT19937"), "data_position is"),
    (_set("data_position", "has_uint32", 7), "data_position is"),
    (_set("validation_position", [1]), "validation_position is [1]"),
    (_set("backend", 5), "backend is 5"),
    (_set("ranks", 0), "ranks is 0"),
    (_set("identity", "tiny"), "identity is \"tiny\""),
    (_set("identity", "seed", -1), "identity.seed is -1"),
    (_set("identity", "seed", "0"), "identity.seed is \"0\""),
    (_set("identity", "overrides", ["cgWidth=64"]), "identity.overrides is"),
    (_set("identity", "learning_rate", {"peak": "x"}), "identity.learning_rate is"),
    (_set("identity", "learning_rate", "warmup", -2), "identity.learning_rate is"),
    (_set("identity", "data", "kind", "words"), "identity.data is"),
    (_set("identity", "entries", "cgFcWeight", "count", "x"), "identity.entries is"),
    (_set("identity", "constants", [1]), "identity.constants is"),
    (_set("identity", "config", 3), "identity.config is 3"),
    (_set("identity", "ranks", 0), "identity.ranks is 0"),
])
@pytest.mark.parametrize("command", ["resume", "sample"])
def test_every_field_of_the_manifest_is_checked(saved, tmp_path, capsys, edit, named, command):
    """An edited field whose manifest hash was recomputed too: each is a one-line error naming
    the field, never an internal error (exit 3) nor a run "resumed at step -5"."""
    target = _rewritten(saved, tmp_path / "edited.safetensors", edit)
    arguments = (["run", TRAIN, "--backend", "numpy", "--steps", 4, "--resume", target]
                 if command == "resume" else ["sample", target, "--backend", "numpy",
                                             "--tokens", 2])
    status, out, err = cgc(capsys, *arguments)
    assert status == 1, err
    assert err.startswith(f"cgc: error: {target}: the manifest's ") and named in err, err
    assert err.count("\n") <= 2 and "internal error" not in err and "resumed" not in err


@pytest.mark.parametrize("edit", [_set("step", 1), _set("losses", [5.0, 5.0]),
                                  _set("identity", "seed", 1),
                                  _set("data_position", "state", "state", 12345),
                                  _set("backend", "cupy"), _set("novel", 1)])
def test_an_edited_manifest_is_told_by_its_hash(saved, tmp_path, capsys, edit):
    """The manifest is covered by its SHA-256: a field edited and its value valid (step 1 once
    resumed silently from step 1, with the parameters of step 2) is a damaged file."""
    target = _rewritten(saved, tmp_path / "edited.safetensors", edit, rehash=False)
    status, _, err = cgc(capsys, "run", TRAIN, "--backend", "numpy", "--steps", 4,
                         "--resume", target)
    assert status == 1, err
    assert "its manifest does not have the SHA-256 it records" in err, err


def test_a_format_1_checkpoint_still_resumes(saved, tmp_path, capsys):
    """cgc-checkpoint-1 (no manifest hash): still read, its fields checked the same way."""
    def older(manifest):
        manifest["format"] = "cgc-checkpoint-1"
        del manifest["manifest_sha256"]
    target = _rewritten(saved, tmp_path / "old.safetensors", older, rehash=False)
    status, _, err = cgc(capsys, "run", TRAIN, "--backend", "numpy", "--steps", 3,
                         "--resume", target)
    assert status == 0 and "at step 2" in err, err
    bad = _rewritten(saved, tmp_path / "old-bad.safetensors",
                     lambda m: (older(m), m.update(step=-5)), rehash=False)
    status, _, err = cgc(capsys, "run", TRAIN, "--backend", "numpy", "--steps", 3,
                         "--resume", bad)
    assert status == 1 and "the manifest's step is -5" in err, err
    other = _rewritten(saved, tmp_path / "future.safetensors", _set("format", "cgc-checkpoint-9"))
    status, _, err = cgc(capsys, "run", TRAIN, "--backend", "numpy", "--steps", 3,
                         "--resume", other)
    assert status == 1 and "its format is \"cgc-checkpoint-9\"" in err, err


# ---- stopping during a validation pass ----------------------------------------------------


def test_sigterm_during_a_long_validation_stops_within_a_batch(tmp_path):
    """--val-steps 10**9: once SIGTERM waited for the whole pass (11 minutes and more); now
    the pass stops before its next batch, the step is checkpointed and the run ends 143."""
    import time
    folder = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "cgc", "run", TRAIN, "--backend", "numpy", "--steps", "5",
         "--val-every", "1", "--val-steps", "1000000000", "--checkpoint-dir", str(folder)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        line = process.stdout.readline()  # step 1's line: its validation pass has begun
        assert line.startswith("step 1/5"), process.stderr.read()
        time.sleep(1.0)
        process.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        out, err = process.communicate(timeout=60)
        waited = time.monotonic() - sent
    finally:
        process.kill()
    assert process.returncode == 143, err
    assert waited < 30, waited  # a batch takes some 0.1 s here
    assert "validation loss" not in out  # the pass was not finished, so not reported
    _, manifest = checkpoint.load(checkpoint.latest(str(folder)))
    assert manifest["step"] == 1 and "Traceback" not in err
