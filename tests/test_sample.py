"""`cgc sample` (cgc/training/sampling.py, schedules/sample.cg): the forward-only schedule
computes what the training step's forward computes, from a checkpoint's parameters; greedy
decoding is deterministic; what fills the rows after the text does not change the row read."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

from cgc.training import checkpoint
from cgc.training.data import Batches, load_corpus
from cgc.training.sampling import Sampler, choose_token
from cgc.cli import main
from cgc.pipeline import analyse, open_run

from conftest import ROOT, SCHEDULES

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


# ---- what a user may ask: never a NumPy error ---------------------------------------------


def _altered(trained, folder, change) -> str:
    """The trained checkpoint with `change` applied to its tensors, written whole (its
    hashes recomputed): a checkpoint cgc would read, of a model that is not finite."""
    values, manifest = checkpoint.load(trained)
    values = {label: np.array(value) for label, value in values.items()}
    change(values)
    manifest = {k: v for k, v in manifest.items() if k not in ("manifest_sha256",
                                                                 "tensors_sha256")}
    return checkpoint.save(str(folder), manifest["step"], values, manifest)


def test_a_model_with_nan_parameters_is_told_not_sampled(trained, tmp_path, capsys):
    """Once `ValueError: probabilities contain NaN` (exit 3) with a temperature, and NaN's
    arg-max without one."""
    def nan(values):
        values["cgBankP.cgFcWeight"][3] = np.nan
    path = _altered(trained, tmp_path, nan)
    for temperature in ("0", "1"):
        assert main(["sample", path, "--backend", "numpy", "--tokens", "3",
                     "--temperature", temperature]) == 1
        err = capsys.readouterr().err
        assert "cgc: error: the model's parameters are not all finite: cgBankP.cgFcWeight[3] " \
               "is nan" in err, err


def test_parameters_that_overflow_the_forward_are_told(trained, tmp_path, capsys):
    def huge(values):
        for label, value in values.items():
            if value.dtype == np.float32:
                value[...] = 3e38
    path = _altered(trained, tmp_path, huge)
    assert main(["sample", path, "--backend", "numpy", "--tokens", "3",
                 "--temperature", "1"]) == 1
    err = capsys.readouterr().err
    assert "logits after 1 tokens are not all finite" in err and "internal" not in err, err


@pytest.mark.parametrize("temperature", ["1e-30", "5e-324", "1e30", "1.7e308"])
def test_extreme_temperatures_sample(trained, temperature, capsys):
    """A tiny temperature is greedy (the arg-max has all the weight), a huge one uniform over
    the top k; once 5e-324 overflowed to inf - inf = NaN (exit 3)."""
    assert main(["sample", trained, "--backend", "numpy", "--tokens", "5", "--prompt", "def ",
                 "--temperature", temperature, "--top-k", "8", "--seed", "3"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("def ") and "Traceback" not in captured.err
    if float(temperature) < 1e-20:
        assert main(["sample", trained, "--backend", "numpy", "--tokens", "5", "--prompt",
                     "def "]) == 0
        assert capsys.readouterr().out == captured.out  # the greedy text


@pytest.mark.parametrize("options, message", [
    (["--temperature", "-1"], "--temperature must be a finite number, not negative"),
    (["--temperature", "inf"], "--temperature must be a finite number"),
    (["--temperature", "nan"], "--temperature must be a finite number"),
    (["--top-k", "0"], "--top-k must be at least 1"),
    (["--top-k", "257"], "--top-k 257 is more than the model's vocabulary (256 tokens)"),
    (["--top-k", str(10 ** 30)], f"--top-k {10 ** 30} is more than the model's vocabulary"),
    (["--tokens", "0"], "--tokens must be at least 1 and at most 100,000"),
    (["--tokens", "100001"], "--tokens must be at least 1 and at most 100,000"),
    (["--tokens", str(10 ** 30)], "--tokens must be at least 1 and at most 100,000"),
])
def test_options_out_of_range_are_usage_errors(trained, options, message, capsys):
    assert main(["sample", trained, "--backend", "numpy", *options]) == 2
    err = capsys.readouterr().err
    assert f"cgc: error: {message}" in err and "Traceback" not in err, err


def test_a_prompt_that_is_not_utf8_is_sampled_from_its_bytes(trained, capsys):
    """The command line's bytes 0xff 0xfe come as surrogate escapes (Python's): once a
    UnicodeEncodeError (exit 3); now the model reads those bytes and the text shows them as
    U+FFFD, as it shows any sampled byte that is not UTF-8."""
    assert main(["sample", trained, "--backend", "numpy", "--tokens", "4", "--prompt",
                 "\udcff\udcfex"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("\ufffd\ufffdx"), captured
    result = subprocess.run([sys.executable, "-m", "cgc", "sample", trained, "--backend",
                             "numpy", "--tokens", "4", "--prompt", b"\xff\xfex"], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.decode("utf-8").startswith("\ufffd\ufffdx")


def test_sample_streams_its_tokens_and_stops_on_sigterm(trained):
    """The text comes as it is made (once all at the end: nothing to read for minutes), and
    SIGTERM ends it after the token under way: its newline, the count, exit 143."""
    import select
    import time
    process = subprocess.Popen([sys.executable, "-m", "cgc", "sample", trained, "--backend",
                                "numpy", "--tokens", "100000", "--prompt", "ab"], cwd=ROOT,
                               env={**os.environ, "PYTHONPATH": str(ROOT)},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        got = b""
        deadline = time.monotonic() + 90
        while len(got) < 6 and time.monotonic() < deadline:  # the prompt and a few tokens
            if select.select([process.stdout], [], [], 1.0)[0]:
                got += os.read(process.stdout.fileno(), 100)
        assert len(got) >= 6 and got.startswith(b"ab"), got
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 143, err
    assert (got + out).endswith(b"\n") and b"(stopped early)" in err and b"Traceback" not in err


def test_a_step_larger_than_the_memory_is_refused_before_allocating(trained, monkeypatch,
                                                                    capsys):
    """The memory plan against the backend's memory (Run.memory_limit): a machine of 1 MiB
    is told with both figures, for sample and run, before a byte is allocated."""
    from cgc.backends.base import Run
    monkeypatch.setattr(Run, "memory_limit",
                        staticmethod(lambda: (1 << 20, "this machine's physical memory")))
    for arguments in (["sample", trained, "--backend", "numpy", "--tokens", "2"],
                      ["run", TRAIN, "--backend", "numpy", "--steps", "1"]):
        assert main(arguments) == 1
        err = capsys.readouterr().err
        assert re.search(r"cgc: error: the step needs [\d,]+ bytes \([\d.]+ MiB\) \(its memory "
                         r"plan's .*more than this machine's physical memory: 1,048,576 bytes "
                         r"\(1.00 MiB\)", err), err


def test_sample_stops_when_its_reader_leaves(trained):
    """`cgc sample ... | head -c 100`: once the reader is gone no more tokens are drawn (it
    once drew all it was asked for, printing into nothing); exit 0, its count said."""
    process = subprocess.Popen([sys.executable, "-m", "cgc", "sample", trained, "--backend",
                                "numpy", "--tokens", "100000", "--prompt", "ab"], cwd=ROOT,
                               env={**os.environ, "PYTHONPATH": str(ROOT)},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.close()
    try:
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 0, err
    count = int(re.search(rb"sampled (\d+) tokens?", err).group(1))
    assert count <= 2 and b"Traceback" not in err, err
