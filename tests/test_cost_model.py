"""The cost model's arithmetic (scripts/cost_model.py), on small cases worked by hand, and
the step it prints: each launch, concurrent branches on the shared machine, the
data-parallel step's all-reduce. Every figure it gives is MODELLED; these tests check the
arithmetic of the model, not the H200 (there is none here)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections import Counter

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import cost_model  # noqa: E402
from cost_model import (MODEL, UNSHARED, Design, LaunchFacts, Model, Segment,  # noqa: E402
                        collective_seconds, floor_time, hbm_bandwidth, kernel_profile,
                        library_profile, machine_of, model_kernel, model_library,
                        profile_seconds, program_seconds, rates, shared_wavefronts,
                        side_by_side, tail, water_fill)
from sass_audit import H200, KernelAudit, Occupancy  # noqa: E402

from cgc.core.affine import LoopVariable  # noqa: E402
from cgc.core.ir import Concurrent, Launch, PhaseRegion, Repeat  # noqa: E402
from cgc.pipeline import check  # noqa: E402


def test_floor_is_the_longer_of_bytes_and_products():
    # 4.8 GB at 4.8 TB/s is 1 ms; 989 GFLOP at 989 TFLOP/s is 1 ms: each alone, then both
    assert floor_time(4.8e9, 0, H200) == pytest.approx(1e-3)
    assert floor_time(0, 989e9, H200) == pytest.approx(1e-3)
    assert floor_time(4.8e9, 2 * 989e9, H200) == pytest.approx(2e-3)


def test_littles_law_caps_at_hbm():
    # 132 SMs x 2048 threads x 16 bytes / 600 ns = 7.2 TB/s: more than HBM gives, so 4.8
    assert hbm_bandwidth(132, 2048, 16, H200, MODEL) == 4.8e12
    # 132 x 2048 x 4 / 600 ns = 1.8022 TB/s: one float a thread cannot fill the pipe
    assert hbm_bandwidth(132, 2048, 4, H200, MODEL) == pytest.approx(132 * 2048 * 4 / 600e-9)
    # 6 SMs of 256 threads, 16 bytes each: 6 x 4096 / 600 ns = 40.96 GB/s
    assert hbm_bandwidth(6, 256, 16, H200, MODEL) == pytest.approx(40.96e9)


def test_shared_wavefronts_multiply_by_conflict_ways():
    counts = {"wavefronts:generic": 256, "wavefronts:lds": 20, "wavefronts:sts": 40,
              "wavefronts:ldsm": 16}
    # 256 generic loads, 8 ways: 2048; the others conflict-free: 76
    assert shared_wavefronts(counts, {"generic": 8}) == 2048 + 76
    assert shared_wavefronts(counts, {}) == 256 + 76


def test_tail_of_the_last_wave():
    assert tail(100, 200) == 1.0  # under one wave: priced on the SMs it uses instead
    assert tail(400, 200) == 1.0  # two full waves
    assert tail(300, 200) == pytest.approx(0.75)  # 1.5 waves take 2


def test_library_product_at_the_cublas_fraction_plus_its_copy():
    # 2 x 8192 x 768 x 768 flop = 9.66 GFLOP at 0.7 x 989 TFLOP/s
    work = 2.0 * 8192 * 768 * 768
    facts = LaunchFacts("p", 0, 0, floor_bytes=10**6, flops=work, library=True,
                        copies_residual_bytes=2 * 8192 * 768 * 4)
    modelled = model_library(facts, H200, MODEL)
    assert modelled.parts["tensor"] == pytest.approx(work / (989e12 * 0.7))
    assert modelled.parts["hbm"] == pytest.approx((10**6 + 2 * 8192 * 768 * 4) / 4.8e12)
    assert modelled.time == pytest.approx(work / (989e12 * 0.7) + MODEL.launch_overhead_s)
    assert modelled.floor == pytest.approx(work / 989e12)
    assert modelled.bound == "tensor"


def _audit(blocks_per_sm, tile_loops=()):
    return KernelAudit("k", 128, 32, 0, 0, 0, Occupancy(blocks_per_sm, "shared memory",
                                                        blocks_per_sm * 4),
                       Counter(), list(tile_loops), 0)


def test_memory_kernel_by_hand():
    """1320 blocks of 128 threads, 16 blocks an SM: 10 blocks on each of 132 SMs, 1280
    threads x 4 bytes in flight: 132 x 5120 / 600 ns = 1.1264 TB/s; 1.1264 GB takes 1 ms."""
    facts = LaunchFacts("k", 1320, 128, floor_bytes=int(1.1264e9), flops=0)
    modelled = model_kernel(facts, _audit(16), Design(inflight=4), {}, H200, MODEL)
    assert modelled.parts["hbm"] == pytest.approx(1e-3)
    assert modelled.time == pytest.approx(1e-3 + MODEL.launch_overhead_s)
    assert modelled.bound == "hbm"


def test_tiled_kernel_by_hand():
    """264 blocks of 4 warps, one tiled loop of 10 iterations a block (2640 over the grid):
    10560 warp-iterations, each 64 HMMA, 256 generic 32-bit loads at 8 ways and 1000
    instructions. Tensor: 10560 x 64 x 4096 flop at 0.67 x 989 TFLOP/s; shared: 10560 x
    2048 wavefronts over 132 SMs x 1.83 GHz; issue: 10560 x 1000 over 4 a clock an SM.
    Two blocks an SM: exactly one wave (tail 1)."""
    loop = Counter({"tensor": 64, "wavefronts:generic": 256, "instructions": 1000})
    design = Design(conflicts={"generic": 8}, tile_iterations=lambda r: (2640,))
    facts = LaunchFacts("k", 264, 128, floor_bytes=0, flops=0)
    modelled = model_kernel(facts, _audit(2, [loop]), design, {}, H200, MODEL)
    clock = 132 * 1.83e9
    assert modelled.parts["tensor"] == pytest.approx(10560 * 64 * 4096 / (989e12 * 0.67))
    assert modelled.parts["shared"] == pytest.approx(10560 * 2048 / clock)
    assert modelled.parts["issue"] == pytest.approx(10560 * 1000 / (4 * clock))
    assert modelled.bound == "shared"
    # conflict-free loads (ldmatrix, swizzled) take an eighth of the shared time
    free = model_kernel(facts, _audit(2, [loop]), Design(tile_iterations=design.tile_iterations),
                        {}, H200, MODEL)
    assert free.parts["shared"] == pytest.approx(modelled.parts["shared"] / 8)


def test_inner_loops_are_priced_by_their_trips():
    """The loop of test_tiled_kernel_by_hand without HMMA bodies of its own, and two loops
    inside it: one of 100 instructions and 4 wavefronts making 3 trips (the SASS body counts
    1: 2 more), one of 50 instructions run on a quarter of the iterations (-0.75 of one).
    Per warp-iteration: 1000 + 2 x 100 - 0.75 x 50 = 1162.5 instructions, 2 x 4 = 8 more
    wavefronts."""
    loop = Counter({"tensor": 64, "instructions": 1000})
    inner = [Counter({"instructions": 100, "wavefronts:lds": 4}),
             Counter({"instructions": 50})]
    audit = _audit(2, [loop])
    audit.inner_loops = [inner]
    design = Design(tile_iterations=lambda r: (2640,),
                    inner_trips=lambda r, launch, found: (3, 0.25))
    facts = LaunchFacts("k", 264, 128, floor_bytes=0, flops=0)
    modelled = model_kernel(facts, audit, design, {}, H200, MODEL)
    clock = 132 * 1.83e9
    assert modelled.parts["issue"] == pytest.approx(10560 * 1162.5 / (4 * clock))
    assert modelled.parts["shared"] == pytest.approx(10560 * 8 / clock)
    # one trip each: the bodies count once, as the SASS has them
    once = model_kernel(facts, audit, Design(tile_iterations=lambda r: (2640,),
                                             inner_trips=lambda r, launch, found: (1, 1)),
                        {}, H200, MODEL)
    assert once.parts["issue"] == pytest.approx(10560 * 1000 / (4 * clock))


def test_attention_loops_hold_no_loop_to_price():
    """The attention kernels' copies are kCopies chunks a thread, unrolled into the tiled
    loop's body (where the SASS counts them), and q and k arrive turned by the rotary pass:
    no loop inside. One found there (the copies counted at run time again, a rotary loop put
    back) is refused rather than priced as one trip."""
    roles = {"context": 1024, "attentionTile": 64, "batch": 8, "heads": 12, "headWidth": 64}
    launch = LaunchFacts("cgImageAttention", 8 * 12 * 16, 128, 0, 0)
    assert cost_model._attention_inner_trips(roles, launch, []) == ()
    with pytest.raises(AssertionError, match="holds 2 loops"):
        cost_model._attention_inner_trips(roles, launch, [Counter({"ldgsts": 4})] * 2)
    audit = _audit(2, [Counter({"tensor": 64, "instructions": 600})])
    audit.inner_loops = [[Counter({"ldgsts": 4, "instructions": 80})]]
    with pytest.raises(AssertionError, match="holds 1 loops"):
        model_kernel(launch, audit, cost_model.DESIGNS["cgImageAttention"], roles, H200, MODEL)


def test_a_loop_inside_a_tiled_loop_needs_its_trips():
    """A design without inner_trips for a kernel whose tiled loop holds a loop is an error:
    the SASS counts that loop's body once, whatever its trips."""
    audit = _audit(1, [Counter({"tensor": 1, "instructions": 10})])
    audit.inner_loops = [[Counter({"instructions": 5})]]
    with pytest.raises(AssertionError, match="does not price"):
        model_kernel(LaunchFacts("k", 1, 128, 0, 0), audit,
                     Design(tile_iterations=lambda r: (1,)), {}, H200, MODEL)


def test_design_and_sass_must_agree_on_the_tiled_loops():
    """A design naming two tiled loops for a kernel whose SASS has one is an error, not a
    silently mispriced kernel."""
    design = Design(tile_iterations=lambda r: (1, 1))
    with pytest.raises(AssertionError, match="2 tiled loops, the SASS has 1"):
        model_kernel(LaunchFacts("k", 1, 128, 0, 0), _audit(1, [Counter({"tensor": 1})]),
                     design, {}, H200, MODEL)


STEPS = ("train.cg", "train_parallel.cg", "train_recompute.cg", "train_zero.cg",
         "llama/train.cg", "llama/train_parallel.cg", "llama/train_recompute.cg")


def test_every_kernel_image_has_a_design_and_no_design_is_left_over():
    """DESIGNS is exactly the kernel images of the steps in schedules/ (GPT's and the
    Llama-style one's, each alone, data-parallel, recomputing and, for GPT, ZeRO-1's):
    `--file` prices any of them (train_zero.cg's cast-down once had no design: a KeyError),
    and an image no step launches any more takes its design with it."""
    images = set()
    for name in STEPS:
        config = "tinyllama" if name.startswith("llama/") else "gpt2"
        images |= cost_model.kernel_images(_program(ROOT / "schedules" / name, config=config))
    assert images <= set(cost_model.DESIGNS), images - set(cost_model.DESIGNS)
    assert set(cost_model.DESIGNS) <= images, set(cost_model.DESIGNS) - images


def test_sort_of_the_step_by_hand():
    """8192 rows: a bitonic sort of 8192 = 2^13 keys takes 13 x 14 / 2 = 91 passes; 8000 rows
    pad to 8192 too; 5 rows pad to 8: 3 x 4 / 2 = 6 passes."""
    assert cost_model._sort_stages({"rows": 8192}) == 91
    assert cost_model._sort_keys({"rows": 8000}) == 8192
    assert cost_model._sort_stages({"rows": 8000}) == 91
    assert (cost_model._sort_stages({"rows": 5}), cost_model._sort_keys({"rows": 5})) == (6, 8)


def test_design_wavefronts_and_issue_add_to_the_sass_counts():
    """One block (one SM) with 1000 warp instructions and 2000 wavefronts its design adds:
    shared 2000 clocks, issue 250 clocks, at 1.83 GHz on one SM."""
    design = Design(issue=lambda r, launch: 1000, wavefronts=lambda r, launch: 2000)
    modelled = model_kernel(LaunchFacts("k", 1, 1024, 0, 0), _audit(1), design, {}, H200,
                            MODEL)
    assert modelled.parts["shared"] == pytest.approx(2000 / 1.83e9)
    assert modelled.parts["issue"] == pytest.approx(1000 / (4 * 1.83e9))
    assert modelled.bound == "shared"


# ---- the calibrated model --------------------------------------------------------------

def test_products_per_shape_by_hand():
    """8192 x 8192 x 8192 on 128 x 256 tiles: 64 x 32 = 2048 tiles, 15.5 waves take 16, each
    tile 128 k-steps + 2 of fill and drain, a k-step 2 x 128 x 256 x 64 flop at an SM's
    share of 790 TFLOP/s; its bytes (a few hundred MB) hide under that. 768 x 768 x 8192
    (a weight gradient): 36 tiles of 128 x 128 fill 36 of 132 SMs, in one pass over k, as the
    program runs it (it keeps no split-K algorithm); split in 3 (a what-if), 108 tiles of 43
    k-steps, their float32 partial sums written and read back, would beat it."""
    calibrated = cost_model.CALIBRATED
    big = LaunchFacts("p", 0, 0, floor_bytes=3 * 8192 * 8192 * 2, flops=2.0 * 8192**3,
                      library=True, shape=(8192, 8192, 8192), operand_bytes=2 * 8192 * 8192 * 2)
    plans = {(plan.tile, plan.split): plan.parts
             for plan in cost_model.product_plans(big, H200, calibrated)}
    step = 2.0 * 128 * 256 * 64 / (790e12 / 132)
    assert plans[((128, 256), 1)]["tensor"] == pytest.approx(16 * 130 * step)
    best = cost_model.model_product(big, H200, calibrated)
    assert big.flops / best.time == pytest.approx(754e12, rel=0.01)  # 95% of the ceiling
    small = LaunchFacts("w", 0, 0, floor_bytes=2 * 768 * 8192 * 2 + 768 * 768 * 4,
                        flops=2.0 * 768 * 768 * 8192, library=True, shape=(768, 768, 8192),
                        operand_bytes=2 * 768 * 8192 * 2)
    assert {plan.split for plan in cost_model.product_plans(small, H200, calibrated)} == {1}
    what_if = dataclasses.replace(calibrated, product_splits=(1, 2, 3, 4, 6, 8))
    plans = cost_model.product_plans(small, H200, what_if)
    whole = next(plan.parts for plan in plans if plan.tile == (128, 128) and plan.split == 1)
    assert whole["tensor"] == pytest.approx((128 + 2) * 2.0 * 128 * 128 * 64 / (790e12 / 132))
    seconds, tile, split, parts, tiles, moved = plans[0]
    assert (tile, split, tiles) == ((128, 128), 3, 108)
    assert moved == small.floor_bytes + 2 * 3 * 768 * 768 * 4
    assert parts["tensor"] == pytest.approx((43 + 2) * 2.0 * 128 * 128 * 64 / (790e12 / 132))
    assert parts["hbm"] == pytest.approx(moved / 4.3e12)
    assert parts["overhead"] == 2 * MODEL.launch_overhead_s  # the split's reduction launch
    assert seconds < whole["total"] / 2


def test_a_products_waves_hold_the_sms_its_tiles_hold():
    """The calibrated model prices a product's tiles in waves over the SMs, one tile an SM;
    its profile holds those SMs, no more: a 768 x 768 weight gradient's 36 tiles hold 36 of
    132 SMs (a branch beside it has the other 96); 768 x 3072's 144 tiles a wave of 132, then
    12, each half the tiles' time; the last tile's epilogue on one SM after. The optimistic
    bound's product (a fraction of the whole chip's peak) holds every SM."""
    calibrated = cost_model.CALIBRATED

    def weight_gradient(n):
        return LaunchFacts("w", 0, 0, floor_bytes=(768 + n) * 8192 * 2 + 768 * n * 4,
                           flops=2.0 * 768 * n * 8192, library=True, shape=(768, n, 8192),
                           operand_bytes=(768 + n) * 8192 * 2)
    for n, waves in ((768, [36]), (3072, [132, 12])):
        facts = weight_gradient(n)
        modelled = cost_model.model_product(facts, H200, calibrated)
        profile = library_profile(facts, modelled, H200)
        parts = modelled.parts
        assert [s.sms for s in profile] == [0] + waves + [1]
        assert profile_seconds(profile) == pytest.approx(modelled.time)
        body = parts["total"] - parts["overhead"] - parts["last tile"]
        assert [s.seconds for s in profile[1:-1]] == pytest.approx([body / len(waves)] * len(waves))
        assert profile[-1].seconds == pytest.approx(parts["last tile"])
        optimistic = library_profile(facts, model_library(facts, H200, MODEL), H200)
        assert [s.sms for s in optimistic] == [0, 132]
    # split in 3 along K (a what-if the program never runs): 108 tiles on 108 SMs, drawing
    # the split's float32 partial sums (written and read back) as well as the floor's bytes
    what_if = dataclasses.replace(calibrated, product_splits=(1, 2, 3, 4, 6, 8))
    facts = weight_gradient(768)
    split = library_profile(facts, cost_model.model_product(facts, H200, what_if), H200)
    assert [s.sms for s in split] == [0, 108, 1]
    assert split[1].hbm * split[1].seconds == pytest.approx(
        facts.floor_bytes + 2 * 3 * 768 * 768 * 4)
    # beside a kernel of 132 blocks, the 36-tile product leaves it 96 SMs: both run at once,
    # the pair no longer than the product's SM-time and the kernel's together over 132 SMs
    small = library_profile(facts, cost_model.model_product(facts, H200, calibrated), H200)
    kernel = [Segment(100 * US, sms=132)]
    pair = profile_seconds(side_by_side([small, kernel], H200_MACHINE))
    work = (sum(s.seconds * s.sms for s in small) + 100 * US * 132) / 132
    assert pair < profile_seconds(small) + 100 * US
    assert pair == pytest.approx(work + small[0].seconds, rel=0.02)


def test_imbalance_of_unequal_blocks():
    assert cost_model.imbalance([1] * 8, 4) == 1  # two whole waves
    assert cost_model.imbalance([1] * 6, 4) == pytest.approx(2 / 1.5)  # a half-empty wave
    # the longest last: 1, 2, 3 on 2 slots: 1 | 2, then 3 after 1: 4 against 3
    assert cost_model.imbalance([1, 2, 3], 2) == pytest.approx(4 / 3)
    assert cost_model.imbalance([3, 2, 1], 2) == pytest.approx(1)  # longest first: 3 | 2 + 1
    # GPT-2 small's forward, blocks in dispatch order on 396 slots (132 SMs x 3, a hand case:
    # the forward as built holds 4 an SM): longest first, within
    # 4% of even; shortest first (the order before) 21% over, and one pair's tiles after
    # another's (blockIdx.x alone reversed) 30%
    roles = {"context": 1024, "attentionTile": 64, "batch": 8, "heads": 12}
    work = cost_model._attention_forward_work(roles, None)
    assert len(work) == 1536 and sum(work) == cost_model._causal_tiles(roles)
    assert work == sorted(work, reverse=True)
    assert cost_model.imbalance(work, 396) < 1.04
    assert cost_model.imbalance(sorted(work), 396) > 1.2
    assert cost_model.imbalance([16 - x for _ in range(96) for x in range(16)], 396) > 1.3


def _calibrated(facts, audit, design):
    return cost_model.model_kernel_calibrated(facts, audit, design, {}, H200,
                                              cost_model.CALIBRATED)


def test_calibrated_pipes_hide_under_the_busiest_only_as_far_as_warps_allow():
    """The tiled kernel of test_tiled_kernel_by_hand, calibrated: 2 blocks of 4 warps an SM,
    2 warps a scheduler: the busiest pipe (shared) plus half of the others."""
    loop = Counter({"tensor": 64, "wavefronts:generic": 256, "instructions": 1000,
                    "mufu": 40})
    design = Design(conflicts={"generic": 8}, tile_iterations=lambda r: (2640,),
                    pipelined=True)
    facts = LaunchFacts("k", 264, 128, floor_bytes=0, flops=0)
    modelled = _calibrated(facts, _audit(2, [loop]), design)
    clock = 132 * 1.83e9
    parts = modelled.parts
    assert parts["shared"] == pytest.approx(10560 * 2048 / clock)
    assert parts["mufu"] == pytest.approx(10560 * 40 * 32 / (16 * clock))
    others = parts["tensor"] + parts["issue"] + parts["mufu"]
    assert modelled.time == pytest.approx(parts["shared"] + others / 2
                                          + MODEL.launch_overhead_s)
    # one block of one warp an SM: every pipe after the other
    alone = _calibrated(LaunchFacts("k", 132, 32, 0, 0), _audit(1, [loop]),
                        Design(tile_iterations=lambda r: (2640 * 4 // 2,), pipelined=True))
    assert alone.time == pytest.approx(sum(alone.parts[p] for p in cost_model.PIPES)
                                       + MODEL.launch_overhead_s)


def test_calibrated_memory_hides_work_only_with_another_block():
    """A block that loads, then works: with one block an SM its 1 ms of loads and 0.5 ms of
    issue add; with two, another block's work hides them."""
    facts = LaunchFacts("k", 1320, 1024, floor_bytes=int(4.3e9), flops=0)
    audit = _audit(1)
    audit.straight = Counter({"instructions": 1})
    warps = 1320 * 32
    audit.straight["instructions"] = round(0.5e-3 * 132 * 1.83e9 * 4 / warps)
    design = Design(inflight=1024)
    one = _calibrated(facts, audit, design)
    assert one.parts["hbm"] == pytest.approx(1e-3)
    assert one.parts["exposed"] == pytest.approx(one.parts["issue"])
    assert one.time == pytest.approx(1e-3 + one.parts["issue"] + MODEL.launch_overhead_s)
    two = _calibrated(facts, dataclasses.replace(audit, occupancy=Occupancy(2, "threads", 64)),
                      design)
    assert two.parts["exposed"] == 0
    assert two.time == pytest.approx(1e-3 + MODEL.launch_overhead_s)


def test_calibrated_classifier_loops_by_hand():
    """The classifier's loops each step through a thread's groups of 16 bytes: 264 rows of
    1024 bfloat16 (2048 bytes, 128 groups) over 32 threads, 4 groups a thread; a copy loop of
    12 instructions, one copy a trip, runs 4 trips a warp; a pass of 70 instructions, two
    loads a trip, 2. Issue: 264 blocks x (4 x 12 + 2 x 70) warp instructions over 132 SMs'
    4 schedulers. A loop that touches no row is refused, not priced as one trip."""
    copies = Counter({"instructions": 12, "ldgsts": 1})
    sums = Counter({"instructions": 70, "lds": 2, "mufu": 16})
    audit = _audit(2)
    audit.untiled_loops = [copies, sums]
    facts = LaunchFacts("cgImageClassifier", 264, 32, floor_bytes=264 * 2 * 2048, flops=0)
    design = cost_model.DESIGNS["cgImageClassifier"]
    modelled = _calibrated(facts, audit, design)
    assert modelled.parts["issue"] == pytest.approx(264 * (4 * 12 + 2 * 70) / (132 * 1.83e9 * 4))
    assert modelled.parts["mufu"] == pytest.approx(264 * 2 * 16 * 32 / (132 * 1.83e9 * 16))
    audit.untiled_loops = [copies, Counter({"instructions": 40, "lds": 0})]
    with pytest.raises(AssertionError, match="without 16-byte shared accesses"):
        _calibrated(facts, audit, design)


def test_calibrated_estimate_is_slower_than_the_optimistic_bound(audits, train):
    """Every launch of GPT-2 small's step costs at least its floor in both models, and the
    calibrated estimate of the whole step lies above the optimistic bound."""
    for model in (MODEL, cost_model.CALIBRATED):
        price = cost_model.Pricer(train, audits, 1, H200, model)
        for launch, _, point in train.unrolled():
            facts, modelled = price.facts(launch, point)
            if not facts.collective_bytes:
                assert modelled.time >= modelled.floor * 0.999, facts.image
    calibrated = cost_model.step_times(train, audits, 1, H200, cost_model.CALIBRATED)
    optimistic = cost_model.step_times(train, audits, 1, H200, MODEL)
    assert calibrated.shared > optimistic.shared


def test_causal_tiles_at_gpt2_small():
    # 8 sequences x 12 heads x (16 x 17 / 2 = 136) tile pairs
    roles = {"context": 1024, "attentionTile": 64, "batch": 8, "heads": 12}
    assert cost_model._causal_tiles(roles) == 8 * 12 * 136


def test_model_assumptions_are_one_table():
    assert isinstance(cost_model.MODEL, Model)
    assert cost_model.H200 is H200


def _script(*arguments, script="cost_model.py") -> subprocess.CompletedProcess:
    """scripts/`script` run as a user runs it, with `arguments`."""
    return subprocess.run([sys.executable, str(ROOT / "scripts" / script), *arguments],
                          capture_output=True, text=True, timeout=300)


def test_floor_prints_without_a_compiler():
    result = _script("--floor")
    assert result.returncode == 0, result.stderr
    assert "MODELLED" in result.stdout and "floor: " in result.stdout
    assert "modelled as built" not in result.stdout


@pytest.mark.parametrize("script", ["cost_model.py", "sass_audit.py"])
def test_an_unknown_config_is_a_diagnostic(script):
    result = _script("--config", "nope", script=script)
    assert result.returncode == 1
    assert "cgc: error: unknown config 'nope'" in result.stderr
    assert "Traceback" not in result.stderr


# ---- concurrent branches: the critical path over branches, the machine shared ----------

US = 1e-6
H200_MACHINE = machine_of(H200)  # 132 SMs, 4.8 TB/s


def _launch(name):
    """A launch node for hand-built programs: priced by name (_price), nothing else read."""
    return Launch(name, (1, 1, 1), (), (), None)


def _price(table):
    """price(launch, point): the launch's profile from `table` by name; a callable entry
    is given the repeat point (an iteration-dependent launch)."""
    def price(launch, point):
        entry = table[launch.image]
        return entry(point) if callable(entry) else entry
    return price


def test_water_fill_gives_small_demands_all_they_ask():
    # 1 SM and 132 SMs on 132: the small one gets its SM, the big one the other 131
    assert water_fill([1, 132], 132) == [1, 131]
    # two that fit: each what it asks
    assert water_fill([24, 100], 132) == [24, 100]
    # two full ones: half each
    assert water_fill([132, 132], 132) == [66, 66]
    # 24 (NCCL's channels) beside a full product: 24 and 108
    assert water_fill([132, 24], 132) == [108, 24]


def test_two_branches_by_hand():
    """Two branches on 132 SMs. Fitting side by side (66 + 66 SMs): the longer one, 20 us.
    Not fitting (100 + 100 SMs): 66 each, both at 0.66 of their speed; the 10 us one ends
    at 10 / 0.66 = 15.15 us, when the other has done 10 of its 20 us; it finishes alone in
    10 more: 25.15 us (the sum would be 30, the SM-time bound 3000 / 132 = 22.7)."""
    fit = side_by_side([[Segment(10 * US, sms=66)], [Segment(20 * US, sms=66)]], H200_MACHINE)
    assert profile_seconds(fit) == pytest.approx(20 * US)
    crowded = side_by_side([[Segment(10 * US, sms=100)], [Segment(20 * US, sms=100)]],
                           H200_MACHINE)
    assert profile_seconds(crowded) == pytest.approx(10 * US / 0.66 + 10 * US)
    assert crowded[0].sms == pytest.approx(132) and crowded[-1].sms == pytest.approx(100)
    # each branch alone on its own machine: the critical path, the longer branch
    assert profile_seconds(side_by_side([[Segment(10 * US, sms=100)],
                                         [Segment(20 * US, sms=100)]], UNSHARED)) == \
        pytest.approx(20 * US)


def test_a_branch_that_fills_the_machine_gains_nothing():
    """Kernels holding every SM for their whole time leave the other branch nothing: side by
    side they take their sum. A 1-block kernel beside one leaves it 131 of 132 SMs: it costs
    1/132 of its time, not its time."""
    full = [[Segment(10 * US, sms=132)], [Segment(5 * US, sms=132)]]
    assert profile_seconds(side_by_side(full, H200_MACHINE)) == pytest.approx(15 * US)
    small = [[Segment(100 * US, sms=132)], [Segment(50 * US, sms=1)]]
    assert profile_seconds(side_by_side(small, H200_MACHINE)) == \
        pytest.approx(100 * US + 50 * US / 132)
    # HBM shared too: two memory-bound kernels on few SMs, each at 4.8 TB/s alone
    memory = [[Segment(10 * US, sms=10, hbm=4.8e12)], [Segment(10 * US, sms=10, hbm=4.8e12)]]
    assert profile_seconds(side_by_side(memory, H200_MACHINE)) == pytest.approx(20 * US)


def test_two_products_side_by_side_save_only_a_launch_overhead():
    """Two cuBLAS products (which hold every SM) in two branches: the sum of their bodies;
    what concurrency saves is one launch overhead, the second launch's gap hidden behind the
    first product's work. With no overhead it saves nothing."""
    work = 2.0 * 8192 * 768 * 768
    facts = LaunchFacts("p", 0, 0, floor_bytes=10**7, flops=work, library=True)
    for model, saved in ((MODEL, MODEL.launch_overhead_s),
                         (Model(launch_overhead_s=0.0), 0.0)):
        one = library_profile(facts, model_library(facts, H200, model), H200)
        assert profile_seconds(one) == pytest.approx(model_library(facts, H200, model).time)
        both = side_by_side([one, one], H200_MACHINE)
        assert profile_seconds(both) == pytest.approx(2 * profile_seconds(one) - saved)


def test_nested_branches_and_a_repeat_inside_a_branch():
    """concurrently { A | B then concurrently { C | repeat i in 0..2 { E(i) } } } then F.
    E(i) takes (i + 1) x 10 us, so the repeat is 60 us and must see its iterations.
    Unshared, the critical path: max(A, B + max(C, E0 + E1 + E2)) + F = 100 + 5 us.
    In order: every launch once, 215 us. Shared, by the rule (every launch holding 100 SMs
    of 132; F all 132; whatever runs at a moment shares the SMs, whichever branch it is in):
      0      A, B at 0.66: B ends at 30 / 0.66 = 45.45 us (A has 70 left);
      45.45  A, C, E0 at 0.44 (44 SMs each): E0 ends 10 / 0.44 = 22.73 later, 68.18
             (A 60 left, C 10 left);
      68.18  A, C, E1 at 0.44: C ends at 90.91 (A 50 left, E1 10 left);
      90.91  A, E1 at 0.66: E1 ends at 106.06 (A 40 left);
      106.06 A, E2 at 0.66: E2 ends 30 / 0.66 later, 151.52 (A 10 left);
      151.52 A alone: 161.52; then F: 166.52 us."""
    variable = LoopVariable("i", 3, 9999)
    A, B, C, E, F = (_launch(n) for n in "ABCEF")
    inner = Concurrent(((C,), (Repeat(variable, (E,), None),)), None)
    body = (PhaseRegion("p", (Concurrent(((A,), (B, inner)), None),), None), F)
    full = {"A": (Segment(100 * US, sms=100),), "B": (Segment(30 * US, sms=100),),
            "C": (Segment(20 * US, sms=100),), "F": (Segment(5 * US, sms=132),),
            "E": lambda point: (Segment((point[variable] + 1) * 10 * US, sms=100),)}
    price = _price(full)
    assert program_seconds(body, price, UNSHARED) == \
        pytest.approx((max(100, 30 + max(20, 10 + 20 + 30)) + 5) * US)
    assert program_seconds(body, price) == pytest.approx((100 + 30 + 20 + 60 + 5) * US)
    b = 30 / 0.66
    e0 = b + 10 / 0.44
    c = e0 + 10 / 0.44
    e1 = c + 10 / 0.66
    e2 = e1 + 30 / 0.66
    a = e2 + (100 - 0.66 * b - 0.44 * (c - b) - 0.66 * (e2 - c))
    assert a == pytest.approx(161.52, abs=0.01)
    assert program_seconds(body, price, H200_MACHINE) == pytest.approx((a + 5) * US)
    # the inner branches alone take 70.30 us (C and E0 at 0.66, C and E1, E1 alone, E2)
    assert program_seconds((inner,), price, H200_MACHINE) == \
        pytest.approx((2 * 10 / 0.66 + 10 + 30) * US)
    # no machine to share: a branch left empty (a collective at one rank) costs nothing
    assert program_seconds((Concurrent(((A,), ()), None), F), price, H200_MACHINE) == \
        pytest.approx(105 * US)


def test_rates_share_bandwidth_in_proportion():
    """HBM asked beyond 4.8 TB/s: each drawer slowed alike; a segment that draws none is not
    slowed; NVLink shared by two collectives, half each."""
    speed = rates([Segment(1, sms=10, hbm=3.6e12), Segment(1, sms=10, hbm=2.4e12),
                   Segment(1, sms=10)], H200_MACHINE)
    assert speed == pytest.approx([0.8, 0.8, 1.0])
    assert rates([Segment(1, sms=24, link=1.0)] * 2, H200_MACHINE) == pytest.approx([0.5, 0.5])


def test_kernel_profile_waves_and_tail():
    """300 blocks, 2 an SM: two waves of 264 slots, the last with 36 blocks on 36 SMs, each
    wave half the body (the model's tail); bytes drawn in proportion to each wave's blocks;
    the overhead holds nothing; a last block holds one SM."""
    facts = LaunchFacts("k", 300, 128, floor_bytes=3 * 10**8, flops=0)
    parts = {"overhead": 1.5 * US, "last block": 3 * US, "total": 104.5 * US}
    profile = kernel_profile(facts, cost_model.Modelled(0.0, parts), 2, H200)
    assert [s.seconds for s in profile] == pytest.approx([1.5 * US, 50 * US, 50 * US, 3 * US])
    assert [s.sms for s in profile] == [0, 132, 36, 1]
    assert profile[1].hbm == pytest.approx(3e8 * 264 / 300 / (50 * US))
    assert profile[2].hbm == pytest.approx(3e8 * 36 / 300 / (50 * US))
    # one wave of 64 blocks (the layer-norm backward's grid) holds 64 SMs, leaving 68
    small = kernel_profile(LaunchFacts("k", 64, 256, 0, 0),
                           cost_model.Modelled(0.0, {"overhead": 0.0, "total": 10 * US}), 1,
                           H200)
    assert [(s.seconds, s.sms) for s in small] == [(pytest.approx(10 * US), 64)]


def test_collective_time_by_hand():
    """NCCL's ring: 2(N-1)/N x bytes at the protocol's bus bandwidth plus NCCL's latency
    (base + 2(N-1) steps). 494.4 MB on 8 ranks: Simple, 8.4 + 14 x 3.4 = 56 us, and 1.75 x
    494.4 MB at 370 GB/s; 3 KB on 8 ranks: LL, 6.6 + 14 x 0.6 = 15 us; one rank: nothing."""
    nbytes = 123_606_528 * 4
    protocol, latency, transfer = collective_seconds(nbytes, 8)
    assert protocol == "Simple"
    assert latency == pytest.approx(56 * US)
    assert transfer == pytest.approx(1.75 * nbytes / 370e9)
    protocol, latency, transfer = collective_seconds(3072, 8)
    assert protocol == "LL" and latency == pytest.approx(15 * US)
    assert transfer == pytest.approx(1.75 * 3072 / 87.7e9)
    assert collective_seconds(nbytes, 1) == (None, 0.0, 0.0)
    # two ranks: the ring's factor 2(N-1)/N is 1
    assert collective_seconds(nbytes, 2)[2] == pytest.approx(nbytes / 370e9)
    # ZeRO-1's reduce-scatter and all-gather: one pass around the ring each, (N-1)/N x bytes
    # and half the steps' latency (8.4 + 7 x 3.4 = 32.2 us)
    for operation in ("reduceScatter", "allGather"):
        protocol, latency, transfer = collective_seconds(nbytes, 8, operation=operation)
        assert protocol == "Simple" and latency == pytest.approx(32.2 * US)
        assert transfer == pytest.approx(0.875 * nbytes / 370e9)


# ---- whole programs --------------------------------------------------------------------

def _program(path, entry=None, config="gpt2"):
    from cgc.frontend.api import analyse, evaluate
    return evaluate(analyse([str(path)]), str(path), entry=entry, config=config)


@pytest.fixture(scope="module")
def examples(tmp_path_factory):
    """scripts/branch_examples.py's schedules, written out."""
    import branch_examples
    return branch_examples.write(str(tmp_path_factory.mktemp("branches")))


@pytest.fixture(scope="module")
def bucketed(examples):
    return _program(examples["bucketed.cg"])


@pytest.fixture(scope="module")
def products(examples):
    return _program(examples["products.cg"])


@pytest.fixture(scope="module")
def exposed():
    return cost_model.exposed_program("gpt2")


@pytest.fixture(scope="module")
def train():
    return _program(ROOT / "schedules" / "train.cg")


@pytest.fixture(scope="module")
def audits():
    from sass_audit import ToolchainMissing, audit_file
    try:
        return audit_file(str(ROOT / "schedules" / "train.cg"), "gpt2")
    except ToolchainMissing as error:
        pytest.skip(f"no CUDA toolchain for the audit: {error}")


def test_the_bucketed_example_reduces_the_whole_bank_once(bucketed, exposed):
    """The bucketed example reduces every gradient once: the bank's 494.4 MB in 12 x 8 + 3
    calls, in 23 branches: each layer's MLP bucket beside its end (layer 0's beside the
    scatter too), each attention bucket but layer 0's beside the middle of the layer below;
    layer 0's attention bucket and the rest after, alone. The reference (the all-reduce after
    the backward) has one call, in no branch."""
    assert cost_model.collective_bytes(bucketed) == cost_model.collective_bytes(exposed) \
        == 123_606_528 * 4
    assert sum(1 for l, _, _ in bucketed.unrolled() if l.image.collective) == 12 * 8 + 3
    assert sum(1 for l, _, _ in exposed.unrolled() if l.image.collective) == 1
    assert len(_collective_regions(bucketed.body)) == 2 * 12 - 1
    assert _collective_regions(exposed.body) == []


def _collective_regions(body):
    """The Concurrent nodes with a collective launch in a branch."""
    return [n for n in _nodes(body) if isinstance(n, Concurrent) and any(
        isinstance(m, Launch) and m.image.collective for m in _nodes(n.body))]


def _nodes(body):
    for node in body:
        yield node
        if not isinstance(node, Launch):
            yield from _nodes(node.body)


UNTURNED = """\
import "{schedules}/forward.cg"
import "{schedules}/backward.cg"
import "{schedules}/optimizer.cg"

--- The saving backward before its loop was turned: each layer whole (cgLayerBackwardFrom),
--- the next layer waiting for both of its weight-gradient pairs.
def exampleWholeLayer : (Nat -> Schedule) =
  (lambda unrestricted layer : Nat .
    (cgPhase cgPhaseLayerBackward
      (cgLayerBackwardFrom (cgItem (cgArena cgSavedNormed1) layer)
        (cgItem (cgArena cgSavedStatistics1) layer) (cgItem (cgArena cgSavedQkv) layer)
        (cgItem (cgArena cgSavedAttention) layer) (cgItem (cgArena cgSavedAttentionLse) layer)
        (cgItem (cgArena cgSavedMiddle) layer) (cgItem (cgArena cgSavedNormed2) layer)
        (cgItem (cgArena cgSavedStatistics2) layer) (cgItem (cgArena cgSavedFcPre) layer)
        (cgItem (cgArena cgSavedFcAct) layer) layer (cgArena cgDy0) (cgArena cgDy1))))

def exampleUnturnedBackward : (family NvidiaLaunchSchedule) =
  (cgThen (cgClassifier (cgArena cgDy0) (cgArena cgGradientLow))
    (cgThen
      (nvidiaAffineLaunchRepeat cgLayers
        (lambda unrestricted fromTop : Nat .
          (exampleWholeLayer
            (naturalSaturatingSubtract (naturalSaturatingSubtract cgLayers 1) fromTop))))
      cgScatterSorted))

def exampleUnturnedStep : (family NvidiaLaunchSchedule) =
  (cgThen (cgConcurrently cgForwardSaved cgSortIds)
    (cgThen exampleUnturnedBackward cgOptimizer))
"""


def test_the_turned_backward_loop_is_faster_with_the_same_launches(audits, train, tmp_path):
    """The saving backward's turned loop (backward.cg) runs each layer's attention weight
    gradients beside the next layer's first two products as well as its own input gradient's:
    the same launches as the backward with each layer whole (one after another, the same
    time), but on the shared machine the SMs their few tiles leave idle get work, so the step
    is shorter (MODELLED: 13.710 -> 13.506 ms on 2026-12-07). In the IR, the end of a turn is
    one branch pair: the two weight gradients beside the chain that ends with the next
    layer's GELU backward and fc input gradient."""
    path = tmp_path / "unturned.cg"
    path.write_text(UNTURNED.format(schedules=ROOT / "schedules"))
    unturned = _program(path, entry="exampleUnturnedStep")
    assert check(unturned) == []
    turned_times = cost_model.step_times(train, audits, 1, H200, cost_model.CALIBRATED)
    unturned_times = cost_model.step_times(unturned, audits, 1, H200, cost_model.CALIBRATED)
    assert sorted(launch.image.name for launch, _, _ in train.unrolled()) == \
        sorted(launch.image.name for launch, _, _ in unturned.unrolled())
    assert turned_times.in_order == pytest.approx(unturned_times.in_order, rel=1e-9)
    assert turned_times.shared < unturned_times.shared - 100e-6
    (loop,) = [node for node in train.body if isinstance(node, Repeat)
               and node.variable.name == "fromTop"]
    end = loop.body[0]
    (pair,) = [node for node in end.body if isinstance(node, Concurrent)]
    images = [[node.image.name for node in _nodes(branch) if isinstance(node, Launch)]
              for branch in pair.branches]
    assert images == [["cgImageProductWeightSet"] * 2,
                      ["cgImageProductTransposed", "cgImageLayerNormBackwardAdd",
                       "cgImageProductTransposedGeluBackward", "cgImageProductTransposed"]]


def test_in_order_is_the_sum_of_the_launches(train):
    """With no machine, the profile is the old sum over launches (the floor table's); the
    critical path alone is never longer than the branches on the shared machine, nor those
    than the sum."""
    rows = cost_model.step_rows(train, None)
    times = cost_model.step_times(train, None)
    assert times.in_order == pytest.approx(sum(r["floor"] for r in rows.values()))
    assert times.critical_path <= times.shared * (1 + 1e-9)
    assert times.shared <= times.in_order * (1 + 1e-9)


def test_one_rank_reduces_nothing(train, exposed, bucketed):
    """At one rank the data-parallel steps are train.cg's (at the floor)."""
    one = cost_model.step_times(train, None).shared
    assert cost_model.step_times(exposed, None, 1).shared == pytest.approx(one)
    assert cost_model.step_times(bucketed, None, 1).shared == pytest.approx(one)
    assert cost_model.step_times(exposed, None, 8).shared > one * 1.05


def test_buckets_scale_better_at_the_floor(exposed, bucketed):
    """At the floor (no compiler): every rank count above one, the bucketed step is
    quicker than the one all-reduce after the backward, and its branches side by side are
    quicker than taken in order."""
    for ranks in (2, 4, 8):
        old = cost_model.step_times(exposed, None, ranks)
        new = cost_model.step_times(bucketed, None, ranks)
        assert new.shared < old.shared
        assert new.shared < new.in_order


def test_the_shipped_data_parallel_step_overlaps_its_all_reduce(exposed):
    """schedules/train_parallel.cg's buckets, at the floor: quicker than the all-reduce
    after the backward at 8 ranks, every gradient still reduced once."""
    shipped = _program(ROOT / "schedules" / "train_parallel.cg")
    assert cost_model.collective_bytes(shipped) == 123_606_528 * 4
    assert _collective_regions(shipped.body)
    assert cost_model.step_times(shipped, None, 8).shared < \
        cost_model.step_times(exposed, None, 8).shared


def test_buckets_scale_better_as_built(audits, exposed, bucketed):
    """As built (the audit): the bucketed step's scaling efficiency beats the exposed one's
    at 2, 4 and 8 ranks, and both are below 100% (the all-reduce is not free)."""
    old = cost_model.scaling(exposed, audits, [1, 2, 4, 8])
    new = cost_model.scaling(bucketed, audits, [1, 2, 4, 8])
    assert old.times[1].shared == pytest.approx(new.times[1].shared)
    for ranks in (2, 4, 8):
        assert new.efficiency(ranks) > old.efficiency(ranks)
        assert new.efficiency(ranks) < 1.0
    # the exposed step's penalty is its one all-reduce, seen whole (the launch in between
    # holds every SM: nothing overlaps it)
    _, latency, transfer = collective_seconds(123_606_528 * 4, 8)
    assert old.times[8].shared - old.times[1].shared == pytest.approx(
        latency + transfer + MODEL.launch_overhead_s, rel=1e-6)


def test_products_beside_their_chain_as_built(audits, train, products):
    """The one-GPU example (nested branches, inside a repeat, inside a branch beside the
    scatter's one-block sort): the same launches as train.cg, so in order its step is
    train.cg's. Side by side it saves the sort (one SM of 132 beside the forward: hidden
    but for 1/132 of it) and the launch gaps the branches hide (4 products a layer beside
    another launch), but nothing of the products' own time: they hold every SM. Unshared,
    the critical path is much shorter: the machine, not the dependencies, is the limit.
    The exact claim with every product at the bound's flat fraction of the peak; as the
    bound prices them (some at the estimate's price per shape, shorter), kernels that hold
    few SMs meet other work beside them, so the branches save more, never less."""
    flat = Model(products_at_estimate_where_faster=False)
    one = cost_model.step_times(train, audits, model=flat)
    times = cost_model.step_times(products, audits, model=flat)
    assert times.in_order == pytest.approx(one.in_order, rel=1e-9)
    sort = cost_model.step_rows(train, audits, model=flat)["cgImageScatterOrder"]["modelled"]
    saved = times.in_order - times.shared
    gaps = 4 * 12 * MODEL.launch_overhead_s
    assert sort < saved < sort + gaps + 1e-6
    assert times.critical_path < 0.9 * times.shared
    bound = cost_model.step_times(products, audits)
    assert bound.in_order < times.in_order
    assert bound.in_order - bound.shared >= saved - 1e-9
    # at the floor the products are tensor-bound side by side: no saving
    floor = cost_model.step_times(products, None)
    assert floor.shared == pytest.approx(floor.in_order, rel=1e-9)


def test_grouping_a_branchs_collectives_pays_one_latency(audits, bucketed):
    """Model.group_collectives: a bucket's four calls as one NCCL group pay one latency;
    the step is quicker, and by less than the latencies saved (the calls were overlapped)."""
    plain = cost_model.step_times(bucketed, audits, 8).shared
    grouped = cost_model.step_times(bucketed, audits, 8,
                                    model=Model(group_collectives=True)).shared
    assert grouped < plain
    price = cost_model.Pricer(bucketed, audits, 8)
    tasks = cost_model.program_tasks(bucketed.body, price)
    grouped_tasks = cost_model.program_tasks(
        bucketed.body, cost_model.Pricer(bucketed, audits, 8,
                                         model=Model(group_collectives=True)))
    # 99 calls become 24 groups: two buckets a layer, but layer 0's attention bucket and the
    # rest after it, one after another outside any branch, are one
    assert len(tasks) - len(grouped_tasks) == 99 - 24


def test_scaling_of_another_models_file_reduces_its_own_bank():
    """--ranks with --file of the Llama step: the all-reduce after the backward is spliced
    into that file's own step (until 2026-12-07, into train.cg's, whose config tinyllama is
    not: a traceback), so it reduces the Llama gradient bank (4.4 GB, not GPT-2's 494.4 MB)
    in one call, and at one rank both columns are that step's time."""
    result = _script("--floor", "--file", "schedules/llama/train.cg", "--config", "tinyllama",
                     "--parallel", "schedules/llama/train_parallel.cg", "--ranks", "1,2")
    assert result.returncode == 0, result.stderr
    assert "gradients reduced: 4,400.2 MB in 1 call after the backward; " \
        "schedules/llama/train_parallel.cg: 4,400.2 MB in 135 calls" in result.stdout
    (one,) = [line.split("|")[1:-1] for line in result.stdout.splitlines()
              if line.startswith("| 1 |")]
    assert one[1] == one[4] and one[3].strip() == one[6].strip() == "100.0%"


def test_scaling_prints_in_one_run_without_a_compiler():
    result = _script("--floor", "--ranks", "1,2,4,8")
    assert result.returncode == 0, result.stderr
    assert "Data parallel" in result.stdout and "MODELLED" in result.stdout
    assert "| 8 |" in result.stdout and "one all-reduce after the backward" in result.stdout
    bad = _script("--floor", "--ranks", "0,2")
    assert bad.returncode == 2 and "at least 1" in bad.stderr


# ---- --registers: the occupancy what-if -----------------------------------------------------

def test_fewer_registers_than_its_shared_memory_allows_change_nothing(audits, train):
    """The attention backward as built: 255 registers, 4 blocks of 2 warps an SM, held there
    by its registers and by its shared memory alike (4 x 56 KB), so at 168 registers it
    takes no more blocks (shared memory the limit) and the step is as it was; the audit
    itself is left as built."""
    built = audits["cgImageAttentionBackward"]
    assert built.registers > 168 and built.occupancy.blocks == 4
    what_if = dict(audits)
    what_if[built.name] = cost_model.with_registers(built, 168)
    assert what_if[built.name].counts == built.counts
    assert (what_if[built.name].occupancy.blocks, what_if[built.name].occupancy.limiter) == \
        (4, "shared memory")
    steps = [cost_model.step_times(train, each, 1, H200, cost_model.CALIBRATED).shared
             for each in (audits, what_if)]
    assert steps[0] == steps[1]
    assert built.occupancy.blocks == 4 and built.registers > 168


def test_fewer_registers_give_more_blocks_and_a_faster_step_only_in_the_what_if():
    """TinyLlama's rotary pass as built holds 12 blocks of 128 threads an SM, by its 40
    registers a thread; at 30 it would hold 16 (its threads the limit): more rows' loads in
    flight (Little's law), so the launches and the step's estimate fall; the audit itself is
    left as built."""
    from sass_audit import ToolchainMissing, audit_file
    path = ROOT / "schedules" / "llama" / "train.cg"
    try:
        audits = audit_file(str(path), "tinyllama")
    except ToolchainMissing as error:
        pytest.skip(f"no CUDA toolchain for the audit: {error}")
    program = _program(path, config="tinyllama")
    built = audits["cgImageRotary"]
    assert built.occupancy == Occupancy(12, "registers", 48)
    what_if = dict(audits)
    what_if[built.name] = cost_model.with_registers(built, 30)
    assert what_if[built.name].occupancy.blocks == 16
    assert what_if[built.name].counts == built.counts
    steps = [cost_model.step_times(program, each, 1, H200, cost_model.CALIBRATED).shared
             for each in (audits, what_if)]
    assert steps[1] < steps[0]
    assert audits["cgImageRotary"].occupancy.blocks == 12


@pytest.mark.parametrize("arguments, message", [
    (["--registers", "cgImageNope=128"], "cgImageNope: not a kernel of schedules/train.cg"),
    (["--registers", "cgImageAttention"], "is not IMAGE=N"),
    (["--registers", "cgImageAttention=0"], "is not IMAGE=N"),
    (["--registers", "cgImageAttention=256"], "is not IMAGE=N"),
    (["--registers", "cgImageAttention=\u0661\u0662\u0668"], "is not IMAGE=N"),
    (["--registers", "cgImageAttention=128", "--registers", "cgImageAttention=168"],
     "an image given twice"),
    (["--floor", "--registers", "cgImageAttention=128"], "not --floor"),
    (["--scale", "cgImageNope=0.5"], "cgImageNope: not an image schedules/train.cg launches"),
    (["--scale", "cgImageAttention"], "is not IMAGE=F"),
    (["--scale", "cgImageAttention=0"], "is not IMAGE=F"),
    (["--scale", "cgImageAttention=-1"], "is not IMAGE=F"),
    (["--scale", "cgImageAttention=inf"], "is not IMAGE=F"),
    (["--scale", "cgImageAttention=nan"], "is not IMAGE=F"),
    (["--scale", "cgImageAttention=0.5", "--scale", "cgImageAttention=0.6"],
     "an image given twice"),
    (["--floor", "--scale", "cgImageAttention=0.5"], "not with --floor"),
    (["--sensitivity", "--scale", "cgImageAttention=0.5"], "not with --floor"),
    (["--registers", "cgImageAttention=128", "--scale", "cgImageAttention=0.5"],
     "--sensitivity or --registers")])
def test_a_bad_what_if_is_a_usage_error(arguments, message):
    """--registers and --scale: refused before the audit, so without a CUDA toolchain too,
    and before anything is printed."""
    result = _script(*arguments)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert result.stdout == "" and "Traceback" not in result.stderr


def test_a_registers_what_if_no_block_of_which_fits_is_a_usage_error(audits):
    """The classifier's 1,024 threads at 255 registers a thread: no block fits an SM, so the
    kernel could not launch; once priced anyway (as one block an SM), now refused."""
    result = _script("--registers", "cgImageClassifier=255")
    assert result.returncode == 2 and result.stdout == "", result.stderr
    assert "a block of 1024 threads at 255 registers a thread does not fit" in result.stderr
    assert _script("--registers", "cgImageClassifier=64").returncode == 0


def test_the_registers_what_if_from_the_command_line(audits):
    """The script's own what-if says it is one, and prices the step as with_registers does:
    faster than the kernel as built (TinyLlama's rotary pass at 30 registers, 16 blocks an
    SM; in GPT-2 small's file no kernel's registers hold back its step: the attention
    kernels' shared memory holds them to 4 blocks as well, the layer-norm backward pipelines
    its rows). (`audits`: the CUDA compiler the audit needs is here.)"""
    from sass_audit import audit_file
    path = ROOT / "schedules" / "llama" / "train.cg"
    result = _script("--file", str(path), "--config", "tinyllama",
                     "--registers", "cgImageRotary=30")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("WHAT-IF, not the kernel as built: cgImageRotary "
                                    "priced at 30 registers a thread, 16 blocks an SM (built: ")
    shared = [line for line in result.stdout.splitlines()
              if line.startswith("| side by side, the machine shared")]
    printed_ms = float(shared[0].split("|")[2])
    llama_audits = audit_file(str(path), "tinyllama")
    program = _program(path, config="tinyllama")

    def step_ms(what_if):
        return cost_model.step_times(program, what_if, 1, H200,
                                     cost_model.CALIBRATED).shared * 1e3
    rotary = llama_audits["cgImageRotary"]
    expected = step_ms({**llama_audits, rotary.name: cost_model.with_registers(rotary, 30)})
    assert printed_ms == pytest.approx(expected, abs=5e-4) and printed_ms < step_ms(llama_audits)


# ---- --scale: an image's time scaled ----------------------------------------------------------

def test_the_scale_what_if_prices_the_step_with_those_images_scaled(audits, train):
    """Said to be a what-if; the step as built is the script's own estimate, the scaled one
    what the Pricer gives with those factors (a product image too), and shorter."""
    result = _script("--scale", "cgImageAttentionBackward=0.685",
                     "--scale", "cgImageProductWeightSet=0.9")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("WHAT-IF, not the kernels as built:")
    rows = [line.split("|") for line in lines[3:]]
    built_ms, scaled_ms = float(rows[0][2]), float(rows[1][2])
    assert rows[1][1].strip() == \
        "cgImageAttentionBackward x 0.685, cgImageProductWeightSet x 0.9"

    def step_ms(scaled):
        price = cost_model.Pricer(train, audits, 1, H200, cost_model.CALIBRATED, scaled)
        return cost_model.program_seconds(
            train.body, price, cost_model.machine_of(H200, cost_model.CALIBRATED)) * 1e3
    assert built_ms == pytest.approx(
        cost_model.step_times(train, audits, 1, H200, cost_model.CALIBRATED).shared * 1e3,
        abs=5e-4)
    expected = step_ms({"cgImageAttentionBackward": 0.685, "cgImageProductWeightSet": 0.9})
    assert scaled_ms == pytest.approx(expected, abs=5e-4) and scaled_ms < built_ms - 0.5


@pytest.mark.parametrize("arguments,hint", [((), True),
                                            (("--registers", "cgImageAttention=128"), False)])
def test_a_missing_compiler_is_one_line_with_the_way_out_that_fits(arguments, hint, monkeypatch,
                                                                   capsys):
    """Without CUDA's compiler the audit cannot be built: one line, exit 1, and --floor
    offered only where it would answer (a what-if prices a kernel as built: not with it)."""
    import sass_audit

    def missing(*args, **kwargs):
        raise sass_audit.ToolchainMissing("nvcc is not installed: pip install ...")
    monkeypatch.setattr(sass_audit, "audit_file", missing)
    monkeypatch.setattr(sys, "argv", ["cost_model.py", *arguments])
    assert cost_model.main() == 1
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        "cost_model: error: nvcc is not installed: pip install ..."
        + (" (or --floor for the floor alone)" if hint else "")]
    assert captured.out == ""


@pytest.mark.parametrize("arguments", [
    ("--config", "tiny"), ("--config", "tiny32"),
    ("--file", str(ROOT / "schedules" / "llama" / "train.cg"), "--config", "tiny32")],
    ids=["tiny", "tiny32", "llama-tiny32"])
def test_a_context_of_one_attention_tile_is_priced_not_refused(audits, arguments):
    """At config tiny (a context of 64: one attention tile) no tile pair is off the diagonal,
    and nvcc may remove the attention kernels' loops over them: the script once stopped with
    an AssertionError (the design names 1 tiled loop, the SASS has 0); the step is priced.
    In float32 (tiny32) the fragments multiply by FMAs, no HMMA, so there is no tiled loop
    at all (the script stopped so for the Llama file, and for GPT's once its backward's
    chunk loops were priced). (`audits`: the CUDA compiler the audit needs is here.)"""
    result = _script(*arguments)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "side by side, the machine shared (the model)" in result.stdout


def test_the_backward_chunk_loops_and_the_loops_around_them_by_hand():
    """GPT-2 small: 16 tiles a sequence, 8 x 12 (sequence, head) pairs, 136 causal tile pairs
    each (13,056), 16 on the diagonal (1,536): the chunk loops (16 keys or queries a trip, 4
    a tile pair) run 1,536 x 4 = 6,144 times a launch on the diagonal and 11,520 x 4 =
    46,080 off it, in the order of the machine code (the dQ blocks' pairs off the diagonal,
    their diagonal, the dK/dV blocks' diagonal, their pairs off it); each loop over tiles
    runs 11,520 trips in its pass's 1,536 blocks, 3.75 a block of the grid's 3,072 (dK/dV
    and dQ blocks). TinyLlama (32 query heads on 4 key/value heads): the loops over a
    block's 8 query heads come first in each pass, 8 trips in each of the pass's blocks, 4 a
    block of the grid."""
    gpt2 = {"batch": 8, "heads": 12, "context": 1024, "attentionTile": 64}
    assert cost_model._backward_chunks(gpt2) == (46080, 6144, 6144, 46080)
    launch = LaunchFacts("cgImageAttentionBackward", 2 * 16 * 12 * 8, 64, 0, 0)
    assert cost_model._backward_around(gpt2, launch, [Counter()] * 2) == (3.75, 3.75)
    with pytest.raises(AssertionError, match="3 loops around the chunk loops"):
        cost_model._backward_around(gpt2, launch, [Counter()] * 3)
    llama = {"batch": 4, "heads": 32, "kvHeads": 4, "context": 2048, "attentionTile": 64}
    blocks = 2 * 32 * 4 * 4
    off = 4 * 32 * (32 * 33 // 2 - 32)
    assert cost_model._backward_around(
        llama, LaunchFacts("cgImageAttentionBackward", blocks, 64, 0, 0), [Counter()] * 4) == \
        (4, off / blocks, 4, off / blocks)
    # a context of one tile: no pair off the diagonal; the dQ blocks' loops over key tiles
    # (and their chunk loop) are gone from the machine code, the dK/dV blocks' run no trip
    one = {**gpt2, "context": 64}
    assert cost_model._backward_chunks(one) == (8 * 12 * 4, 8 * 12 * 4, 0)
    assert cost_model._backward_around(one, launch, [Counter()] * 2) == (0, 0)
    assert cost_model._backward_around(one, launch, [Counter()]) == (0,)
    assert cost_model._backward_around(one, launch, []) == ()
    grouped = {**llama, "context": 64}
    assert cost_model._backward_around(grouped, launch, [Counter()] * 3) == (4, 4, 0)


def test_the_backward_blocks_run_longest_first():
    """The backward's grid (x: key/value heads, y: sequences, z: the work) in dispatch order:
    every (head, sequence) pair's dK/dV block of key tile 0 (4 products a chunk, 16 query
    tiles), then its dQ block of query tile 15 (3 products a chunk, 16 key tiles), then key
    tile 1's, query tile 14's, and so on: longest first but for the passes' products."""
    gpt2 = {"batch": 8, "heads": 12, "context": 1024, "attentionTile": 64}
    launch = LaunchFacts("cgImageAttentionBackward", 2 * 16 * 12 * 8, 64, 0, 0)
    work = cost_model._attention_backward_work(gpt2, launch)
    pairs = 8 * 12
    assert len(work) == launch.blocks
    assert work[:pairs] == [16 * 4] * pairs and work[pairs:2 * pairs] == [16 * 3] * pairs
    assert work[-pairs:] == [1 * 3] * pairs
    assert all(a >= b for a, b in zip(work[::2 * pairs], work[2 * pairs::2 * pairs]))
    llama = {"batch": 4, "heads": 32, "kvHeads": 4, "context": 2048, "attentionTile": 64}
    assert cost_model._attention_backward_work(llama, launch)[0] == 8 * 32 * 4


def test_sensitivity_of_a_serial_step_is_each_images_own_cut(audits):
    """With no branches (the forward schedule) the step is its launches one after another,
    so cutting an image's time by 10% saves the step exactly 10% of that image's time: the
    cut launch moves 10% fewer bytes too, so it draws HBM at its rate as built, and no wave of
    any launch draws more than the measured HBM rate the calibrated estimate prices a launch
    at (wave_segments: the residual product's full waves, drawing by their tiles 4.43 TB/s,
    leave the rest to its last wave). Either way broken, the residual product's cut would
    save more or less than its own."""
    forward = _program(ROOT / "schedules" / "forward.cg")
    assert not cost_model.has_branches(forward.body)
    rows = cost_model.sensitivity(forward, audits, 0.1)
    assert {image for image, _, _ in rows} == \
        {launch.image.name for launch, _, _ in forward.unrolled()}
    for image, own, saved in rows:
        assert saved == pytest.approx(0.1 * own, rel=1e-9), image
    rate = cost_model.machine_of(H200, cost_model.CALIBRATED).hbm
    assert rate == H200.measured_hbm_bytes_per_s
    built = cost_model.Pricer(forward, audits, 1, H200, cost_model.CALIBRATED)
    cut = cost_model.Pricer(forward, audits, 1, H200, cost_model.CALIBRATED,
                            {"cgImageProductResidual": 0.9})
    for launch, _, point in forward.unrolled():
        assert all(segment.hbm <= rate * (1 + 1e-12) for segment in built(launch, point))
    launch, _, point = next(row for row in forward.unrolled()
                            if row[0].image.name == "cgImageProductResidual")
    facts, modelled = built.facts(launch, point)
    first = cost_model.wave_segments(1.0, modelled.tiles, H200.sms, modelled.moved)[0].hbm
    body = modelled.time - modelled.parts["overhead"] - modelled.parts["last tile"]
    assert first / body > 1.03 * rate  # by its tiles alone its full waves would draw 4.43 TB/s
    for was, now in zip(built(launch, point), cut(launch, point), strict=True):
        assert now.hbm == pytest.approx(was.hbm, rel=1e-12)
        assert now.seconds == pytest.approx(was.seconds if was.sms == 0 and not was.hbm
                                            else 0.9 * was.seconds, rel=1e-12)


def test_sensitivity_of_the_step_with_branches(audits, train):
    """Beside branches a cut saves at most its own size, and an image whose launches run
    beside others that take the SMs they free saves less (the weight gradients beside the
    input gradients' chain); the attention backward, on the chain itself, nearly all."""
    rows = {image: (own, saved) for image, own, saved in
            cost_model.sensitivity(train, audits, 0.1)}
    for image, (own, saved) in rows.items():
        assert -1e-12 <= saved <= 0.1 * own * (1 + 1e-9), image
    weights, backward = rows["cgImageProductWeightSet"], rows["cgImageAttentionBackward"]
    assert weights[1] < 0.9 * 0.1 * weights[0] and backward[1] > 0.9 * 0.1 * backward[0]
    seconds, held, idle = cost_model.sms_at_work(train, audits)
    assert seconds == pytest.approx(cost_model.step_times(train, audits, 1, H200,
                                                          cost_model.CALIBRATED).shared)
    assert 0.5 < held < 1 and 0 < idle < seconds


def test_sensitivity_from_the_command_line(audits, train):
    """--sensitivity prints the shared step, how much of it the SMs are held, and a row an
    image in the order of what its cut saves; with --floor (no kernels as built) a usage
    error."""
    result = _script("--sensitivity")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("schedules/train.cg, config gpt2, H200 SXM, one GPU, calibrated "
                               "estimate, the machine shared: ") and "MODELLED" in lines[0]
    rows = [line.split("|")[1:-1] for line in lines if line.startswith("| cgImage")]
    expected = cost_model.sensitivity(train, audits, 0.1)
    assert [row[0].strip() for row in rows] == [image for image, _, _ in expected]
    assert [float(row[2].replace(",", "")) for row in rows] == \
        [round(saved * 1e6, 1) for _, _, saved in expected]
    refused = _script("--sensitivity", "--floor")
    assert refused.returncode == 2 and "--sensitivity prices the kernels as built" in \
        refused.stderr
    refused = _script("--sensitivity", "--parts")
    assert refused.returncode == 2 and "not with --parts or --ranks" in refused.stderr


def test_the_optimistic_bound_prices_no_image_slower_than_the_estimate(audits, train):
    """The bound is one image by image: no image's launches cost more in it than in the
    calibrated estimate. With products at the flat fraction of the peak alone (the bound
    until 2026-12-07) three images did: ProductData, ProductTransposed, ProductResidual."""
    estimate = cost_model.step_rows(train, audits, model=cost_model.CALIBRATED)

    def slower(model):
        bound = cost_model.step_rows(train, audits, model=model)
        return sorted(image for image, row in bound.items()
                      if row["modelled"] > estimate[image]["modelled"] * (1 + 1e-9))
    assert slower(MODEL) == []
    assert slower(Model(products_at_estimate_where_faster=False)) == [
        "cgImageProductData", "cgImageProductResidual", "cgImageProductTransposed"]



def test_the_optimistic_parts_add_up_to_each_launch_s_time(train, audits):
    """In the optimistic bound a launch costs its busiest part, its tail, its last block or
    tile and its overhead; `--parts` shows each (the tail had no column, so a row's busiest
    part and overhead fell short of its time: the attention backward's by 40.8 us)."""
    price = cost_model.Pricer(train, audits, 1, cost_model.H200, cost_model.MODEL)
    hidden = ("hbm", "l2", "tensor", "shared", "issue")
    tails = 0.0
    for launch, _, point in train.unrolled():
        _, modelled = price.facts(launch, point)
        parts = modelled.parts
        shown = max(parts.get(k, 0.0) for k in hidden) + sum(
            parts.get(k, 0.0) for k in ("tail", "last block", "last tile", "overhead"))
        assert shown == pytest.approx(parts["total"], rel=1e-12, abs=1e-15), launch.image.name
        assert set(parts) - {"total"} <= set(cost_model.PARTS), launch.image.name
        tails += parts.get("tail", 0.0)
    assert tails > 0  # some grid ends in a part wave


# ---- the figures the docs quote -----------------------------------------------------------

def _shared_steps(stdout: str) -> list[tuple[float, str]]:
    """The script's '(the model)' rows: the calibrated estimate's, then the optimistic
    bound's, each (ms, tokens/s as printed)."""
    rows = [line.split("|") for line in stdout.splitlines()
            if line.startswith("| side by side, the machine shared (the model)")]
    return [(float(row[2]), row[3].strip()) for row in rows]


def test_the_readme_and_the_model_document_quote_what_the_script_prints(audits):
    """README's status and docs/performance-model.md's headlines quote the step as the script
    prices it today (GPT-2 small: the calibrated estimate and the optimistic bound; TinyLlama:
    the calibrated estimate): a kernel or a model change that moves them fails here until the
    documents say so. (`audits`: the CUDA compiler the audit needs is here.)"""
    gpt2 = _script()
    llama = _script("--file", str(ROOT / "schedules" / "llama" / "train.cg"),
                    "--config", "tinyllama")
    assert gpt2.returncode == 0 and llama.returncode == 0, gpt2.stderr + llama.stderr
    (ms, tokens), (bound_ms, bound) = _shared_steps(gpt2.stdout)[:2]
    llama_ms, llama_tokens = _shared_steps(llama.stdout)[0]
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    model = " ".join((ROOT / "docs" / "performance-model.md").read_text(encoding="utf-8").split())
    assert f"**{ms:.2f} ms a step, {tokens} tokens/s at GPT-2 small" in readme
    assert f"is {bound_ms:.2f} ms, {bound} tokens/s" in readme
    assert f"**{llama_ms:.1f} ms a step, {llama_tokens} tokens/s" in readme
    assert f"**{ms:.2f} ms a step, {tokens} tokens/s (calibrated, MODELLED)**; the optimistic " \
           f"bound {bound_ms:.2f} ms, {bound} tokens/s" in model
    assert f"**{llama_ms:.2f} ms a step, {llama_tokens} tokens/s (MODELLED)**" in model
