"""The cost model's arithmetic (scripts/cost_model.py), on small cases worked by hand, and
the step it prints. Every figure it gives is MODELLED; these tests check the arithmetic of
the model, not the H200 (there is none here)."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import cost_model  # noqa: E402
from cost_model import (MODEL, Design, LaunchFacts, Model, floor_time,  # noqa: E402
                        hbm_bandwidth, model_kernel, model_library, shared_wavefronts, tail)
from sass_audit import H200, KernelAudit, Occupancy  # noqa: E402


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


def test_every_kernel_image_has_a_design_and_no_design_is_left_over():
    """DESIGNS is exactly the step's kernel images: an image the step stops launching takes
    its design with it."""
    from cgc.frontend.api import analyse, evaluate
    path = str(ROOT / "schedules" / "train.cg")
    program = evaluate(analyse([path]), path, config="gpt2")
    images = {launch.image.name for launch, _, _ in program.unrolled()
              if launch.image.library is None}
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


def test_causal_tiles_at_gpt2_small():
    # 8 sequences x 12 heads x (16 x 17 / 2 = 136) tile pairs
    roles = {"context": 1024, "attentionTile": 64, "batch": 8, "heads": 12}
    assert cost_model._causal_tiles(roles) == 8 * 12 * 136


def test_model_assumptions_are_one_table():
    assert isinstance(cost_model.MODEL, Model)
    assert cost_model.H200 is H200


def test_floor_prints_without_a_compiler():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "cost_model.py"), "--floor"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "MODELLED" in result.stdout and "floor: " in result.stdout
    assert "modelled as built" not in result.stdout


@pytest.mark.parametrize("script", ["cost_model.py", "sass_audit.py"])
def test_an_unknown_config_is_a_diagnostic(script):
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / script), "--config", "nope"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert "cgc: error: unknown config 'nope'" in result.stderr
    assert "Traceback" not in result.stderr
