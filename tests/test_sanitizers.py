"""Memcheck on the CPU: the emitted program built with AddressSanitizer and
UndefinedBehaviorSanitizer, its step buffers and arena slots fenced by poisoned red zones
(cgc/backends/cuda/emulated.py: standalone, cgcpu/sanitize.h), runs the tiny step with no
report; and each detector is shown to fire on a template broken on purpose, naming the
kernel."""

from __future__ import annotations

import io
import re
import shutil

import pytest

from cgc.backends.cuda.emulated import compiler_missing, replay, standalone
from cgc.training.data import Batches, load_corpus
from cgc.training.loop import train
from cgc.pipeline import analyse, evaluate, open_run

from conftest import ROOT, SCHEDULES

PATH = str(SCHEDULES / "train.cg")

pytestmark = pytest.mark.skipif(compiler_missing() is not None,
                                reason="needs the host C++ compiler (g++)")


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dump")
    run = open_run("numpy", analyse([PATH]), PATH, "tiny", {}, 0)
    losses = train(run, Batches(load_corpus(None), 4, 64, 0), 2, out=io.StringIO(),
                   dump=str(folder)).losses
    return str(folder), losses


def reports(stderr: str) -> list[str]:
    return re.findall(r"ERROR: AddressSanitizer[^\n]*|runtime error:[^\n]*", stderr)


@pytest.mark.parametrize("config", ["tiny", "tiny32"])
def test_the_step_runs_clean_under_address_and_undefined_behaviour_sanitizers(config, dump,
                                                                               tmp_path):
    folder, _ = dump
    if config != "tiny":  # a dump of this configuration
        run = open_run("numpy", analyse([PATH]), PATH, config, {}, 0)
        folder = str(tmp_path / "dump")
        train(run, Batches(load_corpus(None), 4, 64, 0), 2, out=io.StringIO(), dump=folder)
    program = evaluate(analyse([PATH]), PATH, config=config)
    status, out, err = replay(standalone(program, sanitize=True), folder, 2)
    assert reports(err) == [] and status == 0, err[-4000:]
    plain_status, plain, _ = replay(standalone(program), folder, 2)
    assert plain_status == 0 and out == plain  # the same computation, fenced or not


# Each a template broken on purpose: (template, the line as written, the broken line, what
# the report must say).
BREAKAGES = {
    # The row after the last lands past the arena's last slot (the last layer's statistics),
    # where ASan's poison begins: a slip into a neighbouring slot of the memory plan is not
    # poisoned (every slot is unpoisoned once, whatever its lifetime), so the breakage is one
    # whose last write leaves the allocation.
    "an index off by one row": (
        "layer_norm", "statistics[2 * row] = mean;", "statistics[2 * (row + 1)] = mean;",
        r"AddressSanitizer: (use-after-poison|heap-buffer-overflow)"),
    "a bound one too large": (
        "layer_norm", "statistics[2 * row + 1] = rstd;", "statistics[2 * row + 2] = rstd;",
        r"AddressSanitizer: (use-after-poison|heap-buffer-overflow)"),
    "a misaligned vector load": (
        "embedding", "*reinterpret_cast<float4*>(to + c) = load4(from + c);",
        "*reinterpret_cast<float4*>(to + c) = load4(from + c + 1);",
        r"runtime error: (load|reference binding|member access) .*misaligned address"),
}
KERNELS = {"embedding": "cgImageEmbedding", "layer_norm": "cgImageLayerNorm"}


@pytest.mark.parametrize("breakage", list(BREAKAGES))
def test_a_broken_template_is_reported_naming_its_kernel(breakage, dump, tmp_path,
                                                          monkeypatch):
    template, line, broken, report = BREAKAGES[breakage]
    templates = tmp_path / "templates"
    shutil.copytree(ROOT / "templates", templates)
    path = templates / "kernels" / f"{template}.cu.j2"
    text = path.read_text()
    assert line in text, "the breakage no longer matches the template: update the test"
    path.write_text(text.replace(line, broken))
    monkeypatch.setenv("CGC_TEMPLATES", str(templates))
    program = evaluate(analyse([PATH]), PATH, config="tiny")
    status, _, err = replay(standalone(program, sanitize=True), dump[0], 1)
    assert status != 0 and re.search(report, err), err[-4000:]
    assert KERNELS[template] in err, err[-4000:]
