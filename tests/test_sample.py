"""`cgc sample` (cgc/backends/sampling.py, schedules/sample.cg): the forward-only schedule
computes what the training step's forward computes, from a checkpoint's parameters; greedy
decoding is deterministic; what fills the rows after the text does not change the row read."""

from __future__ import annotations

import numpy as np
import pytest

from cgc.backends import checkpoint
from cgc.backends.data import Batches, load_corpus
from cgc.backends.sampling import Sampler, choose_token
from cgc.cli import main
from cgc.pipeline import analyse, open_run

from conftest import SCHEDULES

TRAIN = str(SCHEDULES / "train.cg")
SAMPLE = str(SCHEDULES / "sample.cg")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("trained")
    assert main(["run", TRAIN, "--backend", "numpy", "--steps", "20", "--lr", "0.01",
                 "--checkpoint-dir", str(folder)]) == 0
    return checkpoint.latest(str(folder))


def _sampler(backend: str = "numpy", config: str = "tiny") -> Sampler:
    return Sampler(open_run(backend, analyse([SAMPLE]), SAMPLE, config, {}, 0))


def test_the_forward_schedule_computes_the_training_steps_loss(trained):
    """From the same checkpoint and batch, sample.cg's loss is the training step's (its
    forward pass, before the update), bit for bit: the sampler loads the parameters and the
    16-bit copies, and runs the same forward. (Loading only the float32 parameters and not
    the copies the products read would fail this.)"""
    values, _ = checkpoint.load(trained)
    ids, targets = Batches(load_corpus(None), 4, 64, 9).next()
    training = open_run("numpy", analyse([TRAIN]), TRAIN, "tiny", {}, 0)
    checkpoint.restore(training, values)
    expected = training.evaluate(ids, targets)
    sampler = _sampler()
    sampler.load(values)
    assert sampler.run.step(ids, targets).loss == expected
    # and a fresh sampler, without the checkpoint, is another model
    assert _sampler().run.step(ids, targets).loss != expected


def test_the_rows_after_the_text_do_not_change_the_row_read(trained):
    values, _ = checkpoint.load(trained)
    sampler = _sampler()
    sampler.load(values)
    text = list(b"def main():\n    ")
    quiet = sampler.next_logits(text)
    rows, vocab = sampler.rows, sampler.vocab
    ids = np.random.default_rng(1).integers(0, vocab, size=rows).astype(np.int32)
    ids[:len(text)] = text
    sampler.run.step(ids, np.full(rows, -1, dtype=np.int32))
    noisy = sampler.run.fetch(sampler.logits).reshape(rows, vocab)[len(text) - 1]
    np.testing.assert_array_equal(noisy, quiet)  # causal: later rows are never read
    # the row before it is another row (the test can tell rows apart)
    assert not np.array_equal(noisy, sampler.run.fetch(sampler.logits).reshape(rows, vocab)[0])


def test_greedy_sampling_is_deterministic_and_continues_the_prompt(trained, capsys):
    outputs = []
    for _ in range(2):
        assert main(["sample", trained, "--backend", "numpy", "--prompt", "import ",
                     "--tokens", "30"]) == 0
        captured = capsys.readouterr()
        outputs.append(captured.out)
        assert "greedy" in captured.err and "step 20" in captured.err
    assert outputs[0] == outputs[1]
    assert outputs[0].startswith("import ") and len(outputs[0].encode()) >= len("import ") + 1


def test_drawn_samples_follow_the_seed(trained, capsys):
    texts = {}
    for seed in (1, 1, 2):
        assert main(["sample", trained, "--backend", "numpy", "--tokens", "40",
                     "--temperature", "1.0", "--top-k", "40", "--seed", str(seed)]) == 0
        texts.setdefault(seed, []).append(capsys.readouterr().out)
    assert texts[1][0] == texts[1][1]
    assert texts[1][0] != texts[2][0]


def test_choosing_a_token():
    logits = np.array([0.0, 3.0, 1.0, 3.0, -2.0])
    generator = np.random.default_rng(0)
    assert choose_token(logits, 0.0, None, generator) == 1  # greedy: the first maximum
    distinct = np.array([0.0, 3.0, 1.0, 2.5])
    assert {choose_token(distinct, 5.0, 1, generator) for _ in range(50)} == {1}  # top 1
    drawn = [choose_token(logits, 1.0, 2, generator) for _ in range(2000)]
    assert set(drawn) == {1, 3}  # top 2: the two largest only
    assert 0.4 < drawn.count(1) / len(drawn) < 0.6  # equal logits, equal chances


def test_sampling_errors_are_one_line(trained, tmp_path, capsys):
    assert main(["sample", trained, "--tokens", "0"]) == 2
    assert "--tokens must be at least 1" in capsys.readouterr().err
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"\x10" * 64)
    assert main(["sample", str(broken), "--backend", "numpy"]) == 1
    err = capsys.readouterr().err
    assert "is not a whole cgc checkpoint" in err and "Traceback" not in err


def test_sample_every_prints_samples_during_training(capsys):
    assert main(["run", TRAIN, "--backend", "numpy", "--steps", "2", "--sample-every", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count(": sample: ") == 2


def test_the_emulated_backend_samples_too(trained, capsys):
    """The same forward schedule, built as CUDA for the CPU (a few tokens: each is a step)."""
    assert main(["sample", trained, "--backend", "emulated", "--prompt", "x = ",
                 "--tokens", "3"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("x = ") and "emulated backend" in captured.err
