"""Memcheck on the CPU: the emitted program built with AddressSanitizer and
UndefinedBehaviorSanitizer, its step buffers and arena slots fenced by poisoned red zones
(cgc/backends/cuda/emulated.py: standalone, cgcpu/sanitize.h), runs the tiny step with no
report; and each detector is shown to fire on a template broken on purpose, naming the
kernel."""

from __future__ import annotations

import io
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

from cgc.backends.cuda.emit import emit_program
from cgc.backends.cuda.emulated import (RED_ZONE, SANITIZER_FLAGS, STANDALONE_FLAGS, build,
                                        compiler_missing, replay)
from cgc.checking.memory import plan_memory
from cgc.training.data import Batches, load_corpus
from cgc.training.loop import train
from cgc.pipeline import analyse, evaluate, open_run

from conftest import HOPPER_THREE_TILES, ROOT, SCHEDULES

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


@pytest.fixture(scope="module")
def step_programs():
    """Each configuration's step built with the sanitizers (red zones between buffers) and
    plain, as emulated.standalone builds them, two builds at a time."""
    texts = {}
    for config in ("tiny", "tiny32", "tiny-hopper"):
        program = evaluate(analyse([PATH]), PATH, config=config.removesuffix("-hopper"),
                           overrides=HOPPER_THREE_TILES if config.endswith("-hopper") else None)
        texts[config, "sanitized"] = (emit_program(program, plan_memory(program, red_zone=RED_ZONE)).text,
                                      f"standalone-sanitized-{config}", SANITIZER_FLAGS)
        texts[config, "plain"] = (emit_program(program, plan_memory(program)).text,
                                  f"standalone-{config}", STANDALONE_FLAGS)
    with ThreadPoolExecutor(max_workers=2) as pool:
        jobs = {key: pool.submit(build, text, name, flags) for key, (text, name, flags) in texts.items()}
        return {key: job.result() for key, job in jobs.items()}


@pytest.mark.parametrize("config", ["tiny", "tiny32", "tiny-hopper"])
def test_the_step_runs_clean_under_address_and_undefined_behaviour_sanitizers(config, dump,
                                                                               step_programs,
                                                                               tmp_path):
    folder, _ = dump
    if config != "tiny":  # a dump of this configuration
        run = open_run("numpy", analyse([PATH]), PATH, config.removesuffix("-hopper"),
                       HOPPER_THREE_TILES if config.endswith("-hopper") else {}, 0)
        folder = str(tmp_path / "dump")
        train(run, Batches(load_corpus(None), run.program.role("batch"),
                           run.program.role("context"), 0), 2, out=io.StringIO(), dump=folder)
    status, out, err = replay(step_programs[config, "sanitized"], folder, 2)
    assert reports(err) == [] and status == 0, err[-4000:]
    plain_status, plain, _ = replay(step_programs[config, "plain"], folder, 2)
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
NUMBERS = {name: number for number, name in enumerate(BREAKAGES, 1)}  # CG_BREAKAGE's values


# Which breakage a run of the broken build takes: the number in CG_BREAKAGE (1, 2, ...), read
# once; none without it.
SELECTOR = """#include <cstdlib>
static int cg_breakage() {
  static const int chosen = std::getenv("CG_BREAKAGE") ? std::atoi(std::getenv("CG_BREAKAGE")) : 0;
  return chosen;
}
"""


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    """The sanitizer build of the tiny step from templates holding every breakage, each
    taken only in a run that selects it (CG_BREAKAGE, its number): one build for all of them,
    each run as broken as its own template would make it. With it, the line of the built
    source that holds each breakage (its report names that line)."""
    templates = tmp_path_factory.mktemp("templates") / "templates"
    shutil.copytree(ROOT / "templates", templates)
    for name, (template, line, broken_line, _) in BREAKAGES.items():
        path = templates / "kernels" / f"{template}.cu.j2"
        text = path.read_text()
        assert line in text, "the breakage no longer matches the template: update the test"
        path.write_text(text.replace(line, f"if (cg_breakage() == {NUMBERS[name]}) {broken_line} "
                                           f"else {line}"))
    before = os.environ.get("CGC_TEMPLATES")
    os.environ["CGC_TEMPLATES"] = str(templates)
    try:
        program = evaluate(analyse([PATH]), PATH, config="tiny")
        text = emit_program(program, plan_memory(program, red_zone=RED_ZONE)).text
    finally:
        if before is None:
            os.environ.pop("CGC_TEMPLATES")
        else:
            os.environ["CGC_TEMPLATES"] = before
    source = SELECTOR + text
    lines = {name: next(number for number, line in enumerate(source.splitlines(), 1)
                        if f"if (cg_breakage() == {NUMBERS[name]}) " in line)
             for name in BREAKAGES}
    return build(source, BROKEN, SANITIZER_FLAGS), lines


BROKEN = "standalone-sanitized-tiny-broken"  # the build's name: its source is BROKEN.cpp


def test_the_broken_build_runs_clean_with_no_breakage_chosen(dump, broken, monkeypatch):
    """The breakages below are the only faults of the broken build: chosen by none, it runs
    the step with no report."""
    monkeypatch.delenv("CG_BREAKAGE", raising=False)
    status, _, err = replay(broken[0], dump[0], 1)
    assert reports(err) == [] and status == 0, err[-4000:]


@pytest.mark.parametrize("breakage", list(BREAKAGES))
def test_a_broken_template_is_reported_naming_its_kernel(breakage, dump, broken, monkeypatch):
    template, _, _, report = BREAKAGES[breakage]
    monkeypatch.setenv("CG_BREAKAGE", str(NUMBERS[breakage]))
    binary, lines = broken
    status, _, err = replay(binary, dump[0], 1)
    assert status != 0 and re.search(report, err), err[-4000:]
    assert KERNELS[template] in err, err[-4000:]
    # a frame at this breakage's line, not another's
    assert re.search(rf"{BROKEN}\.cpp:{lines[breakage]}\b", err), err[-4000:]
