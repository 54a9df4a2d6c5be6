"""Concurrent branches (cgConcurrently) never change the numbers: the shipped steps, and the
same steps with every cgConcurrently written cgThen (one after the other, in order), give
the same bits on every backend, while the checker proves the branches independent
(tests/checker/concurrent_*; the campaign's interleavings: tests/test_ground_truth.py)."""

from __future__ import annotations

import io
import shutil

import numpy as np
import pytest

import fake_cupy
from cgc.backends.cuda import backend as cupy_backend
from cgc.frontend.api import analyse
from cgc.pipeline import open_run
from cgc.training.data import Batches, load_corpus
from cgc.training.loop import train

from conftest import SCHEDULES


@pytest.fixture(scope="module")
def serial(tmp_path_factory):
    """The shipped schedules with every cgConcurrently a cgThen."""
    folder = tmp_path_factory.mktemp("serial")
    for path in SCHEDULES.glob("*.cg"):
        shutil.copy(path, folder / path.name)
        text = path.read_text()
        (folder / path.name).write_text(text.replace("(cgConcurrently", "(cgThen"))
    assert "cgConcurrently" in (SCHEDULES / "library.cg").read_text()
    return folder


def trained(backend: str, path, steps: int = 2):
    path = str(path)
    run = open_run(backend, analyse([path]), path, "tiny", {}, 3)
    batches = Batches(load_corpus(None), 4, 64, 3)
    losses = train(run, batches, steps, out=io.StringIO()).losses
    banks = {f"{role}/{name}": values.tobytes() for role in ("parameters", "state", "gradients")
             if run.program.bank_of_role(role)  # ZeRO-1 keeps its moments in shards instead
             for name, values in run.bank_values(role).items()}
    banks.update({label: run.fetch(label).tobytes() for label in run.program.sharded})
    return losses, banks


@pytest.mark.parametrize("schedule", ["train.cg", "train_recompute.cg", "train_parallel.cg",
                                      "train_zero.cg"])
def test_the_numpy_backend_gives_the_bits_of_the_serial_step(serial, schedule):
    assert trained("numpy", SCHEDULES / schedule) == trained("numpy", serial / schedule)


def test_the_emulated_backend_gives_the_bits_of_the_serial_step(serial):
    """The emitted program's streams, events and per-stream cuBLASLt workspaces, run by
    the CUDA-on-CPU runtime, against the same program with no branch."""
    concurrent = trained("emulated", SCHEDULES / "train.cg")
    assert concurrent == trained("emulated", serial / "train.cg")


def test_the_cupy_backend_gives_the_bits_of_the_serial_step_and_needs_its_joins(
        serial, monkeypatch):
    """Through the fake CuPy, whose side streams run as late as CUDA allows: the branches on
    their streams (eager, then replayed from the captured graph) give the serial step's
    bits; with the joins left out, a stream's work lands after what needed it."""
    path = str(SCHEDULES / "train.cg")
    reference = open_run("numpy", analyse([path]), path, "tiny", {}, 3)
    fake_cupy.install(monkeypatch, reference.program.images, reference.program.low,
                      reference.machine.constants)
    concurrent = trained("cupy", SCHEDULES / "train.cg", steps=3)
    assert concurrent == trained("cupy", serial / "train.cg", steps=3)
    scheduled = cupy_backend.scheduled
    monkeypatch.setattr(cupy_backend, "scheduled",
                        lambda program: [s for s in scheduled(program) if s.kind != "join"])
    unjoined = trained("cupy", SCHEDULES / "train.cg", steps=3)
    assert unjoined[0] != concurrent[0]
    assert np.isfinite(concurrent[0]).all()
