"""ZeRO-1 (schedules/train_zero.cg) on CPU ranks: the optimizer's state sharded over the ranks.

Each rank reduce-scatters the gradient bank (it receives the average of its own shard),
runs AdamW on its shard of the parameters with the moments it alone holds, and all-gathers
the parameters. Against the all-reduce step (schedules/train_parallel.cg) on the same ranks
and data, the one difference in arithmetic is the gradient norm: the all-reduce step sums
the squares of the whole averaged bank in cgNormBlocks partial sums; ZeRO-1 sums each
rank's shard in cgNormBlocks partial sums and adds the ranks' partial sums. The averaged
gradients themselves are the same bits on 2 ranks (one addition an element, and MPI's
reduce adds the same two values whatever the message); on 4 ranks MPI's reduce may add the
four values in another order for a whole-bank message than for a layer's bucket.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import ROOT
from test_parallel import MPI_ENVIRONMENT, PARALLEL, STEPS, LEARNING_RATE, _ranks, needs_mpi

ZERO = str(ROOT / "schedules" / "train_zero.cg")
SEQUENCES = 4  # a step's sequences, over every rank


def _without_gradients(arrays: dict) -> dict:
    """A ZeRO-1 rank's gradient bank outside its shard is its own, never reduced: only the
    rest is the same on every rank."""
    return {name: values for name, values in arrays.items()
            if not name.startswith("gradients/")}


def _assert_ranks_identical(ranks: dict) -> None:
    first = _without_gradients(ranks[0])
    assert any(name.startswith("moments/") for name in first)
    for rank, arrays in ranks.items():
        for name, values in _without_gradients(arrays).items():
            same = values.tobytes() == first[name].tobytes()  # a bool: no long byte diff
            assert same, f"rank {rank} parts on {name}"


@needs_mpi
def test_without_clipping_zero_on_two_ranks_is_the_all_reduce_step_bit_for_bit(tmp_path):
    """With the clip out of reach (cgClipNorm 1000: the factor is exactly 1), the norm
    changes nothing, and ZeRO-1 is the all-reduce step's arithmetic element for element:
    the same averaged gradients, the same AdamW on each element, the parameters gathered as
    they were computed. (Mutation: an AdamW shard one element off, or an all-gather that
    misses a shard, changes the parameters; the checker refuses an AdamW that reads outside
    its shard: tests/checker/zero_read_outside_shard.)"""
    unclipped = ["cgClipNorm=1000"]
    zero = _ranks(2, "numpy", SEQUENCES // 2, _folder(tmp_path, "zero"), ZERO,
                  settings=unclipped)
    whole = _ranks(2, "numpy", SEQUENCES // 2, _folder(tmp_path, "all"), PARALLEL,
                   settings=unclipped)
    _assert_ranks_identical(zero)
    for name, values in _without_gradients(whole[0]).items():
        same = zero[0][name].tobytes() == values.tobytes()
        assert same, name


@needs_mpi
@pytest.mark.parametrize("count", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_zero_ranks_agree_bit_for_bit_and_follow_the_all_reduce_step(count, tmp_path):
    """On 2 and 4 ranks, clipping on (tiny32's gradient norm is about 2, the clip 1): the
    ranks hold the same parameters and moments bit for bit, and the training is the
    all-reduce step's within the rounding of the gradient norm's sum (and on 4 ranks of the
    ranks' sum). Why these tolerances: the clip factor min(1, clip / norm) comes out a few
    float32 ulps (u = 2^-24) apart, which scales the step's every gradient by 1 + a few u; on
    4 ranks each averaged gradient may differ by a few u of its terms' magnitude T. AdamW's
    step lr m^/(sqrt(v^) + eps) is unchanged by a common scale but for eps, so a parameter
    moves by its own rounding (an ulp or two: rtol 2.4e-7) or a few u lr (atol, 1e-5 of the
    three steps' largest move), as in tests/test_parallel.py's one-rank comparison, whose
    analysis (gradients a few u T apart) covers this one. The moments are linear in the
    gradient (m) and its square (v): within a few u, 2e-6 of their largest value (34 u).
    Measured (numpy backend): losses within 2.9e-9 (2 ranks) and 2.1e-9 (4) relative; every
    parameter within 2 ulps or the atol; moments within 1.2e-7 and 1.7e-7 of their largest."""
    batch = SEQUENCES // count
    zero = _ranks(count, "numpy", batch, _folder(tmp_path, "zero"), ZERO)
    whole = _ranks(count, "numpy", batch, _folder(tmp_path, "all"), PARALLEL)
    _assert_ranks_identical(zero)
    ours, theirs = zero[0], whole[0]
    np.testing.assert_allclose(ours["losses"], theirs["losses"], rtol=1e-6)
    move = LEARNING_RATE * STEPS
    worst = 0.0
    for name, values in theirs.items():
        if name.startswith("parameters/"):
            close = np.isclose(ours[name], values, rtol=2.4e-7, atol=1e-5 * move)
            assert close.all(), (name, float(np.abs(ours[name] - values).max()))
        elif name.startswith("moments/"):
            largest = float(np.abs(values).max())
            difference = float(np.abs(ours[name] - values).max())
            assert difference <= 2e-6 * largest, (name, difference, largest)
            worst = max(worst, difference / largest)
    losses = float(np.max(np.abs(ours["losses"] - theirs["losses"]) / theirs["losses"]))
    print(f"{count} ranks: losses within {losses:.2g} relative, moments within {worst:.2g} "
          "of their largest")


def _folder(tmp_path, name: str):
    folder = tmp_path / name
    folder.mkdir()
    return folder


@needs_mpi
def test_cgc_run_resumes_a_zero_run_from_its_gathered_moments(tmp_path):
    """`cgc run --ranks 2` of ZeRO-1: two steps at once, and one step, a checkpoint and a
    resume to two, end in the same checkpoint bit for bit. The checkpoint holds each
    moment whole (both ranks' shards, gathered in rank order), so a rank resumes from its
    own part of it."""
    def run(*arguments):
        command = [sys.executable, "-m", "cgc", "run", ZERO, "--ranks", "2", "--backend",
                   "numpy", "--config", "tiny32", *arguments]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT,
                              env={**os.environ, **MPI_ENVIRONMENT})
        assert done.returncode == 0, done.stdout + done.stderr
        return done
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    run("--steps", "2", "--checkpoint-dir", str(straight))
    run("--steps", "1", "--checkpoint-dir", str(halves))
    resumed = run("--steps", "2", "--resume", str(halves), "--checkpoint-dir", str(halves))
    assert "resumed from" in resumed.stderr
    one = load_file(straight / "step-00000002.safetensors")
    two = load_file(halves / "step-00000002.safetensors")
    assert sorted(one) == sorted(two)
    for label in one:
        assert one[label].tobytes() == two[label].tobytes(), label
    from cgc import api
    program = api.load(ZERO, config="tiny32", rank=0, ranks=2).program
    for label in program.sharded:  # whole in the checkpoint: two ranks' shards
        assert one[label].size == 2 * program.storages[label].count, label
        assert np.any(one[label][program.storages[label].count:] != 0), label


def test_cgc_check_memory_prints_each_rank_and_zero_holds_less_than_the_all_reduce_step():
    """`cgc check --memory --ranks 4`: ZeRO-1's moments a quarter a rank, the moment banks
    not allocated, each rank's total printed; every rank's total below the all-reduce
    step's by three quarters of the two moment banks (less the moments' own padding)."""
    done = subprocess.run([sys.executable, "-m", "cgc", "check", "--memory", "--ranks", "4",
                           "--config", "tiny32", ZERO, PARALLEL], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    zero, whole = done.stdout.split("schedules/train_zero.cg: ok:")
    assert "banks no launch touches, not allocated: cgBankM, cgBankV" in zero
    assert "not allocated: cgBankM" not in whole
    assert "sharded over 4 ranks (this is rank 0's shard of each): cgMomentShard1, " \
           "cgMomentShard2" in zero
    totals = {}
    for text, name in ((zero, "zero"), (whole, "whole")):
        line = next(l for l in text.splitlines() if l.startswith("each rank's total (4 ranks)"))
        figures = [int(part.split(" bytes")[0].split()[-1].replace(",", ""))
                   for part in line.split(": ", 1)[1].split(", rank")]
        assert len(figures) == 4 and len(set(figures)) == 1, line
        totals[name] = figures[0]
    from cgc import api
    program = api.load(ZERO, config="tiny32", rank=0, ranks=4).program
    shard = program.storages["cgMomentShard1"].count * 4  # bytes of one moment's shard
    assert totals["whole"] - totals["zero"] >= 2 * 3 * shard - 2 * 4096, totals


def test_zero_is_checked_for_every_rank_and_refused_where_the_ranks_do_not_divide_the_bank():
    """Each rank's program passes the checker on 1, 2, 4 and 8 ranks in tiny32; on 3 ranks
    the bank does not deal out evenly and the requirement says so."""
    from cgc import api
    from cgc.core.diagnostics import CompileError
    for ranks in (1, 2, 4, 8):
        for rank in range(ranks):
            program = api.load(ZERO, config="tiny32", rank=rank, ranks=ranks).program
            assert (program.rank, program.ranks) == (rank, ranks)
    with pytest.raises(CompileError) as refused:
        api.load(ZERO, config="tiny32", rank=0, ranks=3)
    assert "to be a multiple of cgRanks (3)" in str(refused.value)


def test_the_checker_refuses_zero_without_its_all_gather(tmp_path):
    """The shipped ZeRO-1 step with its all-gather taken out: each rank would keep its own
    update of its shard, and the checker says the ranks part ways (on every rank: the
    elements are that rank's shard), naming the copies that part with them."""
    import shutil
    from cgc import api
    from cgc.core.diagnostics import CompileError
    for path in (ROOT / "schedules").glob("*.cg"):
        shutil.copy(path, tmp_path / path.name)
    mutant = tmp_path / "train_zero.cg"
    text = mutant.read_text()
    gather = "(cgThen (cgCollective cgImageAllGather (cgBankAll cgBankP))"
    assert text.count(gather) == 1
    mutant.write_text(text.replace(gather, "(cgThen cgNothing"))
    for rank in (0, 1):
        with pytest.raises(CompileError) as refused:
            api.load(str(mutant), config="tiny32", rank=rank, ranks=2)
        (error,) = [d for d in refused.value.diagnostics if d.severity == "error"]
        shard = 115328 // 2
        assert error.message.startswith(
            f"after the step 'cgZeroStep', elements {rank * shard} to {(rank + 1) * shard - 1} "
            "of 'cgBankP' differ from rank to rank: 'cgImageAdamW' wrote them"), error.message
        assert any("'cgBankHalf'" in note.message for note in error.notes)


def test_a_rank_option_is_never_taken_for_the_number_of_ranks(capsys):
    """`cgc check` has --ranks and no --rank: argparse once read `--rank 5` as `--ranks 5`
    (an abbreviation) and checked 5 ranks; options are now never abbreviated."""
    from cgc.cli import main
    assert main(["check", ZERO, "--config", "tiny32", "--rank", "5", "--ranks", "2"]) == 2
    assert "unrecognized arguments: --rank 5" in capsys.readouterr().err
    assert main(["compile", ZERO, "--config", "tiny32", "--rank", "5", "--ranks", "2",
                 "-o", "-"]) == 2
    assert "--rank 5: a rank of --ranks 2 runs from 0 to 1" in capsys.readouterr().err
