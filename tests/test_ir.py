"""The launch program as text: golden files, determinism, loops kept as loops."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cgc.frontend.api import analyse, evaluate
from cgc.core.ir import Concurrent, Launch, PhaseRegion, Repeat, format_program

from conftest import ROOT, SCHEDULES

GOLDEN = ROOT / "tests" / "golden" / "ir"
CASES = [(stem, config) for stem in ("backward", "train", "train_recompute") for config in ("tiny", "tiny32", "gpt2")]


def program(stem: str, config: str, **overrides):
    path = str(SCHEDULES / f"{stem}.cg")
    return evaluate(analyse([path]), path, config=config, overrides=overrides)


@pytest.mark.parametrize("stem,config", CASES, ids=[f"{s}-{c}" for s, c in CASES])
def test_ir_matches_golden(stem, config, golden):
    golden(GOLDEN / f"{stem}.{config}.ir", format_program(program(stem, config)))


def test_ir_is_the_same_bytes_from_another_process():
    path = str(SCHEDULES / "train.cg")
    runs = [subprocess.run([sys.executable, "-m", "cgc", "ir", path, "--config", "gpt2"],
                           capture_output=True, check=True, cwd=ROOT).stdout for _ in range(2)]
    assert runs[0] == runs[1]
    assert runs[0].decode() == format_program(program("train", "gpt2"))


def test_repeats_stay_loops_whatever_the_layer_count():
    texts = {layers: format_program(program("train", "gpt2", cgLayers=layers))
             for layers in (12, 96)}
    assert len(texts[12].splitlines()) == len(texts[96].splitlines())
    assert "repeat layer in 0 .. 95 {" in texts[96]
    # the saving backward's loop is turned: the bottom layer's turn follows it (backward.cg)
    assert "repeat fromTop in 0 .. 94 {" in texts[96]


def test_the_seed_loop_indexes_layers_from_the_top():
    train = program("train_recompute", "tiny")  # the step whose backward recomputes, as the seed
    (loop,) = [node for node in train.body if isinstance(node, Repeat)
               and node.variable.name == "fromTop"]
    (phase,) = loop.body
    assert isinstance(phase, PhaseRegion) and phase.phase == "cgPhaseLayerBackward"
    first = phase.body[0]
    assert isinstance(first, Launch) and first.image.name == "cgImageLayerNorm"
    boundary = first.pointers[2].view
    assert boundary.label == "cgBoundaries[1 - fromTop]"
    assert boundary.offset.at({loop.variable: 0}) == 1 * boundary.count
    assert boundary.offset.at({loop.variable: 1}) == 0


def test_the_saved_backward_reads_each_layers_items_and_recomputes_nothing():
    train = program("train", "tiny")
    (loop,) = [node for node in train.body if isinstance(node, Repeat)
               and node.variable.name == "fromTop"]
    # the turned loop (backward.cg): a layer's end, beside which the layer below starts, then
    # the layer below's middle
    end, middle = loop.body
    launches = list(launches_in(loop.body))
    images = [launch.image.name for launch in launches]
    # No layer norm forward, no attention forward, no GELU forward: read, not recomputed.
    assert not {"cgImageLayerNorm", "cgImageAttention", "cgImageGelu"} & set(images)
    views = {p.view.label for launch in launches_in(end.body) for p in launch.pointers}
    assert {"cgSavedAttention[1 - fromTop]", "cgSavedNormed1[1 - fromTop]",
            "cgSavedStatistics1[1 - fromTop]", "cgSavedFcPre[-fromTop]"} <= views
    views = {p.view.label for launch in launches_in(middle.body) for p in launch.pointers}
    assert {"cgSavedFcAct[-fromTop]", "cgSavedQkv[-fromTop]",
            "cgSavedAttentionLse[-fromTop]", "cgSavedMiddle[-fromTop]"} <= views
    views = {p.view.label for launch in launches for p in launch.pointers}
    assert not any(label in views for label in ("cgQkv", "cgFcAct", "cgMiddle"))


def launches_in(nodes):
    for node in nodes:
        if isinstance(node, Launch):
            yield node
        else:
            yield from launches_in(node.body)


def test_every_phase_of_the_step_appears_in_order():
    def phases_in(nodes):  # the branches of a concurrent region in order
        for node in nodes:
            if isinstance(node, Concurrent):
                yield from phases_in(node.body)
            elif isinstance(node, PhaseRegion):
                yield node.phase
    phases = list(phases_in(program("train", "tiny").body))
    # the backward: the top layer's start and middle, the turned loop (a repeat: not listed),
    # the bottom layer's end, which ends with the embedding's scatter (a phase inside its phase)
    assert phases == ["cgPhaseEmbedding", "cgPhaseLayerForward", "cgPhaseScatter",
                      "cgPhaseLoss", "cgPhaseOutput", "cgPhaseOutputGradient",
                      "cgPhaseLayerBackward", "cgPhaseLayerBackward", "cgPhaseLayerBackward",
                      "cgPhaseGradientNorm", "cgPhaseUpdate"]
