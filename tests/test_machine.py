"""The reference machine is bounds-checked, and its runs are reproducible and learn."""

from __future__ import annotations

import io
import sys

import numpy as np
import pytest

from cgc.training.data import Batches, load_corpus
from cgc.frontend.api import analyse
from cgc.backends.numpy.machine import Fault, Pointer
from cgc.backends.numerics import round_to_bfloat16, to_bfloat16_bits
from cgc.training.loop import train
from cgc.pipeline import open_run

from conftest import ROOT, SCHEDULES

sys.path.insert(0, str(ROOT / "scripts"))
import checker_vs_ground_truth  # noqa: E402


def pointer(count=8, extent=6, access="write"):
    return Pointer("launch 0 of 'cgImageTest'", 1, "output", access, "float32", "bfloat16",
                   np.zeros(count, dtype=np.float32), extent, "buffers", 0, 4)


def test_an_access_past_the_declared_extent_faults_naming_the_slot():
    with pytest.raises(Fault, match="pointer 1 'output' of launch 0 of 'cgImageTest' touches "
                                    "element 6, past its declared extent 6"):
        pointer().write(0, np.ones(7))


def test_an_access_past_the_buffer_faults():
    with pytest.raises(Fault, match="outside the 4 of its buffer"):
        pointer(count=4, extent=6).read(0, 5)


def test_a_read_only_pointer_cannot_be_written():
    with pytest.raises(Fault, match="read-only"):
        pointer(access="read").write(0, np.ones(2))


def test_bfloat16_rounds_to_nearest_even():
    values = np.array([1.0, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -2.5, 3.0e38], dtype=np.float32)
    rounded = round_to_bfloat16(values)
    assert rounded[1] == 1.0  # a tie goes to the even mantissa
    assert rounded[2] == 1.0 + 2 ** -6
    assert rounded[3] == -2.5
    assert to_bfloat16_bits(np.array([1.0], dtype=np.float32))[0] == 0x3F80


def test_the_same_seed_gives_the_same_run():
    path = str(SCHEDULES / "train.cg")
    frontend = analyse([path])
    corpus = load_corpus(None)
    losses = []
    for _ in range(2):
        run = open_run("numpy", frontend, path, "tiny", {}, seed=3)
        batches = Batches(corpus, run.constants["cgBatch"], run.constants["cgContext"], 3)
        losses.append(train(run, batches, 3, out=io.StringIO()).losses)
    assert losses[0] == losses[1]


def test_200_steps_of_the_tiny_model_learn():
    """From about ln 256 = 5.55 to below 3.0 on the default data (figures in docs/benchmarks.md)."""
    path = str(SCHEDULES / "train.cg")
    run = open_run("numpy", analyse([path]), path, "tiny", {}, seed=0)
    batches = Batches(load_corpus(None), run.constants["cgBatch"], run.constants["cgContext"], 0)
    losses = train(run, batches, 200, out=io.StringIO()).losses
    assert 5.0 < losses[0] < 5.7
    assert np.mean(losses[-20:]) < 3.0


def test_the_checker_has_no_false_accepts_on_500_variants_of_the_backward_schedule():
    out = io.StringIO()
    table = checker_vs_ground_truth.run(limit=None, seed=0, out=out)
    print(out.getvalue())
    ran = table["total"] - table["rejected by the front end (not run)"]
    assert ran >= 500
    assert table["accepted but faulted (FALSE ACCEPT)"] == 0, out.getvalue()
    assert table["accepted and safe"] > 50 and table["rejected, and the machine faults"] > 50
    assert table["fault extent"] == 0, "a kernel touched memory past its declared extent"


def test_adamw_over_negative_norm_partials_computes_as_the_kernel_does(tmp_path):
    """Norm partials bound to the residual gradient, all of it (a wrong binding the checker
    accepts: the backward wrote it before, and the reduction reads the whole view its
    (covers 1) asks for) sum below zero at the second step. sqrtf gives NaN on a GPU and fminf
    ignores it, so the kernel clips by 1; the reference once raised Python's "math domain
    error" instead."""
    import shutil
    for source in SCHEDULES.glob("*.cg"):
        shutil.copy(source, tmp_path / source.name)
    optimizer = tmp_path / "launches.cg"
    text = optimizer.read_text()
    for old, new in [("(cgArgument 1) cgGradientNormPartials", "(cgArgument 1) (cgArena cgDy0)"),
                     ("(cgSlot (cgScalar 0) cgNormBlocks cgNoSlots)",
                      "(cgSlot (cgScalar 0) cgSeqWidth cgNoSlots)")]:
        assert text.count(old) == 1, "update the test"
        text = text.replace(old, new)
    optimizer.write_text(text)
    path = str(tmp_path / "train.cg")
    run = open_run("numpy", analyse([path]), path, "tiny", {}, seed=0)
    batches = Batches(load_corpus(None), run.constants["cgBatch"], run.constants["cgContext"], 0)
    losses = train(run, batches, 2, out=io.StringIO()).losses
    assert len(losses) == 2 and all(np.isfinite(losses)), losses
    norm, clip = run.fetch("cgGradientNorm")
    assert clip == 1.0 or 0 < clip < 1, (norm, clip)  # whatever the residual's sum came to


def test_the_norm_of_partials_that_sum_below_zero_is_nan_and_clips_by_one():
    """The case above made certain (whether the residual gradient's sum is negative depends on
    the arena's layout and the numbers): sqrtf of a negative sum is NaN, and fminf ignores
    it, so the update is not clipped; no Python error."""
    from types import SimpleNamespace
    from cgc.backends.numpy.reference import gradient_norm

    class Memory:
        def __init__(self, values):
            self.values = np.array(values, dtype=np.float32)

        def read(self, start, end):
            return self.values[start:end].copy()

        def write(self, start, values):
            self.values[start:start + len(values)] = values

    norm = Memory([7.0, 7.0])
    gradient_norm(SimpleNamespace(pointers={"normPartials": Memory([-4.0, 1.0, 9.0]),
                                            "norm": norm},
                                  scalars={"partialCount": 2, "clipNorm": 1.0}))
    assert np.isnan(norm.values[0]) and norm.values[1] == 1.0
