"""Saved activations as a schedule choice: train.cg's step keeps every layer's activations
in stacked arena slots and its backward reads them (cgSavedBackward); train_recompute.cg's
step keeps only the layer boundaries and its backward recomputes each layer's inside
(cgRecomputeBackward, the seed's way). Both are the same function, both are checked as the
whole step, and the memory plan says what each costs."""

from __future__ import annotations

import io
import re
import shutil

import numpy as np
import pytest

from cgc.training.data import Batches, load_corpus
from cgc.checking.memory import format_memory_plan, plan_memory
from cgc.core.diagnostics import CompileError
from cgc.pipeline import analyse, check, evaluate, open_run

from conftest import SCHEDULES
from test_check import checked, edit

SAVED, RECOMPUTE = str(SCHEDULES / "train.cg"), str(SCHEDULES / "train_recompute.cg")


def one_step(path: str, config: str):
    run = open_run("numpy", analyse([path]), path, config, {}, seed=0)
    ids, targets = Batches(load_corpus(None), run.constants["cgBatch"],
                           run.constants["cgContext"], 0).next()
    loss = run.step(ids, targets).loss
    return loss, run.bank_values("gradients"), run.bank_values("parameters")


@pytest.mark.parametrize("config", ["tiny32", "tiny"])
def test_both_schedules_compute_the_same_step_bit_for_bit(config):
    """The saved values are the ones the recompute makes again, by the same kernels from the
    same inputs: the loss, every gradient and every updated parameter agree to the bit."""
    saved, recomputed = one_step(SAVED, config), one_step(RECOMPUTE, config)
    assert saved[0] == recomputed[0]
    for part in (1, 2):
        assert set(saved[part]) == set(recomputed[part])
        for name, values in saved[part].items():
            np.testing.assert_array_equal(values, recomputed[part][name], err_msg=name)


def test_the_memory_plan_prices_the_choice():
    """At GPT-2 small: the saved step's arena holds every layer's activations (an item per
    layer of ten slots), the recomputing step's none; the difference in the total is what
    the stacks cost, less the per-layer slots the saved step no longer needs."""
    plans = {}
    for path in (SAVED, RECOMPUTE):
        plans[path] = plan_memory(evaluate(analyse([path]), path, config="gpt2"))
    saved, recompute = plans[SAVED], plans[RECOMPUTE]
    rows, width, heads, layers, low = 8 * 1024, 768, 12, 12, 2
    per_row = (3 * width * low  # the two layer norms' outputs and the attention's
               + 3 * width * low  # q, k and v
               + 2 * 4 * width * low  # the MLP's pre-activation and activation
               + width * 4  # the residual stream between attention and MLP
               + 2 * 2 * 4  # the two layer norms' statistics
               + heads * 4)  # the attention's log-sum-exp per head
    per_layer = rows * per_row
    assert saved.stacked_bytes == layers * per_layer  # every size a multiple of 256 bytes
    assert len(saved.stacked_slots) == 10 and recompute.stacked_bytes == 0
    assert saved.total_bytes - recompute.total_bytes > 0.9 * saved.stacked_bytes
    text = format_memory_plan(saved)
    assert "memory plan of cgTrainStep, config gpt2" in text
    assert "kept across the layers (stacked slots, an item per layer): 2,422,210,560 bytes" in text
    assert "none; what the backward needs of a layer's inside, it recomputes" in \
        format_memory_plan(recompute)


@pytest.fixture
def schedules(tmp_path):
    for path in SCHEDULES.glob("*.cg"):
        shutil.copy(path, tmp_path / path.name)
    return tmp_path


def test_both_steps_are_checked_as_the_whole_step(schedules):
    """The second (step ...) role makes the recomputing step a whole step too: a forward
    taken out of it leaves the backward reading boundaries nothing wrote."""
    checked(schedules / "train_recompute.cg")
    edit(schedules / "train_recompute.cg", "(cgConcurrently cgForward cgSortIds)",
         "(cgConcurrently cgZeroGradients cgSortIds)")
    with pytest.raises(CompileError) as error:
        checked(schedules / "train_recompute.cg")
    assert any("cgBoundaries" in d.message and "'cgRecomputeTrainStep'" in d.message
               for d in error.value.diagnostics)
    # Analysed together (`cgc check schedules/*.cg`), train.cg's role comes first: the
    # second names the other step, and each program is checked as its own whole step.
    paths = [str(schedules / "train.cg"), str(schedules / "train_recompute.cg")]
    frontend = analyse(paths)
    assert evaluate(frontend, paths[0], config="tiny").roles["step"] == "cgTrainStep"
    program = evaluate(frontend, paths[1], config="tiny")
    assert program.roles["step"] == "cgRecomputeTrainStep"
    with pytest.raises(CompileError):
        check(program)


def test_the_saved_backward_after_a_forward_that_saves_nothing_is_refused(schedules):
    edit(schedules / "train.cg", "(cgConcurrently cgForwardSaved", "(cgConcurrently cgForward")
    with pytest.raises(CompileError) as error:
        checked(schedules / "train.cg")
    messages = [d.message for d in error.value.diagnostics]
    for slot in ("cgSavedQkv", "cgSavedFcAct", "cgSavedMiddle", "cgSavedAttentionLse"):
        assert any(re.search(rf"reads (items? [0-9 to]+ of )?the arena slot '{slot}'", m) and
                   "nothing earlier in the step" in m for m in messages), slot
