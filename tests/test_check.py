"""The static checker on the real schedules: what it accepts, and that it accepts it for
the right reason (remove the reason and it refuses). Bad inputs with their golden
diagnostics are in tests/checker/."""

from __future__ import annotations

import re
from pathlib import Path
import shutil

import pytest

from cgc.core.diagnostics import CompileError
from cgc.pipeline import analyse, check, evaluate
from cgc.checking.memory import plan_memory
from cgc.checking.signature import c_parameters

from conftest import SCHEDULES


def checked(path, config="tiny", **overrides):
    frontend = analyse([str(path)])
    program = evaluate(frontend, str(path), config=config, overrides=overrides)
    return frontend, program, check(program)


@pytest.mark.parametrize("config", ["tiny", "tiny32", "gpt2"])
@pytest.mark.parametrize("name", ["train", "train_recompute", "backward", "forward", "optimizer"])
def test_every_schedule_passes_in_every_configuration(name, config):
    _, _, warnings = checked(SCHEDULES / f"{name}.cg", config)
    assert warnings == []


@pytest.fixture
def schedules(tmp_path):
    for path in SCHEDULES.glob("*.cg"):
        shutil.copy(path, tmp_path / path.name)
    return tmp_path


def edit(path, old, new):
    """Replaces the first run of `old`'s tokens, whatever the whitespace between them."""
    pattern = r"\s+".join(re.escape(word) for word in old.split())
    text, count = re.subn(pattern, new, path.read_text(), count=1)
    assert count == 1, old
    path.write_text(text)


def errors_of(path, config="tiny"):
    with pytest.raises(CompileError) as error:
        checked(path, config)
    return [d.message for d in error.value.diagnostics if d.severity == "error"]


def test_in_place_gelu_backward_passes_because_the_image_allows_it(schedules):
    # the backward as it was before the DGELU product: a product, then GELU's gradient in place
    edit(schedules / "library.cg",
         "(cgProductTransposedGeluBackward cgSeq cgWidth4 cgWidth (cgArena cgGradientFc) "
         "(cgArena cgGradientLow) (cgHalfOf cgProjWeight layer) fcPre)",
         "(cgThen (cgProductTransposedLow cgSeq cgWidth4 cgWidth (cgArena cgGradientFc) "
         "(cgArena cgGradientLow) (cgHalfOf cgProjWeight layer)) "
         "(cgGeluBackward (cgArena cgGradientFc) (cgArena cgGradientFc) fcPre cgSeqWidth4))")
    checked(schedules / "train.cg")
    edit(schedules / "images.cg", "  (scalar 0 count int32)\n  (alias 0 1)\n",
         "  (scalar 0 count int32)\n")
    messages = errors_of(schedules / "train.cg")
    assert any("'cgImageGeluBackward' does not allow them to alias" in m
               and "cgGradientFc" in m for m in messages)


def test_the_residual_gradient_may_be_updated_in_place_through_the_allowed_pair(schedules):
    """current = current + LN'(dout): residual and dinput bound to one arena slot."""
    edit(schedules / "library.cg",
         "(cgArena cgGradientNormed) statistics1 other current (cgArena cgGradientLow))",
         "(cgArena cgGradientNormed) statistics1 current current (cgArena cgGradientLow))")
    checked(schedules / "train.cg")
    edit(schedules / "images.cg", "(alias 0 6)", "")
    assert any("cgDy0" in m and "alias" in m for m in errors_of(schedules / "train.cg"))


def test_the_seed_backward_writes_gradients_only_because_its_phases_may(schedules):
    edit(schedules / "decoder.cg", "phase cgPhaseOutputGradient (stage backward) (writes cgBankG)",
         "phase cgPhaseOutputGradient (stage backward)")
    messages = errors_of(schedules / "backward.cg")
    assert any("phase 'cgPhaseOutputGradient' may not write bank 'cgBankG'" in m
               for m in messages)


def test_a_vocabulary_the_block_does_not_divide_leaves_a_tail_uncovered(schedules):
    edit(schedules / "decoder.cg", "constant cgThreads : Nat = 128", "constant cgThreads : Nat = 96")
    # The model's requirement refuses it outright ...
    assert any("the model requires cgVocab (256) to be a multiple of cgThreads (96)" in m
               for m in errors_of(schedules / "backward.cg"))
    # ... and without the requirement, the checker still sees the uncovered tail: the
    # cross-entropy backward must write all of the logits' gradient ((covers 0)).
    edit(schedules / "decoder.cg", "(multiple cgVocab cgThreads)", "")
    (message,) = [m for m in errors_of(schedules / "backward.cg") if "cgLogitsGradient" in m]
    assert "'cgImageCrossEntropyBackward' must cover all of 'cgLogitsGradientSlot' through " \
           "pointer 0 'logitsGradient', but this grid reaches only 65472 of its 65536 " \
           "elements" in message


def test_extents_are_checked_at_both_ends_of_a_repeat(schedules):
    """The layer loop one iteration longer reaches one boundary past the stack."""
    for _ in ("cgForwardSaved", "cgForward"):  # both forwards' loops
        edit(schedules / "forward.cg", "(nvidiaAffineLaunchRepeat cgLayers",
             "(nvidiaAffineLaunchRepeat (naturalAdd cgLayers 1)")
    assert any("out of range" in m for m in errors_of(schedules / "forward.cg"))


def test_checking_does_not_depend_on_the_layer_count():
    launches = set()
    for layers in (2, 12, 96):
        _, program, warnings = checked(SCHEDULES / "train.cg", "gpt2", cgLayers=layers)
        assert warnings == [] and program.warnings == []
        launches.add(sum(1 for _ in program.launches()))
    assert len(launches) == 1  # the program is the same size: repeats stay loops
    # One layer: the saving backward's turned loop (a turn for each layer but the bottom
    # one) runs zero times, and the check says so; the program is the rest of the step.
    _, program, warnings = checked(SCHEDULES / "train.cg", "gpt2", cgLayers=1)
    assert warnings == []
    assert [w.message for w in program.warnings] == ["this repeat runs zero times"]
    assert sum(1 for _ in program.launches()) == launches.pop() - 12


def _share_bytes(a, b) -> bool:
    return a.offset < b.offset + b.bytes and b.offset < a.offset + a.bytes


def test_memory_plan_shares_only_slots_never_live_together():
    for name in ("train.cg", "train_recompute.cg"):
        frontend, program, _ = checked(SCHEDULES / name, "gpt2")
        plan = plan_memory(program)
        for i, a in enumerate(plan.arena):
            for b in plan.arena[i + 1:]:
                live_together = any(x[0] <= y[1] and y[0] <= x[1] for x in a.live for y in b.live)
                assert not (_share_bytes(a, b) and live_together), (name, a.name, b.name)
        assert plan.total_bytes >= plan.peak_bytes
        bank = plan.banks["cgBankP"]
        assert bank[2] == 4 * sum(-(-e.count // 64) * 64 for e in bank[3])
        slot = {s.name: s for s in plan.arena}
        others = [s for s in plan.arena if s.name not in ("cgDy0", "cgFcPre")]
        if name == "train.cg":
            # The residual gradient is live from the final layer norm's gradient to the
            # scatter without a gap: each layer's weight-gradient branches (cgConcurrently)
            # span the launches that read and rewrite it, so nothing may take its bytes
            dy0 = slot["cgDy0"]
            assert dy0.live == [[dy0.live[0][0], plan.launches - 5]]
            assert not any(_share_bytes(dy0, other) for other in others)
        else:
            # The recomputing step's layer inside is live in the forward and again in each
            # layer's backward; in between its bytes are free, and another slot takes them
            assert plan.arena_bytes < plan.arena_unshared_bytes
            (first, last) = slot["cgFcPre"].live
            assert first[1] + 1 < last[0]
            assert any(_share_bytes(slot["cgFcPre"], other) for other in others)


def test_c_parameters_come_from_the_declaration():
    frontend = analyse([str(SCHEDULES / "images.cg")])
    images = frontend.declarations.images
    assert c_parameters(images["cgImageGeluBackward"], "bfloat16") == [
        "__nv_bfloat16* gradientPre", "const __nv_bfloat16* gradientAct",
        "const __nv_bfloat16* __restrict__ pre", "int count"]
    assert c_parameters(images["cgImageCastDown"], "float32") == [
        "float* __restrict__ output", "const float* __restrict__ input", "int count"]


def test_the_checker_reference_shows_every_checker_case():
    from conftest import ROOT
    reference = (ROOT / "docs" / "checker.md").read_text(encoding="utf-8")
    for case in (ROOT / "tests" / "checker").glob("*.cg"):
        if not case.name.startswith("_"):
            assert f"`{case.stem}`" in reference, case.stem


def test_every_pointer_a_template_accesses_with_wide_vectors_is_declared_aligned():
    """The kernels' float4/uint4 accesses (load4, load8, store4, store8, float4 casts) on a
    pointer argument are promised by an (aligned 16 ...) clause, which the checker proves."""
    from cgc.backends.cuda.emit import template_path
    from conftest import ROOT
    path = str(SCHEDULES / "train.cg")
    program = evaluate(analyse([path]), path)
    wide = re.compile(r"(?:load[48]|store[48])\((\w+)|reinterpret_cast<(?:const )?"
                      r"(?:float4|uint4)\*>\((\w+)")
    missing = []
    for image in program.images.values():
        if image.library is not None:
            continue
        text = (ROOT / "templates" / template_path(image.name)).read_text()
        names = {a or b for a, b in wide.findall(text)}
        for index, pointer in image.pointers.items():
            if pointer.name in names and image.alignments.get(index, (0,))[0] < 16:
                missing.append(f"{image.name}.{pointer.name}")
    assert missing == []
    assert program.images["cgImageGelu"].alignments  # the scan is not vacuous


def images_with_undeclared_device_state(schedule: Path) -> list[str]:
    """The images whose template keeps a `__device__` variable (state that outlives a
    launch) but whose declaration does not say (deviceState)."""
    from cgc.backends.cuda.emit import template_path
    from conftest import ROOT
    program = evaluate(analyse([str(schedule)]), str(schedule))
    # a declaration with no parenthesis before its `=` or `;`: a variable, not a function
    variable = re.compile(r"^__device__\s+(?!__forceinline__|inline|constexpr)[^()\n]*?[=;]",
                          re.MULTILINE)
    return [image.name for image in program.images.values()
            if image.library is None and image.device_state is None and
            variable.search((ROOT / "templates" / template_path(image.name)).read_text())]


def test_every_kernel_with_device_state_says_so(schedules):
    """Two concurrent launches of a kernel with a `__device__` counter would share it: the
    checker keeps them apart only if the image declares (deviceState)."""
    assert images_with_undeclared_device_state(SCHEDULES / "train.cg") == []
    # the detector sees the layer-norm backwards' tickets once the clause is gone
    text = (schedules / "images.cg").read_text()
    (schedules / "images.cg").write_text(text.replace("  (deviceState)\n", ""))
    assert images_with_undeclared_device_state(schedules / "train.cg") == [
        "cgImageLayerNormBackward", "cgImageLayerNormBackwardAdd", "cgImageRmsNormBackward",
        "cgImageRmsNormBackwardAdd"]
    llama = SCHEDULES / "llama" / "train.cg"
    assert images_with_undeclared_device_state(llama) == []


# ---- what the kernels assume, proved (false accepts an adversarial review found) ---------

def test_removing_the_optimizer_step_advance_is_refused(schedules):
    """AdamW reads the step counter; without the launch that advances it, the whole step
    reads it before writing it (it was a run-time 'internal error' before)."""
    edit(schedules / "launches.cg",
         "(cgLaunch cgImageStepAdvance 1 1 1 (cgPointer (cgArgument 0) cgOptimizerStep "
         "cgNoSlots))", "cgNothing")
    messages = errors_of(schedules / "train.cg")
    assert any("reads the step buffer 'cgOptimizerStep' through pointer 5 'step', but nothing "
               "earlier in the step 'cgTrainStep' writes it" in m for m in messages), messages
    assert len([m for m in messages if "cgOptimizerStep" in m]) == 1  # said once


def test_a_layer_norm_reading_a_buffer_nothing_wrote_is_refused(schedules):
    edit(schedules / "library.cg", "(cgLayerNorm cgFinalHalf cgFinalStatistics (cgBoundary cgLayers)",
         "(cgLayerNorm cgFinalHalf cgFinalStatistics cgFinalGradient")
    messages = errors_of(schedules / "train.cg")
    assert any("reads the step buffer 'cgFinalGradient'" in m for m in messages), messages


def test_the_read_before_write_rule_needs_the_whole_step(schedules):
    """A part of the step (backward.cg alone) reads what the forward wrote: it is not the
    step, so the rule does not apply; the whole step passes it."""
    assert checked(SCHEDULES / "backward.cg", "tiny")[2] == []
    assert checked(SCHEDULES / "train.cg", "tiny")[2] == []


@pytest.mark.parametrize("image,pattern", [
    ("cgImageAttention", r"(\(cgLaunch cgImageAttention\s+)\(naturalDivideUnchecked\s+cgContext"
                         r"\s+cgAttentionTile\)"),
    # its tiles are z (twice: the dK/dV and the dQ blocks), after the heads and sequences
    ("cgImageAttentionBackward", r"(\(cgLaunch cgImageAttentionBackward\s+cgHeads\s+cgBatch\s+)"
                                 r"cgAttentionBackwardBlocks"),
    # rows left unturned would reach the attention kernels with q and k as the product left them
    ("cgImageRotary", r"(\(cgLaunch cgImageRotary\s+)cgContext"),
])
def test_a_grid_of_one_block_that_leaves_outputs_unwritten_is_refused(schedules, image, pattern):
    """On a GPU only the first tile would be computed; the NumPy machine, which ignores
    these grids, computes the same loss: only the checker can see it."""
    path = schedules / ("launches.cg" if image == "cgImageRotary" else "library.cg")
    text, count = re.subn(pattern, r"\g<1>1", path.read_text())
    assert count >= 1, "the launch no longer matches: update the test"
    path.write_text(text)
    messages = errors_of(schedules / "train.cg", "gpt2")
    assert any(f"'{image}' must cover all of" in m for m in messages), messages


@pytest.mark.parametrize("blocks,refused", [
    ("(naturalSaturatingSubtract cgAttentionBackwardBlocks 1)", True),
    ("(naturalAdd cgAttentionBackwardBlocks 1)", False)])
def test_the_backward_grid_covers_a_tile_only_with_both_its_blocks(schedules, blocks, refused):
    """The attention backward's z takes each tile twice (its dK/dV block, then its dQ
    block): a grid of one block fewer lacks a tile's dQ, or its dK and dV, and is refused
    (the image's reach counts gridZ / 2 tiles, rounded down); a block more (past the last
    pair: it returns at once) is accepted."""
    edit(schedules / "library.cg", "cgHeads cgBatch cgAttentionBackwardBlocks",
         f"cgHeads cgBatch {blocks}")
    if refused:
        messages = errors_of(schedules / "train.cg", "gpt2")
        assert any("'cgImageAttentionBackward' must cover all of" in m for m in messages), \
            messages
    else:
        checked(schedules / "train.cg", "gpt2")


@pytest.mark.parametrize("setting,expected", [
    ("cgHeads=7", "the model requires (naturalMultiply cgHeads cgHeadWidth) (763) to be equal "
                  "to cgWidth (768)"),
    ("cgHeads=128", "the model requires cgHeadWidth (6) to be a multiple of 16"),
    ("cgWidth=65", "the model requires cgWidth (65) to be a multiple of 8"),
    ("cgWidth=66", "the model requires cgWidth (66) to be a multiple of 8"),
    # the attention templates static_assert a tile of 64: NVRTC would refuse the file
    ("cgAttentionTile=32", "the model requires cgAttentionTile (32) to be equal to 64"),
    ("cgAttentionTile=0", "role 'attentionTile' must be a positive natural, found 0"),
    # the scatter keeps a step's ids in 48 KB of shared memory
    ("cgBatch=16", "the model requires cgSeq (16384) to be at most 12288"),
])
def test_constants_the_kernels_cannot_take_are_refused(setting, expected):
    name, value = setting.split("=")
    path = SCHEDULES / "train.cg"
    with pytest.raises(CompileError) as error:
        checked(path, "gpt2", **{name: int(value)})
    messages = [d.message for d in error.value.diagnostics]
    assert expected in messages, messages
    notes = [n.message for d in error.value.diagnostics for n in d.notes]
    assert f"in config 'gpt2' with --set {setting}" in notes


def test_a_constant_of_zero_reports_each_declaration_it_breaks_once():
    """--set cgWidth=0 once printed 183 errors, 29 distinct: each one now once."""
    with pytest.raises(CompileError) as error:
        checked(SCHEDULES / "train.cg", "tiny", cgWidth=0)
    keys = [(d.message, d.span.start if d.span else None) for d in error.value.diagnostics]
    assert len(keys) == len(set(keys)) and len(keys) < 40


# ---- what must be written whole (item 8 of issue 21; docs/checker.md, "What covers what") --

def diagnostics_of(path, config="tiny"):
    """(errors, warnings) the checker gives for `path`, as messages."""
    try:
        _, _, warnings = checked(path, config)
    except CompileError as error:
        return ([d.message for d in error.diagnostics if d.severity == "error"],
                [d.message for d in error.diagnostics if d.severity == "warning"])
    return [], [w.message for w in warnings]


def without_covers(path, image):
    """images.cg with `image`'s (covers ...) clause taken out."""
    text, count = re.subn(rf"(\nimage {image} .*?)\n  \(covers [0-9 ]+\)", r"\1", path.read_text(),
                          count=1, flags=re.S)
    assert count == 1, image
    path.write_text(text)


SHORT = [  # (file edited, its text, the edit, the file checked, image, covered view, before)
    # AdamW one block short: the layer norms' gains and biases (the banks' last 640 elements)
    # and their moments never updated; the copies (the first elements) are whole, so
    # nothing at all was said
    ("launches.cg", "(naturalDivideCeiling (cgCount (cgBankAll cgBankP)) 1024)",
     "(naturalSubtract (naturalDivideCeiling (cgCount (cgBankAll cgBankP)) 1024) 1)",
     "train.cg", "cgImageAdamW", "'cgBankP' through pointer 0 'parameter'", "accepted"),
    # half of the gradient in the norm: the clip factor is wrong, silently
    ("launches.cg", "(cgSlot (cgScalar 0) (cgCount (cgBankAll cgBankG)) cgNoSlots)",
     "(cgSlot (cgScalar 0) (naturalDivideUnchecked (cgCount (cgBankAll cgBankG)) 2) cgNoSlots)",
     "train.cg", "cgImageSquareSum", "'cgBankG' through pointer 1 'input'", "accepted"),
    ("launches.cg", "(cgSlot (cgScalar 0) cgNormBlocks cgNoSlots)",
     "(cgSlot (cgScalar 0) (naturalSubtract cgNormBlocks 1) cgNoSlots)",
     "train.cg", "cgImageGradientNorm", "'cgGradientNormPartials' through pointer 1", "accepted"),
    # the last row's logits left as logits, which the products then read as their gradient
    # (the loss role catches the loss, but nothing named the gradient)
    ("library.cg", "(cgLaunch cgImageClassifier cgSeq",
     "(cgLaunch cgImageClassifier (naturalSubtract cgSeq 1)",
     "train.cg", "cgImageClassifier", "'cgLogits' through pointer 0 'logits'", "accepted"),
    # the embedding gradient's last row keeps the previous step's: a warning only
    ("library.cg", "(cgProductWeightSet cgVocab cgWidth cgSeq",
     "(cgProductWeightSet (naturalSubtract cgVocab 1) cgWidth cgSeq",
     "train.cg", "cgImageProductWeightSet", "'cgBankG.cgEmbeddingEntry' through pointer 0",
     "warned"),
    ("library.cg", "(cgProductDataLow cgSeq cgWidth3 cgWidth qkv",
     "(cgProductDataLow (naturalSubtract cgSeq 1) cgWidth3 cgWidth qkv",
     "train.cg", "cgImageProductDataLow", "'cgSavedQkv[layer]' through pointer 0", "warned"),
    ("launches.cg", "(cgSlot (cgScalar 0) (cgCount dst) cgNoSlots)",
     "(cgSlot (cgScalar 0) (naturalSubtract (cgCount dst) 4) cgNoSlots)",
     "library.cg", "cgImageZero", "'cgBankG' through pointer 0 'output'", "warned"),
    ("library.cg", "(cgLaunch cgImageLayerNorm cgSeq",
     "(cgLaunch cgImageLayerNorm (naturalSubtract cgSeq 1)",
     "sample.cg", "cgImageLayerNorm", "'cgFinalStatistics' through pointer 1 'statistics'",
     "warned"),
]


@pytest.mark.parametrize("edited,old,new,file,image,view,before", SHORT,
                         ids=[f"{c[4]}-{c[3]}" for c in SHORT])
def test_a_launch_short_of_a_covered_view_is_refused_at_the_launch(
        schedules, edited, old, new, file, image, view, before):
    """A grid (or count) short of a view the step needs whole is an error naming that view at
    the launch; without the image's (covers ...) the same schedule was accepted, or warned
    about, and nothing refused it for that view."""
    edit(schedules / edited, old, new)
    errors, _ = diagnostics_of(schedules / file)
    assert any(m.startswith(f"'{image}' must cover all of {view}") for m in errors), errors
    without_covers(schedules / "images.cg", image)
    errors, warnings = diagnostics_of(schedules / file)
    label = view.split("'")[1]
    assert not any(label in m and image in m for m in errors), errors
    if before == "accepted":
        assert not any(label in m and image in m for m in warnings), warnings
    else:
        assert any(label in m and "writes only up to element" in m for m in warnings), warnings


def test_the_checker_reference_lists_what_every_image_covers():
    """docs/checker.md, "What covers what": a row for every image of schedules/images.cg,
    its "covers" column exactly the image's (covers ...) pointers, by index and name, and
    every pointer it says is left uncovered really is."""
    from conftest import ROOT
    text = (ROOT / "docs" / "checker.md").read_text(encoding="utf-8")
    section = text.split("## What covers what", 1)[1].split("\n## ", 1)[0]
    images = analyse([str(SCHEDULES / "images.cg")]).declarations.images
    listed = {}
    for row in (r for r in section.splitlines() if r.startswith("| `cgImage")):
        names, covers, _, uncovered = [c.strip() for c in row.strip().strip("|").split("|")]
        for name in re.findall(r"`(cgImage\w+)`", names):
            assert name not in listed, f"{name} has two rows"
            listed[name] = (re.findall(r"`(\d+) (\w+)`", covers),
                            re.findall(r"`(\d+) (\w+)`", uncovered))
    assert sorted(listed) == sorted(images), "every image has a row, and only images do"
    for name, (covered, uncovered) in listed.items():
        image = images[name]
        assert sorted(int(i) for i, _ in covered) == sorted(image.covers), name
        for index, pointer in covered + uncovered:
            assert image.pointers[int(index)].name == pointer, (name, index, pointer)
        assert not {int(i) for i, _ in uncovered} & set(image.covers), name


# ---- what a write leaves alive: one analysis for the checker and the memory plan ----------

PROBE = """-- A whole step that zeroes all of a slot, lets another slot's launch run, rewrites the
-- slot's first 16 elements and reads all 2048: their sum of squares must be 0.
import "forward.cg"
import "backward.cg"
import "optimizer.cg"
arena cgProbe float32 2048
arena cgOther float32 (naturalMultiply 32 cgWidth)
buffer cgProbeSquares float32 1
--- cgImageZero without its (covers 0): an image whose short write is the schedule's choice
--- (the shipped zeroing refuses one), where only liveness keeps the rest of the slot.
image cgProbeImageZero (block 256 1 1)
  (pointer 0 output float32 write (naturalMinimum count (naturalMultiply gridX 1024)))
  (scalar 0 count int32)
  (aligned 16 0)
def cgProbeZero : (Nat -> Schedule) = (lambda unrestricted count : Nat .
  (cgLaunch cgProbeImageZero (naturalDivideCeiling count 1024) 1 1
    (cgPointer (cgArgument 0) (cgArena cgProbe) (cgSlot (cgScalar 0) count cgNoSlots))))
def cgProbeTail : Schedule =
  (cgPhase cgPhaseLoss
    (cgThen (cgProbeZero 2048)
    (cgThen (cgLaunch cgImageEmbedding 32 1 1
      (cgPointer (cgArgument 0) (cgArena cgOther)
        (cgPointer (cgArgument 1) (cgParameter cgBankP cgEmbeddingEntry)
          (cgPointer (cgArgument 2) cgIds cgNoSlots))))
    (cgThen (cgProbeZero 16)
      (cgLaunch cgImageSquareSum 1 1 1 (cgPointer (cgArgument 0) cgProbeSquares
        (cgPointer (cgArgument 1) (cgArena cgProbe) (cgSlot (cgScalar 0) 2048 cgNoSlots))))))))
def cgProbeStep : (family NvidiaLaunchSchedule) =
  (cgThen (cgConcurrently cgForwardSaved cgSortIds)
    (cgThen cgSavedBackward (cgThen cgOptimizer cgProbeTail)))
roles cgProbeRoles (step cgProbeStep)
"""


def _shares(plan, a: str, b: str) -> bool:
    x, y = (next(slot for slot in plan.arena if slot.name == n) for n in (a, b))
    return x.offset < y.offset + y.bytes and y.offset < x.offset + x.bytes


def test_a_write_of_part_of_a_slot_leaves_the_rest_of_its_value_alive(schedules):
    """The issue's false accept: the checker saw elements 16.. of cgProbe written by the first
    zeroing (a warning for the short rewrite, no error), but the memory plan took any write
    binding the whole slot as a whole write, let cgOther take the bytes in between, and the
    NumPy machine summed the embedding's squares (0.81) instead of 0."""
    import numpy as np
    from cgc.backends.base import initial_parameters
    from cgc.backends.numpy.machine import Machine
    from cgc.backends.numpy.reference import KERNELS
    path = schedules / "probe.cg"
    path.write_text(PROBE)
    _, program, warnings = checked(path, "tiny", cgBatch=1)
    assert [w.message.split(":")[0] for w in warnings] == [
        "'cgProbeImageZero' writes only up to element 16 of the 2048 of 'cgProbe'"]
    plan = plan_memory(program)
    machine = Machine(program, plan, {**KERNELS, "cgProbeImageZero": KERNELS["cgImageZero"]})
    for name, values in initial_parameters(program, 0).items():
        machine.store(f"cgBankP.{name}", values)
    machine.store("cgIds", np.arange(64) % 256)
    machine.store("cgTargets", np.arange(64) % 256)
    machine.store("cgStepLearningRate", [1e-3])
    machine.run()
    assert machine.array("cgProbeSquares")[0] == 0.0
    assert not _shares(plan, "cgProbe", "cgOther")


SMALL = """import "{base}"
arena cgSlotA float32 (naturalMultiply cgRows 4)
arena cgSlotB float32 (naturalMultiply cgRows 4)
def cgAddInto : ((Buffer float32) -> Schedule) = (lambda unrestricted data : (Buffer float32) .
  (cgLaunch cgImageAdd 8 1 1 (cgPointer (cgArgument 0) data
    (cgPointer (cgArgument 1) cgA cgNoSlots))))
def cgSmall : Schedule = (cgPhase cgPhaseForward {body})
"""


def _small_plan(tmp_path, *launches: str):
    from conftest import ROOT
    body = launches[-1]
    for launch in reversed(launches[:-1]):
        body = f"(cgThen {launch} {body})"
    path = tmp_path / "small.cg"
    path.write_text(SMALL.format(base=ROOT / "tests" / "checker" / "_base.cg", body=body))
    frontend = analyse([str(path)])
    program = evaluate(frontend, str(path), config="small", entry="cgSmall")
    check(program)
    plan = plan_memory(program)
    return {slot.name: slot.live for slot in plan.arena}, plan


def test_a_short_rewrite_keeps_a_slot_live_across_another(tmp_path):
    """A written whole, read, B used, A's first half rewritten, A read whole: A's second
    half is the first write's, so A is live throughout and B may not take its bytes."""
    live, plan = _small_plan(
        tmp_path, "(cgScale (cgArena cgSlotA) cgA 8)", "(cgScale cgB (cgArena cgSlotA) 8)",
        "(cgScale (cgArena cgSlotB) cgA 8)", "(cgScale cgB (cgArena cgSlotB) 8)",
        "(cgScale (cgArena cgSlotA) cgA 4)", "(cgScale cgB (cgArena cgSlotA) 8)")
    assert live == {"cgSlotA": [[0, 5]], "cgSlotB": [[2, 3]]}
    assert not _shares(plan, "cgSlotA", "cgSlotB")


def test_a_whole_rewrite_ends_a_slot_s_value(tmp_path):
    """The same with A rewritten whole: its first value dies at its last read, and B takes
    its bytes in between (what the plan is for)."""
    live, plan = _small_plan(
        tmp_path, "(cgScale (cgArena cgSlotA) cgA 8)", "(cgScale cgB (cgArena cgSlotA) 8)",
        "(cgScale (cgArena cgSlotB) cgA 8)", "(cgScale cgB (cgArena cgSlotB) 8)",
        "(cgScale (cgArena cgSlotA) cgA 8)", "(cgScale cgB (cgArena cgSlotA) 8)")
    assert live == {"cgSlotA": [[0, 1], [4, 5]], "cgSlotB": [[2, 3]]}
    assert _shares(plan, "cgSlotA", "cgSlotB")


def test_a_value_read_before_the_program_writes_it_lives_to_the_end(tmp_path):
    """A is added to before anything writes it (its value is the previous run's), and
    written whole later: that value must survive to the end of the program, where the next
    run reads it, so B used after it may not share A's bytes."""
    live, plan = _small_plan(
        tmp_path, "(cgAddInto (cgArena cgSlotA))", "(cgScale (cgArena cgSlotB) cgA 8)",
        "(cgScale cgB (cgArena cgSlotB) 8)", "(cgScale (cgArena cgSlotA) cgA 8)",
        "(cgScale (cgArena cgSlotB) cgA 8)")
    assert live == {"cgSlotA": [[0, 0], [3, 4]], "cgSlotB": [[1, 2], [4, 4]]}
    assert not _shares(plan, "cgSlotA", "cgSlotB")


def test_regions_nested_past_the_proofs_budget_are_an_error_not_a_hang(tmp_path, monkeypatch):
    """Each region compares the accesses of its branches, a region inside another counting
    them again: nesting regions n deep costs n^2. Past TOUCH_LIMIT it is a diagnostic at the
    region where the budget ran out (3,000 levels took minutes before there was a budget)."""
    from cgc.checking import concurrency
    from conftest import ROOT
    shutil.copy(ROOT / "tests" / "checker" / "_base.cg", tmp_path / "_base.cg")
    term = "(cgScale cgB cgA cgRows)"
    for level in range(40):
        term = (f"(cgConcurrently (cgThen (cgScale (cgItem cgItems 0) cgA cgRows) {term}) "
                f"(cgScale (cgItem cgItems 1) cgA cgRows))")
    path = tmp_path / "deep.cg"
    path.write_text('import "_base.cg"\ndef cgStep : Schedule =\n'
                    f"  (cgPhase cgPhaseForward {term})\n")
    def messages():
        program = evaluate(analyse([str(path)]), str(path), entry="cgStep")
        with pytest.raises(CompileError) as error:
            check(program)
        return [d.message for d in error.value.diagnostics]

    monkeypatch.setattr(concurrency, "TOUCH_LIMIT", 200)
    said = messages()
    assert any("make more than 200 accesses to compare" in m for m in said), said
    monkeypatch.setattr(concurrency, "TOUCH_LIMIT", 10 ** 6)
    said = messages()
    assert not any("accesses to compare" in m for m in said)
    assert any("concurrent branches may not touch" in m for m in said)  # item 0 in two branches
