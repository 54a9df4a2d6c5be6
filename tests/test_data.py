"""Training data and the numbers around it: llm.c token files, the held-out split by
document, the learning-rate schedule, bfloat16 through ml_dtypes."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from cgc.training.data import (END_OF_TEXT, LLM_C_HEADER_INTS, LLM_C_MAGIC, Batches,
                               load_tokens, read_token_file, split_documents,
                               write_token_file)
from cgc.backends.numerics import from_bfloat16_bits, to_bfloat16_bits
from cgc.training.loop import LearningRate
from cgc.cli import main

from conftest import SCHEDULES

TRAIN = str(SCHEDULES / "train.cg")


# ---- llm.c token files -----------------------------------------------------------------


def _header(magic=LLM_C_MAGIC, version=1, count=0) -> bytes:
    header = np.zeros(LLM_C_HEADER_INTS, dtype="<i4")
    header[:3] = (magic, version, count)
    return header.tobytes()


def test_a_token_file_reads_back_its_tokens_and_documents(tmp_path):
    # two documents, each led by llm.c's end-of-text token
    tokens = np.array([END_OF_TEXT, 1, 2, 3, END_OF_TEXT, 4, 5], dtype=np.uint16)
    path = tmp_path / "tiny.bin"
    write_token_file(path, tokens)
    raw = path.read_bytes()
    assert len(raw) == 4 * LLM_C_HEADER_INTS + 2 * tokens.size  # header, then uint16
    assert np.frombuffer(raw[:12], "<i4").tolist() == [LLM_C_MAGIC, 1, tokens.size]
    loaded = load_tokens([str(path)], vocab=50304)
    assert loaded.kind == "tokens" and loaded.tokens.tolist() == tokens.tolist()
    assert loaded.starts == [0, 4]


@pytest.mark.parametrize("content, message", [
    (lambda: _header(magic=12345, count=1) + b"\0\0", "not an llm.c token file (magic 12345"),
    (lambda: _header(version=2, count=1) + b"\0\0", "version 2"),
    (lambda: _header(count=100) + b"\1\0" * 10, "the header says 100 tokens, the file holds 10"),
    (lambda: b"\0" * 100, "shorter than llm.c's header"),
])
def test_a_broken_token_file_is_named_with_what_is_wrong(tmp_path, content, message):
    path = tmp_path / "broken.bin"
    path.write_bytes(content())
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        read_token_file(path, vocab=256)


def test_a_token_past_the_vocabulary_is_named_with_its_position(tmp_path, capsys):
    path = tmp_path / "gpt2.bin"
    write_token_file(path, [1, 2, 300, 4] * 100)
    with pytest.raises(ValueError, match="token 2 is 300, past the vocabulary"):
        read_token_file(path, vocab=256)
    assert main(["run", TRAIN, "--backend", "numpy", "--steps", "1", "--data", str(path)]) == 1
    err = capsys.readouterr().err
    assert "cgc: error: cannot use the training data" in err and "token 2 is 300" in err


def test_cgc_run_trains_on_a_token_file(tmp_path, capsys):
    """A byte-valued .bin file made here (never downloaded) trains the tiny model."""
    text = (SCHEDULES / "library.cg").read_bytes()
    path = tmp_path / "library.bin"
    write_token_file(path, np.frombuffer(text, dtype=np.uint8).astype(np.uint16))
    assert main(["run", TRAIN, "--backend", "numpy", "--steps", "2", "--data", str(path)]) == 0
    captured = capsys.readouterr()
    assert f"{len(text):,} tokens in 1 document" in captured.err
    assert "after 2 steps" in captured.out


def test_text_and_token_files_are_not_mixed(tmp_path):
    write_token_file(tmp_path / "a.bin", [1, 2, 3])
    (tmp_path / "b.txt").write_text("text")
    with pytest.raises(ValueError, match="mixes llm.c token files"):
        load_tokens([str(tmp_path / "a.bin"), str(tmp_path / "b.txt")])


# ---- the held-out split ------------------------------------------------------------------


def test_validation_holds_out_whole_documents_every_tenth(tmp_path):
    for i in range(25):
        (tmp_path / f"doc{i:02d}.txt").write_bytes(bytes([65 + i]) * (100 + i))
    tokens = load_tokens([str(tmp_path)])
    assert len(tokens.starts) == 25
    training, held_out = split_documents(tokens, held_out=True)
    # documents 9 and 19 (letters J and T), whole; nothing of them in the training text
    assert sorted(set(held_out.tolist())) == [65 + 9, 65 + 19]
    assert held_out.size == 109 + 119
    assert not set(training.tolist()) & {65 + 9, 65 + 19}
    assert training.size + held_out.size == tokens.tokens.size


def test_the_shipped_corpus_splits_at_its_file_sections():
    tokens = load_tokens(None)
    text = tokens.tokens.tobytes()
    assert len(tokens.starts) == 92  # its first line, then 91 files
    for start in tokens.starts[1:]:
        assert text[start:start + 4] == b"==> "
    training, held_out = split_documents(tokens, held_out=True)
    assert held_out.size and training.size + held_out.size == tokens.tokens.size


def test_one_document_cannot_be_split(tmp_path):
    (tmp_path / "one.txt").write_text("x" * 1000)
    with pytest.raises(ValueError, match="holds out whole documents"):
        split_documents(load_tokens([str(tmp_path / "one.txt")]), held_out=True)


def test_windows_continue_from_a_saved_position():
    corpus = np.arange(1000, dtype=np.uint16) % 256
    straight = Batches(corpus, 2, 8, seed=4)
    [straight.next() for _ in range(3)]
    position = json.loads(json.dumps(straight.position()))  # through JSON, as a checkpoint
    expected = straight.next()
    resumed = Batches(corpus, 2, 8, seed=4)
    resumed.restore(position)
    for ours, theirs in zip(resumed.next(), expected):
        np.testing.assert_array_equal(ours, theirs)


# ---- the learning-rate schedule ----------------------------------------------------------


def test_warm_up_then_cosine_to_the_floor():
    rate = LearningRate(peak=1e-3, floor=1e-4, warmup=10, decay_steps=110)
    assert rate.at(1) == pytest.approx(1e-4, rel=1e-6)  # 1/10 of the peak
    assert rate.at(10) == pytest.approx(1e-3, rel=1e-6)
    assert rate.at(60) == pytest.approx(1e-4 + 0.5 * (1e-3 - 1e-4), rel=1e-6)  # half way
    assert rate.at(110) == pytest.approx(1e-4, rel=1e-6)
    assert rate.at(500) == pytest.approx(1e-4, rel=1e-6)  # the floor after the decay
    middle = 1e-4 + 0.5 * (1 + math.cos(math.pi * 0.25)) * 9e-4
    assert rate.at(35) == pytest.approx(middle, rel=1e-6)
    assert rate.at(35) == float(np.float32(rate.at(35)))  # what the float32 buffer holds


def test_the_rate_reaches_the_optimizer(capsys):
    """--lr changes the update: the same step with a ten times larger rate moves the loss of
    the next step differently, and the line and the summary print the rate used."""
    losses = {}
    for lr in ("0.003", "0.03"):
        assert main(["run", TRAIN, "--backend", "numpy", "--steps", "2", "--lr", lr]) == 0
        out = capsys.readouterr().out
        assert f"lr {float(lr):.3e}" in out
        losses[lr] = [line.split("loss ")[1].split()[0] for line in out.splitlines()
                      if line.startswith("step ")]
    assert losses["0.003"][0] == losses["0.03"][0]  # step 1: before any update
    assert losses["0.003"][1] != losses["0.03"][1]


def test_the_log_has_one_object_per_step_and_per_validation(tmp_path, capsys):
    log = tmp_path / "run.jsonl"
    assert main(["run", TRAIN, "--backend", "numpy", "--steps", "3", "--warmup", "2",
                 "--lr-min", "0.0003", "--val-every", "2", "--val-steps", "1",
                 "--log", str(log)]) == 0
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in records] == [
        ("step", 1), ("step", 2), ("validation", 2), ("step", 3), ("validation", 3)]
    steps = [r for r in records if r["kind"] == "step"]
    assert steps[0]["learning_rate"] == pytest.approx(0.0015, rel=1e-6)  # warm-up: 1/2
    assert steps[1]["learning_rate"] == pytest.approx(0.003, rel=1e-6)
    assert steps[2]["learning_rate"] == pytest.approx(0.0003, rel=1e-6)  # decayed at --steps
    for record in steps:
        assert record["gradient_norm"] > 0 and record["ms"] > 0 and "loss" in record


def test_the_gradient_norm_is_the_norm_of_the_gradient_before_clipping():
    """The printed norm (from the step's partial sums) against the gradient bank's own."""
    from cgc.training.data import load_corpus
    from cgc.pipeline import analyse, open_run
    run = open_run("numpy", analyse([TRAIN]), TRAIN, "tiny", {}, 0)
    ids, targets = Batches(load_corpus(None), 4, 64, 0).next()
    run.set_learning_rate(0.003)
    run.step(ids, targets)
    expected = math.sqrt(sum(float(np.square(v.astype(np.float64)).sum())
                             for v in run.bank_values("gradients").values()))
    assert run.gradient_norm() == pytest.approx(expected, rel=1e-5)
    assert run.gradient_norm() > 1.0  # above the clip: the norm printed is before clipping


# ---- bfloat16 through ml_dtypes ----------------------------------------------------------


def _hand_rounded(values: np.ndarray) -> np.ndarray:
    """The independent oracle: round to nearest, ties to even, on the bits (cgc's code before
    ml_dtypes), NaN as 0x7FC0."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    result = (rounded >> np.uint32(16)).astype(np.uint16)
    result[np.isnan(values)] = 0x7FC0
    return result


def test_bfloat16_encoding_matches_round_to_nearest_even_on_the_bits():
    """Every 2^32 float32 pattern was compared once (docs/checkpoint-format.md); here 2^24
    random patterns, every bfloat16 value, and the ties either side of each."""
    generator = np.random.default_rng(0)
    random = generator.integers(0, 1 << 32, size=1 << 24, dtype=np.uint64).astype(np.uint32)
    every = np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)
    ties = np.concatenate([every | np.uint32(0x8000), every | np.uint32(0x7FFF),
                           every | np.uint32(0x8001)])
    for bits in (random, every, ties):
        values = bits.view(np.float32)
        np.testing.assert_array_equal(to_bfloat16_bits(values), _hand_rounded(values))


def test_bfloat16_decoding_widens_every_pattern_exactly():
    bits = np.arange(1 << 16, dtype=np.uint16)
    expected = (bits.astype(np.uint32) << np.uint32(16))
    assert (from_bfloat16_bits(bits).view(np.uint32) == expected).all()


def test_every_steps_rate_reaches_the_optimizer(capsys):
    """A one-step warm-up (step 1 at the peak) and a decay ending at step 2 change only the
    second step's rate (0.0003 against 0.003): losses 1 and 2 agree, loss 3 differs. (A rate written once and never again,
    as a scalar baked into a captured graph would be, makes loss 3 agree.)"""
    losses = []
    for floor in ("0.003", "0.0003"):
        assert main(["run", TRAIN, "--backend", "numpy", "--steps", "3", "--lr", "0.003",
                     "--lr-min", floor, "--warmup", "1", "--decay-steps", "2"]) == 0
        out = capsys.readouterr().out
        losses.append([line.split("loss ")[1].split()[0] for line in out.splitlines()
                       if line.startswith("step ")])
    assert losses[0][:2] == losses[1][:2]
    assert losses[0][2] != losses[1][2]
