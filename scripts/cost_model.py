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

Concurrent branches (`cgConcurrently`, ir.Concurrent) are priced on the critical path over
the branches, the machine shared (program_seconds): every launch is a task of the program's
graph, with a profile of segments, each holding SMs, drawing HBM and NVLink bandwidth (and,
at the floor, the tensor cores) for a time; the tasks running at a moment share the machine
(rates: SMs max-min fairly, bandwidth in proportion), a kernel granted fewer SMs than its
blocks hold, or less bandwidth than it draws, slowed in proportion (run_tasks). Collectives
are NCCL's ring all-reduce on NVLink (collective_seconds). docs/performance-model.md argues
each figure.

    python3 scripts/cost_model.py             # needs nvcc (cuda-tools) for the audit
    python3 scripts/cost_model.py --floor     # the floor alone, no compiler needed
    python3 scripts/cost_model.py --ranks 1,2,4,8   # and the data-parallel step's scaling
    python3 scripts/cost_model.py --file schedules/llama/train.cg --config tinyllama \\
        --registers cgImageRotary=30   # a what-if: 16 blocks an SM, not 12
    python3 scripts/cost_model.py --sensitivity   # what a 10% cut of each image would save
    python3 scripts/cost_model.py --scale cgImageAttentionBackward=0.800   # a what-if
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from typing import NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from cgc.core.affine import Affine  # noqa: E402
from cgc.backends.numpy.reference import norm_group  # noqa: E402
from cgc.core.ir import Concurrent, Launch, PhaseRegion, Repeat  # noqa: E402
from cgc.checking.memory import element_bytes  # noqa: E402
from cgc.frontend.api import analyse, evaluate  # noqa: E402
from sass_audit import H200, DATA_PATH_KINDS, Hardware, KernelAudit, occupancy  # noqa: E402

FLOP_PER_HMMA = 2 * 16 * 8 * 16  # one m16n8k16 product: 4096 flop
TRAIN = os.path.join(ROOT, "schedules", "train.cg")


@dataclass(frozen=True)
class Model:
    """The model's assumptions: rates and latencies no datasheet fixes. Each is a
    modelling choice, argued in docs/performance-model.md."""

    memory_latency_s: float = 600e-9  # an HBM load under load, issue to use
    l2_bytes_per_s: float = 10e12  # L2 hits across the chip
    mma_sync_fraction: float = 0.67  # mma.sync (HMMA) against wgmma's peak on Hopper
    cublas_fraction: float = 0.70  # cuBLAS on GPT-2 small's products, of the peak
    # The bound prices a product at the calibrated estimate's price for its shape where that
    # is faster than cublas_fraction (model_library); False: at cublas_fraction alone, as the
    # bound did until 2026-12-07 (when three product images priced slower in it than in the
    # estimate)
    products_at_estimate_where_faster: bool = True
    issue_per_clock: int = 4  # warp instructions an SM issues a clock (4 schedulers)
    launch_overhead_s: float = 1.5e-6  # a launch replayed from a CUDA graph, end to start
    l2_latency_s: float = 300e-9  # an L2 hit under load, issue to use (the far partition too)
    sm_l2_bytes_per_clock: int = 64  # what one SM's loads take from L2 a clock
    # The all-reduce: NCCL's ring on one node's NVLink 4 (H100/H200 SXM, NVSwitch).
    # nccl-tests' bus bandwidth, the large-message plateau of the ring (NCCL_ALGO=RING) on
    # 8 x H100 SXM, the same from 2 to 8 GPUs (NVIDIA/nccl#1455; NVIDIA/nccl-tests#212: line
    # rate 450 GB/s a direction, about 20% protocol overhead)
    allreduce_bus_bytes_per_s: float = 370e9
    # NCCL 2.20.3's own tuning model (src/graph/tuning.cc), ring on NVLink, per protocol:
    # (base latency, latency a step, share of the Simple protocol's bus bandwidth, cap on
    # the bus bandwidth); a call takes 2(N-1) steps and NCCL picks the quickest protocol
    allreduce_protocols: tuple = (("LL", 6.6e-6, 0.6e-6, 1 / 4, 87.7e9),
                                  ("LL128", 14.0e-6, 1.9e-6, 0.92, math.inf),
                                  ("Simple", 8.4e-6, 3.4e-6, 1.0, math.inf))
    # SMs a collective holds while it runs: one CTA a channel, each alone on its SM
    # (NVIDIA/nccl#689); 24 channels on NVLink (NVIDIA/nccl#1225: 24 CTAs on DGX A100)
    collective_sms: int = 24
    # NVLink 4 a direction (900 GB/s both ways): the floor of an all-reduce is each rank
    # sending its buffer once and receiving the result once (the switch reducing: NVLS)
    nvlink_bytes_per_s: float = 450e9
    # Collectives that follow one another in a branch issued as one NCCL group
    # (ncclGroupStart/End: one launch, one latency): not what cgc emits (one call each),
    # a what-if for the scaling table
    group_collectives: bool = False
    # ---- the calibrated model (CALIBRATED; docs/performance-model.md "Calibrated") ----
    # False: the optimistic bound (peak rates, every part of a kernel hidden under its
    # slowest, every product at cublas_fraction). True: the measured ceilings
    # (Hardware.measured_*), products priced per shape (model_product), kernels by
    # model_kernel_calibrated (parts overlapped only as the design and its warps allow).
    calibrated: bool = False
    # The tiles cuBLASLt's Hopper kernels take (M x N, one tile an SM at a time), the K
    # step of their main loop, and the k-steps' worth of time a tile spends filling its
    # pipeline before its first product and draining its accumulators after its last
    product_tiles: tuple = ((128, 128), (128, 256), (256, 128))
    product_k_step: int = 64
    product_fixed_steps: float = 2.0
    # Splits of K a product may run in (split-K: each part's float32 partial sums written
    # and read back by a reduction launch). One: the program keeps only algorithms that
    # make one pass over k (program.cu.j2, cg_choose_algorithm: a split sums k in another
    # order, other bits), so the model prices no split; more are a what-if
    product_splits: tuple = (1,)
    # What one SM stores a clock when it writes alone (a product's last tile, after every
    # other tile is done)
    sm_store_bytes_per_clock: int = 64


MODEL = Model()  # the optimistic bound
CALIBRATED = Model(calibrated=True)  # the estimate the docs and README quote


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
    last_block_trips(roles, launch): the dependent L2 round trips of that tail (its floor:
        a tail of few loads in flight is latency-bound);
    last_block_inflight: the bytes each thread of that block has in flight."""

    inflight: int = 16
    conflicts: dict = field(default_factory=dict)
    tile_iterations: object = None
    l2_bytes: object = None
    issue: object = None
    wavefronts: object = None
    inner_trips: object = None
    last_block_bytes: object = None
    last_block_trips: object = None
    last_block_inflight: int = 16
    # For the calibrated model (model_kernel_calibrated):
    # pipelined: the design overlaps its loads with its own work (cp.async stages); without
    #     it a block loads, then works, and only another resident block hides either;
    # block_work(roles, launch): each block's work, in the order the blocks are dispatched
    #     (blockIdx.x fastest), for a grid of unequal blocks (causal attention);
    # loop_trips(roles, launch, loops): for each loop outside the main loops (the audit's
    #     untiled_loops, in address order) its warp-trips over the whole grid (default: a
    #     trip a warp).
    pipelined: bool = False
    block_work: object = None
    loop_trips: object = None
    # around_trips(roles, launch, around): for each loop around the main loops (the audit's
    #     around_tiles: the attention backward's loops over tiles around its chunk loops,
    #     and the grouped-query backward's loops over the query heads a block serves) its
    #     trips a warp; its own body (outside the main loops and the other loops around
    #     them) runs that many times.
    around_trips: object = None
    # roles: the blocks each take one of this many passes (the attention backward's dK/dV
    #     and dQ blocks): a pair of blocks runs the code outside the loops once between them
    roles: int = 1


def _causal_tiles(r) -> int:
    """(query tile, key tile) pairs under the causal mask, over all sequences and heads."""
    tiles = r["context"] // r["attentionTile"]
    return r["batch"] * r["heads"] * tiles * (tiles + 1) // 2


def _off_diagonal_tiles(r) -> int:
    """The pairs off the diagonal: the forward's main loop runs once each, and each of the
    backward's two passes takes each in its loop over tiles (the diagonal pair, peeled,
    masked, runs once a block and query head outside them)."""
    return _causal_tiles(r) - r["batch"] * r["heads"] * (r["context"] // r["attentionTile"])


def _attention_rereads(r, launch) -> int:
    """K and V tiles loaded once per query tile that reads them (the floor counts once)."""
    tile_bytes = 2 * r["attentionTile"] * r["headWidth"] * 2  # K and V, bfloat16
    return _causal_tiles(r) * tile_bytes


def _norm_levels(launch) -> tuple:
    """The rows each level of the layer-norm backward's serial tail adds (common.cuh: the
    two levels of tickets): the largest group's, then the groups'."""
    size = norm_group(launch.blocks)
    return size, -(-launch.blocks // size)


NORM_TAIL_LOADS = 16  # common.cuh's kNormTailLoads: float4 loads a thread has in flight


def _norm_backward(inflight: int, floats_a_row) -> Design:
    """A layer-norm or RMSNorm backward: `inflight` bytes a thread while it takes its rows,
    then the serial tail of the last block to finish (common.cuh: the two levels of tickets),
    which adds its group's rows of partials and then the groups' (`floats_a_row(r)` floats a
    row: 2 x width for the layer norm's [dgamma | dbeta], width for RMSNorm's), from L2,
    NORM_TAIL_LOADS loads a thread in flight. Its dependent round trips: in each level a
    thread sums its share of the (column, slice) tasks one after another (sum_partial_rows:
    kSlices slices of the rows), and between the levels come the group sum's fenced store and
    the groups' ticket. At 64 blocks the levels add 9 and 8 rows: few loads in flight, so
    latency, not L2 bandwidth, sets the tail."""
    def tail_bytes(r, launch):
        return sum(_norm_levels(launch)) * floats_a_row(r) * 4

    def tail_trips(r, launch):
        columns = floats_a_row(r) // 4  # float4 columns: kColumns
        slices = launch.threads // math.gcd(columns, launch.threads)  # kSlices
        tasks = math.ceil(slices * columns / launch.threads)
        return sum(tasks * math.ceil(math.ceil(rows / slices) / NORM_TAIL_LOADS)
                   for rows in _norm_levels(launch)) + 2

    return Design(inflight=inflight, last_block_bytes=tail_bytes, last_block_trips=tail_trips,
                  last_block_inflight=NORM_TAIL_LOADS * 16, pipelined=True)


def _sort_stages(r) -> int:
    """Compare-exchange passes of a bitonic sort of the step's rows, padded to a power of
    two: log2(n) (log2(n) + 1) / 2."""
    steps = max(r["rows"] - 1, 1).bit_length()
    return steps * (steps + 1) // 2


def _sort_keys(r) -> int:
    return 1 << max(r["rows"] - 1, 1).bit_length()


def _attention_inner_trips(r, launch, inner) -> tuple:
    """The attention kernels' tiled loops (the forward's key-tile loop, the backward's chunk
    loops) hold no loop: each cp.async copy of a streamed tile is kCopies chunks a thread, a
    count the shape fixes, unrolled into the body of the loop over tiles, where the SASS
    counts it (q and k arrive turned by cgImageRotary: no rotary loop either). A
    loop found inside is work this design does not price, so it is refused, not priced as
    one trip."""
    assert not inner, f"{launch.image}: the attention loop holds {len(inner)} loops: the " \
        "copies are no longer unrolled, or a loop was put back; price it in DESIGNS"
    return ()


def _backward_chunks(r) -> tuple:
    """The attention backward's chunk loops (16 keys, then 16 queries, a trip), block-wide
    iterations, in address order: the dQ blocks' steps off the diagonal, their diagonal step
    (once a query head and block), the dK/dV blocks' diagonal step, their steps off the
    diagonal. At a context of one tile (no pair off the diagonal) the dQ blocks' loop over
    the key tiles before theirs is gone from the machine code (nvcc sees their tile below
    one), the dK/dV blocks' loop over the query tiles after theirs stays (nvcc cannot see
    their tile at least 0), running no iteration."""
    chunks = r["attentionTile"] // 16
    diagonal = r["batch"] * r["heads"] * (r["context"] // r["attentionTile"]) * chunks
    off = _off_diagonal_tiles(r) * chunks
    return (off, diagonal, diagonal, off) if off else (diagonal, diagonal, 0)


def _backward_around(r, launch, around) -> tuple:
    """The attention backward's loops around its chunk loops, in address order, each pass's
    (the dQ blocks', then the dK/dV blocks'): the grouped-query backward's loop over the query
    heads a block serves (heads / kvHeads trips in each of its pass's blocks; none without
    grouping: kGroup = 1, the compiler drops it), then the loop over the key (dQ) or query
    (dK/dV) tiles off the diagonal. Trips a warp over the whole grid (tile_loop_work
    multiplies by all of its warps), while only a pass's own blocks, half of them, run its
    loops: the heads loop heads / kvHeads / 2 trips, the tiles loop the pass's pairs off the
    diagonal over all blocks. At a context of one tile there is no pair off the diagonal:
    the dQ loop over tiles is gone from the machine code, the dK/dV loop stays, running no
    trip (_backward_chunks says why)."""
    group = r["heads"] // r.get("kvHeads", r["heads"])
    heads = (group / 2,) if group > 1 else ()
    tiles = _off_diagonal_tiles(r) / launch.blocks
    if len(around) == 2 * len(heads) + 2:
        return (*heads, tiles) * 2
    assert tiles == 0 and len(around) in (2 * len(heads), 2 * len(heads) + 1), \
        f"{launch.image}: {len(around)} loops around the chunk loops, the design expects " \
        f"{2 * len(heads) + 2} (a group of {group})"
    if len(around) == 2 * len(heads) + 1:
        return (*heads, *heads, 0)  # the dK/dV loop over tiles kept, no trip
    return heads * 2  # both loops over tiles gone


def _attention_forward_work(r, launch) -> list:
    """The forward's blocks in dispatch order, each its key tiles: query tile t reads t + 1
    of them, and the blocks take the tiles longest first, the last tile of every (head,
    sequence) pair, then the one before (attention.cu.j2). The backward's block j reads the
    query tiles from j on (dK, dV), then the key tiles up to j (dQ): T + 1 tiles every
    block, balanced."""
    tiles, pairs = r["context"] // r["attentionTile"], r["batch"] * r["heads"]
    return [tiles - linear // pairs for linear in range(tiles * pairs)]


def _attention_backward_work(r, launch) -> list:
    """The backward's blocks in dispatch order (blockIdx.x fastest: the key/value heads, then
    the sequences, then z), each its chunk loops' products: z = 2i takes dK and dV of key
    tile i (the query tiles from i on, 4 products a chunk), z = 2i + 1 dQ of query tile
    tiles - 1 - i (as many key tiles, 3 products a chunk), each for the query heads its
    key/value head serves: longest first, but for the passes' products a chunk."""
    tiles = r["context"] // r["attentionTile"]
    group = r["heads"] // r.get("kvHeads", r["heads"])
    pairs = r["batch"] * r.get("kvHeads", r["heads"])
    return [group * (tiles - z // 2) * (4 if z % 2 == 0 else 3)
            for z in range(2 * tiles) for _ in range(pairs)]


def _classifier_trips(r, launch, loops) -> tuple:
    """Each of the classifier's loops steps through a thread's groups of 16 bytes of its row
    (the copies in, the three passes), so many groups a trip as the trip has 16-byte shared
    accesses (the loop unrolled): its trips a warp are the thread's groups over those. The
    row: half the floor's bytes a block (read once, written once; the few bytes of loss and
    target left out). nvcc's remainder loop of the copies is priced as if it took them all
    (an over-estimate of about 50 instructions a warp in 600)."""
    groups = launch.floor_bytes // (2 * launch.blocks) / 16 / launch.threads
    trips = []
    for counts in loops:
        per_trip = counts.get("lds", 0) or counts.get("ldgsts", 0)
        assert per_trip, "cgImageClassifier: a loop without 16-byte shared accesses; price it"
        trips.append(launch.blocks * launch.warps * groups / per_trip)
    return tuple(trips)


# Per 32 keys of one pass of cgImageScatterOrder's sort, one warp-iteration of its inner loop:
# partner, compare, branch, the two loads and (for half the pairs) the two stores, the loop's
# own arithmetic (an estimate from the template, not counted from the SASS), and 4 shared
# accesses of one wavefront each (consecutive 4-byte keys; half the lanes take part).
SORT_INSTRUCTIONS = 14
SORT_WAVEFRONTS = 4

# the layer-norm backward, with or without the residual: a warp a row (its input, its gradient
# and gamma, 24 floats each a lane, loaded together; the residual of the Add variant read after
# the row's sums, alone); the RMSNorm backward's rows likewise, 96 bytes a thread
_LAYER_NORM_BACKWARD = _norm_backward(288, lambda r: 2 * r["width"])
_RMS_NORM_BACKWARD = _norm_backward(96, lambda r: r["width"])


DESIGNS = {
    # ldmatrix from rows padded by kAttentionRowPadding: its conflict ways are read from the
    # emitted file (sass_audit.attention_ldmatrix_ways: 1 with the padding). In flight: the
    # next key tile's K and V (2 x 64 x 64 bfloat16) by cp.async over 64 threads.
    "cgImageAttention": Design(inflight=256,
                               tile_iterations=lambda r: (_off_diagonal_tiles(r),),
                               l2_bytes=_attention_rereads,
                               inner_trips=_attention_inner_trips,
                               pipelined=True, block_work=_attention_forward_work),
    # the dK/dV pass over query tiles >= j, then the dQ pass over key tiles <= j, each tile
    # pair 16 queries (keys) at a time in a chunk loop (_backward_chunks); the streamed pair
    # of tiles (q and dO, then k and v: 2 x 64 x 64 bfloat16 over 64 threads) in flight
    "cgImageAttentionBackward": Design(
        inflight=256,
        tile_iterations=_backward_chunks,
        l2_bytes=lambda r, launch: 2 * _attention_rereads(r, launch),
        inner_trips=_attention_inner_trips, pipelined=True, around_trips=_backward_around,
        block_work=_attention_backward_work, roles=2),
    "cgImageAttentionDelta": Design(inflight=12),  # a row of output and its gradient
    # 8 floats a thread (load8), to the low type: ZeRO-1's step casts its shard's parameters
    "cgImageCastDown": Design(inflight=32),
    # a block a row: a lane's pair in each of its warp's 6 of the 24 heads of q and k (two
    # bfloat16 a pair), all loaded before any is turned
    "cgImageRotary": Design(inflight=24),
    "cgImageEmbedding": Design(inflight=24),  # a row of 768 floats over 128 threads
    "cgImageLayerNorm": Design(inflight=96),  # a row a warp: 6 float4 a lane, loaded first
    "cgImageLayerNormBackward": _LAYER_NORM_BACKWARD,
    "cgImageLayerNormBackwardAdd": _LAYER_NORM_BACKWARD,
    # a row a block, two blocks an SM: each thread copies its 6 or 7 groups of 16 bytes
    # (50304 bfloat16 logits over 1024 threads) to shared memory before using any; then
    # three passes over them (max, sum, gradient) and warp-parallel reductions
    "cgImageClassifier": Design(inflight=98, loop_trips=_classifier_trips),
    # The Llama-style step's (schedules/llama/), at TinyLlama's width of 2048: RMSNorm a row a
    # block, 16 floats a thread; its backward a row at a time over the block (wider than
    # 1024), two float4 of the input, the gradient and gamma a thread, then the last block
    # reads every block's row of partials (width floats); SwiGLU 16 bytes of gate and of up
    # a thread (and of the output's gradient, backward)
    "cgImageRmsNorm": Design(inflight=64),
    "cgImageRmsNormBackward": _RMS_NORM_BACKWARD,
    "cgImageRmsNormBackwardAdd": _RMS_NORM_BACKWARD,  # its residual read is in the floor
    "cgImageSwiGlu": Design(inflight=32),
    "cgImageSwiGluBackward": Design(inflight=48),
    "cgImageZero": Design(inflight=16),
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
    # A collective's buffer (bytes): what each rank reduces over the ranks (0 for the rest)
    collective_bytes: int = 0
    collective: str = "allReduce"  # its operation (RING_PASSES)
    # A product's m, n, k and the bytes of its two operands (the rest of floor_bytes is its
    # epilogue's: the output, the residual read as C, an aux matrix)
    shape: tuple = ()
    operand_bytes: int = 0

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
    """Wavefronts of one loop iteration of one warp on the L1 data path shared memory and
    the L1 cache share: each access's conflict-free wavefronts (its width: 128 bytes a
    wavefront) times its kind's conflict ways; a global access's at its least (coalesced),
    a cache hit or not."""
    return sum(counts.get(f"wavefronts:{kind}", 0) * conflicts.get(kind, 1)
               for kind in DATA_PATH_KINDS)


def tail(blocks: int, per_wave: int) -> float:
    """The fraction of the last wave's slots the grid fills, spread over all waves. A grid
    of one wave or less is priced on the SMs it occupies instead (model_kernel)."""
    waves = blocks / per_wave
    return 1.0 if waves <= 1 else waves / math.ceil(waves)


@dataclass
class Modelled:
    """One launch's modelled time and its parts (seconds); for a product priced per shape
    (model_product), the tiles its plan runs (tiles x splits of K) and the bytes it moves."""

    floor: float
    parts: dict
    tiles: int = 0
    moved: float = 0.0

    @property
    def time(self) -> float:
        return self.parts["total"]

    @property
    def bound(self) -> str:
        return max((k for k in self.parts if k not in ("total", "overhead", "tail")),
                   key=lambda k: self.parts[k])


def model_library(facts: LaunchFacts, hw: Hardware = H200, model: Model = MODEL) -> Modelled:
    """A cuBLAS product in the optimistic bound: its operations at the fraction of the peak
    cuBLAS reaches, its bytes (and the copy before a residual product) at HBM's rate; or,
    where the calibrated estimate prices its shape faster (a large product's tiles fill the
    SMs at more than that fraction of the peak: the classifier's), the estimate's price, so
    that the bound never prices a product slower than the estimate does. Either way it holds
    every SM for its time (library_profile: no tiles)."""
    bytes_moved = facts.floor_bytes + facts.copies_residual_bytes
    parts = {"tensor": facts.flops / (hw.tensor_flops * model.cublas_fraction),
             "hbm": bytes_moved / hw.hbm_bytes_per_s, "overhead": model.launch_overhead_s}
    parts["total"] = max(parts["tensor"], parts["hbm"]) + parts["overhead"]
    if facts.shape and model.products_at_estimate_where_faster:  # (m, n, k): per shape too
        estimate = model_product(facts, hw, dataclasses.replace(model, calibrated=True))
        if estimate.time < parts["total"]:
            parts = dict(estimate.parts)
    return Modelled(floor_time(facts.floor_bytes, facts.flops, hw), parts)


def tile_loop_work(facts: LaunchFacts, audit: KernelAudit, design: Design, roles: dict) -> dict:
    """What the tiled main loops execute over the whole grid: HMMA, shared-memory
    wavefronts (with their conflict ways), warp instructions and MUFU instructions, each
    loop's body counts times its iterations times the block's warps, the loops inside a
    body times their trips from the design."""
    work = {"hmma": 0.0, "wavefronts": 0.0, "issue": 0.0, "mufu": 0.0}
    if not design.tile_iterations:
        return work
    # ldmatrix's conflicts come from the audited file's row stride, not from the design
    conflicts = {**design.conflicts, "ldsm": audit.ldsm_conflicts}
    # the code outside the main loops (the prologue, a peeled last tile, the epilogue) runs
    # once a warp
    grid_warps = facts.blocks * facts.warps
    straight_warps = grid_warps / design.roles
    work["hmma"] += audit.straight.get("tensor", 0) * straight_warps
    work["wavefronts"] += shared_wavefronts(audit.straight, conflicts) * straight_warps
    work["issue"] += audit.straight.get("instructions", 0) * straight_warps
    work["mufu"] += audit.straight.get("mufu", 0) * straight_warps
    if not audit.tile_loops and not audit.counts.get("tensor", 0):
        # float32 fragments (the tiny32 configurations) multiply by shuffles and FMAs: no
        # HMMA, so no tiled loop and none around one (its loops are untiled_loops)
        return work
    # a loop around the main loops runs its own body (a tile's copies and wait, a peeled
    # diagonal step's code outside its chunk loop) its trips a warp
    around = audit.around_tiles
    trips = design.around_trips(roles, facts, around) if design.around_trips else ()
    assert len(trips) == len(around), \
        f"{facts.image}: the SASS has {len(around)} loops around the main loops the design " \
        "does not price (around_trips)"
    for counts, n in zip(around, trips):
        work["hmma"] += counts.get("tensor", 0) * grid_warps * n
        work["wavefronts"] += shared_wavefronts(counts, conflicts) * grid_warps * n
        work["issue"] += counts.get("instructions", 0) * grid_warps * n
        work["mufu"] += counts.get("mufu", 0) * grid_warps * n
    iterations = design.tile_iterations(roles)
    if len(iterations) != len(audit.tile_loops):
        # a loop that runs no iteration at this shape (attention at a context of one tile:
        # no pair off the diagonal) may be gone from the machine code: nvcc removed it
        iterations = tuple(n for n in iterations if n)
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
            work["hmma"] += part.get("tensor", 0) * executed * times
            work["wavefronts"] += shared_wavefronts(part, conflicts) * executed * times
            work["issue"] += part.get("instructions", 0) * executed * times
            work["mufu"] += part.get("mufu", 0) * executed * times
    return work


def model_kernel(facts: LaunchFacts, audit: KernelAudit, design: Design, roles: dict,
                 hw: Hardware = H200, model: Model = MODEL) -> Modelled:
    """The optimistic bound: the slowest of its parts, all at their peak rates, every other
    part hidden under it (model_kernel_calibrated is the estimate)."""
    per_sm = max(audit.occupancy.blocks, 1)
    active = min(hw.sms, facts.blocks)
    resident = min(per_sm, -(-facts.blocks // hw.sms)) * facts.threads
    clock = active * hw.clock_hz
    parts = {"hbm": facts.floor_bytes / hbm_bandwidth(active, resident, design.inflight, hw,
                                                      model)}
    l2 = design.l2_bytes(roles, facts) if design.l2_bytes else 0
    parts["l2"] = l2 / model.l2_bytes_per_s
    work = tile_loop_work(facts, audit, design, roles)
    hmma, wavefronts, issue = work["hmma"], work["wavefronts"], work["issue"]
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
    # the last wave as long as a whole one, however few blocks it runs
    parts["tail"] = busiest * (1 / tail(facts.blocks, per_sm * hw.sms) - 1)
    parts["last block"] = last_block_seconds(facts, design, roles, hw, model)
    parts["total"] = busiest + parts["tail"] + parts["last block"] + parts["overhead"]
    return Modelled(floor_time(facts.floor_bytes, facts.flops, hw), parts)


def last_block_seconds(facts: LaunchFacts, design: Design, roles: dict, hw: Hardware,
                       model: Model) -> float:
    """The bytes the last block reads alone from L2 after every other block is done, at
    one SM's rate (Little's law on its threads, at most sm_l2_bytes_per_clock), and no less
    than its dependent round trips to L2 (last_block_trips) take."""
    if not design.last_block_bytes:
        return 0.0
    rate = min(facts.threads * design.last_block_inflight / model.l2_latency_s,
               model.sm_l2_bytes_per_clock * hw.clock_hz)
    trips = design.last_block_trips(roles, facts) if design.last_block_trips else 0
    return max(design.last_block_bytes(roles, facts) / rate, trips * model.l2_latency_s)


def imbalance(work: list, slots: int) -> float:
    """Blocks of unequal `work`, dispatched in order each to the first slot that frees
    (the block scheduler: a resident block's slot on an SM), against the same work spread
    evenly over the slots: the makespan over the mean (1 for equal blocks filling whole
    waves; a partial last wave and a long block dispatched late both show)."""
    import heapq
    free = [0.0] * slots
    for w in work:
        heapq.heapreplace(free, free[0] + w)
    return max(free) / (sum(work) / slots)


PIPES = ("tensor", "shared", "issue", "mufu")


def model_kernel_calibrated(facts: LaunchFacts, audit: KernelAudit, design: Design,
                            roles: dict, hw: Hardware = H200, model: Model = CALIBRATED
                            ) -> Modelled:
    """The calibrated estimate of one kernel launch (docs/performance-model.md, "The
    calibrated model"):
    - pipes a SM's warps share: issue (every warp instruction the grid executes: the code
      outside loops once a warp, the main loops' bodies times their iterations, the other
      loops times their trips), the tensor cores (HMMA at mma.sync's rate), MUFU (its
      results at Hardware.mufu_per_clock) and shared memory (wavefronts, a clock each).
      The busiest pipe sets the pace; the others hide under it only as far as other warps
      can run while one waits: with W warps a scheduler, 1/W of the rest is exposed (one
      warp a scheduler: the sum; many: the busiest alone);
    - memory: the floor's bytes at Little's law's bandwidth, capped at the measured HBM
      rate (and L2's re-reads). A pipelined design (cp.async stages) hides memory under
      its work; otherwise a block loads and then works, and with one block an SM nothing
      hides either: memory plus work;
    - the grid: unequal blocks (block_work) by the makespan of their dispatch order over
      the SM's slots; equal ones by the last wave's fill;
    - serial parts: the last block's tail, the launch overhead."""
    per_sm = max(audit.occupancy.blocks, 1)
    active = min(hw.sms, facts.blocks)
    blocks_resident = min(per_sm, -(-facts.blocks // hw.sms))
    clock = active * hw.clock_hz
    grid_warps = facts.blocks * facts.warps
    warps_per_scheduler = max(1.0, blocks_resident * facts.warps / hw.sub_partitions)
    work = tile_loop_work(facts, audit, design, roles)
    issue, mufu, wavefronts = work["issue"], work["mufu"], work["wavefronts"]
    if not design.tile_iterations:  # else tile_loop_work counted the code outside loops
        issue += audit.straight.get("instructions", 0) * grid_warps
        mufu += audit.straight.get("mufu", 0) * grid_warps
        wavefronts += shared_wavefronts(audit.straight, design.conflicts) * grid_warps
    loops = audit.untiled_loops
    trips = design.loop_trips(roles, facts, loops) if design.loop_trips else \
        (grid_warps,) * len(loops)
    assert len(trips) == len(loops), \
        f"{facts.image}: the design prices {len(trips)} loops, the SASS has {len(loops)}"
    for counts, n in zip(loops, trips):
        issue += counts.get("instructions", 0) * n
        mufu += counts.get("mufu", 0) * n
        wavefronts += shared_wavefronts(counts, design.conflicts) * n
    if design.issue:
        issue += design.issue(roles, facts)
    if design.wavefronts:
        wavefronts += design.wavefronts(roles, facts)
    parts = {
        "tensor": work["hmma"] * FLOP_PER_HMMA / (active * hw.tensor_flops / hw.sms
                                                  * model.mma_sync_fraction),
        "shared": wavefronts / clock,
        "issue": issue / (clock * hw.sub_partitions),
        "mufu": mufu * hw.warp_size / (clock * hw.mufu_per_clock),
    }
    busiest = max(parts[p] for p in PIPES)
    body = busiest + (sum(parts[p] for p in PIPES) - busiest) / warps_per_scheduler
    bandwidth = min(hbm_bandwidth(active, blocks_resident * facts.threads, design.inflight,
                                  hw, model), hw.measured_hbm_bytes_per_s)
    parts["hbm"] = facts.floor_bytes / bandwidth
    parts["l2"] = (design.l2_bytes(roles, facts) if design.l2_bytes else 0) \
        / model.l2_bytes_per_s
    memory = max(parts["hbm"], parts["l2"])
    hidden = design.pipelined or blocks_resident > 1
    parts["exposed"] = 0.0 if hidden else min(memory, body)
    spread = imbalance(design.block_work(roles, facts), active * per_sm) \
        if design.block_work else 1 / tail(facts.blocks, per_sm * hw.sms)
    parts["imbalance"] = (max(memory, body) + parts["exposed"]) * (spread - 1)
    parts["last block"] = last_block_seconds(facts, design, roles, hw, model)
    parts["overhead"] = model.launch_overhead_s
    parts["total"] = (max(memory, body) + parts["exposed"]) * spread + parts["last block"] \
        + parts["overhead"]
    return Modelled(floor_time(facts.floor_bytes, facts.flops, hw), parts)


class Plan(NamedTuple):
    """One way to run a product (product_plans): its time, tile, split of K, parts, the
    tiles it runs (tiles x splits) and the bytes it moves (a split's partial sums included)."""
    seconds: float
    tile: tuple
    split: int
    parts: dict
    tiles: int
    moved: float


def product_plans(facts: LaunchFacts, hw: Hardware = H200, model: Model = CALIBRATED
                  ) -> list:
    """The ways cuBLASLt may run one product (each a tile and a split of K), each priced
    (Plan), fastest first. Tiles run one an SM at a time at the SM's share of the
    measured ceiling: a tile's time is its k-steps plus product_fixed_steps (filling the
    pipeline, draining the accumulators), the grid's time its waves of tiles over the SMs;
    memory is its operands, its epilogue's bytes (output, residual, aux) and a split's
    float32 partial sums at the measured HBM rate, under the tiles' time; the last tile's
    epilogue drains alone at one SM's store rate; a split adds its reduction's launch."""
    m, n, k = facts.shape
    epilogue = facts.floor_bytes - facts.operand_bytes
    per_sm = hw.measured_tensor_flops / hw.sms
    plans = []
    for tm, tn in model.product_tiles:
        tiles = -(-m // tm) * -(-n // tn)
        for split in model.product_splits:
            if split > 1 and tiles * split > hw.sms * 2:
                continue  # split-K is offered to fill the SMs, not past two waves of them
            steps = -(-k // (split * model.product_k_step))
            step_s = 2.0 * tm * tn * model.product_k_step / per_sm
            waves = -(-tiles * split // hw.sms)
            compute = waves * (steps + model.product_fixed_steps) * step_s
            moved = facts.floor_bytes + (0 if split == 1 else 2 * split * m * n * 4)
            memory = moved / hw.measured_hbm_bytes_per_s
            last = tm * tn * epilogue / (m * n) / (model.sm_store_bytes_per_clock * hw.clock_hz)
            overhead = model.launch_overhead_s * (2 if split > 1 else 1)
            parts = {"tensor": compute, "hbm": memory, "last tile": last,
                     "overhead": overhead}
            parts["total"] = max(compute, memory) + last + overhead
            plans.append(Plan(parts["total"], (tm, tn), split, parts, tiles * split, moved))
    return sorted(plans, key=lambda plan: plan.seconds)


def model_product(facts: LaunchFacts, hw: Hardware = H200, model: Model = CALIBRATED
                  ) -> Modelled:
    """A product as cuBLASLt runs it at its fastest plan (product_plans): what timing the
    heuristic's offers at start-up keeps (issue 24, item 5)."""
    plan = product_plans(facts, hw, model)[0]
    return Modelled(floor_time(facts.floor_bytes, facts.flops, hw), dict(plan.parts),
                    plan.tiles, plan.moved)


# ---- the step ------------------------------------------------------------------------

def value(x, point):
    return x.at(point) if isinstance(x, Affine) else int(x)


def flops(launch, point, roles) -> float:
    name = launch.image.name
    scalars = {launch.image.scalars[b.index].name: value(b.value, point) for b in launch.scalars}
    if launch.image.collective is not None:
        return 0.0
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
    blocks, threads, copy, collective = 0, 0, 0, 0
    operation = image.collective[0] if image.collective is not None else "allReduce"
    if image.collective is not None:
        # one NCCL call over its buffer, in place: the bytes each rank reduces
        collective = sum(b.view.count * element_bytes(b.view.storage.element, program.low)
                         for b in launch.pointers)
    elif library:
        # Every product is one cublasLtMatmul: the residual is read as C (its bytes are in
        # traffic(), as an operand), with no copy first; an epilogue's aux matrix (GELU_AUX
        # writes pre, DGELU reads it) is a pointer of the image, in traffic() too.
        assert image.name in CUBLAS_PRODUCTS, image.name
    else:
        grid = launch.arguments().grid
        blocks = math.prod(value(g, point) for g in grid)
        threads = math.prod(image.block)
    shape, operands = (), 0
    if library and image.collective is None:
        scalars = {image.scalars[b.index].name: value(b.value, point) for b in launch.scalars}
        shape = (scalars["m"], scalars["n"], scalars["k"])
        operands = sum(b.view.count * element_bytes(b.view.storage.element, program.low)
                       for b in launch.pointers if image.pointers[b.index].name in ("a", "b"))
    return LaunchFacts(image.name, blocks, threads, traffic(launch, program.low),
                       flops(launch, point, program.roles), library, copy, collective,
                       operation, shape, operands)


# ---- the collective: NCCL's ring all-reduce on NVLink ----------------------------------

# How many times a ring collective passes the buffer around the ring: an all-reduce is a
# reduce-scatter then an all-gather, 2(N-1) steps of 1/N of the buffer; ZeRO-1's
# reduce-scatter and all-gather are one pass each, N-1 steps (nccl-tests' busbw factors).
RING_PASSES = {"allReduce": 2, "reduceScatter": 1, "allGather": 1}


def collective_seconds(nbytes: float, ranks: int, model: Model = MODEL,
                       operation: str = "allReduce") -> tuple:
    """One ring collective of `nbytes` (the whole buffer) over `ranks` GPUs of one NVLink
    node: (protocol, latency, transfer seconds). The transfer is the ring's
    passes x (N-1)/N x bytes (an all-reduce's 2(N-1)/N) at the protocol's bus bandwidth
    (nccl-tests' busbw is defined so); the latency NCCL's own model's (base + a step a
    hop); NCCL picks the protocol its model finds quickest, so the model does. One rank
    moves nothing: (None, 0, 0)."""
    if ranks <= 1 or nbytes <= 0:
        return None, 0.0, 0.0
    steps = RING_PASSES[operation] * (ranks - 1)
    wire = steps / ranks * nbytes
    options = []
    for name, base, per_step, share, cap in model.allreduce_protocols:
        bus = min(model.allreduce_bus_bytes_per_s * share, cap)
        options.append((base + steps * per_step + wire / bus, name, base + steps * per_step,
                        wire / bus))
    _, name, latency, transfer = min(options)
    return name, latency, transfer


def collective_floor(nbytes: float, ranks: int, model: Model = MODEL,
                     operation: str = "allReduce") -> float:
    """No all-reduce beats each rank sending its buffer once and receiving the result once
    over NVLink (what reducing in the switch, NVLS, does); no reduce-scatter or all-gather
    beats each rank moving the other ranks' (N-1)/N of it once."""
    if ranks <= 1:
        return 0.0
    share = 1.0 if operation == "allReduce" else (ranks - 1) / ranks
    return share * nbytes / model.nvlink_bytes_per_s


def model_collective(facts: LaunchFacts, ranks: int, model: Model = MODEL) -> Modelled:
    _, latency, transfer = collective_seconds(facts.collective_bytes, ranks, model,
                                              facts.collective)
    overhead = model.launch_overhead_s if ranks > 1 else 0.0
    parts = {"nvlink": transfer, "latency": latency, "overhead": overhead}
    parts["total"] = latency + transfer + overhead
    return Modelled(collective_floor(facts.collective_bytes, ranks, model, facts.collective),
                    parts)


# ---- profiles: what a launch holds of the machine, and for how long ---------------------

RESOURCES = ("sms", "hbm", "link", "tensor")


@dataclass(frozen=True)
class Segment:
    """A stretch of a launch's time, priced alone on the machine, during which it holds
    `sms` SMs (its blocks' SMs: a kernel's, a product's, NCCL's channels'), draws `hbm`
    bytes a second, takes `link` of the NVLink bandwidth a collective gets (1: all of it)
    and, at the floor only, `tensor` of the tensor-core peak. A launch is a sequence of
    them (its profile): the launch overhead (nothing held), its waves, a serial tail."""

    seconds: float
    sms: float = 0.0
    hbm: float = 0.0
    link: float = 0.0
    tensor: float = 0.0


@dataclass(frozen=True)
class Machine:
    """What the branches share: SMs, HBM bytes a second, the NVLink bandwidth (1: what one
    collective alone gets) and the tensor-core peak (1, for the floor)."""

    sms: float
    hbm: float
    link: float = 1.0
    tensor: float = 1.0


def machine_of(hw: Hardware = H200, model: Model = MODEL) -> Machine:
    """What branches side by side share: the SMs and HBM's bandwidth, at the rate the model
    prices a kernel alone by (the calibrated estimate: the measured ceiling; the bound and
    the floor: the peak), so that launches together draw no more than one could alone."""
    hbm = hw.measured_hbm_bytes_per_s if model.calibrated else hw.hbm_bytes_per_s
    return Machine(hw.sms, hbm)


# Each branch with a machine of its own: the critical path alone, nothing shared.
UNSHARED = Machine(math.inf, math.inf, math.inf, math.inf)


def profile_seconds(profile) -> float:
    return sum(segment.seconds for segment in profile)


def wave_segments(body: float, blocks: int, per_wave: int, moved: float,
                  hw: Hardware = H200, hbm: float = math.inf) -> list:
    """A grid's waves as segments: each as long as the model prices one (the tail: the last
    wave takes a whole wave's time), holding the SMs with one of its blocks (a grid of 64
    blocks holds 64 SMs; the last wave of a grid as many SMs as it has blocks, up to all),
    drawing `moved` bytes from HBM in proportion to the blocks a wave runs, but no faster
    than `hbm` (the rate the launch was priced at): what the full waves cannot draw at it,
    the last wave does (a memory-bound grid draws its bytes at one rate to the end)."""
    if blocks <= per_wave:
        waves = [(body, min(hw.sms, blocks), moved)]
    else:
        count = math.ceil(blocks / per_wave)
        last = blocks - (count - 1) * per_wave
        first_seconds = body * (count - 1) / count
        first = min(moved * (count - 1) * per_wave / blocks, hbm * first_seconds)
        waves = [(first_seconds, hw.sms, first),
                 (body / count, min(hw.sms, last), moved - first)]
    return [Segment(seconds, sms=sms, hbm=share / seconds if seconds else 0.0)
            for seconds, sms, share in waves]


def kernel_profile(facts: LaunchFacts, modelled: Modelled, per_sm: int,
                   hw: Hardware = H200, hbm: float = math.inf) -> tuple:
    """A kernel: its launch overhead (nothing held); its waves (wave_segments, `per_sm`
    blocks an SM), its floor bytes drawn from HBM; then a serial last block on one SM."""
    parts = modelled.parts
    body = parts["total"] - parts["overhead"] - parts.get("last block", 0.0)
    profile = [Segment(parts["overhead"])]
    profile += wave_segments(body, facts.blocks, max(per_sm, 1) * hw.sms, facts.floor_bytes,
                             hw, hbm)
    if parts.get("last block"):
        profile.append(Segment(parts["last block"], sms=1))
    return tuple(s for s in profile if s.seconds > 0)


def library_profile(facts: LaunchFacts, modelled: Modelled, hw: Hardware = H200,
                    hbm: float = math.inf) -> tuple:
    """A cuBLAS product. Priced per shape (model_product, the calibrated model), its plan's
    tiles run in waves over the SMs, one tile an SM: its waves hold the SMs their tiles hold
    (a 768 x 768 weight gradient's 36 tiles hold 36 SMs, and a branch beside it has the
    other 96), then its last tile's epilogue drains on one SM. Priced at a fraction of the
    whole chip's peak (model_library, the optimistic bound), which only the whole chip
    reaches, it holds every SM for its whole time."""
    parts = modelled.parts
    if modelled.tiles:
        body = parts["total"] - parts["overhead"] - parts["last tile"]
        profile = [Segment(parts["overhead"]),
                   *wave_segments(body, modelled.tiles, hw.sms, modelled.moved, hw, hbm),
                   Segment(parts["last tile"], sms=1)]
    else:
        body = parts["total"] - parts["overhead"]
        moved = facts.floor_bytes + facts.copies_residual_bytes
        profile = [Segment(parts["overhead"]),
                   Segment(body, sms=hw.sms, hbm=moved / body if body else 0.0)]
    return tuple(s for s in profile if s.seconds > 0)


def collective_profile(facts: LaunchFacts, ranks: int, model: Model = MODEL) -> tuple:
    """An all-reduce: its launch overhead; its latency, holding NCCL's SMs; its transfer,
    holding them and all the NVLink bandwidth one collective gets, and drawing HBM: each
    byte that crosses the link is written to this GPU's memory and read back (to reduce or
    forward), and the buffer is read once and written once (an estimate of NCCL's ring)."""
    if ranks <= 1 or facts.collective_bytes <= 0:
        return ()
    _, latency, transfer = collective_seconds(facts.collective_bytes, ranks, model,
                                              facts.collective)
    wire = RING_PASSES[facts.collective] * (ranks - 1) / ranks * facts.collective_bytes
    hbm = (2 * wire + 2 * facts.collective_bytes) / transfer
    return tuple(s for s in (Segment(model.launch_overhead_s),
                             Segment(latency, sms=model.collective_sms),
                             Segment(transfer, sms=model.collective_sms, link=1.0, hbm=hbm))
                 if s.seconds > 0)


def floor_profile(facts: LaunchFacts, ranks: int = 1, hw: Hardware = H200,
                  model: Model = MODEL) -> tuple:
    """At the floor a launch holds no SMs: it takes its bytes at HBM's rate or its
    products at the tensor-core peak for its floor time (a collective: NVLink)."""
    if facts.collective_bytes:
        seconds = collective_floor(facts.collective_bytes, ranks, model, facts.collective)
        return (Segment(seconds, link=1.0, hbm=2 * facts.collective_bytes / seconds),) \
            if seconds > 0 else ()
    seconds = floor_time(facts.floor_bytes, facts.flops, hw)
    if seconds <= 0:
        return ()
    return (Segment(seconds, hbm=facts.floor_bytes / seconds,
                    tensor=facts.flops / hw.tensor_flops / seconds),)


def water_fill(demands, capacity: float) -> list:
    """Max-min fair shares of `capacity`: a demand under the equal share gets all of it,
    the rest split what is left (the block scheduler gives a grid of few blocks all its
    SMs: a 1-block kernel beside a full one gets its SM, the full one the other 131)."""
    granted = [0.0] * len(demands)
    left, remaining = capacity, len(demands)
    for index in sorted(range(len(demands)), key=lambda i: demands[i]):
        granted[index] = min(demands[index], left / remaining)
        left -= granted[index]
        remaining -= 1
    return granted


def rates(segments, machine: Machine) -> list:
    """How fast each of the segments running at once progresses, as a fraction of its
    speed alone. SMs are shared max-min fairly (water_fill), a segment granted fewer SMs
    than it holds alone slowed in proportion; then each bandwidth (HBM, NVLink, the tensor
    peak) asked beyond the machine's is shared in proportion to what each asks (requests in
    flight), every segment drawing on it slowed alike. Each segment takes the smaller."""
    demands = [s.sms for s in segments]
    speed = [1.0] * len(segments)
    if sum(demands) > machine.sms:
        granted = water_fill(demands, machine.sms)
        speed = [g / d if d > 0 else 1.0 for g, d in zip(granted, demands)]
    for key in ("hbm", "link", "tensor"):
        capacity = getattr(machine, key)
        asked = sum(x * getattr(s, key) for x, s in zip(speed, segments))
        if asked > capacity:
            speed = [x * capacity / asked if getattr(s, key) > 0 else x
                     for x, s in zip(speed, segments)]
    return speed


def _merge(profile) -> list:
    merged = []
    for segment in profile:
        last = merged[-1] if merged else None
        if last is not None and all(math.isclose(getattr(last, k), getattr(segment, k),
                                                 rel_tol=1e-9, abs_tol=1e-12)
                                    for k in RESOURCES):
            merged[-1] = dataclasses.replace(last, seconds=last.seconds + segment.seconds)
        else:
            merged.append(segment)
    return merged


@dataclass
class Task:
    """One launch of the program as a task of its graph: its profile, the tasks that wait
    for it, and how many it waits for."""

    segments: list
    waits: int = 0
    then: list = field(default_factory=list)


def run_tasks(tasks, machine: Machine, timeline: list | None = None) -> float:
    """The time the task graph takes on `machine`: a task starts when every task it waits
    for has finished, runs its segments in order, and every segment running at a moment,
    whichever branch it is in, progresses at rates() over all of them (its time alone is
    its work). With `timeline`, each stretch's totals are appended to it as a Segment."""
    running = {}  # task -> [segment, seconds of work left]
    clock = 0.0

    def start(index):
        pending = [index]
        while pending:
            task = pending.pop()
            if tasks[task].segments:
                running[task] = [0, tasks[task].segments[0].seconds]
                continue
            for after in tasks[task].then:  # nothing to run: done at once
                tasks[after].waits -= 1
                if tasks[after].waits == 0:
                    pending.append(after)

    for index in [i for i, task in enumerate(tasks) if task.waits == 0]:
        start(index)
    while running:
        order = list(running)
        segments = [tasks[i].segments[running[i][0]] for i in order]
        speed = rates(segments, machine)
        step = min(running[i][1] / x for i, x in zip(order, speed))
        clock += step
        if timeline is not None:
            timeline.append(Segment(step, *(sum(x * getattr(s, k)
                                                for x, s in zip(speed, segments))
                                            for k in RESOURCES)))
        finished = []
        for i, x, segment in zip(order, speed, segments):
            running[i][1] -= x * step
            if running[i][1] <= 1e-9 * segment.seconds:
                running[i][0] += 1
                if running[i][0] < len(tasks[i].segments):
                    running[i][1] = tasks[i].segments[running[i][0]].seconds
                else:
                    finished.append(i)
        for i in finished:
            del running[i]
            for after in tasks[i].then:
                tasks[after].waits -= 1
                if tasks[after].waits == 0:
                    start(after)
    return clock


def side_by_side(branches, machine: Machine) -> list:
    """Profiles (each a branch of segments run in order) run at the same time on one
    machine: the profile of the whole (each stretch's totals), which ends when the last
    branch does. With the machine unshared (UNSHARED) the whole takes its longest branch."""
    timeline = []
    run_tasks([Task([s for s in branch if s.seconds > 0]) for branch in branches], machine,
              timeline)
    return _merge(timeline)


def program_tasks(body, price) -> list:
    """The launch program as a task graph, every repeat unrolled (a repeat inside a branch
    too): each launch waits for the launch before it; the first launch of each branch of a
    Concurrent node for what came before the node; what follows the node for the last
    launch of every branch (nested branches alike). `price(launch, point)` is its profile.
    With `price.grouped` (Model.group_collectives), collectives that follow one another in
    a branch are one task: one NCCL group, priced by `price.collectives(bytes)`."""
    tasks = []
    grouped = getattr(price, "grouped", False)

    def build(nodes, after, point, group):
        for node in nodes:
            if isinstance(node, Launch):
                nbytes = price.collective_bytes(node, point) if grouped else 0
                if nbytes and group and after == [group[0]]:
                    group[1] += nbytes
                    tasks[group[0]].segments = [s for s in price.collectives(group[1])
                                                if s.seconds > 0]
                    continue
                task = Task([s for s in price(node, point) if s.seconds > 0], len(after))
                tasks.append(task)
                for before in after:
                    tasks[before].then.append(len(tasks) - 1)
                after = [len(tasks) - 1]
                group[:] = [after[0], nbytes] if nbytes else []
            elif isinstance(node, Repeat):
                for number in range(node.variable.count):
                    after = build(node.body, after, {**point, node.variable: number}, group)
            elif isinstance(node, Concurrent):
                ends = []
                for branch in node.branches:
                    ends += build(branch, after, point, [])
                after = list(dict.fromkeys(ends))
                group[:] = []
            else:  # a phase
                after = build(node.body, after, point, group)
        return after

    build(body, [], {}, [])
    return tasks


def program_seconds(body, price, machine: Machine | None = None) -> float:
    """A launch program's time: with a machine, its task graph run on it (program_tasks,
    run_tasks: the critical path over branches, the machine shared); with none, every
    launch one after another (each Concurrent node's body in order: the sum over
    launches, as the step was priced before branches)."""
    if machine is None:
        return sum(profile_seconds(price(launch, point))
                   for launch, point in _in_order(body, {}))
    return run_tasks(program_tasks(body, price), machine)


def _in_order(nodes, point):
    for node in nodes:
        if isinstance(node, Launch):
            yield node, point
        elif isinstance(node, Repeat):
            for number in range(node.variable.count):
                yield from _in_order(node.body, {**point, node.variable: number})
        else:
            yield from _in_order(node.body, point)


def has_branches(body) -> bool:
    return any(isinstance(node, Concurrent) or
               (not isinstance(node, Launch) and has_branches(node.body)) for node in body)


class Pricer:
    """Prices one program's launches (each once per repeat point): the kernel's or
    product's modelled time as built (or its floor), a collective at `ranks`."""

    def __init__(self, program, audits: dict | None, ranks: int = 1, hw: Hardware = H200,
                 model: Model = MODEL, scaled: dict | None = None):
        self.program, self.audits, self.ranks, self.hw, self.model = \
            program, audits, ranks, hw, model
        self.roles = {k: v for k, v in program.roles.items() if isinstance(v, int)}
        self.scaled = scaled or {}  # image -> a factor on its parts and its bytes (a
        # what-if; not its launch overhead, the gap between launches that no faster kernel
        # shortens)
        self.hbm = machine_of(hw, model).hbm  # the rate a launch alone is priced at
        self.cache = {}

    def modelled(self, facts: LaunchFacts) -> Modelled:
        modelled = self._modelled(facts)
        factor = self.scaled.get(facts.image)
        if factor is None:
            return modelled
        overhead = modelled.parts.get("overhead", 0.0)
        parts = {k: v if k == "overhead" else v * factor for k, v in modelled.parts.items()}
        parts["total"] = (modelled.parts["total"] - overhead) * factor + overhead
        return dataclasses.replace(modelled, parts=parts)

    def _modelled(self, facts: LaunchFacts) -> Modelled:
        if facts.collective_bytes:
            return model_collective(facts, self.ranks, self.model)
        if facts.library:
            price = model_product if self.model.calibrated else model_library
            return price(facts, self.hw, self.model)
        price = model_kernel_calibrated if self.model.calibrated else model_kernel
        return price(facts, self.audits[facts.image], DESIGNS[facts.image], self.roles,
                     self.hw, self.model)

    def facts(self, launch, point) -> tuple:
        key = (id(launch), tuple(sorted((v.number, n) for v, n in point.items())))
        if key not in self.cache:
            facts = launch_facts(self.program, launch, point)
            self.cache[key] = (facts, None if self.audits is None else self.modelled(facts))
        return self.cache[key]

    @property
    def grouped(self) -> bool:
        return self.model.group_collectives

    def collective_bytes(self, launch, point) -> int:
        return self.facts(launch, point)[0].collective_bytes

    def collectives(self, nbytes: int) -> tuple:
        """Collectives of `nbytes` in all, as one NCCL group: one call."""
        facts = LaunchFacts("group", 0, 0, 0, 0.0, True, collective_bytes=nbytes)
        return floor_profile(facts, self.ranks, self.hw, self.model) if self.audits is None \
            else collective_profile(facts, self.ranks, self.model)

    def __call__(self, launch, point) -> tuple:
        facts, modelled = self.facts(launch, point)
        if modelled is None:
            return floor_profile(facts, self.ranks, self.hw, self.model)
        if facts.collective_bytes:
            return collective_profile(facts, self.ranks, self.model)
        factor = self.scaled.get(facts.image)
        if factor is not None:
            # A scaled launch moves its bytes times the factor too: it draws HBM at its rate
            # as built. (Its bytes kept, a cut would draw more bandwidth than the kernel as
            # built, past the HBM's for a memory-bound one, and slow every launch beside it.)
            facts = dataclasses.replace(facts, floor_bytes=facts.floor_bytes * factor,
                                        copies_residual_bytes=facts.copies_residual_bytes
                                        * factor)
            modelled = dataclasses.replace(modelled, moved=modelled.moved * factor)
        if facts.library:
            return library_profile(facts, modelled, self.hw, self.hbm)
        return kernel_profile(facts, modelled, self.audits[facts.image].occupancy.blocks,
                              self.hw, self.hbm)


@dataclass
class StepTimes:
    """One program's step three ways (seconds): its branches one after another (the sum of
    its launches), side by side each on a machine of its own (the critical path alone), and
    side by side on one shared machine (the model's figure)."""

    in_order: float
    critical_path: float
    shared: float


def step_times(program, audits: dict | None, ranks: int = 1, hw: Hardware = H200,
               model: Model = MODEL) -> StepTimes:
    price = Pricer(program, audits, ranks, hw, model)
    return StepTimes(program_seconds(program.body, price),
                     program_seconds(program.body, price, UNSHARED),
                     program_seconds(program.body, price, machine_of(hw, model)))


def shared_step(program, audits: dict, scaled: dict | None = None, hw: Hardware = H200,
                model: Model = CALIBRATED, price: Pricer | None = None) -> float:
    """The step on the shared machine (the model's figure), each image of `scaled` with its
    parts times its factor (Pricer), or priced by `price`."""
    price = price or Pricer(program, audits, 1, hw, model, scaled)
    return program_seconds(program.body, price, machine_of(hw, price.model))


def sensitivity(program, audits: dict, cut: float = 0.1, hw: Hardware = H200,
                model: Model = CALIBRATED) -> list:
    """Per image, what cutting its every launch's time (but for the launch overhead) by `cut`
    saves the step on the shared machine (the model's figure), the largest saving first:
    (image, its launches' time summed but for their overheads, and the step's saving),
    seconds.
    A launch off the critical path, or beside others that take the SMs it frees, saves less
    than its own cut."""
    own = defaultdict(float)
    price = Pricer(program, audits, 1, hw, model)
    for launch, _, point in program.unrolled():
        facts, modelled = price.facts(launch, point)
        own[facts.image] += modelled.time - modelled.parts.get("overhead", 0.0)
    step = shared_step(program, audits, hw=hw, price=price)
    rows = [(image, seconds, step - shared_step(program, audits, {image: 1 - cut}, hw, model))
            for image, seconds in own.items()]
    return sorted(rows, key=lambda row: -row[2])


def sms_at_work(program, audits: dict, hw: Hardware = H200, model: Model = CALIBRATED) -> tuple:
    """The shared machine's step as a timeline: (seconds, the mean fraction of the SMs at
    work, an SM a launch holds counted at the speed the shared bandwidths leave it, and the
    seconds no SM works: launch gaps no branch fills)."""
    timeline = []
    run_tasks(program_tasks(program.body, Pricer(program, audits, 1, hw, model)),
              machine_of(hw, model), timeline)
    seconds = sum(s.seconds for s in timeline)
    busy = sum(s.seconds * min(s.sms, hw.sms) for s in timeline) / hw.sms
    return seconds, busy / seconds, sum(s.seconds for s in timeline if s.sms <= 0)


def print_sensitivity(name: str, config: str, program, audits, cut: float = 0.1,
                      hw: Hardware = H200) -> None:
    seconds, busy, idle = sms_at_work(program, audits, hw)
    print(f"{name}, config {config}, {hw.name}, one GPU, calibrated estimate, the machine "
          f"shared: {seconds * 1e3:.3f} ms a step; the SMs at work {100 * busy:.1f}% of it on "
          f"average, none for {idle * 1e6:,.1f} us (launch gaps no branch fills). MODELLED "
          "figures, not measurements.")
    print(f"What a {100 * cut:.0f}% cut of each image's time would save the step (the model "
          "run again with that image's parts and bytes scaled, its launch overheads kept):")
    print("| image | its time (us, summed, overheads aside) | the step saves (us) | of its cut |")
    print("| --- | ---: | ---: | ---: |")
    for image, own, saved in sensitivity(program, audits, cut, hw):
        share = f"{saved / (cut * own):.0%}" if own > 0 else "-"
        print(f"| {image} | {own * 1e6:,.1f} | {saved * 1e6:,.1f} | {share} |")


def tokens_a_step(program) -> int:
    """The tokens one step trains on (one rank's): its batch of sequences of its context."""
    return int(program.roles["batch"]) * int(program.roles["context"])


def print_scaled(name: str, config: str, program, audits, scales: dict,
                 hw: Hardware = H200) -> None:
    """--scale: the step (calibrated, the machine shared) with each named image's parts and
    bytes scaled by its factor, its launch overheads kept, beside the step as built."""
    built, scaled = shared_step(program, audits, hw=hw), shared_step(program, audits, scales, hw)
    tokens = tokens_a_step(program)
    what = ", ".join(f"{image} x {factor:g}" for image, factor in scales.items())
    print(f"WHAT-IF, not the kernels as built: {name}, config {config}, {hw.name}, one GPU, "
          f"calibrated estimate, the machine shared, with {what} (each image's parts and bytes, "
          "its launch overheads kept). MODELLED figures, not measurements.")
    print("| step | ms | tokens/s |")
    print("| --- | ---: | ---: |")
    print(f"| as built | {built * 1e3:.3f} | {tokens / built:,.0f} |")
    print(f"| {what} | {scaled * 1e3:.3f} | {tokens / scaled:,.0f} |")


# ---- the step, image by image -------------------------------------------------------

def step_rows(program, audits: dict | None, hw: Hardware = H200, model: Model = MODEL,
              ranks: int = 1):
    """Per image: [launches, bytes, flops, floor seconds, modelled seconds, bound-by time]."""
    price = Pricer(program, audits, ranks, hw, model)
    rows = defaultdict(lambda: {"launches": 0, "bytes": 0, "flops": 0.0, "floor": 0.0,
                                "modelled": 0.0, "bounds": defaultdict(float)})
    for launch, _, point in program.unrolled():
        facts, modelled = price.facts(launch, point)
        row = rows[facts.image]
        row["launches"] += 1
        row["bytes"] += facts.floor_bytes
        row["flops"] += facts.flops
        row["floor"] += collective_floor(facts.collective_bytes, ranks, model,
                                         facts.collective) \
            if facts.collective_bytes else floor_time(facts.floor_bytes, facts.flops, hw)
        if modelled is None:
            continue
        row["modelled"] += modelled.time
        row["bounds"][modelled.bound] += modelled.time
    return rows


# The optimistic bound's parts (a product it prices at the estimate's price: its last tile):
# a launch costs its busiest part, its tail (the last wave's idle slots), its last block or
# tile and its overhead; the other parts are hidden under the busiest
PARTS = ("hbm", "l2", "tensor", "shared", "issue", "tail", "last block", "last tile",
         "overhead")
# The calibrated model's parts: its pipes, memory, what is not hidden (exposed: memory or
# work a block cannot overlap; imbalance: the grid's uneven end), and a product's last tile
CALIBRATED_PARTS = ("hbm", "l2", "tensor", "shared", "issue", "mufu", "exposed",
                    "imbalance", "last block", "last tile", "overhead")


def print_parts(program, audits, hw: Hardware = H200, model: Model = MODEL) -> None:
    """Each image's modelled parts, summed over its launches (MODELLED, microseconds): in
    the optimistic bound the longest part (after the tail) is what a launch costs, the
    others what it hides; in the calibrated estimate the busiest pipe or memory plus what
    is exposed, imbalance and overhead."""
    price = Pricer(program, audits, 1, hw, model)
    keys = CALIBRATED_PARTS if model.calibrated else PARTS
    sums = defaultdict(lambda: defaultdict(float))
    for launch, _, point in program.unrolled():
        facts, modelled = price.facts(launch, point)
        for key in (*keys, "total"):
            sums[facts.image][key] += modelled.parts.get(key, 0.0)
    kind = "calibrated estimate" if model.calibrated else "optimistic bound"
    print(f"MODELLED parts of each image's time, summed over its launches (us), {kind}")
    print("| image | " + " | ".join(keys) + " | modelled |")
    print("| --- | " + " | ".join("---:" for _ in keys) + " | ---: |")
    for name, parts in sorted(sums.items(), key=lambda r: -r[1]["total"]):
        print(f"| {name} | " + " | ".join(f"{parts[k] * 1e6:,.1f}" for k in keys)
              + f" | {parts['total'] * 1e6:,.1f} |")


# ---- the data-parallel step ----------------------------------------------------------

# The placement the data-parallel step had before its all-reduce went in buckets, kept as
# the reference the bucketed one is compared with: train.cg's step with one all-reduce of
# the whole gradient bank after its backward, before its optimizer (nothing to overlap).
EXPOSED_STEP = "cgCostModelAllReduceAll"
EXPOSED_SOURCE = """\
-- Written by scripts/cost_model.py: one all-reduce of the whole gradient bank, as
-- schedules/train_parallel.cg had it before its buckets.
import "{library}"

def {entry} : (family NvidiaLaunchSchedule) =
  (cgPhase cgPhaseAllReduce
    (cgLaunch cgImageAllReduce 1 1 1
      (cgPointer (cgArgument 0) (cgBankAll cgBankG)
        (cgSlot (cgScalar 0) (cgCount (cgBankAll cgBankG)) cgNoSlots))))
"""


def exposed_program(config: str, train: str | None = None):
    """The reference step: `train`'s (train.cg's) step, with EXPOSED_SOURCE's all-reduce
    (of the gradient bank the library.cg beside `train` declares) spliced in before its
    first optimizer-stage phase at the top level."""
    train = train or TRAIN
    base = evaluate(analyse([train]), train, config=config)
    with tempfile.TemporaryDirectory(prefix="cgc-cost-model-") as folder:
        path = os.path.join(folder, "allreduce_all.cg")
        with open(path, "w") as handle:
            handle.write(EXPOSED_SOURCE.format(
                library=os.path.join(os.path.dirname(os.path.abspath(train)), "library.cg"),
                entry=EXPOSED_STEP))
        reduce = evaluate(analyse([path]), path, entry=EXPOSED_STEP, config=config)
    body = list(base.body)
    at = next((i for i, node in enumerate(body) if isinstance(node, PhaseRegion)
               and base.phases[node.phase].stage == "optimizer"), None)
    assert at is not None, f"{train}: no optimizer phase at the top of the step"
    body[at:at] = reduce.body
    return dataclasses.replace(base, body=tuple(body), entry=EXPOSED_STEP)


def collective_bytes(program) -> int:
    return sum(launch_facts(program, launch, point).collective_bytes
               for launch, _, point in program.unrolled()
               if launch.image.collective is not None)


@dataclass
class Scaling:
    """One schedule's data-parallel step at each number of ranks (seconds, MODELLED)."""

    ranks: list
    times: dict  # ranks -> StepTimes

    def efficiency(self, ranks: int) -> float:
        """Weak scaling (each rank's batch fixed): the one-rank step over the N-rank step."""
        return self.times[1].shared / self.times[ranks].shared if 1 in self.times else \
            math.nan


def scaling(program, audits, ranks_list, hw: Hardware = H200, model: Model = MODEL) -> Scaling:
    """`program`: one program for every number of ranks, or a function of it (a schedule
    that shards, ZeRO-1's, is evaluated for each: its shard is the bank over N)."""
    program_for = program if callable(program) else (lambda n: program)
    return Scaling(list(ranks_list), {n: step_times(program_for(n), audits, n, hw, model)
                                      for n in sorted(set(ranks_list) | {1})})


def print_branches(name: str, program, audits, hw: Hardware = H200,
                   model: Model = MODEL) -> StepTimes:
    times = step_times(program, audits, 1, hw, model)
    tokens = tokens_a_step(program)
    kind = "floor" if audits is None else \
        "calibrated estimate" if model.calibrated else "optimistic bound"
    print()
    print(f"{name}, one GPU, {kind}, with and without its concurrent branches "
          "(cgConcurrently). MODELLED figures, not measurements.")
    if not has_branches(program.body):
        print(f"{name} has no concurrent branches: {times.shared * 1e3:.2f} ms a step either "
              "way.")
        return times
    print("| branches | step (ms) | tokens/s |")
    print("| --- | ---: | ---: |")
    for label, seconds in (("one after another (the sum of the launches)", times.in_order),
                           ("side by side, the machine shared (the model)", times.shared),
                           ("side by side, each on a machine of its own (critical path "
                            "alone)", times.critical_path)):
        print(f"| {label} | {seconds * 1e3:.3f} | {tokens / seconds:,.0f} |")
    saved = times.in_order - times.shared
    saved = 0.0 if abs(saved) < 5e-8 else saved  # no "-0.0 us" from rounding
    print(f"the branches save {saved * 1e6:,.1f} us a step "
          f"({saved / times.in_order * 100:.2f}%, MODELLED)")
    return times


def print_scaling(config: str, path: str, program, audits, ranks_list, hw: Hardware = H200,
                  model: Model = MODEL, train: str | None = None) -> None:
    """The data-parallel step at each number of ranks: the all-reduce after the backward
    (EXPOSED_SOURCE, spliced into `train`'s step: train.cg's by default) against `path`'s
    step (buckets concurrent with the backward)."""
    exposed = exposed_program(config, train)
    program_for = program if callable(program) else (lambda n: program)
    old, new = scaling(exposed, audits, ranks_list, hw, model), \
        scaling(program_for, audits, ranks_list, hw, model)
    most = max(ranks_list)
    program = program_for(most)  # the calls and bytes it prints: at the most ranks
    tokens = tokens_a_step(program)
    name = os.path.relpath(path, ROOT) if path.startswith(ROOT) else path
    kind = "floor" if audits is None else \
        "calibrated estimate" if model.calibrated else "optimistic bound of the kernels as built"
    print()
    print(f"Data parallel, config {config}, {hw.name} x N on one node's NVLink 4, weak "
          f"scaling ({tokens} tokens a rank a step), {kind}. MODELLED figures, not "
          "measurements.")
    if audits is None:
        print(f"floor: an all-reduce moves each rank's buffer once each way at "
              f"{model.nvlink_bytes_per_s / 1e9:.0f} GB/s")
    else:
        print(f"all-reduce: NCCL's ring, 2(N-1)/N x bytes at "
              f"{model.allreduce_bus_bytes_per_s / 1e9:.0f} GB/s bus bandwidth (Simple; "
              "LL, LL128 at their shares), plus NCCL's modelled latency a call; holding "
              f"{model.collective_sms} SMs while it runs")
    print(f"gradients reduced: {collective_bytes(exposed) / 1e6:,.1f} MB in "
          f"{sum(1 for l, _, _ in exposed.unrolled() if l.image.collective)} call after the "
          f"backward; {name}: {collective_bytes(program) / 1e6:,.1f} MB in "
          f"{sum(1 for l, _, _ in program.unrolled() if l.image.collective)} calls")
    print(f"| ranks | one all-reduce after the backward (ms) | tokens/s | efficiency | {name} "
          "(ms) | tokens/s | efficiency | its branches one after another (ms) |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in ranks_list:
        a, b = old.times[n], new.times[n]
        print(f"| {n} | {a.shared * 1e3:.3f} | {n * tokens / a.shared:,.0f} | "
              f"{old.efficiency(n) * 100:.1f}% | {b.shared * 1e3:.3f} | "
              f"{n * tokens / b.shared:,.0f} | {new.efficiency(n) * 100:.1f}% | "
              f"{b.in_order * 1e3:.3f} |")
    if audits is None:
        return
    print(f"at {most} ranks, {name} with other assumptions (MODELLED):")
    print("| assumption | step (ms) | efficiency |")
    print("| --- | ---: | ---: |")
    variants = (("as above", model),
                ("NVLS bus bandwidth, 480 GB/s", dataclasses.replace(
                    model, allreduce_bus_bytes_per_s=480e9)),
                ("NCCL on 16 SMs", dataclasses.replace(model, collective_sms=16)),
                ("NCCL on 32 SMs", dataclasses.replace(model, collective_sms=32)),
                ("NCCL holding no SMs (copy engines)", dataclasses.replace(
                    model, collective_sms=0)),
                ("a branch's consecutive calls as one NCCL group (one latency)",
                 dataclasses.replace(model, group_collectives=True)),
                ("no latency a call", dataclasses.replace(model, allreduce_protocols=(
                    ("Simple", 0.0, 0.0, 1.0, math.inf),))),
                ("480 GB/s, 16 SMs and one group a branch", dataclasses.replace(
                    model, allreduce_bus_bytes_per_s=480e9, collective_sms=16,
                    group_collectives=True)))
    one = new.times[1].shared
    for label, variant in variants:
        seconds = step_times(program, audits, most, hw, variant).shared
        print(f"| {label} | {seconds * 1e3:.3f} | {one / seconds * 100:.1f}% |")
    verdict = "met" if new.efficiency(most) >= 0.95 else "NOT met"
    print(f"target: at least 95% scaling efficiency at {most} ranks: {verdict} by the model "
          f"({new.efficiency(most) * 100:.1f}%; the all-reduce after the backward: "
          f"{old.efficiency(most) * 100:.1f}%)")


def rate(row: dict, seconds: float) -> str:
    """What a row's launches reach in `seconds`: TFLOP/s for products, GB/s for the rest."""
    if seconds <= 0:
        return "-"
    if row["flops"]:
        return f"{row['flops'] / seconds / 1e12:,.0f} TFLOP/s"
    return f"{row['bytes'] / seconds / 1e9:,.0f} GB/s"


def print_step(name: str, config: str, program, audits, hw: Hardware = H200) -> None:
    """The step image by image: the floor, the calibrated estimate (the figure quoted) and
    the optimistic bound beside it, then the step's totals both ways."""
    tokens = tokens_a_step(program)
    floor_rows = step_rows(program, None, hw)
    print(f"{name}, config {config}, {hw.name}: one step. MODELLED figures, not "
          f"measurements. Floor: bytes at {hw.hbm_bytes_per_s / 1e12:.1f} TB/s or products "
          f"at {hw.tensor_flops / 1e12:.0f} TFLOP/s (the peaks), whichever is longer.")
    if audits is None:
        print("| image | launches | MB moved | GFLOP | floor (us) |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for image, row in sorted(floor_rows.items(), key=lambda r: -r[1]["floor"]):
            print(f"| {image} | {row['launches']} | {row['bytes'] / 1e6:,.1f} | "
                  f"{row['flops'] / 1e9:,.1f} | {row['floor'] * 1e6:,.1f} |")
        floor = sum(row["floor"] for row in floor_rows.values())
        print(f"floor: {floor * 1e3:.2f} ms a step, {tokens / floor:,.0f} tokens/s "
              f"({tokens} tokens a step)")
        print_branches(name, program, None, hw)
        return
    calibrated = step_rows(program, audits, hw, CALIBRATED)
    optimistic = step_rows(program, audits, hw, MODEL)
    print(f"Calibrated: work at an H200's ceilings as issue 24's review reports them measured "
          f"(not measured here), {hw.measured_tensor_flops / 1e12:.0f} TFLOP/s "
          f"and {hw.measured_hbm_bytes_per_s / 1e12:.1f} TB/s, products per shape, each "
          "kernel's parts overlapped only as its design and warps allow (the estimate). "
          "Optimistic: the peaks, products at "
          f"{MODEL.cublas_fraction:.0%} of them, every part hidden under the slowest (a bound).")
    print("| image | launches | MB moved | GFLOP | floor (us) | calibrated (us) | reaches | "
          "bound by | optimistic (us) | calibrated / floor |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |")
    total = defaultdict(float)
    for image, row in sorted(calibrated.items(), key=lambda r: -r[1]["modelled"]):
        bound = max(row["bounds"], key=row["bounds"].get)
        # a floor under 0.1 us (a launch that moves a few bytes) makes no useful ratio
        ratio = f"{row['modelled'] / row['floor']:,.1f}x" if row["floor"] > 1e-7 else "-"
        print(f"| {image} | {row['launches']} | {row['bytes'] / 1e6:,.1f} | "
              f"{row['flops'] / 1e9:,.1f} | {row['floor'] * 1e6:,.1f} | "
              f"{row['modelled'] * 1e6:,.1f} | {rate(row, row['modelled'])} | {bound} | "
              f"{optimistic[image]['modelled'] * 1e6:,.1f} | {ratio} |")
        for key in ("launches", "bytes", "flops", "floor", "modelled"):
            total[key] += row[key]
        total["optimistic"] += optimistic[image]["modelled"]
    print(f"| **step** | {int(total['launches'])} | {total['bytes'] / 1e6:,.1f} | "
          f"{total['flops'] / 1e9:,.1f} | {total['floor'] * 1e6:,.1f} | "
          f"{total['modelled'] * 1e6:,.1f} | | | {total['optimistic'] * 1e6:,.1f} | |")
    print(f"floor: {total['floor'] * 1e3:.2f} ms a step, {tokens / total['floor']:,.0f} "
          f"tokens/s ({tokens} tokens a step)")
    print(f"calibrated estimate, the launches one after another: "
          f"{total['modelled'] * 1e3:.2f} ms a step, {tokens / total['modelled']:,.0f} tokens/s;"
          f" optimistic bound {total['optimistic'] * 1e3:.2f} ms, "
          f"{tokens / total['optimistic']:,.0f} tokens/s (MODELLED, not measured)")
    print_branches(name, program, audits, hw, CALIBRATED)
    print_branches(name, program, audits, hw, MODEL)


def kernel_images(program) -> set:
    return {launch.image.name for launch, _, _ in program.unrolled()
            if launch.image.library is None}


def parse_ranks(text: str) -> list:
    try:
        ranks = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a list of whole numbers") from None
    if not ranks or min(ranks) < 1:
        raise argparse.ArgumentTypeError("every number of ranks must be at least 1")
    return ranks


def parse_scale(text: str) -> tuple[str, float]:
    """IMAGE=F of --scale."""
    image, _, number = text.partition("=")
    try:
        factor = float(number)
    except ValueError:
        factor = -1.0
    if not image or not 0 < factor <= 100 or not math.isfinite(factor):
        raise argparse.ArgumentTypeError(
            f"'{text}' is not IMAGE=F with a factor F above 0 and at most 100")
    return image, factor


def parse_registers(text: str) -> tuple[str, int]:
    """IMAGE=N of --registers."""
    image, _, number = text.partition("=")
    if not image or not (number.isascii() and number.isdigit()) or not 1 <= int(number) <= 255:
        raise argparse.ArgumentTypeError(
            f"'{text}' is not IMAGE=N with N registers a thread from 1 to 255")
    return image, int(number)


def with_registers(audit: KernelAudit, registers: int, hw: Hardware = H200) -> KernelAudit:
    """The audit of a kernel as if ptxas had given it `registers` a thread: its occupancy
    recomputed, its instruction mix unchanged (a what-if: fewer registers than the code
    needs would spill, which the mix does not show)."""
    return dataclasses.replace(audit, registers=registers, occupancy=occupancy(
        audit.threads, registers, audit.static_shared + audit.dynamic_shared, hw))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="gpt2")
    parser.add_argument("--floor", action="store_true",
                        help="the floor alone (no audit, so no CUDA compiler needed)")
    parser.add_argument("--parts", action="store_true",
                        help="each image's modelled time split into its parts")
    parser.add_argument("--file", default=TRAIN,
                        help="the one-GPU schedule priced (default schedules/train.cg)")
    parser.add_argument("--ranks", type=parse_ranks, metavar="N,N,...",
                        help="also the data-parallel step at these numbers of ranks, e.g. "
                        "1,2,4,8: the all-reduce after the backward against --parallel's")
    parser.add_argument("--registers", type=parse_registers, action="append", default=[],
                        metavar="IMAGE=N",
                        help="a what-if: price IMAGE's kernel as if it held N registers a "
                        "thread (its blocks an SM recomputed; its machine code otherwise as "
                        "built; N from 1 to 255; not with --floor); may be given again "
                        "for other images")
    parser.add_argument("--scale", type=parse_scale, action="append", default=[],
                        metavar="IMAGE=F",
                        help="a what-if: the step (calibrated, the machine shared) with IMAGE's "
                        "time and bytes (its parts, not its launch overheads) times F, beside "
                        "the step as built, e.g. cgImageAttentionBackward=0.800; may be given "
                        "again for other images (not with --floor, --parts, --ranks, "
                        "--sensitivity or --registers); the step need not be monotone in F "
                        "(concurrent branches' launches start in another order as one "
                        "shrinks)")
    parser.add_argument("--sensitivity", action="store_true",
                        help="what a 10%% cut of each image's time would save the step, and "
                        "how much of the step the SMs are at work (calibrated, the machine "
                        "shared; not with --floor, --parts or --ranks)")
    parser.add_argument("--parallel", default=os.path.join(ROOT, "schedules",
                                                           "train_parallel.cg"),
                        help="the data-parallel schedule (default schedules/train_parallel.cg)")
    args = parser.parse_args()
    if args.registers and args.floor:
        parser.error("--registers prices a kernel as built: it needs the audit, not --floor")
    if args.sensitivity and args.floor:
        parser.error("--sensitivity prices the kernels as built: it needs the audit, not "
                     "--floor")
    if args.sensitivity and (args.parts or args.ranks):
        parser.error("--sensitivity prints a table of its own: not with --parts or --ranks")
    if args.scale and (args.floor or args.parts or args.ranks or args.sensitivity
                       or args.registers):
        parser.error("--scale prints a table of its own from the kernels as built: not with "
                     "--floor, --parts, --ranks, --sensitivity or --registers")
    what_if, scales = dict(args.registers), dict(args.scale)
    if len(what_if) < len(args.registers):
        parser.error("--registers: an image given twice")
    if len(scales) < len(args.scale):
        parser.error("--scale: an image given twice")
    from cgc.cli import _count
    from cgc.core.diagnostics import CompileError, render_all
    from sass_audit import ToolchainMissing, audit_file
    path = os.path.abspath(args.file)
    name = os.path.relpath(path, ROOT) if path.startswith(ROOT + os.sep) else path
    try:
        program = evaluate(analyse([path]), path, config=args.config)
        unknown = sorted(set(what_if) - kernel_images(program))
        if unknown:
            parser.error(f"--registers: {', '.join(unknown)}: not a kernel of {name} (its "
                         f"kernels: {', '.join(sorted(kernel_images(program)))})")
        images = {launch.image.name for launch, _, _ in program.unrolled()}
        unknown = sorted(set(scales) - images)
        if unknown:
            parser.error(f"--scale: {', '.join(unknown)}: not an image {name} launches (its "
                         f"images: {', '.join(sorted(images))})")
        parallel = None
        if args.ranks:
            parallel_path = os.path.abspath(args.parallel)
            parallel = evaluate(analyse([parallel_path]), parallel_path, config=args.config)
        audits = None
        if not args.floor:
            # the priced file's own kernels (a build it shares with another file is the
            # cache's); the data-parallel file's, where it launches a kernel this one does not
            audits = audit_file(path, args.config)
            if parallel is not None and not kernel_images(parallel) <= set(audits):
                audits = {**audit_file(os.path.abspath(args.parallel), args.config), **audits}
    except ToolchainMissing as error:
        # --floor needs no compiler, but prices no kernel as built: no what-if with it
        hint = "" if what_if or scales or args.sensitivity else \
            " (or --floor for the floor alone)"
        print(f"cost_model: error: {error}{hint}", file=sys.stderr)
        return 1
    except CompileError as error:  # the schedule itself: cgc's own diagnostics
        print(render_all(error.diagnostics), file=sys.stderr)
        return 1
    for image, registers in what_if.items():
        built = audits[image]
        audits[image] = with_registers(built, registers, H200)
        if audits[image].occupancy.blocks < 1:  # no block fits an SM: it could not launch
            parser.error(f"--registers {image}={registers}: a block of {built.threads} "
                         f"threads at {registers} registers a thread does not fit in the "
                         f"{H200.registers_per_block:,} registers a block may hold: the "
                         "kernel could not launch")
        print(f"WHAT-IF, not the kernel as built: {image} priced at {_count(registers, 'register')} "
              f"a thread, {_count(audits[image].occupancy.blocks, 'block')} an SM (built: "
              f"{built.registers}, {built.occupancy.blocks})")
    if args.sensitivity:
        print_sensitivity(name, args.config, program, audits)
        return 0
    if scales:
        print_scaled(name, args.config, program, audits, scales)
        return 0
    if args.parts and audits:
        print_parts(program, audits, model=CALIBRATED)
        print()
        print_parts(program, audits, model=MODEL)
        return 0
    hw = H200
    schedules = os.path.join(ROOT, "schedules")
    shown = os.path.relpath(path, schedules) if path.startswith(schedules + os.sep) else name
    print_step(shown, args.config, program, audits, hw)
    if parallel is not None:
        if has_branches(parallel.body):
            print_branches(os.path.basename(parallel_path) + " (1 rank)", parallel, audits, hw)
        def parallel_for(ranks: int, frontend=analyse([parallel_path])):
            """The data-parallel step as rank 0 of `ranks` evaluates it (cgRank, cgRanks)."""
            return evaluate(frontend, parallel_path, config=args.config, ranks=(0, ranks))
        print_scaling(args.config, parallel_path, parallel_for, audits, args.ranks, hw,
                      train=path)
    return 0


if __name__ == "__main__":
    from cgc.outputs import script_status
    sys.exit(script_status(main))
