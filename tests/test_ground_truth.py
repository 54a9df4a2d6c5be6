"""The static checker against two ground truths (scripts/checker_vs_ground_truth.py --all):
the bounds-checked NumPy machine, and the emitted kernels on the CPU under AddressSanitizer
and UndefinedBehaviorSanitizer (scripts/ground_truth_emulated.py). A CI-sized slice of the
campaign whose whole run, and its table, are in docs/checker.md: the unmutated schedules run
clean on both, known-bad mutants fault on both (naming the kernel), and a few hundred
mutants and random schedules give no false accept."""

from __future__ import annotations

import io
import sys

import pytest

from cgc.backends.cuda.emulated import compiler_missing

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import checker_vs_ground_truth as campaign  # noqa: E402
import ground_truth_emulated as gt2  # noqa: E402

pytestmark = pytest.mark.skipif(compiler_missing() is not None,
                                reason="needs the host C++ compiler (g++)")


@pytest.fixture(scope="module")
def lane():
    """A lane of the campaign on the sanitized kernels of config tiny, cgBatch 1."""
    program = campaign.base_program(campaign.OVERRIDES)
    libraries = {repr(gt2.library_key(program)): gt2.build_library(program)}
    judged = campaign.Lane(seed=0, pairs=0, libraries=libraries, emulated=True, budget=120,
                           threads=2)
    yield judged
    judged.close()


def judge(lane, schedule: str, description: str | None = None) -> dict:
    entry = dict(campaign.SCHEDULES)[schedule]
    index = -1
    if description is not None:
        found = [i for i, m in enumerate(lane.mutants[schedule])
                 if m.description.startswith(description)]
        assert found, f"no mutant '{description}' of {schedule}: update the test"
        index = found[0]
    case = campaign.Case(0, schedule, entry, "test", description or "unmutated", index)
    return lane.judge(case)


def judge_renamed(lane, schedule: str, definition: str, slot: str, other: str) -> dict:
    """The campaign's slot-lifetime mutation made on purpose, not drawn: every use of arena
    slot `slot` in `definition` renamed `other` (campaign.with_slots_renamed, as the
    campaign's own), judged as the campaign judges its own."""
    declaration = {d.name.text: d for m in lane.modules[schedule]
                   for d in m.declarations}[definition]
    changed = campaign.with_slots_renamed(declaration, {slot: other})
    mutant = campaign.Mutant("lifetime", f"slot {slot} renamed {other} throughout {definition}",
                             ((definition, None, None, changed),))
    assert mutant.apply(lane.modules[schedule]) is not None
    lane.mutants[schedule].append(mutant)
    case = campaign.Case(0, schedule, dict(campaign.SCHEDULES)[schedule], "test",
                         mutant.description, len(lane.mutants[schedule]) - 1)
    return lane.judge(case)


@pytest.mark.parametrize("schedule", [s for s, _ in campaign.SCHEDULES])
def test_every_unmutated_schedule_is_accepted_and_clean_on_both_ground_truths(lane, schedule):
    record = judge(lane, schedule)
    assert record["verdict"] == "accepted", record
    assert record["gt1"] == "safe", record
    assert record["gt2"] == "clean", record  # no report, and no NaN reaches the results


def test_a_grid_one_block_too_large_faults_on_both_naming_the_kernel(lane):
    record = judge(lane, "train.cg", "grid x +1 in cgLayerNorm at")
    assert record["verdict"] == "rejected" and record["rules"] == ["bounds"], record
    assert record["gt1"] == "faulted" and record["gt1_why"].startswith("bounds"), record
    assert record["gt2"] == "faulted", record
    assert "AddressSanitizer" in record["gt2_why"] and "cgImageLayerNorm" in record["gt2_why"]


def test_a_product_into_a_buffer_one_element_short_faults_on_both(lane):
    """cuBLAS (emulated) writes the logits one element past the shrunk buffer: the view is
    all that is addressable while the launch runs."""
    record = judge(lane, "train.cg", "size of cgLogits -1")
    assert record["verdict"] == "rejected" and "bounds" in record["rules"], record
    assert record["gt1"] == "faulted", record
    assert record["gt2"] == "faulted" and "AddressSanitizer" in record["gt2_why"], record


def test_an_unbound_pointer_has_no_c_program(lane):
    record = judge(lane, "backward.cg", "pointer 1 dropped in cgBackward")
    assert record["verdict"] == "rejected" and "not bound" in record["rules"], record
    assert record["gt1"] == "faulted" and record["gt2"] == "refused", record


def test_a_slot_moved_onto_one_live_across_it_keeps_both_values(lane):
    """Every use of cgGradientAttention in a layer's backward moved onto cgSavedFcPre's bytes
    (a stacked slot the backward reads in every later layer): the step computes what it
    computes with a slot each. (The campaign draws such partners at random from the slots of
    the type, and its draw moves as the schedules' definitions do: this mutant is made here,
    as the campaign makes its slot renamings, so that the test does not depend on the draw.)
    The plan that took a write binding a slot's whole view as a
    whole write let another slot into such a slot's bytes between the partial write and the
    read (with this very slot, then with cgGradientAttention onto cgSavedNormed1, mutants
    the campaign drew before the layer-norm backward wrote the low copy: 304 bytes of the
    gradient norm's partial sums came out different)."""
    record = judge_renamed(lane, "train.cg", "cgLayerAttentionBackward", "cgGradientAttention",
                           "cgSavedFcPre")
    assert record["gt1"] == "safe", record
    # The (covers ...) clauses refuse it (the product that writes the gradient must cover
    # its output, and reaches one item of the stacked slot); the values ground truth
    # runs on every safe variant all the same, and the plan must keep both slots' values
    # whatever the checker's verdict.
    assert record["verdict"] in ("accepted", "rejected"), record
    assert record["values"] == "same", record
    assert record["verdict"] == "rejected" or record["gt2"] in ("clean", "poisoned"), record


def test_the_values_ground_truth_sees_a_plan_that_shares_live_bytes(monkeypatch):
    """The detector, broken on purpose: live ranges that keep a float slot only at the
    launches that touch it (a value dead as soon as written), so that slots share bytes
    across values still to be read. The unmutated step then ends with other bits than with
    a slot each, and without an access fault (the machine sees nothing wrong). The int32
    slots (the sorted ids' order) keep their true ranges: their bytes overwritten, the
    scatter refuses an order entry out of range, a fault the machine sees by itself."""
    from cgc.backends.base import initial_parameters
    from cgc.checking import flow
    path = str(ROOT / "schedules" / "train.cg")
    program, verdict, _, _, _ = campaign.evaluate_variant(
        campaign.load([path], campaign.Reporter()), path, "cgTrainStep", campaign.CONFIG,
        campaign.OVERRIDES)
    assert verdict == "accepted"
    parameters = initial_parameters(program, 0)
    machines = []
    assert campaign.ground_truth_1(program, parameters, machines=machines)[0] == "safe"
    assert campaign.ground_truth_values(program, parameters, machines[0]) == ("same", "")

    true_ranges = flow.Flow.live_ranges

    def touches_only(self):
        ranges = true_ranges(self)
        storages = self.program.storages
        return {name: ranges[name] if storages[name].element == "int32" else
                flow.merged([[self.places[t].position] * 2 for t in times])
                for name, times in self.touched.items() if storages[name].kind == "arena"}

    monkeypatch.setattr(flow.Flow, "live_ranges", touches_only)
    machines = []
    assert campaign.ground_truth_1(program, parameters, machines=machines)[0] == "safe"
    verdict, why = campaign.ground_truth_values(program, parameters, machines[0])
    assert verdict == "differ" and "bytes differ" in why, why


def test_the_values_ground_truth_sees_branches_that_are_not_independent(lane, monkeypatch):
    """The detector, broken on purpose: the checker's independence proof turned off, the
    backward made concurrent with the forward that feeds it. The checker then accepts it,
    and the runs with the branches interleaved end with other bits than in program order."""
    from cgc.checking import concurrency
    record = judge(lane, "train.cg", "cgThen made cgConcurrently in cgTrainStep")
    assert record["verdict"] == "rejected" and "concurrency" in record["rules"], record
    monkeypatch.setattr(concurrency.Independence, "run", lambda self: None)
    record = judge(lane, "train.cg", "cgThen made cgConcurrently in cgTrainStep")
    assert record["verdict"] == "accepted", record
    assert record["values"] == "differ" and "interleaved" in record["values_why"], record


def test_a_slice_of_the_campaign_has_no_false_accepts():
    """Mutants of every kind and schedule and random schedules against the NumPy machine,
    a sample of them against the sanitized kernels too."""
    out = io.StringIO()
    summary = campaign.campaign(seed=1, limit=400, randoms=40, constants=0, pairs=40, jobs=2,
                                emulated_limit=100, budget=120, out=out, values="accepted")
    text = out.getvalue()
    print(text)
    assert summary["errors"] == 0, text
    assert summary["false accepts"] == 0, text
    kinds = summary["by kind"]
    assert set(kinds) >= {"grid", "binding", "removed", "reordered", "concurrency", "storage",
                          "extent", "lifetime", "combined", "random"}, text
    assert summary["values compared"] >= 60, text  # every accepted variant GT1 runs
    accepted = sum(row.get("accepted", 0) for row in kinds.values())
    gt1 = sum(row.get("gt1 fault", 0) for row in kinds.values())
    gt2_faults = sum(row.get("gt2 fault", 0) for row in kinds.values())
    assert accepted >= 60 and gt1 >= 60 and gt2_faults >= 20, text
