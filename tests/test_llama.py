"""The Llama-style step (schedules/llama/): RMSNorm, grouped-query attention, SwiGLU, an
untied head, written in .cg with the GPT step's images, launches and optimizer.

Proven here:
- the reference machine (numpy backend) against an independent PyTorch model
  (tests/torch_llama.py): in float32 (tiny32) the loss, every gradient and the parameters
  after one and after three AdamW steps within 1e-5 relative (||a - b|| / ||b||), the
  tolerance tests/test_reference.py argues for the GPT step (both sides compute in float32,
  in different orders; measured here: gradients about 2.5e-7, parameters after three steps
  about 4e-6); in bfloat16 (tiny) the loss and gradients within BFLOAT16_TOLERANCES, the
  same argument as the GPT step's (each product input rounded once to 8 bits);
- the emitted CUDA, run on the CPU (the emulated backend), kernel by kernel with its outputs
  poisoned against each image's NumPy reference, and the whole float32 step within 1e-4
  (tests/test_emulated.py says why), at the tiny shape and at an awkward one (a key/value
  head serving 3 query heads, 2 query tiles a sequence, an MLP width that is no multiple of
  a kernel's block);
- it learns, resumes bit-identically from a checkpoint, samples, and trains on 2 data-parallel
  ranks as on one rank with the whole batch;
- what GQA requires of the shape is checked: query heads a multiple of key/value heads.
"""

from __future__ import annotations

import io

import numpy as np
import pytest

from cgc.backends.cuda.emulated import compiler_missing
from cgc.cli import main
from cgc.pipeline import analyse, open_run
from cgc.training import checkpoint
from cgc.training.data import Batches, load_corpus
from cgc.training.loop import train

from conftest import HOPPER, SCHEDULES
from test_emulated import (every_kernel_against_its_reference,
                           one_float32_step_matches_the_numpy_backend, tokens)
from test_parallel import _assert_same_training, _ranks, needs_mpi
from test_reference import BFLOAT16_TOLERANCES, FLOAT32_TOLERANCE, relative
from torch_llama import Llama
from torch_model import Dump

LLAMA = SCHEDULES / "llama"
TRAIN = str(LLAMA / "train.cg")
RECOMPUTE = str(LLAMA / "train_recompute.cg")
PARALLEL = str(LLAMA / "train_parallel.cg")
SAMPLE = str(LLAMA / "sample.cg")
STEPS = 3
# 3 sequences of 128 (2 query tiles), width 96 in 6 query heads of 16 sharing 2 key/value
# heads (3 each), an MLP of 40 (5 rows of 8 elements short of a 2048-element block), 3 layers.
AWKWARD = {"cgBatch": 3, "cgContext": 128, "cgVocab": 384, "cgWidth": 96, "cgHeads": 6,
           "cgKvHeads": 2, "cgFfnWidth": 40, "cgLayers": 3}
needs_compiler = pytest.mark.skipif(compiler_missing() is not None,
                                    reason="needs the host C++ compiler (g++)")


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """Three steps of each configuration on the reference machine, dumped."""
    frontend = analyse([TRAIN])
    found = {}
    for config in ("tiny32", "tiny"):
        run = open_run("numpy", frontend, TRAIN, config, {}, seed=0)
        folder = tmp_path_factory.mktemp(config)
        batches = Batches(load_corpus(None), run.constants["cgBatch"],
                          run.constants["cgContext"], 0)
        train(run, batches, STEPS, dump=str(folder), out=io.StringIO())
        found[config] = Dump(folder)
    return found


def test_the_step_uses_the_llama_kernels_and_grouped_heads():
    program = open_run("numpy", analyse([TRAIN]), TRAIN, "tiny", {}, 0).program
    images = {launch.image.name for launch, _, _ in program.unrolled()}
    assert {"cgImageRmsNorm", "cgImageRmsNormBackward", "cgImageRmsNormBackwardAdd",
            "cgImageSwiGlu", "cgImageSwiGluBackward", "cgImageAttention",
            "cgImageAttentionBackward"} <= images
    assert not {"cgImageLayerNorm", "cgImageGelu", "cgImageProductGelu"} & images
    assert (program.role("heads"), program.role("kvHeads")) == (4, 2)


def test_float32_loss_and_every_gradient_against_pytorch(dumps):
    dump = dumps["tiny32"]
    model = Llama(dump.constants, dump.parts["before"])
    loss = model.loss(dump.ids[0], dump.targets[0])
    loss.backward()
    loss = float(loss.detach())
    assert abs(dump.manifest["losses"][0] - loss) / loss <= FLOAT32_TOLERANCE
    gradients = model.flat(gradients=True)
    assert set(gradients) == set(dump.parts["gradients"])
    for name, expected in gradients.items():
        assert relative(dump.parts["gradients"][name], expected) <= FLOAT32_TOLERANCE, name


def test_float32_parameters_after_one_and_three_adamw_steps_against_pytorch(dumps):
    dump = dumps["tiny32"]
    model = Llama(dump.constants, dump.parts["before"])
    optimizer = model.optimizer(dump.constants)
    clip = float(dump.constants["cgClipNorm"])
    losses = []
    for step in range(STEPS):
        losses.append(model.step(optimizer, dump.ids[step], dump.targets[step], clip))
        if step == 0:
            for name, expected in model.flat().items():
                assert relative(dump.parts["after"][name], expected) <= FLOAT32_TOLERANCE, name
    for ours, theirs in zip(dump.manifest["losses"], losses):
        assert abs(ours - theirs) / theirs <= FLOAT32_TOLERANCE
    for name, expected in model.flat().items():
        assert relative(dump.parts["final"][name], expected) <= FLOAT32_TOLERANCE, name


def test_bfloat16_loss_and_gradients_against_pytorch(dumps):
    dump = dumps["tiny"]
    model = Llama(dump.constants, dump.parts["before"])
    loss = model.loss(dump.ids[0], dump.targets[0])
    loss.backward()
    loss = float(loss.detach())
    assert abs(dump.manifest["losses"][0] - loss) / loss <= BFLOAT16_TOLERANCES["loss"]
    for name, expected in model.flat(gradients=True).items():
        assert relative(dump.parts["gradients"][name], expected) <= \
            BFLOAT16_TOLERANCES["gradient"], name


def test_the_comparison_tells_a_wrong_grouping(dumps):
    """The oracle can fail: a PyTorch model whose key/value heads serve the wrong query heads
    (head h reads h mod kvHeads) is far from the machine's gradients."""
    dump = dumps["tiny32"]
    model = Llama(dump.constants, dump.parts["before"])
    model.consecutive_groups = False
    model.loss(dump.ids[0], dump.targets[0]).backward()
    gradients = model.flat(gradients=True)
    assert relative(dump.parts["gradients"]["cgQkvWeight"], gradients["cgQkvWeight"]) > 1e-2


@needs_compiler
@pytest.mark.parametrize("config,overrides,tolerance", [
    ("tiny32", None, 1e-4), ("tiny", None, 2e-2), ("tiny32", AWKWARD, 1e-4),
    # the Hopper attention forward on grouped queries (4 query heads on 2 kv heads, heads of 32)
    ("tiny", {**HOPPER, "cgWidth": 128, "cgContext": 128}, 2e-2)],
    ids=["tiny32", "tiny", "tiny32-awkward", "tiny-hopper-grouped"])
def test_every_kernel_matches_its_reference_with_outputs_poisoned(config, overrides, tolerance):
    checked = every_kernel_against_its_reference(TRAIN, config, overrides, tolerance)
    assert {"cgImageRmsNorm", "cgImageRmsNormBackward", "cgImageRmsNormBackwardAdd",
            "cgImageSwiGlu", "cgImageSwiGluBackward", "cgImageAttention",
            "cgImageAttentionBackward", "cgImageRotary", "cgImageClassifier",
            "cgImageProductResidual"} <= checked


@needs_compiler
def test_the_float32_step_on_the_emulated_backend_matches_the_numpy_backend():
    one_float32_step_matches_the_numpy_backend(TRAIN)


def test_the_recomputing_step_is_the_same_function():
    frontend = analyse([TRAIN, RECOMPUTE])
    saving = open_run("numpy", frontend, TRAIN, "tiny32", {}, 0)
    recomputing = open_run("numpy", frontend, RECOMPUTE, "tiny32", {}, 0)
    ids, targets = tokens(saving)
    assert saving.step(ids, targets).loss == recomputing.step(ids, targets).loss
    for name, values in saving.bank_values("parameters").items():
        assert np.array_equal(values, recomputing.bank_values("parameters")[name]), name


def test_the_tiny_model_learns_in_200_steps():
    run = open_run("numpy", analyse([TRAIN]), TRAIN, "tiny", {}, 0)
    losses = train(run, Batches(load_corpus(None), 4, 64, 0), 200, out=io.StringIO()).losses
    first, last = np.mean(losses[:10]), np.mean(losses[-10:])
    # a uniform guess over the 256 bytes costs ln 256 = 5.55; measured: 4.55 -> 2.69
    assert last < 3.0 and last < first - 1.5, (first, last)


def test_checks_refuse_query_heads_that_are_no_multiple_of_the_key_value_heads(capsys):
    assert main(["check", TRAIN, "--set", "cgKvHeads=3"]) == 1
    err = capsys.readouterr().err
    assert "the model requires cgHeads (4) to be a multiple of cgKvHeads (3)" in err, err


def test_the_gpt_step_refuses_grouped_query_heads_at_its_own_requirement(capsys):
    """GPT-2's schedules size their qkv rows as three widths: fewer key/value heads are told
    as the model's requirement, not as the coverage errors they would cause further on."""
    assert main(["check", str(SCHEDULES / "train.cg"), "--set", "cgKvHeads=2"]) == 1
    err = capsys.readouterr().err
    assert "the model requires cgKvHeads (2) to be equal to cgHeads (4)" in err, err
    assert err.count("error:") == 1, err


def _cgc(capsys, *arguments):
    status = main([str(a) for a in arguments])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_a_resumed_run_is_bit_identical_and_samples(tmp_path, capsys):
    common = [TRAIN, "--backend", "numpy", "--lr", "0.01"]
    status, straight, _ = _cgc(capsys, "run", *common, "--steps", 4,
                               "--checkpoint-dir", tmp_path / "straight")
    assert status == 0
    assert _cgc(capsys, "run", *common, "--steps", 2, "--checkpoint-dir", tmp_path / "parts")[0] == 0
    status, second, err = _cgc(capsys, "run", TRAIN, "--backend", "numpy", "--steps", 4,
                               "--resume", tmp_path / "parts", "--checkpoint-dir", tmp_path / "parts")
    assert status == 0, err
    assert second.splitlines()[-1] == straight.splitlines()[-1]
    ours = checkpoint.load(checkpoint.latest(str(tmp_path / "parts")))[0]
    theirs = checkpoint.load(checkpoint.latest(str(tmp_path / "straight")))[0]
    assert sorted(ours) == sorted(theirs)
    for label in theirs:
        assert np.array_equal(ours[label].view(np.uint8), theirs[label].view(np.uint8)), label
    saved = checkpoint.latest(str(tmp_path / "straight"))
    samples = []
    for _ in range(2):
        status, out, err = _cgc(capsys, "sample", saved, "--schedule", SAMPLE, "--prompt", "The ",
                                "--tokens", 12)
        assert status == 0, err
        samples.append(out)
    assert samples[0] == samples[1] and samples[0].startswith("The ")
    # with no --schedule, the shipped sampler whose model is the checkpoint's (Llama's, not
    # GPT's schedules/sample.cg, which has other entries)
    status, out, err = _cgc(capsys, "sample", saved, "--prompt", "The ", "--tokens", 12)
    assert status == 0 and out == samples[0], err


def test_a_llama_run_samples_as_it_trains(capsys):
    """--sample-every takes the sample.cg beside the training schedule (GPT's was taken, and
    refused as another model)."""
    status, out, err = _cgc(capsys, "run", TRAIN, "--backend", "numpy", "--steps", 1,
                            "--sample-every", 1)
    assert status == 0, err
    assert "sample: " in out + err


def test_a_model_no_shipped_sampler_runs_is_told_which_differ():
    from cgc import api
    from cgc.training.checkpoint import CheckpointError
    with pytest.raises(CheckpointError, match=r"no shipped sampling schedule runs this model; "
                       r"give one with --schedule FILE.*sample\.cg is not the checkpoint's "
                       r"model.*llama/sample\.cg is not the checkpoint's model"):
        api._matching_sampler("numpy", None, {"config": "tiny", "entries": {}, "low": "bfloat16"})


def test_one_rank_of_the_parallel_step_is_the_ordinary_step():
    runs = [open_run("numpy", analyse([path]), path, "tiny32", {}, 0) for path in (TRAIN, PARALLEL)]
    results = [train(run, Batches(load_corpus(None), 4, 64, 0), 2, out=io.StringIO())
               for run in runs]
    assert results[0].losses == results[1].losses
    for name, values in runs[0].bank_values("parameters").items():
        assert values.tobytes() == runs[1].bank_values("parameters")[name].tobytes(), name


@needs_mpi
def test_two_ranks_train_as_one_rank_on_the_whole_batch(tmp_path):
    """As tests/test_parallel.py proves it for the GPT step, with its tolerances."""
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    whole = _ranks(1, "numpy", 2, tmp_path / "one", schedule=PARALLEL)[0]
    ranks = _ranks(2, "numpy", 1, tmp_path / "two", schedule=PARALLEL)
    _assert_same_training(ranks, whole)
    (tmp_path / "apart").mkdir()
    apart = _ranks(2, "numpy", 1, tmp_path / "apart", schedule=TRAIN)  # no all-reduce: apart
    assert apart[0]["parameters/cgQkvWeight"].tobytes() != \
        apart[1]["parameters/cgQkvWeight"].tobytes()
