"""Full-size index arithmetic: every kernel image of the step at GPT-2 small's shape (config
gpt2: vocabulary 50304, width 768, 12 heads, 8 sequences of 1024 rows; one layer, to bound
memory: `cgc check --memory --config gpt2 --set cgLayers=1` plans 4.9 GiB, which the emulated
run and the numpy machine each hold), and of the Llama-style step at a Llama-like shape
(TinyLlama's width 2048, vocabulary 32000 and MLP 5632, with 16 query heads of 128 sharing 4
key/value heads, 4 sequences of 2048 rows, one layer: 4.5 GiB), on real-size buffers, where 32-bit overflow and grid
edges show up. Running every block is too slow on a CPU, so each kernel runs a sample of its
blocks (block sampling, EmulatedRun.set_blocks): the first, the last and three random ones.

For each non-library image, its first launch of the step:
- its inputs get fresh random data (seeded; ids and targets inside the vocabulary; values in
  ranges where exp cannot overflow), the same in the emulated memory and the numpy machine's;
  a kernel whose blocks each own a part of the launch (a row, 128 rows, a sequence, 2048
  elements: PARTITIONS) gets data only in the parts its sampled blocks own;
- its write-only outputs are poisoned (all bits set: NaN, or -1) in the emulated memory;
- the sampled blocks run in the emulator; the image's numpy reference runs on the sampled
  blocks' parts (a sub-launch of one part, with the grid cut to it; for attention, one
  sequence and the heads a sampled block serves), or on the whole launch for the small
  images that are not partitioned;
- every element the sampled blocks wrote (not poison) must be one the blocks own (OWNED) and
  every element they own must be written: a write anywhere else (an index that overflowed
  into another row) or a part left unwritten fails; the owned elements equal the reference's
  (TOLERANCE by storage type). Outputs the kernel reads too (accumulate, readwrite, in place)
  are compared on the owned elements, and must be unchanged everywhere else.
The cuBLAS products are the emulator's own CPU code (and compared in tests/test_emulated.py).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field

import numpy as np
import pytest

from cgc.backends.cuda.emulated import compiler_missing
from cgc.backends.numerics import decode, encode, storage_dtype
from cgc.backends.numpy.machine import Kernel, Pointer
from cgc.backends.numpy.reference import norm_group
from cgc.checking.memory import storage_home
from cgc.core.elements import concrete, element_bytes
from cgc.pipeline import analyse, open_run

from conftest import HOPPER, SCHEDULES

# (schedule, config, overrides) of each step checked
CASES = {"gpt2": (str(SCHEDULES / "train.cg"), "gpt2", {"cgLayers": 1}),
         "llama": (str(SCHEDULES / "llama" / "train.cg"), "tinyllama",
                   {"cgLayers": 1, "cgHeads": 16, "cgKvHeads": 4}),
         # the attention forward on wgmma, TMA and mbarrier (its tensor map over 8192 rows)
         "gpt2-hopper": (str(SCHEDULES / "train.cg"), "gpt2", {"cgLayers": 1, **HOPPER})}
# The images a case checks, where not all (the others are the same kernels as another case's)
ONLY = {"gpt2-hopper": ("cgImageAttention",)}
RANDOM_BLOCKS = 3
# A layer-norm backward's group of tickets larger than a launch's sample: never complete.
NORM_GROUP_AT_LEAST = 2 + RANDOM_BLOCKS + 1
# Element-wise, relative to the largest magnitude compared (np.isclose's rtol and atol): a
# bfloat16 output carries 8 bits (2^-8 = 0.4% a step; a value computed in another order can
# land on the next one); float32 outputs computed in another order (warp butterflies, partial
# sums) from the same inputs differ in the last bits.
TOLERANCE = {"low": 2e-2, "float32": 2e-4}

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(compiler_missing() is not None,
                                 reason="needs the host C++ compiler (g++)")]


@dataclass
class Partition:
    """How a launch splits into parts that blocks own: the part is the block's index along
    grid `axis`; `per_part` gives each partitioned pointer's elements per part (the others
    are read whole); `count`: an element-wise kernel's elements per block (its `count` scalar
    is re-based to the part)."""

    axis: int
    per_part: dict = field(default_factory=dict)
    count: int | None = None
    rebased: tuple = ("count",)  # scalars that count elements from the launch's start
    fixed: dict = field(default_factory=dict)  # scalars a one-part sub-launch takes instead
    part_of: object = None  # block (x, y, z), grid -> its part, where not block[axis]
    # attention: block (x, y, z), grid -> the query heads and the key/value head it serves
    # (the reference then runs on those heads of the part's sequence alone)
    heads_of: object = None
    tiles_axis: int = 0  # attention: the grid axis of the tiles (a heads sub-launch keeps it)

    def part(self, block, grid) -> int:
        return self.part_of(block, grid) if self.part_of else block[self.axis]


def attention_sequence(block, grid) -> int:
    """The sequence a forward attention block serves: blocks run longest first over the
    grid's linear index (templates/kernels/attention.cu.j2), so not its z."""
    x, y, z = block
    X, Y, Z = grid
    return (x + X * (y + Y * z)) % (Y * Z) // Y


def attention_head(block, grid) -> int:
    """The query head a forward attention block serves (longest first, as
    attention_sequence)."""
    x, y, z = block
    X, Y, Z = grid
    return (x + X * (y + Y * z)) % (Y * Z) % Y


def query_group(c) -> int:
    """Query heads a key/value head serves."""
    return c["heads"] // c.get("kvHeads", c["heads"])


def forward_heads(c):
    """A forward attention block's query head and the key/value head it reads."""
    group = query_group(c)
    def heads(block, grid):
        head = attention_head(block, grid)
        return (head,), head // group
    return heads


def backward_heads(c):
    """A backward attention block's key/value head (its x) and the query heads it serves."""
    group = query_group(c)
    return lambda block, grid: (tuple(range(block[0] * group, (block[0] + 1) * group)), block[0])


def backward_place(block, grid) -> tuple:
    """A backward attention block's pass and tile: z orders the work longest first
    (templates/kernels/attention_backward.cu.j2): z = 2i is dK and dV of key tile i, z = 2i + 1
    dQ of query tile Z / 2 - 1 - i."""
    z, tiles = block[2], grid[2] // 2
    keys = z % 2 == 0
    return keys, (z // 2 if keys else tiles - 1 - z // 2)


def qkv_width(c) -> int:
    """A row of qkv: q's heads, then k's and v's key/value heads."""
    return (c["heads"] + 2 * c.get("kvHeads", c["heads"])) * (c["width"] // c["heads"])


def partitions(c, grid) -> dict:
    W, V, H, T = c["width"], c["vocab"], c["heads"], c["context"]
    Q = qkv_width(c)
    norm_rows = c["rows"] // grid[0]  # the layer-norm backward's rows a block (when it divides)
    rows_n = norm_rows * W
    norm_backward = {"gradientInput": rows_n, "gradientOutput": rows_n, "input": rows_n,
                     "gradientLow": rows_n}
    return {
        "cgImageEmbedding": Partition(0, {"output": W, "ids": 1}),
        "cgImageLayerNorm": Partition(0, {"output": W, "statistics": 2, "input": W}),
        "cgImageRmsNorm": Partition(0, {"output": W, "statistics": 1, "input": W}),
        "cgImageAttention": Partition(2, {"output": T * W, "lse": T * H, "qkv": T * Q},
                                      part_of=attention_sequence, heads_of=forward_heads(c)),
        "cgImageAttentionBackward": Partition(1, {"gradientQkv": T * Q, "qkv": T * Q,
                                                  "gradientOutput": T * W, "lse": T * H,
                                                  "delta": T * H}, heads_of=backward_heads(c),
                                              tiles_axis=2),
        "cgImageAttentionDelta": Partition(0, {"delta": H, "output": W, "gradientOutput": W}),
        "cgImageRotary": Partition(1, {"qkv": T * Q}),
        "cgImageGelu": Partition(0, {"output": 2048, "input": 2048}, 2048),
        "cgImageGeluBackward": Partition(0, {"gradientPre": 2048, "gradientAct": 2048,
                                             "pre": 2048}, 2048),
        "cgImageCastDown": Partition(0, {"output": 2048, "input": 2048}, 2048),
        "cgImageZero": Partition(0, {"output": 1024}, 1024),
        "cgImageLoss": Partition(0, {"loss": 1, "correct": 1, "logits": V, "targets": 1}),
        "cgImageClassifier": Partition(0, {"logits": V, "loss": 1, "correct": 1, "targets": 1}),
        "cgImageCrossEntropyBackward": Partition(0, {"logitsGradient": V, "logits": V,
                                                     "loss": 1, "correct": 1, "targets": 1}),
        "cgImageLayerNormBackward": Partition(0, {"gradientInput": rows_n, "gradientOutput":
                                                  rows_n, "input": rows_n,
                                                  "statistics": 2 * norm_rows,
                                                  "partials": 2 * W, "gradientLow": rows_n},
                                         fixed={"rows": norm_rows}),
        "cgImageLayerNormBackwardAdd": Partition(0, {"gradientInput": rows_n, "gradientOutput":
                                                     rows_n, "input": rows_n, "residual": rows_n,
                                                     "statistics": 2 * norm_rows,
                                                     "partials": 2 * W, "gradientLow": rows_n},
                                                 fixed={"rows": norm_rows}),
        "cgImageRmsNormBackward": Partition(0, {**norm_backward, "statistics": norm_rows,
                                                "partials": W}, fixed={"rows": norm_rows}),
        "cgImageRmsNormBackwardAdd": Partition(0, {**norm_backward, "residual": rows_n,
                                                   "statistics": norm_rows, "partials": W},
                                               fixed={"rows": norm_rows}),
        "cgImageAdamW": Partition(0, {"parameter": 1024, "gradient": 1024,
                                      "moment1": 1024, "moment2": 1024, "copy": 1024},
                                  1024, ("count", "matrices")),
    }


def owned(image: str, pointer: str, block, grid, scalars, c) -> list[tuple[int, int]]:
    """The element ranges of `pointer`'s view that block `block` of the launch writes."""
    x, y, z = block
    W, V, H, T = c["width"], c["vocab"], c["heads"], c["context"]
    D, tile, Q = W // H, c["attentionTile"], qkv_width(c)
    KV = c.get("kvHeads", H)
    group = query_group(c)

    def elementwise(per, limit="count"):
        first, last = x * per, min((x + 1) * per, int(scalars[limit]))
        return [(first, last)] if first < last else []

    def rows(first, count, width, columns=None):
        columns = columns or [(0, width)]
        return [(r * width + a, r * width + b) for r in range(first, first + count)
                for a, b in columns]

    if image == "cgImageAttention":  # longest first: the grid's linear index, tiles last
        X, Y, Z = grid
        linear, pairs = x + X * (y + Y * z), Y * Z
        head, sequence = attention_head(block, grid), attention_sequence(block, grid)
        first = (sequence * T + (X - 1 - linear // pairs) * tile, tile)
        return {"output": rows(*first, W, [(head * D, (head + 1) * D)]),
                "lse": rows(*first, H, [(head, head + 1)])}[pointer]
    if image == "cgImageAttentionBackward":  # block x: key/value head x and its query heads
        keys, tile_index = backward_place(block, grid)
        heads = [((H + x) * D, (H + x + 1) * D), ((H + KV + x) * D, (H + KV + x + 1) * D)] \
            if keys else [(x * group * D, (x + 1) * group * D)]  # dk, dv; or the group's dq
        return rows(y * T + tile_index * tile, tile, Q, heads)
    if image == "cgImageRotary":  # q and k of the row, in place
        return rows(y * T + x, 1, Q, [(0, (H + KV) * D)])
    if image in ("cgImageSwiGlu", "cgImageSwiGluBackward"):
        first, last = x * 2048, min((x + 1) * 2048, int(scalars["count"]))
        if image == "cgImageSwiGlu" or first >= last:
            return [(first, last)] if first < last else []
        width, found = int(scalars["width"]), []  # element i: [gate | up] row i / width
        for i in range(first, last):
            if i == first or i % width == 0:
                row, column = divmod(i, width)
                stop = min(last - i, width - column)
                base = row * 2 * width + column
                found += [(base, base + stop), (base + width, base + width + stop)]
        return found
    if image == "cgImageCrossEntropyBackward":
        return [(x * V + y * 128, x * V + min((y + 1) * 128, V))]
    if image in ("cgImageLayerNormBackward", "cgImageLayerNormBackwardAdd",
                 "cgImageRmsNormBackward", "cgImageRmsNormBackwardAdd"):
        # A block's row of partials is its own. Its group's first row and dgamma and dbeta
        # are written again by a group's last block and by the groups' last to finish, which
        # run only when every block of a group has taken its ticket: never under block
        # sampling, which runs fewer blocks (2 + RANDOM_BLOCKS) than a group has
        # (NORM_GROUP_AT_LEAST), or a last group of one block, which writes only its own row.
        size = norm_group(grid[0])
        last = grid[0] - (grid[0] - 1) // size * size
        assert size >= NORM_GROUP_AT_LEAST, grid
        assert last == 1 or last >= NORM_GROUP_AT_LEAST, grid
        rows_a_block = int(scalars["rows"]) // grid[0] * W
        row = W if image.startswith("cgImageRms") else 2 * W  # [dgamma] or [dgamma | dbeta]
        per_block = {"gradientInput": rows_a_block, "gradientLow": rows_a_block, "partials": row,
                     "gradientGamma": 0, "gradientBeta": 0}[pointer]
        return [(x * per_block, (x + 1) * per_block)] if per_block else []
    if image == "cgImageScatter":
        share = -(-V // grid[0])
        first, last = x * share, min((x + 1) * share, V)
        return [(first * W, last * W)] if first < last else []
    per_row = {"cgImageEmbedding": {"output": W},
               "cgImageLayerNorm": {"output": W, "statistics": 2},
               "cgImageRmsNorm": {"output": W, "statistics": 1},
               "cgImageAttentionDelta": {"delta": H}, "cgImageLoss": {"loss": 1, "correct": 1},
               "cgImageClassifier": {"logits": V, "loss": 1, "correct": 1},
               "cgImageScatterOrder": {"order": c["rows"]},
               "cgImageSquareSum": {"partials": 1}, "cgImageStepAdvance": {"step": 1},
               "cgImageGradientNorm": {"norm": 2}}
    if image in per_row:
        n = per_row[image][pointer]
        return [(x * n, (x + 1) * n)]
    if image == "cgImageAdamW" and pointer == "copy":  # the matrices only
        return elementwise(1024, "matrices")
    per_block = {"cgImageGelu": 2048, "cgImageGeluBackward": 2048, "cgImageCastDown": 2048,
                 "cgImageZero": 1024, "cgImageAdamW": 1024}
    return elementwise(per_block[image])


def sorted_scatter_owned(ids, order, coordinates, grid, c) -> list[tuple[int, int]]:
    """The table rows the sampled blocks of cgImageScatterSorted write: the ids whose run
    (in the order's positions) starts at a position the block takes (grid-stride)."""
    W, keys = c["width"], ids[order]
    found = []
    for x, _, _ in coordinates:
        for position in range(x, len(keys), grid[0]):
            if position == 0 or keys[position] != keys[position - 1]:
                found.append((int(keys[position]) * W, (int(keys[position]) + 1) * W))
    return found


# ---- data ------------------------------------------------------------------------------

def values_for(name: str, count: int, rng, c, image: str = "") -> np.ndarray:
    """Fresh inputs for a pointer of `image`, by what it holds."""
    V = c["vocab"]
    if name in ("ids", "targets"):
        return rng.integers(0, V, count).astype(np.int32)
    if name == "step":
        return rng.integers(1, 20, count).astype(np.int32)
    if name == "correct":
        return rng.integers(0, 2, count).astype(np.int32)
    if name == "statistics" and image.startswith("cgImageRms"):  # rstd alone
        return rng.uniform(0.5, 2, count).astype(np.float32)
    if name == "statistics":  # (mean, rstd) pairs
        pairs = np.stack([rng.normal(0, 0.1, count // 2), rng.uniform(0.5, 2, count // 2)], 1)
        return pairs.reshape(-1).astype(np.float32)
    uniform = {"gamma": (0.5, 1.5), "lse": (2, 8), "loss": (5, 12), "moment2": (0, 1e-4),
               "normPartials": (0, 1e-3)}
    if name in uniform:
        return rng.uniform(*uniform[name], count).astype(np.float32)
    scale = {"qkv": 0.5, "logits": 2.0, "delta": 0.1, "beta": 0.1, "moment1": 1e-2,
             "gradient": 1e-2, "parameter": 0.02, "table": 0.02, "partials": 1.0}.get(name, 1.0)
    # drawn in float32 (NumPy's float32 ziggurat): the buffers run to 10^8 elements, and
    # float64 draws cast down took most of the inputs' time
    values = rng.standard_normal(count, dtype=np.float32)
    values *= np.float32(scale)
    return values


class Memory:
    """A bound pointer's view, raw (storage dtype), in one memory (emulated or numpy)."""

    def __init__(self, program, plan, low):
        self.program, self.plan, self.low = program, plan, low

    def raw(self, memory: dict, bound) -> np.ndarray:
        view = bound.view
        home, start = storage_home(self.program, self.plan, view.storage)
        dtype = storage_dtype(view.storage.element, self.low)
        size = np.dtype(dtype).itemsize
        whole = memory[home][start:start + view.storage.count * size].view(dtype)
        return whole[bound.offset:bound.offset + view.count]


def bits(array: np.ndarray) -> np.ndarray:
    return array.view({2: np.uint16, 4: np.uint32}[array.dtype.itemsize])


def _owned_mask(ranges, size: int) -> np.ndarray:
    """The elements the [a, b) ranges cover (they may overlap), as a mask of `size`: linear
    in the buffer, where sorting the ranges' indices (np.unique, np.setdiff1d) was not."""
    mask = np.zeros(size, dtype=bool)
    for a, b in ranges:
        assert 0 <= a <= b <= size, f"owned elements [{a}, {b}) past the buffer's {size}"
        mask[a:b] = True
    return mask


# ---- the test -------------------------------------------------------------------------------

def runs(case: str = "gpt2"):
    path, config, overrides = CASES[case]
    frontend = analyse([path])
    emulated = open_run("emulated", frontend, path, config, overrides, 0)
    reference = open_run("numpy", frontend, path, config, overrides, 0)
    return emulated, reference


@pytest.mark.parametrize("case", CASES)
def test_sampled_blocks_of_every_kernel_at_full_size(case):
    """Runs the check below in a process of its own: it holds two copies of the step's
    buffers (about 5 GB each) and the emulator's worker pool, which other tests' libraries
    in this process would share the machine with."""
    import subprocess
    import sys

    from conftest import ROOT
    script = ("import sys; sys.path.insert(0, 'tests'); import test_full_size as t; "
              f"t.check_sampled_blocks_of_every_kernel_at_full_size(t.runs({case!r}), "
              f"t.ONLY.get({case!r}))")
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]


def sample(total: int, rng) -> list[int]:
    """The first and the last block, and RANDOM_BLOCKS others, as linear indices."""
    between = range(1, total - 1)
    chosen = rng.choice(len(between), size=min(RANDOM_BLOCKS, len(between)), replace=False) \
        if len(between) else []
    return sorted({0, total - 1, *(between[int(i)] for i in chosen)})


def _sub_launch(machine, launch, bound, partition, part):
    """The image's reference on part `part` alone: its partitioned pointers cut to the part
    and the grid to one block along the partition's axis."""
    image = launch.image
    scalars = {s.parameter.name: s.value for s in bound.scalars}
    if partition.count is not None:
        for name in partition.rebased:
            scalars[name] = max(int(scalars[name]) - part * partition.count, 0)
    scalars.update(partition.fixed)
    grid = list(bound.grid)
    grid[partition.axis] = 1
    pointers = {}
    for b in bound.pointers:
        array = machine.storage_array(b.view)[b.offset:b.offset + b.view.count]
        n = partition.per_part.get(b.parameter.name)
        if n is not None:
            array = array[part * n:(part + 1) * n]
        pointers[b.parameter.name] = _pointer(machine, f"{image.name} part {part}", b, array)
    machine.kernels[image.name](Kernel(pointers, scalars, tuple(grid), image.block or (1, 1, 1),
                                       machine.constants))


def _pointer(machine, label: str, bound_pointer, array) -> Pointer:
    """The reference's pointer argument for `bound_pointer` of a sub-launch, over `array`."""
    parameter, view = bound_pointer.parameter, bound_pointer.view
    home, base = machine.home(view)
    return Pointer(label, parameter.index, parameter.name, parameter.access, parameter.element,
                   machine.low, array, None, home, base,
                   element_bytes(view.storage.element, machine.low))


def _heads_sub_launch(machine, launch, bound, sequence: int, query_heads: tuple, kv_head: int,
                      tiles_axis: int):
    """An attention image's reference on one sequence and the heads one block serves (its
    query heads and their key/value head) alone: each pointer's rows of the sequence, its
    columns of those heads, as a problem of len(query_heads) heads sharing one key/value
    head; what it writes is put back in place. The reference's heads are independent
    problems, so this is the whole launch's result on them, at a fraction of its cost."""
    c = machine.constants
    H, KV, T = int(c["heads"]), int(c.get("kvHeads", c["heads"])), int(c["context"])
    D = int(c["width"]) // H

    def head_columns(heads):
        return [h * D + i for h in heads for i in range(D)]
    qkv = head_columns(query_heads) + head_columns((H + kv_head, H + KV + kv_head))
    columns = {"qkv": (qkv, (H + 2 * KV) * D), "gradientQkv": (qkv, (H + 2 * KV) * D),
               "output": (head_columns(query_heads), H * D),
               "gradientOutput": (head_columns(query_heads), H * D),
               "lse": (list(query_heads), H), "delta": (list(query_heads), H)}
    pointers, put_back = {}, []
    for b in bound.pointers:
        parameter, view = b.parameter, b.view
        chosen, width = columns[parameter.name]
        rows = machine.storage_array(view)[b.offset:b.offset + view.count] \
            .reshape(-1, width)[sequence * T:(sequence + 1) * T]
        part = np.ascontiguousarray(rows[:, chosen])
        if parameter.access != "read":
            put_back.append((rows, chosen, part))
        pointers[parameter.name] = _pointer(machine, f"{launch.image.name} sequence {sequence}",
                                            b, part.reshape(-1))
    constants = {**c, "heads": len(query_heads), "kvHeads": 1, "width": len(query_heads) * D}
    scalars = {s.parameter.name: s.value for s in bound.scalars}
    grid = tuple(int(n) if axis == tiles_axis else 1 for axis, n in enumerate(bound.grid))
    machine.kernels[launch.image.name](Kernel(pointers, scalars, grid, launch.image.block,
                                              constants))
    for rows, chosen, part in put_back:
        rows[:, chosen] = part


def check_sampled_blocks_of_every_kernel_at_full_size(runs, only=None):
    emulated, reference = runs
    program, plan, low = reference.program, reference.plan, reference.program.low
    machine = reference.machine
    c = dict(machine.constants)
    c.setdefault("attentionTile", program.role("attentionTile"))
    memory = Memory(program, plan, low)
    rng = np.random.default_rng(20240611)
    checked, report = [], []
    seen = set()
    for (launch, phase, point), call in zip(program.unrolled(), emulated.calls):
        image = launch.image
        if image.library is not None or image.name in seen:
            continue
        if only is not None and image.name not in only:
            continue  # each checked launch's inputs are fresh: nothing before it need run
        seen.add(image.name)
        bound = launch.arguments(point)
        grid = tuple(int(g) for g in bound.grid)
        blocks = sample(grid[0] * grid[1] * grid[2], rng)
        coordinates = [(b % grid[0], b // grid[0] % grid[1], b // (grid[0] * grid[1]))
                       for b in blocks]
        partition = partitions(c, grid).get(image.name)
        parts = sorted({partition.part(xyz, grid) for xyz in coordinates}) if partition else None
        scalars = {s.parameter.name: s.value for s in bound.scalars}
        access = {b.parameter.name: b.parameter.access for b in bound.pointers}
        views = {}
        for b in bound.pointers:  # in place: one view bound to two pointers
            views.setdefault((b.view.label, b.offset), []).append(b.parameter.name)
        in_place = {n for names in views.values() if len(names) > 1 for n in names}

        # Inputs: the same fresh values on both sides (only the sampled parts if partitioned).
        filled = set()
        fresh = {}
        before = {}
        for b in bound.pointers:
            name = b.parameter.name
            if access[name] == "write" and name not in in_place:
                continue
            if (b.view.label, b.offset) in filled:
                continue
            filled.add((b.view.label, b.offset))
            ours, theirs = memory.raw(emulated.memory, b), memory.raw(machine.memory, b)
            n = partition.per_part.get(name) if partition else None
            spans = [(p * n, min((p + 1) * n, len(ours))) for p in parts] if n else [(0, len(ours))]
            for first, last in spans:
                values = values_for(name, last - first, rng, c, image.name)
                if name == "order":  # the rows sorted by the ids just given (ids come first)
                    values = np.argsort(fresh["ids"].astype(np.int64) * len(values)
                                        + np.arange(len(values)), kind="stable").astype(np.int32)
                fresh[name] = values
                encoded = encode(values, b.view.storage.element, low)
                ours[first:last] = encoded
                theirs[first:last] = encoded
        for b in bound.pointers:
            name = b.parameter.name
            if access[name] == "read":
                continue
            if access[name] == "write" and name not in in_place:
                memory.raw(emulated.memory, b).view(np.uint8)[:] = 0xFF  # poison
            else:
                before[name] = memory.raw(emulated.memory, b).copy()

        emulated.set_blocks(blocks)
        call()
        emulated.set_blocks(None)
        if partition is None:
            machine.launch(launch, phase, point)
        elif partition.heads_of is not None:
            for sequence, (query_heads, kv_head) in sorted(
                    {(partition.part(xyz, grid), partition.heads_of(xyz, grid))
                     for xyz in coordinates}):
                _heads_sub_launch(machine, launch, bound, sequence, query_heads, kv_head,
                                  partition.tiles_axis)
        else:
            for part in parts:
                _sub_launch(machine, launch, bound, partition, part)

        for b in bound.pointers:
            name = b.parameter.name
            if access[name] == "read":
                continue
            where = f"{image.name} {name} (grid {grid}, blocks {blocks})"
            ours = memory.raw(emulated.memory, b)
            if image.name == "cgImageScatterSorted":  # which table rows depends on the ids
                ranges = sorted_scatter_owned(fresh["ids"], fresh["order"], coordinates, grid, c)
            else:
                ranges = [r for xyz in coordinates
                          for r in owned(image.name, name, xyz, grid, scalars, c)]
            owned_mask = _owned_mask(ranges, len(ours))
            expected = np.flatnonzero(owned_mask)
            if name in before:
                written = bits(ours) != bits(before[name])
            else:
                written = bits(ours) != np.iinfo(bits(ours).dtype).max
            stray = np.flatnonzero(written & ~owned_mask)
            assert stray.size == 0, f"{where}: wrote {stray.size} elements it does not own, " \
                                    f"first {stray[:5]}"
            if name not in before:
                missing = np.flatnonzero(owned_mask & ~written)
                assert missing.size == 0, f"{where}: left {missing.size} of its " \
                                          f"{expected.size} elements unwritten, first {missing[:5]}"
            element = b.view.storage.element
            got = decode(ours[expected], element, low)
            want = decode(memory.raw(machine.memory, b)[expected], element, low)
            if element == "int32":
                assert np.array_equal(got, want), where
                report.append(f"{image.name:36} {name:16} {expected.size:9} elements, exact")
                continue
            tolerance = TOLERANCE["low" if concrete(element, low).name == "bfloat16" else "float32"]
            scale = float(np.abs(want).max()) if want.size else 0.0
            close = np.isclose(got, want, rtol=tolerance, atol=tolerance * max(scale, 1e-30))
            worst = float(np.abs(got - want).max() / max(scale, 1e-30)) if want.size else 0.0
            assert close.all(), f"{where}: {np.count_nonzero(~close)} of {want.size} differ; " \
                                f"worst {worst:.2e} of the largest"
            report.append(f"{image.name:36} {name:16} {expected.size:9} elements, "
                          f"worst {worst:.1e}")
        checked.append(image.name)
        before.clear()
        gc.collect()
    print("\n" + "\n".join(report))
    kernels = {launch.image.name for launch, _, _ in program.unrolled()
               if launch.image.library is None and (only is None or launch.image.name in only)}
    assert set(checked) == kernels, checked  # every kernel image of the step (or those asked)
