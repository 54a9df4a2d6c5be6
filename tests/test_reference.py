"""The reference machine against an independent PyTorch model (tests/torch_model.py).

float32 configuration (tiny32): loss, every gradient, every parameter after one AdamW step,
and a 10-step loss trajectory agree to a relative error (||a - b|| / ||b||) of 1e-5.

bfloat16 configuration (tiny): the machine rounds every value stored in the low type to
bfloat16 (8 significant bits: unit roundoff u = 2^-9, about 2e-3), while the PyTorch
model stays in float32, so the comparison measures what bfloat16 costs. Each product input
is rounded once and the roundings are independent, so their errors add in quadrature
through the layers: we measured 3e-3 to 5e-3 on the gradients, 3e-5 on the first loss and
3e-4 on the 10-step trajectory. The tolerances, with about twice that as margin, are in
BFLOAT16_TOLERANCES. Parameters after a bfloat16 step are not compared with the float32
model: AdamW's first update is nearly lr * sign(g) per element, so an element whose
gradient is within bfloat16 noise of zero moves by lr the other way. The optimizer is
checked instead on the machine's own gradients, where it must agree to 1e-5 as in float32,
and the 16-bit copies must be exactly the rounded parameters.

The logits are stored in the low type too (the fused classifier, cgImageClassifier, reads
them and overwrites them with their gradient in bfloat16). Rounding a logit z to bfloat16
moves it by at most |z| 2^-9; a row's loss lse(z) - z[target] moves by sum_j p_j dz_j -
dz[target], at most twice the largest such move, and with independent signs the mean over
rows moves far less. Measured at tiny (step 1 against the float32 PyTorch model): the loss
error went from 1.44e-5 (float32 logits) to 1.31e-5, the worst gradient from 4.42e-3 to
4.38e-3, the 10-step trajectory from 2.4e-4 to 1.4e-4: below the noise of the rest of the
bfloat16 step, so BFLOAT16_TOLERANCES stand unchanged. At GPT-2's vocabulary of 50,304 and
logits of larger spread (test_bfloat16_logits_at_the_full_vocabulary) the mean loss of 256
rows moves by 5e-6 (logits of standard deviation 1) to 7e-5 (6), a single row by up to 0.07;
the gradient, rounded once to bfloat16, is as precise as the cast of the float32 gradient
that the seed's backward makes.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from cgc.training.data import Batches, load_corpus
from cgc.frontend.api import analyse
from cgc.backends.numerics import round_to_bfloat16
from cgc.training.loop import train
from cgc.pipeline import open_run

from conftest import SCHEDULES
from torch_model import MATRICES, Dump, Gpt

STEPS = 10
FLOAT32_TOLERANCE = 1e-5
BFLOAT16_TOLERANCES = {"loss": 1e-3, "gradient": 1e-2, "trajectory": 2e-3}


def relative(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Ten steps of each configuration on the reference machine, dumped."""
    path = str(SCHEDULES / "train.cg")
    frontend = analyse([path])
    corpus = load_corpus(None)
    found = {}
    for config in ("tiny32", "tiny"):
        run = open_run("numpy", frontend, path, config, {}, seed=0)
        folder = tmp_path_factory.mktemp(config)
        batches = Batches(corpus, run.constants["cgBatch"], run.constants["cgContext"], 0)
        train(run, batches, STEPS, dump=str(folder), out=io.StringIO())
        found[config] = (run, Dump(folder))
    return found


def first_step(dump: Dump):
    model = Gpt(dump.constants, dump.parts["before"])
    loss = model.loss(dump.ids[0], dump.targets[0])
    loss.backward()
    return model, float(loss.detach())


def trajectory(dump: Dump) -> list[float]:
    model = Gpt(dump.constants, dump.parts["before"])
    optimizer = model.optimizer(dump.constants)
    return [model.step(optimizer, dump.ids[s], dump.targets[s], float(dump.constants["cgClipNorm"]))
            for s in range(STEPS)]


def test_float32_loss_and_every_gradient(runs):
    _, dump = runs["tiny32"]
    model, loss = first_step(dump)
    assert abs(dump.manifest["losses"][0] - loss) / loss <= FLOAT32_TOLERANCE
    gradients = model.flat(gradients=True)
    assert set(gradients) == set(dump.parts["gradients"])
    for name, expected in gradients.items():
        assert relative(dump.parts["gradients"][name], expected) <= FLOAT32_TOLERANCE, name


def test_float32_parameters_after_one_step(runs):
    _, dump = runs["tiny32"]
    model = Gpt(dump.constants, dump.parts["before"])
    model.step(model.optimizer(dump.constants), dump.ids[0], dump.targets[0],
               float(dump.constants["cgClipNorm"]))
    for name, expected in model.flat().items():
        assert relative(dump.parts["after"][name], expected) <= FLOAT32_TOLERANCE, name


def test_float32_ten_step_trajectory(runs):
    _, dump = runs["tiny32"]
    theirs = trajectory(dump)
    ours = dump.manifest["losses"]
    for step, (a, b) in enumerate(zip(ours, theirs)):
        assert abs(a - b) / abs(b) <= FLOAT32_TOLERANCE, step
    assert ours[-1] < ours[0]


def test_bfloat16_loss_gradients_and_trajectory(runs):
    _, dump = runs["tiny"]
    model, loss = first_step(dump)
    assert abs(dump.manifest["losses"][0] - loss) / loss <= BFLOAT16_TOLERANCES["loss"]
    for name, expected in model.flat(gradients=True).items():
        error = relative(dump.parts["gradients"][name], expected)
        assert error <= BFLOAT16_TOLERANCES["gradient"], (name, error)
    for step, (a, b) in enumerate(zip(dump.manifest["losses"], trajectory(dump))):
        assert abs(a - b) / abs(b) <= BFLOAT16_TOLERANCES["trajectory"], step


def test_bfloat16_optimizer_on_the_machines_own_gradients(runs):
    run, dump = runs["tiny"]
    model = Gpt(dump.constants, dump.parts["before"])
    for name, parameter in model.parameters.items():
        parameter.grad = torch.tensor(dump.parts["gradients"][name].reshape(parameter.shape))
    torch.nn.utils.clip_grad_norm_(list(model.parameters.values()),
                                   float(dump.constants["cgClipNorm"]))
    model.optimizer(dump.constants).step()
    for name, expected in model.flat().items():
        assert relative(dump.parts["after"][name], expected) <= FLOAT32_TOLERANCE, name


def test_bfloat16_copies_are_the_rounded_parameters(runs):
    run, dump = runs["tiny"]
    parameters = run.bank_values("parameters")
    for name in MATRICES:
        copy = run.machine.array(f"cgBankHalf.{name}")
        np.testing.assert_array_equal(copy, round_to_bfloat16(parameters[name]))


# The fused classifier's reference on bfloat16 logits against PyTorch on the float32
# logits they were rounded from, at GPT-2's vocabulary: the relative error of the mean loss
# (measured 5e-6 at spread 1, 2.6e-5 at 3, 6.5e-5 at 6; see the module's docstring) and of
# the gradient (one bfloat16 rounding of values computed from rounded logits: measured about
# 4e-3). Breaking the reference (the one-hot left out of the gradient, or the loss taken from
# the unrounded logits' maximum) fails the gradient or the bit-level loss comparison below.
CLASSIFIER_TOLERANCES = {"loss": 2e-4, "gradient": 1e-2}


@pytest.mark.parametrize("spread", [1.0, 6.0])
def test_bfloat16_logits_at_the_full_vocabulary(spread):
    from cgc.backends.numpy.machine import Kernel, Pointer
    from cgc.backends.numpy.reference import classifier

    rows, vocab = 64, 50304
    rng = np.random.default_rng(7)
    logits = rng.normal(0, spread, (rows, vocab)).astype(np.float32)
    targets = rng.integers(0, vocab, rows).astype(np.int32)
    targets[3] = -1  # an ignored row: loss and gradient 0
    stored = round_to_bfloat16(logits).astype(np.float32)
    memory = {"logits": np.frombuffer(np.ascontiguousarray(
        (stored.view(np.uint32) >> 16).astype(np.uint16)).tobytes(), dtype=np.uint16).copy(),
        "loss": np.zeros(rows, np.float32), "correct": np.zeros(rows, np.int32),
        "targets": targets.copy()}
    elements = {"logits": "low", "loss": "float32", "correct": "int32", "targets": "int32"}
    access = {"logits": "readwrite", "loss": "write", "correct": "write", "targets": "read"}
    pointers = {name: Pointer("classifier", i, name, access[name], elements[name], "bfloat16",
                              memory[name], None, name, 0, memory[name].itemsize)
                for i, name in enumerate(elements)}
    scale = 1.0 / rows
    classifier(Kernel(pointers, {"scale": scale, "ignoreIndex": -1}, (rows, 1, 1), (1024, 1, 1),
                      {"vocab": vocab}))
    z = torch.tensor(logits, requires_grad=True)
    expected = torch.nn.functional.cross_entropy(z, torch.tensor(targets, dtype=torch.long),
                                                 ignore_index=-1, reduction="sum") * scale
    expected.backward()
    loss = memory["loss"]
    assert loss[3] == 0 and memory["correct"][3] == 0
    assert abs(loss.sum() * scale - expected.item()) / expected.item() <= \
        CLASSIFIER_TOLERANCES["loss"]
    gradient = (memory["logits"].astype(np.uint32) << 16).view(np.float32).reshape(rows, vocab)
    assert not gradient[3].any()
    assert relative(gradient, z.grad.numpy()) <= CLASSIFIER_TOLERANCES["gradient"]
    # The loss is exactly that of the rounded logits (float64 here, float32 there).
    top = stored.max(axis=1, keepdims=True).astype(np.float64)
    lse = top[:, 0] + np.log(np.exp(stored - top).sum(axis=1))
    exact = lse - stored[np.arange(rows), np.maximum(targets, 0)]
    counted = targets >= 0
    np.testing.assert_allclose(loss[counted], exact[counted], rtol=1e-5)
    hits = counted & (stored.argmax(axis=1) == np.maximum(targets, 0))
    np.testing.assert_array_equal(memory["correct"], hits.astype(np.int32))


def test_the_dump_holds_what_its_format_promises(runs):
    _, dump = runs["tiny32"]
    manifest = dump.manifest
    assert manifest["format"] == "cgc-dump-1" and manifest["steps"] == STEPS
    rows = manifest["constants"]["cgBatch"] * manifest["constants"]["cgContext"]
    assert dump.ids.shape == dump.targets.shape == (STEPS, rows)
    windows = (STEPS, manifest["constants"]["cgBatch"], manifest["constants"]["cgContext"])
    ids, targets = dump.ids.reshape(windows), dump.targets.reshape(windows)
    np.testing.assert_array_equal(ids[..., 1:], targets[..., :-1])  # next-byte targets
    for part in ("before", "gradients", "after", "final"):
        for name, entry in manifest["entries"].items():
            assert dump.parts[part][name].shape == (entry["count"],), (part, name)


@pytest.mark.parametrize("count,blocks,threads", [(100_003, 7, 32), (4 * 32 * 7 * 64, 7, 32),
                                                  (5, 3, 128), (5, 4096, 1024),
                                                  (1_000_000, 132, 128)])
def test_the_square_sums_are_each_blocks_share(count, blocks, threads, monkeypatch):
    """Block b's partial sums the squares of the runs of 4 x threads elements whose run
    index is b modulo the grid (the kernel's grid-stride loop), in float64, rounded once: the
    same bits as a bincount over each element's owner (both add in index order), with the
    reference's pieces made small (portable.PIECE: many pieces, each carrying the sums so
    far), at sizes a whole number of rounds of the grid and not, and with a grid larger than
    the input. (Rounded to float32, another order of addition would seldom show; a sum
    dropped between pieces, or a wrong owner, does.)"""
    from cgc.backends.numpy import portable
    from cgc.backends.numpy.machine import Kernel, Pointer
    from cgc.backends.numpy.reference import square_sum

    monkeypatch.setattr(portable, "PIECE", 256)  # 4,096 elements a piece, or a round
    rng = np.random.default_rng(count)
    values = (rng.standard_normal(count) * rng.choice([1e-20, 1e-3, 1, 1e3, 1e12], count)) \
        .astype(np.float32)
    values[::1001] = 0
    memory = {"input": values, "partials": np.full(blocks, np.nan, np.float32)}
    access = {"input": "read", "partials": "write"}
    pointers = {name: Pointer("squareSum", i, name, access[name], "float32", "bfloat16",
                              memory[name], None, name, 0, 4)
                for i, name in enumerate(memory)}
    square_sum(Kernel(pointers, {"count": count}, (blocks, 1, 1), (threads, 1, 1), {}))
    wide = values.astype(np.float64)
    owner = (np.arange(count) // (4 * threads)) % blocks
    expected = np.bincount(owner, weights=wide * wide, minlength=blocks).astype(np.float32)
    assert np.array_equal(memory["partials"].view(np.uint32), expected.view(np.uint32))
