"""What `cgc run` refuses before any work: a schedule that is not a whole training step, a
data-parallel launch that could not train (no collective, more ranks than cores), and a
resume that would continue on other data (the held-out split). Each is a diagnostic, never
a run that "trains" on whatever the buffers held."""

from __future__ import annotations

import pytest

from cgc.training import ranks
from cgc.cli import main

from conftest import SCHEDULES

TRAIN = str(SCHEDULES / "train.cg")
PARALLEL = str(SCHEDULES / "train_parallel.cg")


def cgc(capsys, *arguments) -> tuple[int, str, str]:
    status = main([str(a) for a in arguments])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


@pytest.mark.parametrize("part", ["forward", "backward", "optimizer"])
def test_run_refuses_a_part_of_a_step_and_names_the_whole_steps_that_use_it(part, capsys):
    """backward.cg once "trained" at loss 5.5452 and norm 0 for as many steps as asked, and
    forward.cg at loss 0: nothing wrote the loss, nothing proved it."""
    status, out, err = cgc(capsys, "run", SCHEDULES / f"{part}.cg", "--backend", "numpy",
                           "--steps", "3")
    assert status == 1 and "step 1" not in out, out + err
    assert "is not a whole training step: no `roles` declaration gives it the `step` role" in err
    assert err.count("error:") == 1
    for whole in ("train.cg", "train_recompute.cg", "train_parallel.cg"):
        assert f"is a whole step that uses it: cgc run {SCHEDULES / whole}" in err, err
    # `check` still accepts the part, as before
    assert cgc(capsys, "check", SCHEDULES / f"{part}.cg")[0] == 0


def test_run_refuses_another_entry_of_a_file_with_a_whole_step(capsys):
    status, out, err = cgc(capsys, "run", TRAIN, "--entry", "cgForwardSaved", "--steps", "1",
                           "--backend", "numpy")
    assert status == 1 and "step 1" not in out
    assert "'cgForwardSaved' is not a whole training step" in err
    assert "'cgTrainStep' is the whole step (its `step` role here): run it without --entry" in err


def test_run_refuses_a_step_that_leaves_its_loss_unwritten(tmp_path, capsys):
    for source in SCHEDULES.glob("*.cg"):
        (tmp_path / source.name).write_text(source.read_text())
    train = tmp_path / "train.cg"
    text = train.read_text()
    step = "(cgThen (cgConcurrently cgForwardSaved cgSortIds) (cgThen cgSavedBackward cgOptimizer))"
    assert step in text
    train.write_text(text.replace(step, "(cgThen cgForwardSaved cgOptimizer)"))
    status, out, err = cgc(capsys, "run", train, "--steps", "1", "--backend", "numpy")
    assert status == 1 and "step 1" not in out
    assert "the step 'cgTrainStep' never writes 'cgLoss', its `loss` role" in err


def test_a_schedule_without_a_standalone_whole_step_is_told_what_one_is(tmp_path, capsys):
    for source in SCHEDULES.glob("*.cg"):
        if source.name not in ("train.cg", "train_recompute.cg", "train_parallel.cg"):
            (tmp_path / source.name).write_text(source.read_text())
    status, _, err = cgc(capsys, "run", tmp_path / "sample.cg", "--steps", "1")
    assert status == 1
    assert "a whole step is a schedule named by a `roles` declaration's (step NAME) clause" in err


@pytest.fixture
def no_mpirun(monkeypatch):
    """Records a launch instead of starting mpirun: a refusal must come before it."""
    launched = []
    monkeypatch.setattr(ranks, "launch_ranks", lambda ranks, arguments, seconds:
                        launched.append((ranks, arguments, seconds)) or 0)
    return launched


def test_ranks_without_a_collective_are_refused_before_mpirun_starts(no_mpirun, capsys):
    status, _, err = cgc(capsys, "run", TRAIN, "--ranks", "2", "--steps", "1")
    assert status == 1 and no_mpirun == []
    assert "2 ranks would run 'cgTrainStep', which has no collective" in err
    assert "train.cg:9:5: error:" in err  # at the step's own definition
    status, _, err = cgc(capsys, "run", SCHEDULES / "backward.cg", "--ranks", "2")
    assert status == 1 and no_mpirun == [] and "is not a whole training step" in err


def test_more_ranks_than_cores_need_oversubscribe(no_mpirun, capsys, monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    status, _, err = cgc(capsys, "run", PARALLEL, "--ranks", "3", "--steps", "1")
    assert status == 2 and no_mpirun == []
    assert "--ranks 3 is more ranks than this machine's 2 cores" in err
    assert "--oversubscribe" in err
    status, _, _ = cgc(capsys, "run", PARALLEL, "--ranks", "3", "--steps", "1",
                       "--oversubscribe")
    assert status == 0 and no_mpirun[0][0] == 3
    assert no_mpirun[0][2] == 120  # the start-up deadline, read once by the command
    status, _, _ = cgc(capsys, "run", PARALLEL, "--ranks", "2", "--steps", "1")
    assert status == 0 and no_mpirun[1][0] == 2


@pytest.mark.parametrize("first, then", [(["--val-every", "2"], []), ([], ["--val-every", "2"])])
def test_resume_refuses_another_held_out_split(first, then, tmp_path, capsys):
    """A checkpoint of a run that held documents out, resumed without (or the other way),
    went on silently on other data (step 31: 3.8657 against 3.5965 uninterrupted)."""
    folder = tmp_path / "run"
    status, _, err = cgc(capsys, "run", TRAIN, "--backend", "numpy", "--steps", "2",
                         "--checkpoint-dir", folder, *first)
    assert status == 0, err
    status, out, err = cgc(capsys, "run", TRAIN, "--backend", "numpy", "--steps", "3",
                           "--resume", folder, *then)
    assert status == 1 and "step 3" not in out
    assert "this run differs from the checkpoint's: data.held_out:" in err, err
    assert "1 in 10 documents (--val-every)" in err and "none (no --val-every)" in err


def test_resume_with_the_same_split_and_other_validation_lengths_goes_on(tmp_path, capsys):
    """How often and how long a run validates changes nothing of its training: not part of
    its identity."""
    folder = tmp_path / "run"
    assert cgc(capsys, "run", TRAIN, "--backend", "numpy", "--steps", "2", "--checkpoint-dir",
               folder, "--val-every", "2", "--val-steps", "1")[0] == 0
    status, out, err = cgc(capsys, "run", TRAIN, "--backend", "numpy", "--steps", "3",
                           "--resume", folder, "--val-every", "1", "--val-steps", "2")
    assert status == 0, err
    assert "resumed from" in err and "step 3/3" in out


def test_a_fifo_beside_a_part_of_a_step_does_not_hang_the_search_for_whole_steps(tmp_path,
                                                                                  capsys):
    """The refusal looks for whole steps in the `.cg` files beside the schedule: a FIFO among
    them is passed over, never opened for a read that would wait for a writer."""
    import os
    for source in SCHEDULES.glob("*.cg"):
        (tmp_path / source.name).write_text(source.read_text())
    os.mkfifo(tmp_path / "a_fifo.cg")
    status, _, err = cgc(capsys, "run", tmp_path / "backward.cg", "--steps", "1")
    assert status == 1
    assert f"is a whole step that uses it: cgc run {tmp_path / 'train.cg'}" in err
