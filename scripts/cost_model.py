#!/usr/bin/env python3
"""The cost model: each kernel of the step as built, next to its floor. All figures MODELLED.

Floor (what no kernel can beat): for every launch, the larger of the bytes of the buffers it
binds (a read or a write once, a read-and-write or an accumulation twice) over the H200's
HBM bandwidth, and the floating-point operations of its products over its dense bf16
tensor-core rate.

As built (docs/performance-model.md): each kernel priced from its machine code and launch
shape, read by scripts/sass_audit.py (registers and shared memory -> blocks an SM; the
tensor-core, shared-memory and generic instructions of each tiled main loop), and from the
design facts SASS cannot show (DESIGNS: bytes in flight a thread, bank conflicts, loop trip
counts and inner loops' trips, re-reads). A launch takes the longest of:
- HBM: floor bytes over the bandwidth Little's law allows with the bytes the resident
  threads keep in flight (MODEL.memory_latency_s), capped at the HBM rate;
- L2: re-read bytes (a K and V tile loaded once per query tile that reads it) over
  MODEL.l2_bytes_per_s;
- tensor cores: HMMA instructions executed x 4096 flop over the rate mma.sync reaches
  (MODEL.mma_sync_fraction of the peak), on the SMs the grid occupies; cuBLAS products at
  MODEL.cublas_fraction of the peak;
- shared memory: wavefronts (128 bytes a clock an SM; an n-way bank conflict costs n);
- issue: warp instructions a loop executes (the loops inside a main loop times their trips
  from the design) over 4 schedulers an SM;
divided by the tail of the last wave; plus, for a kernel whose last block finishes the work
alone after every other block is done (the layer-norm backward's sum of the blocks' partial
sums), that block's reads from L2 on one SM (Little's law with MODEL.l2_latency_s, at most
MODEL.sm_l2_bytes_per_clock); plus MODEL.launch_overhead_s. The gap between
modelled and floor, kernel by kernel, is the to-do list.

    python3 scripts/cost_model.py             # needs nvcc (cuda-tools) for the audit
    python3 scripts/cost_model.py --floor     # the floor alone, no compiler needed
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections import defaultdict
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from cgc.core.affine import Affine  # noqa: E402
from cgc.checking.memory import element_bytes  # noqa: E402
from cgc.frontend.api import analyse, evaluate  # noqa: E402
from sass_audit import H200, SHARED_KINDS, Hardware, KernelAudit  # noqa: E402

FLOP_PER_HMMA = 2 * 16 * 8 * 16  # one m16n8k16 product: 4096 flop


@dataclass(frozen=True)
class Model:
    """The model's assumptions: rates and latencies no datasheet fixes. Each is a
    modelling choice, argued in docs/performance-model.md."""

    memory_latency_s: float = 600e-9  # an HBM load under load, issue to use
    l2_bytes_per_s: float = 10e12  # L2 hits across the chip
    mma_sync_fraction: float = 0.67  # mma.sync (HMMA) against wgmma's peak on Hopper
    cublas_fraction: float = 0.70  # cuBLAS on GPT-2 small's products, of the peak
    issue_per_clock: int = 4  # warp instructions an SM issues a clock (4 schedulers)
    launch_overhead_s: float = 1.5e-6  # a launch replayed from a CUDA graph, end to start
    l2_latency_s: float = 300e-9  # an L2 hit under load, issue to use (the far partition too)
    sm_l2_bytes_per_clock: int = 64  # what one SM's loads take from L2 a clock


MODEL = Model()


@dataclass(frozen=True)
class Design:
    """What a kernel's design adds to its machine code, for the model.

    inflight: global bytes each thread has in flight (loads issued before the first use);
    conflicts: bank-conflict ways of its shared accesses, by audit kind (1 when absent);
    tile_iterations(roles): for each tiled main loop (in address order, as the audit lists
        them), its iterations summed over the whole grid;
    l2_bytes(roles, launch): bytes re-read from L2 beyond the floor's traffic;
    issue(roles, launch): warp instructions of a loop the SASS counts cannot price;
    wavefronts(roles, launch): shared-memory wavefronts of such a loop;
    inner_trips(roles, launch, inner): for the loops inside one tiled main loop (their
        counts, in address order, as the audit lists them), the trips each makes a thread
        per main-loop iteration (on average: a loop run on the first iteration only makes
        fewer than one). The SASS body counts each once; the model adds the rest;
    last_block_bytes(roles, launch): bytes the last block reads from L2 alone, after every
        other block has finished (a serial tail, on one SM);
    last_block_inflight: the bytes each thread of that block has in flight."""

    inflight: int = 16
    conflicts: dict = field(default_factory=dict)
    tile_iterations: object = None
    l2_bytes: object = None
    issue: object = None
    wavefronts: object = None
    inner_trips: object = None
    last_block_bytes: object = None
    last_block_inflight: int = 16


def _causal_tiles(r) -> int:
    """(query tile, key tile) pairs under the causal mask, over all sequences and heads."""
    tiles = r["context"] // r["attentionTile"]
    return r["batch"] * r["heads"] * tiles * (tiles + 1) // 2


def _attention_rereads(r, launch) -> int:
    """K and V tiles loaded once per query tile that reads them (the floor counts once)."""
    tile_bytes = 2 * r["attentionTile"] * r["headWidth"] * 2  # K and V, bfloat16
    return _causal_tiles(r) * tile_bytes


def _norm_partials(r, launch) -> int:
    """The layer-norm backward's partial sums: a row of 2 x width floats a block."""
    return launch.blocks * 2 * r["width"] * 4


def _sort_stages(r) -> int:
    """Compare-exchange passes of a bitonic sort of the step's rows, padded to a power of
    two: log2(n) (log2(n) + 1) / 2."""
    steps = max(r["rows"] - 1, 1).bit_length()
    return steps * (steps + 1) // 2


def _sort_keys(r) -> int:
    return 1 << max(r["rows"] - 1, 1).bit_length()


def _attention_inner_trips(r, launch, inner) -> tuple:
    """The attention kernels' tiled loops hold no loop: each cp.async copy of a streamed tile
    is kCopies chunks a thread, a count the shape fixes, unrolled into the loop's body, where
    the SASS counts it (q and k arrive turned by cgImageRotary: no rotary loop either). A
    loop found inside is work this design does not price, so it is refused, not priced as
    one trip."""
    assert not inner, f"{launch.image}: the attention loop holds {len(inner)} loops: the " \
        "copies are no longer unrolled, or a loop was put back; price it in DESIGNS"
    return ()


# Per 32 keys of one pass of cgImageScatterOrder's sort, one warp-iteration of its inner loop:
# partner, compare, branch, the two loads and (for half the pairs) the two stores, the loop's
# own arithmetic (an estimate from the template, not counted from the SASS), and 4 shared
# accesses of one wavefront each (consecutive 4-byte keys; half the lanes take part).
SORT_INSTRUCTIONS = 14
SORT_WAVEFRONTS = 4

DESIGNS = {
    # ldmatrix from rows padded by kAttentionRowPadding: its conflict ways are read from the
    # emitted file (sass_audit.attention_ldmatrix_ways: 1 with the padding). In flight: the next key tile's K and V (2 x 64 x 64 bfloat16) by cp.async over 128 threads.
    "cgImageAttention": Design(inflight=128,
                               tile_iterations=lambda r: (_causal_tiles(r),),
                               l2_bytes=_attention_rereads,
                               inner_trips=_attention_inner_trips),
    # the dK/dV loop over query tiles >= j, then the dQ loop over key tiles <= j: each runs
    # over the causal tile pairs; the streamed pair of tiles (q and dO, then k and v) in flight
    "cgImageAttentionBackward": Design(
        inflight=128,
        tile_iterations=lambda r: (_causal_tiles(r), _causal_tiles(r)),
        l2_bytes=lambda r, launch: 2 * _attention_rereads(r, launch),
        inner_trips=_attention_inner_trips),
    "cgImageAttentionDelta": Design(inflight=12),  # a row of output and its gradient
    # a block a row: a lane's pair in each of its warp's 6 of the 24 heads of q and k (two
    # bfloat16 a pair), all loaded before any is turned
    "cgImageRotary": Design(inflight=24),
    "cgImageEmbedding": Design(inflight=24),  # a row of 768 floats over 128 threads
    "cgImageLayerNorm": Design(inflight=24),
    # a warp a row: its input, its gradient and gamma, 24 floats each a lane, loaded together
    # (the residual of the Add variant is read after the row's sums, alone); then the last
    # block reads every block's row of partials (2 x width floats) from L2, kNormTailLoads
    # (16) float4 loads a thread in flight (common.cuh: layer_norm_backward)
    "cgImageLayerNormBackward": Design(inflight=288, last_block_bytes=_norm_partials,
                                       last_block_inflight=16 * 16),
    "cgImageLayerNormBackwardAdd": Design(inflight=288, last_block_bytes=_norm_partials,
                                          last_block_inflight=16 * 16),
    # a row a block: each thread loads its 7 groups of 16 bytes (50304 bfloat16 logits over
    # 1024 threads) before using any
    "cgImageClassifier": Design(inflight=112),
    "cgImageCastDown": Design(inflight=32),
    "cgImageSquareSum": Design(inflight=16),
    # one 16-byte load a thread of each of 4 arrays; the clip factor is computed once
    "cgImageAdamW": Design(inflight=64),
    "cgImageGradientNorm": Design(inflight=4),  # one partial sum a thread at a time
    # one block sorts the step's keys in shared memory: every pass visits every key
    "cgImageScatterOrder": Design(
        inflight=4,
        issue=lambda r, launch: _sort_stages(r) * _sort_keys(r) // 32 * SORT_INSTRUCTIONS,
        wavefronts=lambda r, launch: _sort_stages(r) * _sort_keys(r) // 32 * SORT_WAVEFRONTS),
    # each gradient float's address waits on order[p] and then ids[order[p]]: one float a
    # thread in flight
    # a run's rows are looked up a window at a time, then four rows' loads issued before
    # their adds: the SASS issues 8 of them (32 bytes) before the first add
    "cgImageScatterSorted": Design(inflight=32),
    "cgImageStepAdvance": Design(inflight=4),
}


# ---- one launch ----------------------------------------------------------------------

@dataclass
class LaunchFacts:
    """What the model reads of one launch."""

    image: str
    blocks: int
    threads: int
    floor_bytes: int
    flops: float  # the products' operations (0 for kernels without products)
    library: bool = False
    # A copy a library product makes before it runs: none since the products went through
    # cuBLASLt (cublasGemmEx's C = D made the residual product copy C first).
    copies_residual_bytes: int = 0

    @property
    def warps(self) -> int:
        return -(-self.threads // 32)


def floor_time(bytes_moved: float, flops: float, hw: Hardware = H200) -> float:
    return max(bytes_moved / hw.hbm_bytes_per_s, flops / hw.tensor_flops)


def hbm_bandwidth(active_sms: int, resident_threads: int, inflight: int,
                  hw: Hardware = H200, model: Model = MODEL) -> float:
    """Little's law: the bytes in flight on the active SMs over the latency, at most HBM's."""
    return min(hw.hbm_bytes_per_s,
               active_sms * resident_threads * inflight / model.memory_latency_s)


def shared_wavefronts(counts: dict, conflicts: dict) -> float:
    """Wavefronts of one loop iteration of one warp: each access's conflict-free wavefronts
    (its width: 128 bytes a wavefront) times its kind's conflict ways."""
    return sum(counts.get(f"wavefronts:{kind}", 0) * conflicts.get(kind, 1)
               for kind in SHARED_KINDS)


def tail(blocks: int, per_wave: int) -> float:
    """The fraction of the last wave's slots the grid fills, spread over all waves. A grid
    of one wave or less is priced on the SMs it occupies instead (model_kernel)."""
    waves = blocks / per_wave
    return 1.0 if waves <= 1 else waves / math.ceil(waves)


@dataclass
class Modelled:
    """One launch's modelled time and its parts (seconds)."""

    floor: float
    parts: dict

    @property
    def time(self) -> float:
        return self.parts["total"]

    @property
    def bound(self) -> str:
        return max((k for k in self.parts if k not in ("total", "overhead")),
                   key=lambda k: self.parts[k])


def model_library(facts: LaunchFacts, hw: Hardware = H200, model: Model = MODEL) -> Modelled:
    """A cuBLAS product: its operations at the fraction of the peak cuBLAS reaches, its
    bytes (and the copy before a residual product) at HBM's rate."""
    bytes_moved = facts.floor_bytes + facts.copies_residual_bytes
    parts = {"tensor": facts.flops / (hw.tensor_flops * model.cublas_fraction),
             "hbm": bytes_moved / hw.hbm_bytes_per_s, "overhead": model.launch_overhead_s}
    parts["total"] = max(parts["tensor"], parts["hbm"]) + parts["overhead"]
    return Modelled(floor_time(facts.floor_bytes, facts.flops, hw), parts)


def model_kernel(facts: LaunchFacts, audit: KernelAudit, design: Design, roles: dict,
                 hw: Hardware = H200, model: Model = MODEL) -> Modelled:
    per_sm = max(audit.occupancy.blocks, 1)
    active = min(hw.sms, facts.blocks)
    resident = min(per_sm, -(-facts.blocks // hw.sms)) * facts.threads
    clock = active * hw.clock_hz
    parts = {"hbm": facts.floor_bytes / hbm_bandwidth(active, resident, design.inflight, hw,
                                                      model)}
    l2 = design.l2_bytes(roles, facts) if design.l2_bytes else 0
    parts["l2"] = l2 / model.l2_bytes_per_s
    hmma = wavefronts = issue = 0.0
    # ldmatrix's conflicts come from the audited file's row stride, not from the design
    conflicts = {**design.conflicts, "ldsm": audit.ldsm_conflicts}
    if design.tile_iterations:
        iterations = design.tile_iterations(roles)
        assert len(iterations) == len(audit.tile_loops), \
            f"{facts.image}: the design names {len(iterations)} tiled loops, the SASS has " \
            f"{len(audit.tile_loops)}"
        inner_loops = audit.inner_loops or [[] for _ in audit.tile_loops]
        for counts, n, inner in zip(audit.tile_loops, iterations, inner_loops):
            executed = n * facts.warps  # loop iterations over all warps of the grid
            body = [(counts, 1.0)]
            assert design.inner_trips or not inner, \
                f"{facts.image}: the SASS has loops inside a tiled loop the design does " \
                "not price (inner_trips)"
            if design.inner_trips and inner:
                # the SASS counts an inner loop's body once: add its other trips (or take
                # off the part of its one that a first-iteration-only loop does not run)
                body += [(c, trips - 1) for c, trips in
                         zip(inner, design.inner_trips(roles, facts, inner))]
            for part, times in body:
                hmma += part.get("tensor", 0) * executed * times
                wavefronts += shared_wavefronts(part, conflicts) * executed * times
                issue += part.get("instructions", 0) * executed * times
    if design.issue:
        issue += design.issue(roles, facts)
    if design.wavefronts:
        wavefronts += design.wavefronts(roles, facts)
    parts["tensor"] = hmma * FLOP_PER_HMMA / (active * hw.tensor_flops / hw.sms
                                              * model.mma_sync_fraction)
    parts["shared"] = wavefronts / clock  # one wavefront a clock an SM
    parts["issue"] = issue / (clock * model.issue_per_clock)
    parts["overhead"] = model.launch_overhead_s
    busiest = max(v for k, v in parts.items() if k != "overhead")
    parts["last block"] = 0.0
    if design.last_block_bytes:
        rate = min(facts.threads * design.last_block_inflight / model.l2_latency_s,
                   model.sm_l2_bytes_per_clock * hw.clock_hz)
        parts["last block"] = design.last_block_bytes(roles, facts) / rate
    parts["total"] = busiest / tail(facts.blocks, per_sm * hw.sms) + parts["last block"] \
        + parts["overhead"]
    return Modelled(floor_time(facts.floor_bytes, facts.flops, hw), parts)


# ---- the step ------------------------------------------------------------------------

def value(x, point):
    return x.at(point) if isinstance(x, Affine) else int(x)


def flops(launch, point, roles) -> float:
    name = launch.image.name
    scalars = {launch.image.scalars[b.index].name: value(b.value, point) for b in launch.scalars}
    if launch.image.library is not None:
        return 2.0 * scalars["m"] * scalars["n"] * scalars["k"]
    if name in ("cgImageAttention", "cgImageAttentionBackward"):
        batch, heads = int(roles["batch"]), int(roles["heads"])
        context, width = int(roles["context"]), int(roles["width"])
        head_width = width // heads
        causal_pairs = context * (context + 1) / 2  # query-key pairs under the mask
        one_product = 2.0 * batch * heads * causal_pairs * head_width
        # forward: S = Q K^T and O = P V; backward (as written: dK, dV pass, then dQ pass):
        # S, dP, dV, dK, then S, dP, dQ again.
        return one_product * (2 if name == "cgImageAttention" else 7)
    return 0.0


def traffic(launch, low) -> int:
    total = 0
    for binding in launch.pointers:
        parameter = launch.image.pointers[binding.index]
        passes = 2 if parameter.access in ("readwrite", "accumulate") else 1
        total += passes * binding.view.count * element_bytes(binding.view.storage.element, low)
    return total


def launch_facts(program, launch, point) -> LaunchFacts:
    from cgc.backends.cuda.emit import CUBLAS_PRODUCTS
    image = launch.image
    library = image.library is not None
    blocks, threads, copy = 0, 0, 0
    if library:
        # Every product is one cublasLtMatmul: the residual is read as C (its bytes are in
        # traffic(), as an operand), with no copy first; an epilogue's aux matrix (GELU_AUX
        # writes pre, DGELU reads it) is a pointer of the image, in traffic() too.
        assert image.name in CUBLAS_PRODUCTS, image.name
    else:
        grid = launch.arguments().grid
        blocks = math.prod(value(g, point) for g in grid)
        threads = math.prod(image.block)
    return LaunchFacts(image.name, blocks, threads, traffic(launch, program.low),
                       flops(launch, point, program.roles), library, copy)


def step_rows(program, audits: dict | None, hw: Hardware = H200, model: Model = MODEL):
    """Per image: [launches, bytes, flops, floor seconds, modelled seconds, bound-by time]."""
    roles = {k: v for k, v in program.roles.items() if isinstance(v, int)}
    rows = defaultdict(lambda: {"launches": 0, "bytes": 0, "flops": 0.0, "floor": 0.0,
                                "modelled": 0.0, "bounds": defaultdict(float)})
    for launch, _, point in program.unrolled():
        facts = launch_facts(program, launch, point)
        row = rows[facts.image]
        row["launches"] += 1
        row["bytes"] += facts.floor_bytes
        row["flops"] += facts.flops
        row["floor"] += floor_time(facts.floor_bytes, facts.flops, hw)
        if audits is None:
            continue
        if facts.library:
            modelled = model_library(facts, hw, model)
        else:
            modelled = model_kernel(facts, audits[facts.image], DESIGNS[facts.image], roles,
                                    hw, model)
        row["modelled"] += modelled.time
        row["bounds"][modelled.bound] += modelled.time
    return rows


PARTS = ("hbm", "l2", "tensor", "shared", "issue", "last block", "overhead")


def print_parts(program, audits, hw: Hardware = H200, model: Model = MODEL) -> None:
    """Each image's modelled parts, summed over its launches (MODELLED, microseconds): the
    longest part (after the tail) is what a launch costs; the others are what it hides."""
    roles = {k: v for k, v in program.roles.items() if isinstance(v, int)}
    sums = defaultdict(lambda: defaultdict(float))
    for launch, _, point in program.unrolled():
        facts = launch_facts(program, launch, point)
        modelled = model_library(facts, hw, model) if facts.library else \
            model_kernel(facts, audits[facts.image], DESIGNS[facts.image], roles, hw, model)
        for key in (*PARTS, "total"):
            sums[facts.image][key] += modelled.parts.get(key, 0.0)
    print("MODELLED parts of each image's time, summed over its launches (us)")
    print("| image | " + " | ".join(PARTS) + " | modelled |")
    print("| --- | " + " | ".join("---:" for _ in PARTS) + " | ---: |")
    for name, parts in sorted(sums.items(), key=lambda r: -r[1]["total"]):
        print(f"| {name} | " + " | ".join(f"{parts[k] * 1e6:,.1f}" for k in PARTS)
              + f" | {parts['total'] * 1e6:,.1f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="gpt2")
    parser.add_argument("--floor", action="store_true",
                        help="the floor alone (no audit, so no CUDA compiler needed)")
    parser.add_argument("--parts", action="store_true",
                        help="each image's modelled time split into its parts")
    args = parser.parse_args()
    from cgc.core.diagnostics import CompileError, render_all
    from sass_audit import ToolchainMissing, audit_file
    path = os.path.join(ROOT, "schedules", "train.cg")
    try:
        program = evaluate(analyse([path]), path, config=args.config)
        audits = None if args.floor else audit_file(path, args.config)
    except ToolchainMissing as error:
        print(f"cost_model: error: {error} (or --floor for the floor alone)", file=sys.stderr)
        return 1
    except CompileError as error:  # the schedule itself: cgc's own diagnostics
        print(render_all(error.diagnostics), file=sys.stderr)
        return 1
    rows = step_rows(program, audits)
    if args.parts and audits:
        print_parts(program, audits)
        return 0
    hw = H200
    print(f"train.cg, config {args.config}, {hw.name}: one step. MODELLED figures, not "
          f"measurements. Floor: bytes at {hw.hbm_bytes_per_s / 1e12:.1f} TB/s or products at "
          f"{hw.tensor_flops / 1e12:.0f} TFLOP/s, whichever is longer.")
    print("| image | launches | MB moved | GFLOP | floor (us) | modelled (us) | "
          "modelled / floor | modelled bound by |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    total = defaultdict(float)
    order = sorted(rows.items(), key=lambda r: -(r[1]["modelled"] or r[1]["floor"]))
    for name, row in order:
        bound = max(row["bounds"], key=row["bounds"].get) if row["bounds"] else \
            ("products" if row["flops"] / hw.tensor_flops > row["bytes"] / hw.hbm_bytes_per_s
             else "memory")
        modelled = f"{row['modelled'] * 1e6:,.1f}" if audits else "-"
        # a floor under 0.1 us (a launch that moves a few bytes) makes no useful ratio
        ratio = f"{row['modelled'] / row['floor']:,.1f}x" if audits and row["floor"] > 1e-7 \
            else "-"
        print(f"| {name} | {row['launches']} | {row['bytes'] / 1e6:,.1f} | "
              f"{row['flops'] / 1e9:,.1f} | {row['floor'] * 1e6:,.1f} | {modelled} | {ratio} | "
              f"{bound} |")
        for key in ("launches", "bytes", "flops", "floor", "modelled"):
            total[key] += row[key]
    modelled = f"{total['modelled'] * 1e6:,.1f}" if audits else "-"
    print(f"| **step** | {int(total['launches'])} | {total['bytes'] / 1e6:,.1f} | "
          f"{total['flops'] / 1e9:,.1f} | {total['floor'] * 1e6:,.1f} | {modelled} | | |")
    tokens = int(program.roles["batch"]) * int(program.roles["context"])
    print(f"floor: {total['floor'] * 1e3:.2f} ms a step, {tokens / total['floor']:,.0f} "
          f"tokens/s ({tokens} tokens a step)")
    if audits:
        print(f"modelled as built: {total['modelled'] * 1e3:.2f} ms a step, "
              f"{tokens / total['modelled']:,.0f} tokens/s (MODELLED, not measured)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
