"""The emitted program's choice of cuBLASLt algorithm (templates/program.cu.j2,
cg_choose_algorithm): of the heuristic's first few, only those that make one pass over k and
give the first one's bits on the shape's first operands are timed, and the fastest is kept, so
the numbers never hang on a timing. The CPU twin (cgc/backends/cuda_cpu) offers three
algorithms: two in one pass (the same bits) and a split-K one (other bits, where rounding
shows). Built with -DCG_TIME_ALGORITHMS=1, the CPU build runs the choice as a GPU build does
(by default it keeps the first: a time on the CPU says nothing of a GPU)."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from cgc.backends.cuda.emulated import STANDALONE_FLAGS, build, compiler_missing
from cgc.pipeline import analyse, open_run
from cgc.training.data import Batches, load_corpus
from cgc.training.loop import train

from conftest import SCHEDULES

pytestmark = pytest.mark.skipif(compiler_missing() is not None, reason=str(compiler_missing()))

PATH = SCHEDULES / "train.cg"
REPORT = re.compile(r"cuBLASLt product m (\d+) n (\d+) k (\d+): (\d+) algorithms in one pass over k, "
                    r"(\d+) give the first's bits, chose algorithm (\d+)")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The tiny step's program built both ways, and a dumped 3-step NumPy run."""
    folder = tmp_path_factory.mktemp("algorithms")
    run = open_run("numpy", analyse([PATH]), PATH, "tiny", {}, 0)
    numpy_losses = train(run, Batches(load_corpus(None), 4, 64, 0), 3, out=open(os.devnull, "w"),
                         dump=str(folder / "dump")).losses
    emulated = open_run("emulated", analyse([PATH]), PATH, "tiny", {}, 0)
    text = emulated.emitted.text
    return {"dump": str(folder / "dump"), "numpy": numpy_losses,
            "first": build(text, "algorithms-first", STANDALONE_FLAGS),
            "timed": build(text, "algorithms-timed", STANDALONE_FLAGS, ("-DCG_TIME_ALGORITHMS=1",))}


def _replay(binary, dump, steps=3, **environment):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CG_")}
    env.update(environment, CG_ALGORITHM_REPORT="1")
    done = subprocess.run([str(binary), dump, str(steps)], capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    losses = re.findall(r"loss (\S+)", done.stdout)
    return losses, [tuple(int(x) for x in m.groups()) for m in REPORT.finditer(done.stderr)]


def test_the_cpu_build_keeps_the_first_algorithm(built):
    losses, reports = _replay(built["first"], built["dump"])
    assert reports == []
    assert len(losses) == 3
    for ours, theirs in zip(losses, built["numpy"]):
        assert abs(float(ours) - theirs) <= 1e-4 * theirs


def test_only_one_pass_algorithms_are_timed_and_the_numbers_are_the_firsts(built):
    first, _ = _replay(built["first"], built["dump"])
    losses, reports = _replay(built["timed"], built["dump"])
    assert losses == first  # the same printed losses, whichever was fastest
    # each plan (shape, operations, epilogue) chosen once, at its first call: in step 1
    one_step = _replay(built["timed"], built["dump"], steps=1)[1]
    assert len(reports) >= 8 and [r[:5] for r in reports] == [r[:5] for r in one_step]
    for m, n, k, one_pass, same, chosen in reports:
        assert (one_pass, same) == (2, 2) and chosen in (0, 1), reports  # split-K never offered


def test_an_algorithm_with_other_bits_is_never_chosen_whatever_its_label(built):
    """With the split-K algorithm labelled one pass, the comparison of bits alone keeps it
    out where its rounding differs (a comparison that always said "same" fails here)."""
    first, _ = _replay(built["first"], built["dump"])
    losses, reports = _replay(built["timed"], built["dump"], CG_CPU_SPLIT_K_UNLABELLED="1")
    assert losses == first
    assert all(one_pass == 3 for _, _, _, one_pass, _, _ in reports), reports
    dropped = [r for r in reports if r[4] == 2]
    assert len(dropped) >= 4, reports  # the split's other bits, caught
    assert all(r[5] in (0, 1) for r in dropped), dropped


# ---- what each product writes -------------------------------------------------------------

# The product outputs no launch reads before they are written again, by schedule: the
# recomputing step's forward writes the GELU product's aux matrix (pre, 50 MB a layer at
# GPT-2's shape) that its backward recomputes rather than reads; a forward product without the
# aux (cuBLASLt's GELU epilogue, an image not written yet) would save 12 x 2 x 50 MB of HBM
# traffic a step, about 0.14 ms at 4.3 TB/s (docs/performance-model.md, "What is not done").
DEAD_OUTPUTS = {"train.cg": set(), "train_parallel.cg": set(),
                "train_recompute.cg": {("cgImageProductGelu", "pre")}}


def _product_outputs(program):
    """Each write of a product to a step buffer or arena slot, (time in the unrolled step,
    storage) -> (launch, parameter), and the reads that see it, from the checker's own flow of
    values (cgc/checking/flow.py: which write each read sees, element by element)."""
    from cgc.checking.flow import TRACKED, WRITES, follow
    flow = follow(program)
    assert flow.exact
    outputs = {}
    for time, (launch, _, _) in enumerate(program.unrolled()):
        if launch.image.library is None:
            continue
        for binding in launch.pointers:
            parameter = launch.image.pointers[binding.index]
            if parameter.access in WRITES and binding.view.storage.kind in TRACKED:
                outputs[time, binding.view.storage.name] = (launch, parameter)
    readers = {key: [] for key in outputs}
    for read in flow.reads:
        for _, _, writer in read.sources:
            key = (writer, read.binding.view.storage.name)
            if key in readers:
                readers[key].append(read)
    return outputs, readers


@pytest.mark.parametrize("schedule", sorted(DEAD_OUTPUTS))
def test_no_product_output_is_cast_down_each_is_written_as_its_readers_read_it(schedule):
    """Issue 24: a product that feeds a low-type consumer writes the low type. At GPT-2's shape
    each product's output is read (until it is written again) only as the type it was written
    in, and never by a cast-down: the float32 ones are the residual stream and the layer norms'
    input gradients, each read as float32 (the weight gradients go to the banks, which the
    optimizer reads as float32 by their type). An output no launch reads is listed
    (DEAD_OUTPUTS), so that a new one fails here."""
    from cgc.api import load
    outputs, readers = _product_outputs(load(SCHEDULES / schedule, config="gpt2").program)
    written = {"float32": 0, "low": 0}
    dead = set()
    for key, (launch, parameter) in outputs.items():
        written[parameter.element] += 1
        for read in readers[key]:
            assert read.launch.image.name != "cgImageCastDown", (launch.image.name, key)
            assert read.parameter.element == parameter.element, \
                (launch.image.name, read.launch.image.name)
        if not readers[key]:
            dead.add((launch.image.name, parameter.name))
    assert written["float32"] > 0 and written["low"] > 0, written
    assert dead == DEAD_OUTPUTS[schedule]
