"""The SASS audit (scripts/sass_audit.py): what each kernel promises, read from its machine
code for sm_90. Needs only the CPU and CUDA's wheels (nvcc, nvdisasm, cuobjdump: the
cuda-tools extra), so CI runs it: a kernel that starts spilling, loading shared memory
through generic pointers or losing its 128-bit accesses fails here.

EVERY_KERNEL applies to every kernel of every shipped file: each schedule of schedules/ that
compiles to a file, in each configuration (tiny, tiny32, gpt2, and the Llama-style step's),
each distinct kernel of a configuration built once (kernel_units; train.cg, train_parallel.cg
and train_recompute.cg are the same in kernels in each configuration). PROMISES is the one table of what each kernel
of GPT-2 small's file keeps besides (its design's figures: HMMA a tile, blocks an SM).
PENDING marks the promises not yet true of the kernels as built, each with its reason: they
are strict xfails, so the change that makes one true fails here until its mark is removed.
The attention kernels (FlashAttention-2 style: mma.sync m16n8k16 fed by ldmatrix, cp.async;
issue 13) keep every promise, no local memory included (rotary is a pass of its own).

Every detector is shown to fail: GPT-2 small's file built from templates broken on purpose
(MUTATIONS: a float4 copy made scalar, an atomic added twice, a local array) breaks those
promises; a local array at the tiny shapes only, in a kernel only library.cg launches, fails
exactly those two files; a tiny kernel compiled here spills to local memory, loads shared
memory through a generic pointer, adds atomically, and (the other way) uses ldmatrix,
mma.sync in a loop, cp.async and 128-bit accesses; doctored listings check the parser's
corner cases; the occupancy rules are checked on hand-worked cases.
"""

from __future__ import annotations

import re
import shutil
import sys
from collections import Counter
from fractions import Fraction

import pytest

from cgc.resources import data_dir
from conftest import ROOT, SCHEDULES

sys.path.insert(0, str(ROOT / "scripts"))
import sass_audit  # noqa: E402
from sass_audit import H200, KernelAudit, LaunchShape, Occupancy, occupancy  # noqa: E402

# ---- the promises --------------------------------------------------------------------


def no_local_memory(a: KernelAudit) -> bool:
    return a.counts["local"] == 0 and a.stack == 0


def no_generic_accesses(a: KernelAudit) -> bool:
    """Generic LD/ST: what a shared-memory access through an unqualified pointer (WMMA's
    fragment loads) compiles to. No kernel needs them, so none may have them."""
    return a.counts["generic"] == 0


def no_atomics(a: KernelAudit) -> bool:
    """The step gives the same bits every run: no kernel adds atomically."""
    return a.counts["atomic"] == 0


def two_tickets(a: KernelAudit) -> bool:
    """The layer-norm backward's two atomics: its two levels of tickets (atomicInc), a
    group's, which finds the group's last block, and the groups', which finds the last of
    those; each adds partial sums in a fixed order. No other atomic: no data is added
    atomically, so the same bits every run."""
    return a.counts["atomic"] == 2 and a.counts["ticket"] == 2


def launchable(a: KernelAudit) -> bool:
    return a.occupancy.blocks >= 1


def wide_global_accesses(a: KernelAudit) -> bool:
    return a.counts["wide"] > 0


def ldmatrix(a: KernelAudit) -> bool:
    return a.counts["ldsm"] > 0


def cp_async(a: KernelAudit) -> bool:
    return a.counts["ldgsts"] > 0


def conflict_free_ldmatrix(a: KernelAudit) -> bool:
    """ldmatrix reads rows padded so that the 8 rows of each 8 x 8 matrix fall in 8
    different bank groups: the ways are computed from the emitted file's row stride."""
    return a.ldsm_conflicts == 1


def at_least(blocks: int):
    def promise(a: KernelAudit) -> bool:
        return a.occupancy.blocks >= blocks
    promise.__name__ = f"at_least_{blocks}_blocks_per_sm"
    return promise


def tensor_per_tile(*designed: int):
    """Each main loop (innermost loop issuing HMMA) issues one of the designed counts per
    iteration, in order, and the HMMA outside loops (a peeled diagonal tile) add up to a sum
    of designed counts. Attention forward: per warp and key tile, S = Q K^T (32 x 64 x 64:
    2 row tiles x 8 n-tiles x 4 k-steps of m16n8k16) and O += P V (the same), 128 HMMA.
    Backward: per warp and chunk of 16 keys (queries), 3 products in each dQ chunk loop (S,
    dP, dQ over 32 query rows: 48) and 4 in each dK/dV chunk loop (S, dP, dV, dK over 32 key
    rows: 64); no HMMA outside them."""
    def promise(a: KernelAudit) -> bool:
        loops = tuple(t["tensor"] for t in a.tile_loops)
        return loops == designed and _sum_of(a.tensor_outside_loops, designed)
    promise.__name__ = "tensor_per_tile_" + "_".join(map(str, designed))
    return promise


def exp2_per_logit(logits: int, corrections: int, rescales: int):
    """Each logit's exponential in the main loop is one MUFU.EX2 whose argument is one FFMA:
    the scale, log2(e) and the row's maximum folded into it (no FMUL a logit, no denormal
    guard around `__expf`). Per warp and iteration: EX2 = logits + corrections (a row's
    rescaling factor each), FFMA at least a logit each, and FMUL only the accumulator's
    rescaling and the corrections. Forward: 32 rows x 64 keys over 32 lanes = 64 logits a
    lane, 4 rows a lane, O's 2 x 8 accumulators x 4 values rescaled."""
    def promise(a: KernelAudit) -> bool:
        loop = a.tile_loops[0]
        return (loop["ex2"] == logits + corrections and loop["op:FFMA"] >= logits
                and loop["op:FMUL"] <= rescales + corrections)
    promise.__name__ = f"exp2_per_logit_{logits}"
    return promise


def backward_exp2_per_logit(logits: int, row_terms: int):
    """The backward recomputes each probability as one MUFU.EX2 of one FFMA (the scale and
    the row's lse in log2 units folded in) and each dS as one FFMA and one FMUL
    (P (dP scale - delta scale)), in each of its four chunk loops (each pass's diagonal tile
    pair and the pairs off it): per warp and chunk, 32 rows x 16 columns (dK/dV: the warp's
    keys, 16 queries; dQ: the warp's queries, 16 keys) over 32 lanes = 16 logits a lane.
    EX2 = MUFU = logits (no other special function), FFMA at least two a logit, FMUL at most
    one a logit and the rows' terms (the dK/dV chunk scales its 16 queries' lse and delta,
    4 of each a lane: 8)."""
    def promise(a: KernelAudit) -> bool:
        return len(a.tile_loops) == 4 and all(
            loop["ex2"] == loop["mufu"] == logits and loop["op:FFMA"] >= 2 * logits
            and loop["op:FMUL"] <= logits + row_terms for loop in a.tile_loops)
    promise.__name__ = f"backward_exp2_per_logit_{logits}"
    return promise


def mask_on_the_diagonal_only(a: KernelAudit) -> bool:
    """The causal mask's compare-and-select runs on the diagonal tile only, peeled from the
    main loops: no select or float compare in any main loop, selects outside them."""
    return all(loop["op:FSEL"] == 0 and loop["op:FSETP"] == 0 for loop in a.tile_loops) \
        and a.outside_tiles["op:FSEL"] > 0


def mask_on_the_diagonal_chunks_only(*diagonal: bool):
    """The causal mask's compare-and-select runs in the diagonal tile pair's chunk loops only
    (`diagonal`: which of the main loops, in order, is one): selects there, and no select or
    float compare in the chunk loops of the pairs off the diagonal (the backward: each
    pass's diagonal step, peeled, takes its chunks in a loop of its own)."""
    def promise(a: KernelAudit) -> bool:
        return len(a.tile_loops) == len(diagonal) and all(
            loop["op:FSEL"] > 0 if masked else loop["op:FSEL"] == loop["op:FSETP"] == 0
            for loop, masked in zip(a.tile_loops, diagonal))
    promise.__name__ = "mask_on_the_diagonal_chunks_only"
    return promise


def main_loops_read_no_global_memory(a: KernelAudit) -> bool:
    """The main loops take what they stream from shared memory only: the tiles, and the
    backward's lse and delta of each query tile, arrive by cp.async with the stage (no LDG
    in a main loop: nothing reloaded from global memory per fragment or per logit). The
    copies are issued in each main loop, or, where the main loops are chunk loops inside a
    loop over tiles (the backward), in each loop around them."""
    return bool(a.tile_loops) and all(loop["global"] == 0 for loop in a.tile_loops) and all(
        loop["ldgsts"] > 0 for loop in a.around_tiles or a.tile_loops)


def hmma_per_ldmatrix(*at_least: Fraction):
    """HMMA a fragment load in each main loop, in order: each fragment an ldmatrix brings
    feeds this many products or more (exactly: a Fraction each). Forward, 32 query rows a
    warp: 128 HMMA over 32 ldmatrix.x4 (4: each K and V fragment feeds both row tiles; 16
    rows a warp gave 64 over 36). Backward, a chunk of 16 keys or queries: the dQ pass, 32
    query rows a warp, 48 over 12 (4: each K and V fragment feeds both of the warp's row
    tiles); the dK/dV pass, 32 key rows a warp, 64 over 16 (4: each q and dO fragment feeds
    both of the warp's row tiles, k's and v's fragments held; with v's loaded again each
    chunk, while one block took both passes, 64 over 24; at 16 key rows a warp a tile took
    128 over 64)."""
    def promise(a: KernelAudit) -> bool:
        return len(a.tile_loops) == len(at_least) and all(
            loop["tensor"] * least.denominator >= least.numerator * loop["ldsm"]
            for loop, least in zip(a.tile_loops, at_least))
    promise.__name__ = "hmma_per_ldmatrix_" + "_".join(
        f"{least.numerator}_{least.denominator}" for least in at_least)
    return promise


def classifier_passes(values_per_group: int):
    """The classifier's three passes over its row in shared memory, each a loop over the
    thread's 16-byte groups (one 16-byte LDS a group): the maximum, an FMNMX a value and no
    exponential; the sum, one FFMA and one EX2 a value (log2(e) and the maximum folded into
    the FFMA, no FMUL); the gradient, one FFMA, one EX2 and at most one FMUL (the scale) a
    value. None compares a value: at most one FSETP a group (the maximum pass's group against
    the thread's largest) and no FSEL."""
    def promise(a: KernelAudit) -> bool:
        passes = [loop for loop in a.untiled_loops  # 16-byte loads: 4 wavefronts each
                  if loop["lds"] and loop["wavefronts:lds"] == 4 * loop["lds"]]
        if len(passes) != 3:
            return False
        top, total, gradient = passes

        def values(loop):
            return loop["lds"] * values_per_group
        return (top["op:FMNMX"] >= values(top) and top["ex2"] == 0
                and total["ex2"] == total["op:FFMA"] == values(total) and total["op:FMUL"] == 0
                and gradient["ex2"] == gradient["op:FFMA"] == values(gradient)
                and gradient["op:FMUL"] <= values(gradient)
                and all(loop["op:FSETP"] <= loop["lds"] and loop["op:FSEL"] == 0
                        for loop in passes))
    promise.__name__ = f"classifier_passes_{values_per_group}_a_group"
    return promise


def warp_parallel_merge(a: KernelAudit) -> bool:
    """No thread merges the warps' results alone: every loop of the kernel steps through the
    row (16-byte copies or loads, 4 wavefronts each), none walks the warps' partial results
    (a loop of 4-byte shared loads, 1 wavefront each); and the code outside the loops reads
    fewer words of shared memory a lane (its wavefronts) than the other warps' results a
    merge unrolled by nvcc reads (block_reduce: one a reduction, every warp at once; about
    21 in all at GPT-2 small, the passes' last groups and the maximum's group included)."""
    warps = a.threads // 32
    return bool(a.untiled_loops) and a.straight["wavefronts:lds"] < warps - 1 and all(
        loop["lds"] + loop["ldgsts"] > 0 and loop["wavefronts:lds"] == 4 * loop["lds"]
        and loop["wavefronts:ldgsts"] == 4 * loop["ldgsts"] for loop in a.untiled_loops)


def _sum_of(total: int, parts: tuple[int, ...]) -> bool:
    reachable = {0}
    while True:
        more = {r + p for r in reachable for p in parts if r + p <= total} - reachable
        if not more:
            return total in reachable
        reachable |= more


EVERY_KERNEL = (no_local_memory, no_generic_accesses, no_atomics, launchable)

# The attention backward's four chunk loops, in order: the dQ blocks' pairs off the diagonal,
# their diagonal tile pair, the dK/dV blocks' diagonal pair, their pairs off the diagonal.
BACKWARD_MASK = mask_on_the_diagonal_chunks_only(False, True, True, False)
BACKWARD_LOADS = hmma_per_ldmatrix(Fraction(4), Fraction(4), Fraction(4), Fraction(4))

PROMISES = {
    "cgImageAttention": (tensor_per_tile(128), at_least(2), ldmatrix, cp_async,
                         conflict_free_ldmatrix, exp2_per_logit(64, 4, 64),
                         mask_on_the_diagonal_only, hmma_per_ldmatrix(Fraction(4)),
                         main_loops_read_no_global_memory),
    "cgImageAttentionBackward": (tensor_per_tile(48, 48, 64, 64), at_least(4), ldmatrix,
                                 cp_async, conflict_free_ldmatrix, backward_exp2_per_logit(16, 8),
                                 BACKWARD_MASK, BACKWARD_LOADS, main_loops_read_no_global_memory),
    # float4 or 16-byte packs (docs/kernels.md)
    "cgImageEmbedding": (wide_global_accesses,),
    "cgImageLayerNorm": (wide_global_accesses,),
    "cgImageLayerNormBackward": (wide_global_accesses, two_tickets),
    "cgImageLayerNormBackwardAdd": (wide_global_accesses, two_tickets),
    "cgImageRmsNorm": (wide_global_accesses,),
    "cgImageRmsNormBackward": (wide_global_accesses, two_tickets),
    "cgImageRmsNormBackwardAdd": (wide_global_accesses, two_tickets),
    "cgImageSwiGlu": (wide_global_accesses,),
    "cgImageSwiGluBackward": (wide_global_accesses,),
    "cgImageClassifier": (wide_global_accesses, at_least(2), cp_async, classifier_passes(8),
                          warp_parallel_merge),
    "cgImageAdamW": (wide_global_accesses,),
    "cgImageSquareSum": (wide_global_accesses,),
}

# The kernels excused from no_atomics, each promising two_tickets instead (in PROMISES).
TICKETS = {"cgImageLayerNormBackward", "cgImageLayerNormBackwardAdd", "cgImageRmsNormBackward",
           "cgImageRmsNormBackwardAdd"}

# None pending. Until rotary moved out of the attention kernels (cgImageRotary: q and k turned
# once per step in the qkv buffer), their sincosf kept a 32-byte stack (Payne-Hanek's local
# array) and LDL/STL in the key-tile loops, and no_local_memory was pending for both; the
# forward kernel then needs kAttentionMinBlocks to stay spill-free.
PENDING: dict = {}


@pytest.fixture(scope="session")
def sass_folder(tmp_path_factory):
    """The session's cubins, by content: a build another test asks for again is reused."""
    return tmp_path_factory.mktemp("sass")


@pytest.fixture(scope="session")
def shipped(sass_folder):
    """Every shipped file's kernels, audited: each distinct kernel of a configuration built
    once (sass_audit.kernel_units)."""
    return sass_audit.audit_shipped(sass_folder)


@pytest.fixture(scope="session")
def gpt2_audit(shipped):
    """GPT-2 small's kernels (train.cg, config gpt2), from the shipped audit."""
    return shipped.files[("train.cg", "gpt2")]


# The files at a GPU's shape, whose kernels keep PROMISES: GPT-2 small's step and TinyLlama's.
GPU_FILES = (("train.cg", "gpt2"), ("llama/train.cg", "tinyllama"))


def _excused(kernel: str, promise) -> bool:
    return (kernel, promise.__name__) in PENDING or (promise is no_atomics and kernel in TICKETS)


def _cases():
    """(kernels, promise) for every promise of the table; "*" is every kernel but those a
    PENDING entry excuses, each of which is its own case. Pending cases are strict xfails."""
    def case(kernel, promise):
        reason = PENDING.get((kernel, promise.__name__))
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        return pytest.param(kernel, promise, marks=marks, id=f"{kernel}-{promise.__name__}")
    for promise in EVERY_KERNEL:
        yield case("*", promise)
        yield from (case(kernel, promise) for kernel, name in sorted(PENDING)
                    if name == promise.__name__)
    for kernel in sorted(PROMISES):
        yield from (case(kernel, promise) for promise in PROMISES[kernel])


@pytest.mark.parametrize("kernel, promise", list(_cases()))
def test_kernel_keeps_its_promise(shipped, kernel, promise):
    """A promise of EVERY_KERNEL ("*", or a kernel PENDING excuses from it) is kept in every
    shipped file; one of PROMISES, in each GPU-shaped file that launches the kernel (GPT-2
    small's, TinyLlama's: GPU_FILES)."""
    if promise in EVERY_KERNEL:
        files = shipped.files
        cases = [(key, k) for key, audits in files.items() for k in audits
                 if (k == kernel if kernel != "*" else not _excused(k, promise))]
    else:
        files = {key: shipped.files[key] for key in GPU_FILES}
        cases = [(key, kernel) for key in GPU_FILES if kernel in files[key]]
    assert cases and all(k in files[key] for key, k in cases), \
        f"the table promises for a kernel no file has: {kernel}"
    broken = [(key, k) for key, k in cases if not promise(files[key][k])]
    assert not broken, f"{promise.__name__} broken in " + "; ".join(
        f"{name} {config}: {files[name, config][k].row()}" for (name, config), k in broken)


def test_the_audit_covers_every_shipped_configuration(shipped):
    """Every schedules/*.cg and schedules/llama/*.cg that `cgc compile` turns into a file, in
    every configuration its model declares: the files left out are exactly those that declare
    no schedule, or no configuration (the definitions a model's steps import)."""
    from cgc.core.diagnostics import CompileError
    from cgc.pipeline import analyse, evaluate
    names, configs_of = [], {}
    for folder, model in (("", "model.cg"), ("llama/", "llama/model.cg")):
        configs = re.findall(r"^config (\w+)", (SCHEDULES / model).read_text(), re.M)
        for path in sorted((SCHEDULES / folder).glob("*.cg")):
            names.append(folder + path.name)
            configs_of[folder + path.name] = configs
    assert configs_of["train.cg"] == ["tiny", "tiny32", "gpt2"]
    assert configs_of["llama/train.cg"] == ["tiny", "tiny32", "tinyllama"]
    left_out = sorted(set(names) - {name for name, _ in shipped.files})
    assert left_out == ["decoder.cg", "images.cg", "launches.cg", "llama/model.cg", "model.cg"]
    for name in left_out:
        path = str(SCHEDULES / name)
        with pytest.raises(CompileError) as refused:
            evaluate(analyse([path]), path, config=None)
        message = refused.value.diagnostics[0].message
        assert "declares no schedule" in message or "declares no configuration" in message
    assert set(shipped.files) == {(name, config) for name in names if name not in left_out
                                  for config in configs_of[name]}
    # every kernel the file launches (a launch shape each), each found in the built code
    assert all(audits and all(a.registers > 0 for a in audits.values())
               for audits in shipped.files.values())


def test_files_the_same_in_kernels_share_one_build(shipped):
    """train.cg, train_parallel.cg and train_recompute.cg differ only in their host programs
    (the collectives are library calls, the recomputing backward the same kernels): one
    build of their device code in each configuration serves the three; every other file is
    its own (train_zero.cg casts its shard of the parameters down, a kernel the others no
    longer launch). The audit's figures for the three are the same."""
    for folder, configs in (("", ("tiny", "tiny32", "gpt2")),
                            ("llama/", ("tiny", "tiny32", "tinyllama"))):
        steps = [folder + name for name in ("train.cg", "train_parallel.cg", "train_recompute.cg")]
        for config in configs:
            assert [(name, config) for name in steps] in shipped.builds
            rows = [[a.row() for a in shipped.files[name, config].values()] for name in steps]
            assert all(row == rows[0] for row in rows)
    # GPT: backward, forward, library, optimizer, sample, train_zero; Llama: library, sample,
    # steps; each in three configurations
    assert sorted(len(keys) for keys in shipped.builds) == [1] * 27 + [3] * 6
    assert sum(map(len, shipped.builds)) == len(shipped.files)
    # compiled: each distinct kernel of a configuration once (a second build where two files
    # emit one kernel differently: the rotary pass, RMSNorm and SwiGLU), six configurations
    assert shipped.compiled <= 2 * 6


def test_a_kernel_built_beside_others_is_the_same(shipped, sass_folder):
    """The shipped audit builds each kernel once, beside a configuration's other kernels
    (kernel_units); GPT-2 small's step file built alone, as one nvcc build of its own
    device code, gives every kernel the same audit: registers, shared memory, every count
    of every loop. So does TinyLlama's, whose RMSNorm and SwiGLU kernels are built in a
    second build of their configuration (another file emits them differently)."""
    for name, config in (("train.cg", "gpt2"), ("llama/train.cg", "tinyllama")):
        source, shapes = sass_audit.emitted_file(str(SCHEDULES / name), config)
        alone = sass_audit.audit_source(source, shapes, sass_folder)
        assert alone == shipped.files[(name, config)], (name, config)


def test_kernel_units_build_each_kernel_once_and_a_second_text_apart():
    """Two files of one common part: a kernel they share goes in one build, once; a kernel
    they emit differently goes in a second build; another common part is built apart."""
    def kernel(name, body):
        return f'extern "C" __global__ void __launch_bounds__(32) {name}() {{ {body} }}'

    def code(common, **kernels):
        return common + sass_audit.KERNELS_HEADER + " --\n" + "".join(
            f"\n// {name}: summary\n{kernel(name, body)}\n" for name, body in kernels.items())
    a = code("// tiny\n", k1="int a;", k2="int b;")
    b = code("// tiny\n", k1="int a;", k2="int c;")
    c = code("// gpt2\n", k1="int a;")
    units = sass_audit.kernel_units([(a, {"k1": 0, "k2": 0}), (b, {"k1": 0, "k2": 0}),
                                     (c, {"k1": 0})])
    assert [list(kernels) for _, kernels in units] == [["k1", "k2"], ["k2"], ["k1"]]
    codes = [sass_audit.unit_code(*unit) for unit in units]
    assert codes[0].count("int a;") == 1 and "int c;" in codes[1]
    assert codes[2].startswith("// gpt2\n")
    common, kernels = sass_audit.split_kernels(b, ["k2", "k1"])
    # each kernel from the blank line before its "// NAME: " line
    assert common == "// tiny\n" and kernels == {
        "k1": f"\n// k1: summary\n{kernel('k1', 'int a;')}\n",
        "k2": f"\n// k2: summary\n{kernel('k2', 'int c;')}\n"}
    # a kernel the names leave out would be glued to the one before it: refused
    with pytest.raises(AssertionError, match="not one kernel of its own"):
        sass_audit.split_kernels(b, ["k1"])


def test_pending_promises_are_promises():
    """Every PENDING entry names a kernel and a promise the table holds: a typo cannot
    silently excuse a kernel."""
    for kernel, name in PENDING:
        names = {p.__name__ for p in EVERY_KERNEL + PROMISES.get(kernel, ())}
        assert name in names, (kernel, name)


def test_audit_reads_the_attention_design(gpt2_audit):
    """The FlashAttention-2 design as issue 13 describes it, read from the SASS. The forward's
    key-tile loop feeds its HMMA from ldmatrix, streams the next tile by cp.async (16 bytes a
    thread a copy: 4 wavefronts each) and has no generic access; its diagonal tile is peeled
    (its 128 HMMA outside the loop). The backward takes each tile pair 16 keys (its dQ
    blocks) or queries (its dK/dV blocks) at a time in a chunk loop, four of them (each
    pass's diagonal pair, peeled, and the pairs off it): ldmatrix and HMMA, no copy, no
    generic access, no loop inside, no HMMA outside them; the loops over key and query tiles
    around them stream the next tiles (the dK/dV pass's also its query rows' lse and delta,
    4 bytes a copy: 1 wavefront)."""
    forward, backward = gpt2_audit["cgImageAttention"], gpt2_audit["cgImageAttentionBackward"]
    assert forward.tensor_outside_loops == 128 and backward.tensor_outside_loops == 0
    for audit, loops in ((forward, forward.tile_loops), (backward, backward.around_tiles)):
        # the next two tiles, 64 x 64 bfloat16 each, over the block's 64 threads: 8 copies a
        # thread each, unrolled in the body (kCopies: a count the shape fixes)
        tile_copies = 2 * 64 * 64 // 8 // audit.threads
        rows = (0,) if audit is forward else (0, 2)  # a thread's query row's lse and delta
        assert len(loops) == len(rows)
        for loop, row_copies in zip(loops, rows):
            assert loop["ldgsts"] == tile_copies + row_copies
            assert loop["wavefronts:ldgsts"] == 4 * tile_copies + row_copies
    assert len(backward.tile_loops) == 4 and all(t["ldgsts"] == 0 for t in backward.tile_loops)
    for audit in (forward, backward):
        for tile in audit.tile_loops:
            assert tile["tensor"] > 0 and tile["ldsm"] > 0
            assert tile["generic"] == 0 and tile["atomic"] == 0
        # and no loop inside (the cost model prices none): the copies are unrolled, and q and
        # k arrive turned (a rotary loop put back would add inner loops with STS)
        assert audit.inner_loops == [[]] * len(audit.tile_loops)
        assert all(tile.get("sts", 0) == 0 for tile in audit.tile_loops)
    # each loop's body once: the forward's loop and peeled tile; the backward's four chunks
    assert forward.counts["tensor"] == 2 * 128 and backward.counts["tensor"] == 48 + 48 + 64 + 64


def test_every_kernel_of_the_file_is_audited(gpt2_audit):
    """The audit covers exactly what the file launches, and the table promises only for
    kernels the file has (an image the step stops launching leaves the table too)."""
    source, shapes = sass_audit.emitted_file(str(SCHEDULES / "train.cg"), "gpt2")
    # 15 kernels: GELU and its gradient are epilogues of the cuBLASLt products now, the
    # layer-norm parameter gradients and the gradient's low-type copy (once 24 cast-downs)
    # part of the layer-norm backward
    assert set(gpt2_audit) == set(shapes) and len(shapes) >= 15
    llama = sass_audit.emitted_file(str(SCHEDULES / "llama" / "train.cg"), "tinyllama")[1]
    assert set(PROMISES) <= set(shapes) | set(llama), set(PROMISES) - set(shapes) - set(llama)
    for name, audit in gpt2_audit.items():
        assert audit.registers > 0 and audit.threads == shapes[name].threads


# ---- every detector can fail: a tiny kernel that breaks each promise ------------------

TINY = r"""
#include <cuda_bf16.h>
#include <cstdint>
extern "C" __global__ void __launch_bounds__(128) spills(float* out, const int* index) {
  float a[256];                             // written and read at run-time indices:
  for (int i = 0; i < 256; ++i) a[i] = out[i * 128 + threadIdx.x];  // local memory
  a[index[threadIdx.x] & 255] += 1.0f;
  out[threadIdx.x] = a[index[threadIdx.x + 128] & 255];
}
extern "C" __global__ void __launch_bounds__(128) generic_shared(float* out, const float* in) {
  __shared__ float tile[128];
  tile[threadIdx.x] = in[threadIdx.x];
  __syncthreads();
  // either space, chosen at run time: the compiler can only emit a generic load
  const float* p = (in[0] > 0.0f) ? tile : in;
  out[threadIdx.x] = p[(threadIdx.x * 7) & 127];
}
extern "C" __global__ void __launch_bounds__(256) atomics(float* out, const float* in) {
  atomicAdd(out, in[threadIdx.x]);
}
__device__ unsigned int tickets[3];
extern "C" __global__ void __launch_bounds__(256) ticket(float* out, const float* in) {
  if (threadIdx.x == 0 && atomicInc(&tickets[0], gridDim.x - 1) == gridDim.x - 1) out[0] = in[0];
}
extern "C" __global__ void __launch_bounds__(256) tickets2(float* out, const float* in) {
  if (threadIdx.x == 0 && atomicInc(&tickets[1 + blockIdx.x % 2], gridDim.x / 2 - 1) ==
                              gridDim.x / 2 - 1 &&
      atomicInc(&tickets[0], 1) == 1)
    out[0] = in[0];
}
extern "C" __global__ void __launch_bounds__(128) tiled(float* out, const __nv_bfloat16* in,
                                                       int tiles) {
  __shared__ __align__(16) __nv_bfloat16 tile[2][16 * 16];
  float c0 = 0.f, c1 = 0.f, c2 = 0.f, c3 = 0.f;
  const float4* wide = reinterpret_cast<const float4*>(in);
#pragma unroll 1
  for (int t = 0; t < tiles; ++t) {
    uint32_t slot = static_cast<uint32_t>(
        __cvta_generic_to_shared(&tile[t & 1][(threadIdx.x & 31) * 8]));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(slot),
                 "l"(wide + t * 32 + (threadIdx.x & 31)));
    asm volatile("cp.async.wait_all;\n" ::);
    __syncthreads();
    uint32_t a0, a1, a2, a3;
    uint32_t row = static_cast<uint32_t>(
        __cvta_generic_to_shared(&tile[t & 1][(threadIdx.x & 15) * 16]));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(a0), "=r"(a1), "=r"(a2), "=r"(a3) : "r"(row));
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c0), "+f"(c1), "+f"(c2), "+f"(c3)
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(a0), "r"(a1));
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c0), "+f"(c1), "+f"(c2), "+f"(c3)
                 : "r"(a2), "r"(a3), "r"(a0), "r"(a1), "r"(a2), "r"(a3));
    __syncthreads();
  }
  reinterpret_cast<float4*>(out)[threadIdx.x] = make_float4(c0, c1, c2, c3);
}
"""

TINY_SHAPES = {"spills": LaunchShape(128, 0), "generic_shared": LaunchShape(128, 0),
               "atomics": LaunchShape(256, 0), "ticket": LaunchShape(256, 0),
               "tickets2": LaunchShape(256, 0),
               "tiled": LaunchShape(128, 0)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cubin = sass_audit.build_cubin(TINY, tmp_path_factory.mktemp("tiny"))
    return sass_audit.audit_code(sass_audit.parse_sass(sass_audit.disassemble(cubin)),
                                 sass_audit.resources(cubin), TINY_SHAPES)


def test_detectors_flag_local_memory(tiny):
    assert tiny["spills"].counts["local"] > 0
    assert not no_local_memory(tiny["spills"]) and no_local_memory(tiny["atomics"])


def test_detectors_flag_generic_loads_of_shared_memory(tiny):
    assert tiny["generic_shared"].counts["generic"] >= 1
    assert not no_generic_accesses(tiny["generic_shared"])
    assert no_generic_accesses(tiny["tiled"])


def test_detectors_flag_atomics(tiny):
    assert not no_atomics(tiny["atomics"]) and no_atomics(tiny["spills"])
    # a ticket is an atomic, and an atomic add is no ticket; two levels are two tickets
    assert not no_atomics(tiny["tickets2"]) and two_tickets(tiny["tickets2"])
    assert not two_tickets(tiny["ticket"])
    assert not two_tickets(tiny["atomics"]) and not two_tickets(tiny["spills"])


def test_detectors_see_ldmatrix_mma_in_a_loop_cp_async_and_wide_accesses(tiny):
    """What the attention kernels' promises look for is seen in a kernel that has it, and
    not in one that has not."""
    tiled = tiny["tiled"]
    assert ldmatrix(tiled) and cp_async(tiled) and wide_global_accesses(tiled)
    assert [t["tensor"] for t in tiled.tile_loops] == [2]
    assert [t["ldsm"] for t in tiled.tile_loops] == [1]
    # ldmatrix .x4 moves four 8 x 8 matrices, cp.async 16 bytes a thread: 4 wavefronts each
    assert [t["wavefronts:ldsm"] for t in tiled.tile_loops] == [4]
    assert [t["wavefronts:ldgsts"] for t in tiled.tile_loops] == [4]
    assert tensor_per_tile(2)(tiled) and not tensor_per_tile(4)(tiled)
    assert not ldmatrix(tiny["spills"]) and not cp_async(tiny["spills"])
    assert not wide_global_accesses(tiny["atomics"])


def test_resources_come_from_the_cubin(tiny):
    assert tiny["tiled"].static_shared == 2 * 2 * 16 * 16
    assert tiny["atomics"].threads == 256


# ---- every detector can fail: the real file, with templates broken on purpose --------

MUTATIONS = {
    # the embedding copies a float at a time: no 128-bit access left
    "embedding.cu.j2": ("*reinterpret_cast<float4*>(to + c) = load4(from + c);",
                        "for (int e = 0; e < 4; ++e) to[c + e] = from[c + e];"),
    # the classifier adds its row's loss atomically
    "classifier.cu.j2": ("    loss[row] = counted ? ",
                         "    atomicAdd(&loss[row], 0.0f);\n    loss[row] = counted ? "),
    # the attention delta keeps an array indexed at run time: local memory (the step's GELU,
    # then its cast-down, which this mutated before, are now a product's epilogue and the
    # layer-norm backward's second output)
    "attention_delta.cu.j2": ("  const size_t base = static_cast<size_t>(row) * kWidth;",
                              "  const size_t base = static_cast<size_t>(row) * kWidth;\n"
                              "  float scratch[256];\n"
                              "  for (int i = 0; i < 256; ++i) scratch[i] = to_float(output[i]);\n"
                              "  scratch[(threadIdx.x * 13) & 255] += 1.0f;\n"
                              "  if (scratch[(row * 7) & 255] == 12345.0f) delta[0] = 1.0f;"),
    # the layer-norm backward adds its partial sums atomically as well as taking its tickets
    "layer_norm_backward_add.cu.j2": ("                                           residual, rows, {{ name }}_tickets);",
                                      "                                           residual, rows, {{ name }}_tickets);\n"
                                      "  atomicAdd(gradientGamma, 1.0f);"),
}


def test_mutated_templates_break_their_promises(tmp_path, monkeypatch):
    """The promises of the table fail on the real file when a template breaks them: one
    more nvcc build, of GPT-2 small's file with four kernels broken as MUTATIONS says."""
    templates = tmp_path / "templates"
    shutil.copytree(data_dir("templates"), templates)
    for name, (old, new) in MUTATIONS.items():
        path = templates / "kernels" / name
        text = path.read_text(encoding="utf-8")
        assert old in text, f"{name} no longer has the line this test mutates"
        path.write_text(text.replace(old, new), encoding="utf-8")
    monkeypatch.setenv("CGC_TEMPLATES", str(templates))
    source, shapes = sass_audit.emitted_file(str(SCHEDULES / "train.cg"), "gpt2")
    cubin = sass_audit.build_cubin(source, tmp_path / "sass")
    audit = sass_audit.audit_code(sass_audit.parse_sass(sass_audit.disassemble(cubin)),
                                  sass_audit.resources(cubin), shapes)
    assert not wide_global_accesses(audit["cgImageEmbedding"])
    assert not no_atomics(audit["cgImageClassifier"])
    assert not two_tickets(audit["cgImageLayerNormBackwardAdd"])
    assert not no_local_memory(audit["cgImageAttentionDelta"])
    # the kernels left alone keep theirs
    assert wide_global_accesses(audit["cgImageLayerNorm"]) and no_atomics(audit["cgImageRotary"])
    assert two_tickets(audit["cgImageLayerNormBackward"])
    assert no_local_memory(audit["cgImageAdamW"])


# The attention kernels' designs undone, in two builds. "exponential": e^(scale x - m) by
# __expf of the scaled difference again (an FMUL a logit and __expf's own guard), forward and
# backward. "mask and fragments": every key tile masked as the diagonal is (forward; the
# backward's dQ pass: its chunk loop off the diagonal), a K fragment loaded again where one
# load fed several products (the forward's S = Q K^T: one load a product instead of one for
# two; the backward's dQ = dS K: one load a row tile instead of one for the warp's two; from
# another address, or ptxas would drop the load as the same as the last), and the backward's
# v fragments loaded again in each dK/dV chunk. Numbers wrong on purpose (only the machine
# code is read).
_K_FRAGMENT = ("          mma(s[m][2 * n], query[m][d], left);\n"
               "          mma(s[m][2 * n + 1], query[m][d], right);")
_DQ_FRAGMENT = ("              mma(dq[m][2 * n], ds[m], left);\n"
                "              mma(dq[m][2 * n + 1], ds[m], right);")
_V_HELD = "          mma(gradients[m][0], held_v[m][d], left);"
_V_RELOADED = ("          load_a(held_v[m][d], held + (T + top + 16 * m) * kStride + d * 16, kStride);\n"
               + _V_HELD)
# the backward's lse and delta read from global memory a logit, as before they were staged
_ROWS_STAGED = "          const float2 pair = tile_rows[c * 16 + n * 8 + 2 * t + e];"
_ROWS_RELOADED = (
    "          const size_t at = (base + query_tile * T + c * 16 + n * 8 + 2 * t + e) * kHeads + head;\n"
    "          const float2 pair = make_float2(lse[at], delta[at]);")
ATTENTION_MUTATIONS = {
    "exponential and reloads": {
        "attention.cu.j2": (
            ("            x = cg_exp2_approx(fmaf(x, scale_log2, -shift));",
             "            x = __expf((x - new_max) * scale);"),),
        "attention_backward.cu.j2": (
            ("            p = cg_exp2_approx(fmaf(p, scale_log2, -lse_log2));",
             "            p = __expf(p * scale - lse_log2 * 0.69314718f);"),
            (_ROWS_STAGED, _ROWS_RELOADED))},
    "mask and fragments": {
        "attention.cu.j2": (
            ("key_step(key_tile, cg_false{});", "key_step(key_tile, cg_true{});"),
            (_K_FRAGMENT, _K_FRAGMENT.replace(
                "\n", "\n          load_b_transposed(left, right, k + n * 16 * kStride + d * 16 + "
                      "8 * m + 8, kStride);\n"))),
        "attention_backward.cu.j2": (
            ("      for (int key_tile = 0; key_tile < tile; ++key_tile) key_step(key_tile, cg_false{});",
             "      for (int key_tile = 0; key_tile < tile; ++key_tile) key_step(key_tile, cg_true{});"),
            (_DQ_FRAGMENT, _DQ_FRAGMENT.replace(
                "left);\n", "left);\n              load_b(left, right, k + c * 16 * kStride + n * 16 + "
                            "8 * m + 8, kStride);\n")),
            # v's fragments loaded again in each dK/dV chunk, as before v was held
            (_V_HELD, _V_RELOADED)),
    },
}


def _mutated_audits(tmp_path, monkeypatch, label: str, mutations: dict) -> dict:
    """GPT-2 small's file audited with `mutations` ({template: ((old, new), ...)}) applied to a
    copy of the shipped templates."""
    shipped = data_dir("templates")
    templates = tmp_path / label
    shutil.copytree(shipped, templates)
    for name, pairs in mutations.items():
        path = templates / "kernels" / name
        text = path.read_text(encoding="utf-8")
        for old, new in pairs:
            assert old in text, f"{name} no longer has the line this test mutates"
            text = text.replace(old, new)
        path.write_text(text, encoding="utf-8")
    monkeypatch.setenv("CGC_TEMPLATES", str(templates))
    source, shapes = sass_audit.emitted_file(str(SCHEDULES / "train.cg"), "gpt2")
    cubin = sass_audit.build_cubin(source, tmp_path / f"{label} sass")
    monkeypatch.delenv("CGC_TEMPLATES")
    return sass_audit.audit_code(sass_audit.parse_sass(sass_audit.disassemble(cubin)),
                                 sass_audit.resources(cubin), shapes)


def test_mutated_attention_breaks_its_promises(tmp_path, monkeypatch):
    """Each of the attention kernels' promises fails on the mutation that undoes its choice
    and holds on the other build: __expf breaks the exponential promises (and, its guard a
    compare, the mask's too); the backward's lse and delta read from global memory in the
    dK/dV pass's chunks break main_loops_read_no_global_memory; masking every tile breaks
    mask_on_the_diagonal_only (mask_on_the_diagonal_chunks_only in the backward) with the
    exponentials intact; a fragment load a product (and, in the backward's dK/dV blocks, v's
    fragments loaded again each chunk) breaks hmma_per_ldmatrix. Two nvcc builds of GPT-2
    small's file."""
    exponential = _mutated_audits(tmp_path, monkeypatch, "exponential",
                                  ATTENTION_MUTATIONS["exponential and reloads"])
    forward, backward = exponential["cgImageAttention"], exponential["cgImageAttentionBackward"]
    assert not exp2_per_logit(64, 4, 64)(forward)
    assert not backward_exp2_per_logit(16, 8)(backward)
    assert not main_loops_read_no_global_memory(backward)
    assert main_loops_read_no_global_memory(forward)
    assert hmma_per_ldmatrix(Fraction(4))(forward) and BACKWARD_LOADS(backward)
    masked = _mutated_audits(tmp_path, monkeypatch, "masked",
                             ATTENTION_MUTATIONS["mask and fragments"])
    forward, backward = masked["cgImageAttention"], masked["cgImageAttentionBackward"]
    assert exp2_per_logit(64, 4, 64)(forward) and backward_exp2_per_logit(16, 8)(backward)
    assert not mask_on_the_diagonal_only(forward) and not BACKWARD_MASK(backward)
    assert not hmma_per_ldmatrix(Fraction(4))(forward) and not BACKWARD_LOADS(backward)
    # each of the backward's four chunk loops breaks it: a K fragment load a product in the
    # dQ blocks' two, v's fragments loaded again in the dK/dV blocks' two
    assert all(loop["tensor"] < 4 * loop["ldsm"] for loop in backward.tile_loops)
    assert tensor_per_tile(128)(forward) and tensor_per_tile(48, 48, 64, 64)(backward)
    assert main_loops_read_no_global_memory(forward)
    assert main_loops_read_no_global_memory(backward)


# Each undoes one of the classifier's choices: e^(x - max) by __expf (an FMUL and a guard
# around each EX2), and the sum's merge by thread 0 alone, warp after warp (kept a loop, then
# as written plainly, which nvcc unrolls).
_SERIAL_SUM = (
    "  sum = warp_sum(sum);\n"
    "  if (threadIdx.x % 32 == 0) shared_sum[threadIdx.x / 32] = sum;\n"
    "  __syncthreads();\n"
    "  if (threadIdx.x == 0) {{\n"
    "{pragma}"
    "    for (int w = 1; w < {{{{ threads }}}} / 32; ++w) sum += shared_sum[w];\n"
    "    shared_sum[0] = sum;\n"
    "  }}\n"
    "  __syncthreads();\n"
    "  const float row_sum = shared_sum[0];")
_ROW_SUM = "  const float row_sum = block_reduce<{{ threads }}>(sum, 0.0f, shared_sum, cg_plus());"
CLASSIFIER_MUTATIONS = (
    ("      sum += cg_exp2_approx(fmaf(classifier_value(values, j), kLog2e, -shift));",
     "      sum += __expf(classifier_value(values, j) - row_top);"),
    (_ROW_SUM, _SERIAL_SUM.format(pragma="#pragma unroll 1\n")),
    (_ROW_SUM, _SERIAL_SUM.format(pragma="")),
)


def test_mutated_classifier_breaks_its_promises(tmp_path, monkeypatch):
    """The classifier's promises fail when its template undoes them, one mutation at a time
    (each its own nvcc build of GPT-2 small's file): __expf breaks classifier_passes, a merge
    in thread 0 (a loop, or unrolled) breaks warp_parallel_merge, and neither breaks the
    other's promise."""
    broken, shipped = [], data_dir("templates")  # before CGC_TEMPLATES points elsewhere
    for index, (old, new) in enumerate(CLASSIFIER_MUTATIONS):
        templates = tmp_path / f"templates{index}"
        shutil.copytree(shipped, templates)
        path = templates / "kernels" / "classifier.cu.j2"
        text = path.read_text(encoding="utf-8")
        assert old in text, "classifier.cu.j2 no longer has the line this test mutates"
        path.write_text(text.replace(old, new), encoding="utf-8")
        monkeypatch.setenv("CGC_TEMPLATES", str(templates))
        source, shapes = sass_audit.emitted_file(str(SCHEDULES / "train.cg"), "gpt2")
        cubin = sass_audit.build_cubin(source, tmp_path / f"sass{index}")
        mutated = sass_audit.audit_code(sass_audit.parse_sass(sass_audit.disassemble(cubin)),
                                        sass_audit.resources(cubin), shapes)
        audit = mutated["cgImageClassifier"]
        broken.append((classifier_passes(8)(audit), warp_parallel_merge(audit)))
    assert broken == [(False, True), (True, False), (True, False)]


# A local array at the tiny shapes only (kWidth 64: tiny and tiny32), in the zeroing kernel,
# which only library.cg launches: the step's files and GPT-2 small's stay clean.
TINY_ONLY_SPILL = ("  if (first + 4 <= count) {",
                   "  if constexpr (kWidth == 64) {\n"
                   "    float scratch[64];\n"
                   "    for (int i = 0; i < 64; ++i) scratch[i] = output[i];\n"
                   "    scratch[threadIdx.x & 63] += 1.0f;\n"
                   "    if (scratch[(threadIdx.x * 7) & 63] == 12345.0f) output[0] = 1.0f;\n"
                   "  }\n"
                   "  if (first + 4 <= count) {")


def test_a_spill_in_any_shipped_file_fails_the_audit(shipped, sass_folder, tmp_path,
                                                      monkeypatch):
    """The audit reaches past GPT-2 small's step file: local memory in a kernel of another
    schedule, at another configuration's shape, breaks no_local_memory in exactly the files
    that have it (at tiny and tiny32), and the test of the promise names them.
    The files the mutation leaves alone are the session's builds again."""
    templates = tmp_path / "templates"
    shutil.copytree(data_dir("templates"), templates)
    path = templates / "kernels" / "zero.cu.j2"
    old, new = TINY_ONLY_SPILL
    assert old in path.read_text(encoding="utf-8"), "zero.cu.j2 no longer has the mutated line"
    path.write_text(path.read_text(encoding="utf-8").replace(old, new), encoding="utf-8")
    monkeypatch.setenv("CGC_TEMPLATES", str(templates))
    mutated = sass_audit.audit_shipped(sass_folder)
    spilling = {(key, k) for key, audits in mutated.files.items()
                for k, a in audits.items() if not no_local_memory(a)}
    # the GPT step's library (cgZeroGradients) and every Llama step that zeroes the
    # embedding's gradient before its scatter
    assert spilling == {((name, config), "cgImageZero") for config in ("tiny", "tiny32")
                        for name in ("library.cg", "llama/train.cg", "llama/train_parallel.cg",
                                     "llama/train_recompute.cg")}
    with pytest.raises(AssertionError, match=r"no_local_memory broken in library\.cg tiny: "):
        test_kernel_keeps_its_promise(mutated, "*", no_local_memory)
    test_kernel_keeps_its_promise(shipped, "*", no_local_memory)


def test_ldmatrix_conflicts_follow_the_row_stride_of_the_emitted_file():
    """Rows of 64 bfloat16 (128 bytes) put the 8 rows an ldmatrix reads in one bank group: 8
    ways; padded by 8 (144 bytes) they fall in 8 groups: conflict-free. Read from the file,
    so a template that drops the padding fails the attention kernels' promise (the SASS
    alone cannot show a bank conflict)."""
    assert sass_audit.ldmatrix_conflict_ways(128) == 8
    assert sass_audit.ldmatrix_conflict_ways(144) == 1
    assert sass_audit.ldmatrix_conflict_ways(160) == 2
    source, _ = sass_audit.emitted_file(str(SCHEDULES / "train.cg"), "gpt2")
    assert sass_audit.attention_ldmatrix_ways(source) == 1
    unpadded = source.replace("constexpr int kAttentionRowPadding = 8;",
                              "constexpr int kAttentionRowPadding = 0;")
    assert unpadded != source and sass_audit.attention_ldmatrix_ways(unpadded) == 8


# ---- doctored listings: the parser's corners -----------------------------------------

LISTING = """
//--------------------- .text.doctored --------------------------
\t.section\t.text.doctored,"ax",@progbits
doctored:
.text.doctored:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   LDL.64 R2, [R1] ;
        /*0020*/                   STL [R1+0x4], R2 ;
.L_x_0:
        /*0030*/                   LD.E R4, desc[UR4][R2.64] ;
        /*0040*/                   LDSM.16.M88.4 R8, [R3] ;
        /*0050*/                   HMMA.16816.F32.BF16 R12, R8, R4, R12 ;
        /*0060*/                   HMMA.16816.F32.BF16 R12, R8, R6, R12 ;
        /*0070*/               @P0 BRA.DIV UR5, `(.L_x_9) ;
.L_x_1:
        /*0080*/                   LDS.U16 R5, [R3+0x2] ;
        /*0090*/              @!P1 BRA `(.L_x_0) ;
        /*00a0*/                   LDG.E.128.CONSTANT R16, desc[UR4][R2.64] ;
        /*00b0*/                   STG.E.128 desc[UR4][R2.64], R16 ;
        /*00c0*/                   ATOMG.E.ADD.F32.FTZ.RN.STRONG.GPU PT, RZ, desc[UR4][R2.64], R5 ;
        /*00d0*/                   HMMA.16816.F32.BF16 R12, R8, R4, R12 ;
        /*00e0*/                   EXIT ;
.L_x_9:
        /*00f0*/                   SHFL.BFLY PT, R7, R6, 0x1, 0x1f ;
        /*0100*/                   BRA `(.L_x_1) ;
"""


def test_doctored_listing_counts_each_kind():
    code = sass_audit.parse_sass(LISTING)["doctored"]
    counts = code.counts()
    assert counts == Counter({"local": 2, "generic": 1, "ldsm": 1, "tensor": 3, "lds": 1,
                              "global": 2, "wide": 2, "atomic": 1, "instructions": 17,
                              "wavefronts:generic": 1, "wavefronts:ldsm": 4,
                              "wavefronts:lds": 1, "wavefronts:global": 8})


def test_an_instruction_predicated_never_counts_for_nothing():
    """`@!PT LDS RZ, [RZ]` pads the code after cp.async: it never runs, so it is no
    shared-memory load (counting it charged the attention kernels wavefronts they never
    issue); under a real predicate the same load counts."""
    padded = LISTING.replace("        /*00e0*/                   EXIT ;",
                             "        /*00d8*/              @!PT LDS RZ, [RZ] ;\n"
                             "        /*00dc*/             @!UPT LDS RZ, [RZ] ;\n"
                             "        /*00e0*/                   EXIT ;")
    assert sass_audit.parse_sass(padded)["doctored"].counts() == \
        sass_audit.parse_sass(LISTING)["doctored"].counts()
    real = LISTING.replace("        /*00e0*/                   EXIT ;",
                           "        /*00d8*/               @P2 LDS RZ, [RZ] ;\n"
                           "        /*00e0*/                   EXIT ;")
    assert sass_audit.parse_sass(real)["doctored"].counts()["lds"] == 2


def test_doctored_listing_loops_ignore_the_jump_back_from_an_out_of_line_path():
    """The loop .L_x_0..0x90 holds two HMMA; the branch from the divergent path at 0x100
    back to 0x80 crosses it and spans the EXIT: no loop. The HMMA at 0xd0 is outside."""
    code = sass_audit.parse_sass(LISTING)["doctored"]
    assert [(l.start, l.end) for l in code.loops] == [(0x30, 0x90)]
    assert [t["tensor"] for _, t in code.tile_loops()] == [2]
    assert code.tensor_outside_loops() == 1


# The attention backward's shape of loops, grouped queries: a loop over a block's query heads
# (0x10..0xe0) holds a peeled diagonal step's chunk loop (0x30..0x50) and a loop over tiles
# (0x70..0xd0) that holds the chunk loop of the pairs off the diagonal (0x90..0xb0).
NESTED = """
//--------------------- .text.nested --------------------------
\t.section\t.text.nested,"ax",@progbits
nested:
.text.nested:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   LDGSTS.E.BYPASS.128 [R2], desc[UR4][R4.64] ;
        /*0020*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
.L_x_1:
        /*0030*/                   LDSM.16.M88.4 R8, [R3] ;
        /*0040*/                   HMMA.16816.F32.BF16 R12, R8, R4, R12 ;
        /*0050*/              @P0 BRA `(.L_x_1) ;
        /*0060*/                   IADD3 R6, R6, 0x1, RZ ;
.L_x_2:
        /*0070*/                   LDGSTS.E.BYPASS.128 [R2], desc[UR4][R4.64] ;
        /*0080*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
.L_x_3:
        /*0090*/                   LDSM.16.M88.4 R8, [R3] ;
        /*00a0*/                   HMMA.16816.F32.BF16 R12, R8, R4, R12 ;
        /*00b0*/              @P1 BRA `(.L_x_3) ;
        /*00c0*/                   IADD3 R7, R7, 0x1, RZ ;
        /*00d0*/              @P2 BRA `(.L_x_2) ;
        /*00e0*/              @P3 BRA `(.L_x_0) ;
        /*00f0*/                   EXIT ;
.L_x_9:
        /*0100*/                   BRA `(.L_x_9) ;
"""


def test_each_loop_around_main_loops_has_its_own_body():
    """around_tiles gives every loop that holds main loops (the innermost loops issuing
    HMMA) one trip of its own code, in address order: the loop over heads its copy, barrier,
    the IADD3 between the steps and its own branch (4 instructions), nothing of the loop
    over tiles it holds; the loop over tiles its copy, barrier, IADD3 and branch (4). The model
    multiplies each by its own trips (cost_model._backward_around). Before, only the
    outermost such loop was one, its body counted with the inner loop's code once."""
    code = sass_audit.parse_sass(NESTED)["nested"]
    assert [t["tensor"] for _, t in code.tile_loops()] == [1, 1]
    heads, tiles = code.around_tiles()
    assert (heads["instructions"], heads["ldgsts"], heads["barrier"]) == (4, 1, 1)
    assert (tiles["instructions"], tiles["ldgsts"], tiles["barrier"]) == (4, 1, 1)
    assert heads["tensor"] == tiles["tensor"] == 0
    assert code.tensor_outside_loops() == 0


def test_doctored_audit_fails_each_promise():
    code = sass_audit.parse_sass(LISTING)
    usage = {"doctored": sass_audit.Resources(registers=40, static_shared=0, stack=8, local=0)}
    audit = sass_audit.audit_code(code, usage, {"doctored": LaunchShape(128, 200 * 1024)})
    doctored = audit["doctored"]
    assert doctored.occupancy.blocks == 1
    for promise in (no_local_memory, no_generic_accesses, no_atomics, at_least(2),
                    tensor_per_tile(64)):
        assert not promise(doctored), promise.__name__
    # one HMMA outside the loop is not a whole tile of 2: a stray product is caught too
    assert not tensor_per_tile(2)(doctored)


# ---- occupancy: hand-worked cases (CUDA's occupancy rules for 9.x, H200) -----------

@pytest.mark.parametrize("threads, registers, shared, expected", [
    # 32 registers: 1024 a warp, 16 warps a scheduler, 64 warps: 8 blocks of 256, as threads
    (256, 32, 0, Occupancy(8, "threads", 64)),
    # 39 registers -> 1248, rounded to 1280 a warp; 16384 // 1280 = 12 warps a scheduler,
    # 48 warps an SM, 6 blocks of 8 warps
    (256, 39, 0, Occupancy(6, "registers", 48)),
    # 151 registers -> 4832 -> 4864 a warp; 3 warps a scheduler, 12 an SM: 3 blocks of 4
    (128, 151, 24576, Occupancy(3, "registers", 12)),
    # 66048 bytes + 1 KB reserve = 67072 (a multiple of 128); 233472 // 67072 = 3
    (128, 32, 66048, Occupancy(3, "shared memory", 12)),
    # 98816 + 1024 = 99840; 233472 // 99840 = 2
    (128, 52, 98816, Occupancy(2, "shared memory", 8)),
    # 1 thread a block: 32 blocks an SM at most
    (1, 8, 0, Occupancy(32, "blocks", 32)),
    # 227 KB is the most a block may have; one byte more and it does not launch
    (128, 32, 227 * 1024, Occupancy(1, "shared memory", 4)),
    (128, 32, 227 * 1024 + 1, Occupancy(0, "shared memory", 0)),
    # 256 registers a thread is over the limit of 255
    (32, 256, 0, Occupancy(0, "registers", 0)),
    # 1024 threads of 64 registers: 2048 a warp, 8 warps a scheduler, 32 an SM: 1 block
    # (threads alone would allow 2)
    (1024, 64, 0, Occupancy(1, "registers", 32)),
    # 1024 threads of 72 registers: 32 warps x 2304 = 73728 > 65536: does not launch
    (1024, 72, 0, Occupancy(0, "registers", 0)),
])
def test_occupancy_hand_worked(threads, registers, shared, expected):
    assert occupancy(threads, registers, shared, H200) == expected


def test_versions_are_checked(monkeypatch):
    """An nvdisasm older than nvcc is refused with a message naming the fix."""
    releases = {"nvcc": (13, 5), "nvdisasm": (13, 4), "cuobjdump": (13, 5)}
    monkeypatch.setattr(sass_audit, "release", lambda program: releases[program.name])
    with pytest.raises(sass_audit.ToolchainMissing, match="nvdisasm 13.4 is older than nvcc"):
        sass_audit.check_versions()
