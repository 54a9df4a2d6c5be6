"""Racecheck on the CPU: CUDA's racecheck, done with ThreadSanitizer's fiber API
(cgc/backends/cuda_cpu/README.md, "Racecheck"; cgc/backends/cuda/emulated.py: racecheck).

Every CUDA thread is a TSan fiber; the only happens-before edges between them are CUDA's:
__syncthreads, __syncwarp, block start and block end. So a write by one thread and an access
by another with no barrier between them is reported, whatever order the fibers happened to
run in, with the kernel, the shared-memory offset and both threads.

- A C++ program with a race on purpose in each of six kernels (two writers of one static
  __shared__ word, a write and a read of dynamic shared memory, a shuffle taken for a barrier,
  a WMMA store read back without __syncwarp, a cp.async copy read by another warp after the
  wait but with no barrier, an ldmatrix of rows other lanes wrote with no __syncwarp) and clean
  kernels beside them (one the attention kernels' cp.async, wait, barrier, ldmatrix).
- The tiny step (bfloat16, with mma.m16n8k16, ldmatrix and cp.async; and float32) has no race;
  nor has it with the Hopper attention forward (wgmma, TMA, mbarrier stages) at three key
  tiles a sequence, where a stage is loaded again once its consumers freed it; freeing the
  stage before the products that read it have waited is reported as a race.
- The barrier campaign: every __syncthreads and __syncwarp of the emitted file (attention,
  attention backward, loss, scatter, and block_sum and layer_norm_backward of
  common.cuh, which the classifier, square-sum, gradient-norm and layer-norm backward
  kernels call) is removed in turn, from ONE racecheck build (cgcpu::barrier_disabled), and
  the removal is reported as a race naming a kernel that runs that barrier, except for the
  barriers listed in REDUNDANT, each with the reason the campaign cannot see what it
  guards. The campaign runs the tiny model with a context of 128 (two attention tiles a
  sequence, so the barriers that guard a tile's reuse guard something)
  on the first two blocks of every launch (CG_CPU_BLOCKS: block sampling), except for the
  barriers of layer_norm_backward (and of its tickets' helpers, sum_partial_rows and
  take_last_ticket), whose last blocks run only when every block of a group has taken its
  ticket, of the sorted scatter, whose window of a run's rows is refilled
  only in a run longer than 32 rows (the space of byte tokens), and of the attention
  backward, whose first two blocks are both dK/dV blocks (its dQ blocks come after them):
  those run every block of their own kernels' launches, the others sampled
  (UNSAMPLED_KERNELS, CG_CPU_UNSAMPLED).
  Removing the barrier between a block's partial sums and its ticket (or a group's sum and
  the groups' ticket) is reported as a race on those partials (global memory) with the last
  block's reads. The ticket's __threadfence calls are not barriers and
  are not removed: ThreadSanitizer does not model fences, and the emulation's atomicInc is
  sequentially consistent, so a missing fence could not be seen here (nor on x86).
- Three scheduling seeds (the order of the fibers at every barrier) give the same bits.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from cgc.backends.cuda.emit import emit_program
from cgc.backends.cuda.emulated import (HEADERS, RACECHECK_ENVIRONMENT, RACECHECK_FLAGS,
                                        BuildFailed, build, compiler_missing, number_barriers,
                                        parse_racecheck, racecheck_run, standalone)
from cgc.training.data import Batches, load_corpus
from cgc.training.loop import train
from cgc.checking.memory import plan_memory
from cgc.pipeline import analyse, evaluate, open_run
from cgc.resources import data_dir

from conftest import HOPPER_THREE_TILES, SCHEDULES

PATH = str(SCHEDULES / "train.cg")
UNIT = HEADERS.parent / "tests" / "racecheck.cu"
CAMPAIGN = ("tiny", {"cgContext": 128})
SAMPLE = "0,1"  # the blocks of every launch the campaign runs (the first two, in linear order)
TOLERANCE = {"tiny": 1e-2, "tiny32": 1e-4}  # the loss against the numpy run's (relative)

# The kernels that run the barriers of each function of the emitted file.
# layer_norm_backward and the two helpers of its tickets (common.cuh): the partial sums' two
# levels, whose last blocks run only when every block of a group has taken its ticket.
NORM_FUNCTIONS = ("layer_norm_backward", "sum_partial_rows", "take_last_ticket")
NORM_KERNELS = ("cgImageLayerNormBackward", "cgImageLayerNormBackwardAdd")
KERNELS_OF = {
    "block_reduce": {"cgImageSquareSum", "cgImageGradientNorm", "cgImageClassifier"},
    **{function: set(NORM_KERNELS) for function in NORM_FUNCTIONS},
}
# Functions whose barriers the campaign removes with every block of their own kernels' launches
# run (the other launches sampled: a barrier guards its kernel's own memory whatever values the
# kernel's inputs hold), with the workers each needs. The layer-norm backward's last blocks (a
# group's, the one that takes the group's last ticket, and the groups', common.cuh) run only
# when every block of the group has taken one, which block sampling never lets happen (the
# sample is blocks 0 and 1, a group 5 blocks here: 16 blocks in groups of 5, 5, 5 and 1, so
# the last two blocks the two workers run, 14 and 15, are in different groups, and a group's
# sum is written while another group's last block runs); and its partial sums go from block
# to block, which only blocks running at once on two workers can show (consecutive blocks of
# one worker are ordered). A layer-norm backward sampled on two workers would find a wrong
# last block (its group's ticket counts only the sampled blocks, and wraps in a later launch)
# reading rows another block of the launch is writing: every two-worker run runs it whole.
# The sorted scatter's second barrier guards the window of a run's rows, which only a run
# longer than one window (32 rows) refills: the space of byte tokens, at a position that
# blocks 0 and 1 do not hold; its runs are the dump's ids in the order cgImageScatterOrder
# sorts them, one block, which the sample runs whole; its races are within a block: one
# worker. The attention backward's blocks 0 and 1 are the dK/dV blocks of key tile 0 of two
# heads (its grid orders the work by z, longest first: the dQ blocks start at z = 1): its
# barriers are removed with every block run, both passes; its races are within a block: one
# worker.
UNSAMPLED_KERNELS = {**{function: (NORM_KERNELS, 2) for function in NORM_FUNCTIONS},
                     "cgImageScatterSorted": (("cgImageScatterSorted",), 1),
                     "cgImageAttentionBackward": (("cgImageAttentionBackward",), 1)}
assert all(set(NORM_KERNELS) <= set(kernels) for kernels, workers in UNSAMPLED_KERNELS.values()
           if workers > 1)
# Every function whose barriers the campaign must reach (at least one site each).
# (The classifier's barriers are block_reduce's, as are block_sum's.)
COVERED = {"cgImageAttention", "cgImageAttentionBackward", "block_reduce", *NORM_FUNCTIONS}

# Barriers whose removal changes nothing in the campaign, by (function, index among its
# barriers, from 0), and why. Not removed from the templates here: reported. The campaign
# found one that guarded nothing anywhere (the second __syncwarp of the attention's row
# loop: the next row touches only its own values, and row r's statistics are read again only
# after the __syncwarp that ends the key tile), and the template dropped it. The ones listed
# guard something the campaign's step does not run.
REDUNDANT: dict = {
    # block_reduce's first barrier keeps a call's writes to `scratch` after every thread's
    # reads of the call before it on the same scratch. Since the layer norm went to a warp a
    # row (its two sums by shuffles), no kernel of the campaign's step (GPT, tiny) makes two
    # such calls: the classifier's three reductions have a scratch each, the square sum and
    # the gradient norm one call. The layer-norm backward's row-over-the-block path makes
    # them (rows wider than 1,024: two sums a row, and the RMSNorm backward's one, in a loop
    # over rows, on one scratch: TinyLlama's width of 2,048), which the campaign does not run.
    ("block_reduce", 0): "guards a second call on one scratch; only wide rows make one",
    # The attention backward's dQ blocks take their key/value head's query heads in turn: the
    # barrier before a head's copies keeps them after every warp's reads of the head before.
    # The campaign's step (GPT, tiny) has no grouped heads: a dQ block takes one head, and
    # the barrier (member > 0) never runs. With grouped heads it guards the stage the last
    # key step read (test_the_grouped_backward_races_without_its_head_barrier).
    ("cgImageAttentionBackward", 0): "guards the next query head's copies; only grouped "
                                     "heads (kvHeads < heads) have one",
}


def _racecheck_available() -> str | None:
    if compiler_missing() is not None:
        return compiler_missing()
    try:
        build('#include <cstdio>\nint main() { std::puts("ok"); }\n', "tsan-probe",
              flags=RACECHECK_FLAGS)
    except BuildFailed as error:
        return f"g++ cannot build with -fsanitize=thread: {str(error)[-300:]}"
    return None


_MISSING = _racecheck_available()
pytestmark = pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))


def _dump(folder: Path, config: str, overrides: dict, path: str = PATH) -> str:
    run = open_run("numpy", analyse([path]), path, config, overrides, 0)
    program = run.program
    train(run, Batches(load_corpus(None), program.role("batch"), program.role("context"), 0), 1,
          out=io.StringIO(), dump=str(folder))
    return str(folder)


class Setup:
    """The racecheck builds (in parallel) and the dumps they replay."""

    def __init__(self, folder: Path):
        frontend = analyse([PATH])
        self.programs = {
            "tiny": evaluate(frontend, PATH, config="tiny"),
            "tiny32": evaluate(frontend, PATH, config="tiny32"),
            "tiny-hopper": evaluate(frontend, PATH, config="tiny", overrides=HOPPER_THREE_TILES),
            "campaign": evaluate(frontend, PATH, config=CAMPAIGN[0], overrides=CAMPAIGN[1]),
        }
        with ThreadPoolExecutor(max_workers=2) as pool:
            self.unit = pool.submit(build, UNIT.read_text(), "racecheck-unit",
                                    RACECHECK_FLAGS, (f"-I{UNIT.parent}",))
            binaries = {name: pool.submit(standalone, program, racecheck=True)
                        for name, program in self.programs.items()}
            self.dumps = {"tiny": _dump(folder / "tiny", "tiny", {}),
                          "tiny32": _dump(folder / "tiny32", "tiny32", {}),
                          "tiny-hopper": _dump(folder / "tiny-hopper", "tiny", HOPPER_THREE_TILES),
                          "campaign": _dump(folder / "campaign", *CAMPAIGN)}
            for future in [self.unit, *binaries.values()]:
                future.result()
        self.unit = self.unit.result()

    def run(self, name: str, **options):
        return racecheck_run(self.programs[name], self.dumps[name], **options)


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Setup:
    return Setup(tmp_path_factory.mktemp("racecheck"))


def _source_line(text: str, fragment: str) -> int:
    return next(i + 1 for i, line in enumerate(text.splitlines()) if fragment in line)


@pytest.mark.parametrize("seed", [0, 5])
def test_a_known_race_is_reported_with_both_threads_and_the_offset(setup, seed):
    environment = {name: value for name, value in os.environ.items()
                   if not name.startswith("CG_CPU_")}
    environment.update(RACECHECK_ENVIRONMENT, CG_CPU_THREADS="2", CG_CPU_SCHEDULE_SEED=str(seed))
    done = subprocess.run([str(setup.unit)], capture_output=True, text=True, env=environment,
                          timeout=120)
    assert "racecheck: ok" in done.stdout, done.stdout + done.stderr[-3000:]
    races = parse_racecheck(done.stderr, setup.unit, "racecheck-unit.cpp")
    by_kernel = {race.kernel: race for race in races}
    assert set(by_kernel) == {"racy_two_writers", "racy_dynamic",
                              "racy_shuffle_is_not_a_barrier", "racy_wmma_store_then_read",
                              "racy_cp_async_without_barrier",
                              "racy_ldmatrix_without_syncwarp"}, \
        "\n".join(map(str, races))
    assert done.returncode == 66  # ThreadSanitizer's exit status when it reported
    source = UNIT.read_text()

    two = by_kernel["racy_two_writers"]
    assert two.memory == "static shared" and two.variable.endswith("::word"), two
    assert two.offset == 8 and two.block == (0, 0, 0)  # word[2]
    assert set(two.threads) == {3, 17}
    assert two.access.access == two.previous.access == "write"
    assert set(two.lines) == {_source_line(source, "word[2] = threadIdx.x")}

    dynamic = by_kernel["racy_dynamic"]
    assert dynamic.memory == "dynamic shared" and dynamic.offset == 40, dynamic  # words[10]
    assert set(dynamic.threads) == {5, 9}
    sides = {dynamic.access.access: dynamic.access, dynamic.previous.access: dynamic.previous}
    assert sides["write"].index == 5 and sides["read"].index == 9
    assert sides["write"].line == _source_line(source, "words[10] = 1")
    assert sides["read"].line == _source_line(source, "out[blockIdx.x] = words[10]")

    shuffle = by_kernel["racy_shuffle_is_not_a_barrier"]
    assert set(shuffle.threads) == {0, 1} and shuffle.memory == "static shared", shuffle

    wmma = by_kernel["racy_wmma_store_then_read"]
    assert {wmma.access.access, wmma.previous.access} == {"read", "write"}, wmma
    assert wmma.threads[0] != wmma.threads[1] and wmma.variable.endswith("::tile"), wmma
    assert "by thread" in str(two) and "offset 8" in str(two)

    # cp.async: the copy is the issuing thread's write, at its wait (cgcpu/ptx.h).
    copy = by_kernel["racy_cp_async_without_barrier"]
    assert {copy.access.access, copy.previous.access} == {"read", "write"}, copy
    assert copy.threads[0] // 32 != copy.threads[1] // 32, copy  # another warp's copy
    load = by_kernel["racy_ldmatrix_without_syncwarp"]
    assert {load.access.access, load.previous.access} == {"read", "write"}, load
    assert set(load.threads) == {3, 7} and load.variable.endswith("::raw"), load


@pytest.mark.parametrize("config", ["tiny", "tiny32"])
def test_the_tiny_step_has_no_race(setup, config):
    """The whole step, every block of every launch, two workers: no report of any kind (and
    the loss of the numpy run that made the dump)."""
    result = setup.run(config, threads=2)
    assert result.races == [], "\n".join(map(str, result.races[:10]))
    assert result.status == 0 and "ThreadSanitizer" not in result.stderr, result.stderr[-3000:]
    loss = float(re.search(r"loss (\S+)", result.stdout).group(1))
    expected = json.loads((Path(setup.dumps[config]) / "run.json").read_text())["losses"][0]
    assert abs(loss - expected) <= TOLERANCE[config] * expected, (loss, expected)


def test_the_hopper_attention_has_no_race(setup):
    """The step with the Hopper attention forward at three key tiles a sequence, every block
    of its launches (each refills a stage after its consumers freed it), the other kernels'
    first, second and last blocks (they are the tiny step's, checked whole above): no report
    of any kind."""
    result = setup.run("tiny-hopper", threads=2, blocks="0,1,-1",
                       unsampled=("cgImageAttention",))
    assert result.races == [], "\n".join(map(str, result.races[:10]))
    assert result.status == 0 and "ThreadSanitizer" not in result.stderr, result.stderr[-3000:]


def test_a_hopper_stage_freed_before_its_products_read_it_is_a_race(setup, tmp_path,
                                                                     monkeypatch):
    """The Hopper attention's consumers arrive on a stage's empty barrier before their P V
    products have read its V tile: the producer's next copy into that stage races the
    products' reads (the detector behind test_the_tiny_step_has_no_race[tiny-hopper])."""
    templates = tmp_path / "templates"
    shutil.copytree(data_dir("templates"), templates)
    path = templates / "kernels" / "attention_hopper.cu.j2"
    text = path.read_text(encoding="utf-8")
    early, late = "    cg_wgmma_fence();\n#pragma unroll\n    for (int c = 0;", \
        "    cg_mbarrier_arrive(&empty[s]);  // this stage's key and value tiles are read\n"
    assert early in text and late in text
    text = text.replace(late, "").replace(early, late + early)
    path.write_text(text, encoding="utf-8")
    monkeypatch.setenv("CGC_TEMPLATES", str(templates))
    program = evaluate(analyse([PATH]), PATH, config="tiny", overrides=HOPPER_THREE_TILES)
    # block 0 of each launch: the forward's takes the last query tile first (longest first),
    # three key tiles, so it loads a stage again
    result = racecheck_run(program, setup.dumps["tiny-hopper"], threads=2, blocks="0")
    assert any(race.kernel == "cgImageAttention" for race in result.races), \
        (result.races[:3], result.stderr[-2000:])


def _outcome(result, baseline) -> str:
    # A removal reported as a race may fault afterwards: the layer-norm backward's threads,
    # reading `last` before thread 0 wrote it, part ways and deadlock at its last barrier.
    if result.races:
        return "race"
    if result.faults or result.status not in (0, 66):
        return "fault"
    if result.stdout != baseline.stdout:
        return "wrong result"
    return "redundant"


def test_removing_any_barrier_is_reported(setup):
    program = setup.programs["campaign"]
    _, sites = number_barriers(emit_program(program, plan_memory(program)).text)
    functions = {site.function for site in sites}
    assert COVERED <= functions, functions
    def how(site):
        """The blocks each launch runs, the kernels that run all of theirs, the workers."""
        if site.function in UNSAMPLED_KERNELS:
            return SAMPLE, *UNSAMPLED_KERNELS[site.function]
        return SAMPLE, (), 1

    def run(ways, **options):
        blocks, unsampled, threads = ways
        return setup.run("campaign", blocks=blocks, unsampled=unsampled, threads=threads,
                         **options)

    baselines = {ways: run(ways) for ways in {how(site) for site in sites}}
    for baseline in baselines.values():
        assert baseline.races == [] and baseline.status == 0, baseline.stderr[-3000:]

    def removal(site):
        return site, run(how(site), disabled_barrier=site.number)

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(removal, sites))

    ordinal: dict[str, int] = {}
    table, problems = [], []
    for site, result in results:
        key = (site.function, ordinal.setdefault(site.function, 0))
        ordinal[site.function] += 1
        outcome = _outcome(result, baselines[how(site)])
        kernels = sorted({race.kernel for race in result.races})
        table.append(f"{site.number:3} {site.function:26} #{key[1]} line {site.line:4} "
                     f"{site.kind:14} {outcome:12} {', '.join(kernels)}")
        if key in REDUNDANT:
            if outcome != "redundant":
                problems.append(f"{site}: listed as redundant, but {outcome}")
            continue
        if outcome != "race":
            problems.append(f"{site}: {outcome}, no race reported\n{result.stderr[-2000:]}")
            continue
        allowed = KERNELS_OF.get(site.function, {site.function})
        if not set(kernels) <= allowed:
            problems.append(f"{site}: races in {kernels}, expected only {sorted(allowed)}")
        for race in result.races:
            # the layer-norm backward's partials are global memory: the barrier before the
            # ticket orders the writes of one block before another block's reads of them
            memories = ("dynamic shared", "static shared") + \
                (("global",) if site.function in NORM_FUNCTIONS else ())
            if race.memory not in memories or race.offset is None:
                problems.append(f"{site}: not a shared-memory race: {race}")
            sides = [(side.block, side.index) for side in (race.access, race.previous)]
            if race.threads[0] is None or sides[0] == sides[1]:
                problems.append(f"{site}: a race needs two threads: {race}")
    print("\nbarrier campaign (tiny, context 128, blocks " + SAMPLE + "; every block of "
          + ", ".join(sorted({k for kernels, _ in UNSAMPLED_KERNELS.values() for k in kernels}))
          + "):\n" + "\n".join(table))
    assert not problems, "\n".join(problems) + "\n" + "\n".join(table)
    # The redundant barriers, again in a shuffled order: still nothing to report.
    for (function, index) in REDUNDANT:
        site = [s for s in sites if s.function == function][index]
        for seed in (1,):
            again = run(how(site), seed=seed, disabled_barrier=site.number)
            assert again.races == [] and again.stdout == baselines[how(site)].stdout, \
                (site, seed)


def test_three_schedule_seeds_give_the_same_bits():
    """The tiny step (bfloat16, WMMA) with the fibers woken at every barrier and collective in
    three pseudo-random orders: every byte of every allocation is the same."""
    frontend = analyse([PATH])
    memories = []
    for seed in (1, 2, 3):
        run = open_run("emulated", frontend, PATH, "tiny", {}, 0)
        run.set_schedule_seed(seed)
        program = run.program
        ids, targets = Batches(load_corpus(None), program.role("batch"),
                               program.role("context"), 0).next()
        run.step(ids, targets)
        memories.append({name: memory.copy() for name, memory in run.memory.items()})
    for other in memories[1:]:
        for name, memory in memories[0].items():
            assert np.array_equal(memory, other[name]), name


LLAMA = str(SCHEDULES / "llama" / "train.cg")


def test_the_grouped_backward_races_without_its_head_barrier(tmp_path):
    """The barrier REDUNDANT lists for the campaign's step (GPT, no grouped heads) guards
    something where heads are grouped. Llama's tiny step (4 query heads on 2 key/value heads)
    at a context of one attention tile: a dQ block's diagonal key step reads stage 0 (k and
    v), which the next query head's copies refill; every backward block run, without the
    barrier the copies race with the other warp's ldmatrix reads, with it nothing races."""
    overrides = {"cgContext": 64}
    program = evaluate(analyse([LLAMA]), LLAMA, config="tiny", overrides=overrides)
    assert program.role("heads") > program.role("kvHeads")
    standalone(program, racecheck=True)
    dump = _dump(tmp_path / "llama", "tiny", overrides, LLAMA)
    text = emit_program(program, plan_memory(program)).text
    _, sites = number_barriers(text)
    backward = [site for site in sites if site.function == "cgImageAttentionBackward"]
    barrier = backward[0]  # REDUNDANT's ("cgImageAttentionBackward", 0)
    assert ("cgImageAttentionBackward", 0) in REDUNDANT
    assert "if (member > 0) __syncthreads();" in text.splitlines()[barrier.line - 1]
    ways = {"blocks": SAMPLE, "unsampled": ("cgImageAttentionBackward",), "threads": 1}
    kept = racecheck_run(program, dump, **ways)
    assert kept.races == [] and kept.status == 0, kept.stderr[-3000:]
    removed = racecheck_run(program, dump, disabled_barrier=barrier.number, **ways)
    assert removed.races, removed.stderr[-3000:]
    assert {race.kernel for race in removed.races} == {"cgImageAttentionBackward"}
    assert all(race.memory == "dynamic shared" for race in removed.races)
