"""Reference semantics of every kernel image, in NumPy: the living definition of what each
image computes. Arithmetic is float32; values stored in the low type are rounded to it as
they are written (cgc/numerics.py). Products and exp, log, tanh, powers, cos and sin go
through portable.py (a product: the float32 nearest its exact sum; a function: float64
from IEEE's basic operations, rounded once), the same bits on every machine (NumPy's own
follow the BLAS threads and the CPU's SIMD path). Each function receives a Kernel (cgc/machine.py) and
touches memory only through its pointers, as the CUDA kernel would: rows from the grid,
the model's own dimensions guarded.
"""

from __future__ import annotations

import math

import numpy as np

from . import portable
from .machine import Fault, Kernel

F32 = np.float32


def _width(k: Kernel) -> int:
    return int(k.constants["width"])


def embedding(k: Kernel) -> None:
    rows, width, vocab = k.grid[0], _width(k), int(k.constants["vocab"])
    ids = k.pointers["ids"].read(0, rows).astype(np.int64)
    if ((ids < 0) | (ids >= vocab)).any():
        raise Fault("data", f"a token id is outside 0 .. {vocab - 1}")
    table = k.pointers["table"].read(0, (int(ids.max()) + 1) * width).reshape(-1, width)
    k.pointers["output"].write(0, table[ids])


def _statistics(x: np.ndarray, epsilon) -> tuple[np.ndarray, np.ndarray]:
    mean = x.mean(axis=1, dtype=F32)
    variance = np.square(x - mean[:, None]).mean(axis=1, dtype=F32)
    return mean, (F32(1) / np.sqrt(variance + F32(epsilon))).astype(F32)


def layer_norm(k: Kernel) -> None:
    rows, width = k.grid[0], _width(k)
    x = k.pointers["input"].read(0, rows * width).reshape(rows, width)
    gamma, beta = k.pointers["gamma"].read(0, width), k.pointers["beta"].read(0, width)
    mean, rstd = _statistics(x, k.scalars["epsilon"])
    out = (x - mean[:, None]) * rstd[:, None] * gamma + beta
    k.pointers["output"].write(0, out)
    k.pointers["statistics"].write(0, np.stack([mean, rstd], axis=1))


NORM_MAX_GROUPS = 64  # common.cuh's kNormMaxGroups


def norm_group(blocks: int) -> int:
    """The blocks of a group of the layer-norm backward's tickets (common.cuh:
    cg_norm_group; the last group has the rest): the least s with s * s > blocks, and at
    most NORM_MAX_GROUPS groups."""
    size = math.isqrt(blocks) + 1
    while -(-blocks // size) > NORM_MAX_GROUPS:
        size += 1
    return size


def _norm_partials(k: Kernel, sums: np.ndarray, blocks: int) -> np.ndarray:
    """The layer-norm backward's partials as the kernel leaves them, and their total: each
    block's column sums of its rows (block b: rows b * rows // gridX up to (b + 1) * rows //
    gridX) in its row, then each group's rows (norm_group consecutive blocks) added in
    block order into the group's first row, and those rows added in group order: the total
    (dgamma and dbeta, or dgamma alone), written whole by the groups' last block to
    finish."""
    rows = sums.shape[0]
    edges = [b * rows // blocks for b in range(blocks + 1)]
    partials = np.stack([sums[a:b].sum(axis=0, dtype=F32) for a, b in zip(edges, edges[1:])])
    size = norm_group(blocks)
    for lead in range(0, blocks, size):
        partials[lead] = partials[lead:lead + size].sum(axis=0, dtype=F32)
    k.pointers["partials"].write(0, partials)
    return partials[::size].sum(axis=0, dtype=F32)


def _layer_norm_gradient(k: Kernel):
    """dx of the launch's rows; the sums for dgamma and dbeta through the partials
    (_norm_partials), written whole."""
    blocks, width, rows = k.grid[0], _width(k), int(k.scalars["rows"])
    x = k.pointers["input"].read(0, rows * width).reshape(rows, width)
    dout = k.pointers["gradientOutput"].read(0, rows * width).reshape(rows, width)
    statistics = k.pointers["statistics"].read(0, rows * 2).reshape(rows, 2)
    gamma = k.pointers["gamma"].read(0, width)
    mean, rstd = statistics[:, :1], statistics[:, 1:]
    normed = (x - mean) * rstd
    dnormed = dout * gamma
    dx = rstd * (dnormed - dnormed.mean(axis=1, keepdims=True, dtype=F32)
                 - normed * (dnormed * normed).mean(axis=1, keepdims=True, dtype=F32))
    totals = _norm_partials(k, np.concatenate([dout * normed, dout], axis=1), blocks)
    k.pointers["gradientGamma"].write(0, totals[:width])
    k.pointers["gradientBeta"].write(0, totals[width:])
    return dx, rows, width


def layer_norm_backward(k: Kernel) -> None:
    dx, _, _ = _layer_norm_gradient(k)
    k.pointers["gradientInput"].write(0, dx)
    k.pointers["gradientLow"].write(0, dx)  # rounded to the low type as it is stored


def layer_norm_backward_add(k: Kernel) -> None:
    dx, rows, width = _layer_norm_gradient(k)
    residual = k.pointers["residual"].read(0, rows * width).reshape(rows, width)
    k.pointers["gradientInput"].write(0, residual + dx)
    k.pointers["gradientLow"].write(0, residual + dx)


def rms_norm(k: Kernel) -> None:
    rows, width = k.grid[0], _width(k)
    x = k.pointers["input"].read(0, rows * width).reshape(rows, width)
    gamma = k.pointers["gamma"].read(0, width)
    rstd = (F32(1) / np.sqrt(np.square(x).mean(axis=1, dtype=F32)
                             + F32(k.scalars["epsilon"]))).astype(F32)
    k.pointers["output"].write(0, x * rstd[:, None] * gamma)
    k.pointers["statistics"].write(0, rstd)


def _rms_norm_gradient(k: Kernel):
    """As _layer_norm_gradient for RMSNorm: no mean, statistics rstd alone, a row of partials
    [dgamma] a block."""
    blocks, width, rows = k.grid[0], _width(k), int(k.scalars["rows"])
    x = k.pointers["input"].read(0, rows * width).reshape(rows, width)
    dout = k.pointers["gradientOutput"].read(0, rows * width).reshape(rows, width)
    rstd = k.pointers["statistics"].read(0, rows).reshape(rows, 1)
    gamma = k.pointers["gamma"].read(0, width)
    normed = x * rstd
    dnormed = dout * gamma
    dx = rstd * (dnormed - normed * (dnormed * normed).mean(axis=1, keepdims=True, dtype=F32))
    k.pointers["gradientGamma"].write(0, _norm_partials(k, dout * normed, blocks))
    return dx, rows, width


def rms_norm_backward(k: Kernel) -> None:
    dx, _, _ = _rms_norm_gradient(k)
    k.pointers["gradientInput"].write(0, dx)
    k.pointers["gradientLow"].write(0, dx)


def rms_norm_backward_add(k: Kernel) -> None:
    dx, rows, width = _rms_norm_gradient(k)
    residual = k.pointers["residual"].read(0, rows * width).reshape(rows, width)
    k.pointers["gradientInput"].write(0, residual + dx)
    k.pointers["gradientLow"].write(0, residual + dx)


def _operands(k: Kernel, transposed: bool, weight: bool):
    m, n, depth = k.scalars["m"], k.scalars["n"], k.scalars["k"]
    a = k.pointers["a"].read(0, m * depth)
    a = a.reshape(depth, m).T if weight else a.reshape(m, depth)
    b = k.pointers["b"].read(0, depth * n)
    b = b.reshape(n, depth).T if transposed else b.reshape(depth, n)
    return portable.matmul(a, b)


def product_data(k: Kernel) -> None:
    k.pointers["output"].write(0, _operands(k, transposed=False, weight=False))


def product_transposed(k: Kernel) -> None:
    k.pointers["output"].write(0, _operands(k, transposed=True, weight=False))


def product_gelu(k: Kernel) -> None:
    """cuBLASLt's GELU_AUX epilogue: GELU of the float32 sum, then rounded to the low type;
    pre is the float32 sum rounded on its own."""
    value = _operands(k, transposed=False, weight=False)
    k.pointers["pre"].write(0, value)
    k.pointers["output"].write(0, _gelu(value))


def product_transposed_gelu_backward(k: Kernel) -> None:
    """cuBLASLt's DGELU epilogue: the float32 sum times GELU'(pre as stored), rounded once."""
    m, n = k.scalars["m"], k.scalars["n"]
    pre = k.pointers["pre"].read(0, m * n).reshape(m, n)
    k.pointers["output"].write(0, _operands(k, transposed=True, weight=False) * _gelu_slope(pre))


def product_residual(k: Kernel) -> None:
    m, n = k.scalars["m"], k.scalars["n"]
    residual = k.pointers["residual"].read(0, m * n).reshape(m, n)
    k.pointers["output"].write(0, residual + _operands(k, transposed=False, weight=False))


def product_weight(k: Kernel) -> None:
    k.pointers["output"].accumulate(0, _operands(k, transposed=False, weight=True))


def product_weight_set(k: Kernel) -> None:
    k.pointers["output"].write(0, _operands(k, transposed=False, weight=True))


def _rotary_tables(positions: int, head_width: int):
    """cos and sin of each position's angle for pair i, position * 10000^(-2i/D), as the
    kernels' rotary_angle computes them: the angle in half-turns (over pi), in float32."""
    half = head_width // 2
    frequencies = portable.power_of_10000(-np.arange(half, dtype=F32) * F32(2)
                                          / F32(head_width))
    per_position = (frequencies * F32(1 / math.pi)).astype(F32)
    turns = (np.arange(positions, dtype=F32)[:, None] * per_position[None, :]).astype(F32)
    return portable.cos_sin_pi(turns)


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, inverse: bool = False):
    """Rotates pairs (i, i + D/2) of the last axis by each position's angle; x: [.., T, D]."""
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    if inverse:
        sin = -sin
    return np.concatenate([first * cos - second * sin, first * sin + second * cos], axis=-1)


def _kv_heads(k: Kernel) -> int:
    return int(k.constants.get("kvHeads", k.constants["heads"]))


def rotary(k: Kernel) -> None:
    """q and k of the first gridX positions of each of gridY sequences of qkv turned in place
    by their positions (back, for `inverse`); v untouched. A row of qkv is q's heads, then
    k's and v's key/value heads."""
    width, context = _width(k), int(k.constants["context"])
    heads, positions = int(k.constants["heads"]), min(k.grid[0], int(k.constants["context"]))
    head_width = width // heads
    turned_heads = heads + _kv_heads(k)  # q's and k's
    row = (heads + 2 * _kv_heads(k)) * head_width
    cos, sin = _rotary_tables(context, head_width)
    pointer = k.pointers["qkv"]
    for sequence in range(k.grid[1]):
        first = sequence * context * row
        qkv = pointer.read(first, first + positions * row).reshape(positions, -1, head_width)
        turned = _rotate(qkv[:, :turned_heads].transpose(1, 0, 2), cos[:positions],
                         sin[:positions], inverse=bool(k.scalars["inverse"]))
        qkv[:, :turned_heads] = turned.transpose(1, 0, 2)
        pointer.write(first, qkv)


class _Heads:
    """The attention problem of one launch: sequences of the grid, heads. q and k arrive
    turned by the rotary pass (rotary); the backward turns their gradients back. The grid
    covers `tiles` tiles of each sequence, `heads` heads and `sequences` sequences: the
    forward's x, y and z (by default); the backward's z / 2 (its dK/dV and dQ blocks), x and y."""

    def __init__(self, k: Kernel, tiles: int | None = None, heads: int | None = None,
                 sequences: int | None = None):
        self.grid_tiles = k.grid[0] if tiles is None else tiles
        self.grid_heads = k.grid[1] if heads is None else heads
        self.sequences = k.grid[2] if sequences is None else sequences
        self.context = int(k.constants["context"])
        self.heads = int(k.constants["heads"])
        self.kv_heads = _kv_heads(k)
        self.group = self.heads // self.kv_heads  # query heads a key/value head serves
        self.width = _width(k)
        self.head_width = self.width // self.heads
        self.row = (self.heads + 2 * self.kv_heads) * self.head_width  # of qkv
        self.rows = self.sequences * self.context
        self.scale = F32(1.0 / math.sqrt(self.head_width))
        self.mask = np.triu(np.ones((self.context, self.context), dtype=bool), k=1)

    def split(self, qkv: np.ndarray):
        """[rows, (H + 2 KV) D] to q [sequences, H, T, D] and k and v [sequences, KV, T, D]."""
        heads = qkv.reshape(self.sequences, self.context, -1, self.head_width).transpose(0, 2, 1, 3)
        h, kv = self.heads, self.kv_heads
        return heads[:, :h], heads[:, h:h + kv], heads[:, h + kv:]

    def widen(self, x: np.ndarray) -> np.ndarray:
        """[sequences, KV, T, D] to [sequences, H, T, D]: each key/value head for the query
        heads it serves."""
        return np.repeat(x, self.group, axis=1)

    def narrow(self, x: np.ndarray) -> np.ndarray:
        """[sequences, H, T, D] gradients to [sequences, KV, T, D]: summed over the query heads
        each key/value head serves, in order of head."""
        grouped = x.reshape(x.shape[0], self.kv_heads, self.group, *x.shape[2:])
        total = grouped[:, :, 0].copy()
        for member in range(1, self.group):
            total += grouped[:, :, member]
        return total

    def write_owned(self, k: Kernel, name: str, values: np.ndarray, head_columns,
                    count: int | None = None) -> None:
        """Writes, of [rows, columns] values, what the grid's blocks own, as the kernels do:
        the rows of the grid's first tiles of each of its sequences, and of each row the
        columns `head_columns(h)` of the grid's first heads (of `count`, the query heads
        unless given). A grid short of the context or
        of the heads leaves the rest unwritten (the checker refuses it: (covers ...))."""
        tile = int(k.constants["attentionTile"])
        rows = min(self.grid_tiles * tile, self.context)
        mask = np.zeros(values.shape[1], dtype=bool)
        for head in range(min(self.grid_heads, self.heads if count is None else count)):
            mask[head_columns(head)] = True
        pointer, columns = k.pointers[name], values.shape[1]
        edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
        runs = list(zip(edges[::2], edges[1::2]))
        for sequence in range(self.sequences):
            first = sequence * self.context
            if runs == [(0, columns)]:
                pointer.write(first * columns, values[first:first + rows])
                continue
            for row in range(first, first + rows):
                for start, stop in runs:
                    pointer.write(row * columns + start, values[row, start:stop])

    def merge(self, x: np.ndarray) -> np.ndarray:
        """[sequences, heads, T, D] to [rows, heads D]."""
        return x.transpose(0, 2, 1, 3).reshape(self.rows, -1)

    def probabilities(self, q, key, lse=None):
        scores = portable.matmul(q, key.transpose(0, 1, 3, 2)) * self.scale
        scores = np.where(self.mask, F32(-np.inf), scores)
        if lse is None:
            top = scores.max(axis=-1, keepdims=True)
            lse = top + portable.log(portable.exp(scores - top).sum(axis=-1, keepdims=True,
                                                                 dtype=F32))
        return portable.exp(scores - lse).astype(F32), lse




def attention(k: Kernel) -> None:
    heads = _Heads(k)
    qkv = k.pointers["qkv"].read(0, heads.rows * heads.row)
    q, key, v = heads.split(qkv.reshape(heads.rows, heads.row))
    key, v = heads.widen(key), heads.widen(v)
    probabilities, lse = heads.probabilities(q, key)
    width = heads.head_width
    heads.write_owned(k, "output", heads.merge(portable.matmul(probabilities, v)),
                      lambda h: slice(h * width, (h + 1) * width))
    # lse[row, head], rows in order
    heads.write_owned(k, "lse", lse[..., 0].transpose(0, 2, 1).reshape(heads.rows, -1),
                      lambda h: slice(h, h + 1))


def attention_delta(k: Kernel) -> None:
    rows, width, count = k.grid[0], _width(k), int(k.constants["heads"])
    out = k.pointers["output"].read(0, rows * width).reshape(rows, count, -1)
    dout = k.pointers["gradientOutput"].read(0, rows * width).reshape(rows, count, -1)
    k.pointers["delta"].write(0, (out * dout).sum(axis=-1, dtype=F32))


def attention_backward(k: Kernel) -> None:
    heads = _Heads(k, tiles=k.grid[2] // 2, heads=k.grid[0], sequences=k.grid[1])
    rows, width, count = heads.rows, heads.width, heads.heads
    qkv = k.pointers["qkv"].read(0, rows * heads.row).reshape(rows, heads.row)
    q, key, v = heads.split(qkv)
    key, v = heads.widen(key), heads.widen(v)
    d_out = k.pointers["gradientOutput"].read(0, rows * width).reshape(
        heads.sequences, heads.context, count, heads.head_width).transpose(0, 2, 1, 3)
    lse = k.pointers["lse"].read(0, rows * count).reshape(
        heads.sequences, heads.context, count).transpose(0, 2, 1)[..., None]
    delta = k.pointers["delta"].read(0, rows * count).reshape(
        heads.sequences, heads.context, count).transpose(0, 2, 1)[..., None]
    probabilities, _ = heads.probabilities(q, key, lse)
    dv = portable.matmul(probabilities.transpose(0, 1, 3, 2), d_out)
    dprobabilities = portable.matmul(d_out, v.transpose(0, 1, 3, 2))
    dscores = probabilities * (dprobabilities - delta) * heads.scale
    # the gradients at the turned q and k, turned back: at the unturned ones
    cos, sin = _rotary_tables(heads.context, heads.head_width)
    dq = _rotate(portable.matmul(dscores, key), cos, sin, inverse=True)
    dkey = _rotate(heads.narrow(portable.matmul(dscores.transpose(0, 1, 3, 2), q)), cos, sin,
                   inverse=True)
    dv = heads.narrow(dv)
    merged = np.concatenate([heads.merge(dq), heads.merge(dkey), heads.merge(dv)], axis=1)
    d, group, kv = heads.head_width, heads.group, heads.kv_heads
    # key/value head j's blocks: dq of the query heads it serves (its dQ blocks), dk and dv
    # of j (its dK/dV blocks)
    heads.write_owned(k, "gradientQkv", merged, lambda j: np.r_[
        [(j * group + m) * d + i for m in range(group) for i in range(d)],
        [(count + j) * d + i for i in range(d)], [(count + kv + j) * d + i for i in range(d)]],
        count=kv)


_GELU = F32(math.sqrt(2.0 / math.pi))


def _elementwise_count(k: Kernel, per_block: int) -> int:
    return min(int(k.scalars["count"]), k.grid[0] * per_block)


def _gelu(x: np.ndarray) -> np.ndarray:
    """GELU, tanh form, in float32: the kernels' gelu_forward and cuBLASLt's GELU epilogue."""
    return F32(0.5) * x * (F32(1) + portable.tanh(_GELU * (x + F32(0.044715) * x * x * x)))


def _gelu_slope(x: np.ndarray) -> np.ndarray:
    """GELU'(x), tanh form, in float32: the kernels' gelu_slope and cuBLASLt's DGELU."""
    t = portable.tanh(_GELU * (x + F32(0.044715) * x * x * x))
    return F32(0.5) * (F32(1) + t) + F32(0.5) * x * (F32(1) - t * t) * _GELU * \
        (F32(1) + F32(3 * 0.044715) * x * x)


def gelu(k: Kernel) -> None:
    n = _elementwise_count(k, 2048)
    k.pointers["output"].write(0, _gelu(k.pointers["input"].read(0, n)))


def gelu_backward(k: Kernel) -> None:
    n = _elementwise_count(k, 2048)
    x = k.pointers["pre"].read(0, n)
    dy = k.pointers["gradientAct"].read(0, n)
    k.pointers["gradientPre"].write(0, dy * _gelu_slope(x))


def _gate_up(k: Kernel, name: str):
    """The first `count` elements' gate and up halves of rows of [gate | up] (each `width`
    wide), and the element count and width."""
    count, width = _elementwise_count(k, 2048), int(k.scalars["width"])
    rows = -(-count // width)
    both = k.pointers[name].read(0, rows * 2 * width).reshape(rows, 2, width)
    return both[:, 0].reshape(-1)[:count], both[:, 1].reshape(-1)[:count], count, width


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return (F32(1) / (F32(1) + portable.exp(-x))).astype(F32)


def swi_glu(k: Kernel) -> None:
    gate, up, _, _ = _gate_up(k, "gateUp")
    k.pointers["output"].write(0, gate * _sigmoid(gate) * up)


def swi_glu_backward(k: Kernel) -> None:
    gate, up, count, width = _gate_up(k, "gateUp")
    dout = k.pointers["gradientOutput"].read(0, count)
    s = _sigmoid(gate)
    dgate, dup = dout * up * (s * (F32(1) + gate * (F32(1) - s))), dout * (gate * s)
    rows = -(-count // width)
    # written element by element as the kernel's threads do: a short last row stays short
    pointer = k.pointers["gradientGateUp"]
    for row in range(rows):
        part = slice(row * width, min((row + 1) * width, count))
        pointer.write(row * 2 * width, dgate[part])
        pointer.write(row * 2 * width + width, dup[part])


def cast_down(k: Kernel) -> None:
    n = _elementwise_count(k, 2048)
    k.pointers["output"].write(0, k.pointers["input"].read(0, n))


def loss(k: Kernel) -> None:
    rows, vocab = k.grid[0], int(k.constants["vocab"])
    logits = k.pointers["logits"].read(0, rows * vocab).reshape(rows, vocab)
    targets = k.pointers["targets"].read(0, rows).astype(np.int64)
    if (targets >= vocab).any():
        raise Fault("data", f"a target is past the vocabulary ({vocab})")
    counted = (targets >= 0) & (targets != k.scalars["ignoreIndex"])
    top = logits.max(axis=1)
    lse = top + portable.log(portable.exp(logits - top[:, None]).sum(axis=1, dtype=F32))
    safe = np.where(counted, targets, 0)
    target_logit = logits[np.arange(rows), safe]
    k.pointers["loss"].write(0, np.where(counted, lse - target_logit, F32(0)))
    k.pointers["correct"].write(0, (counted & (logits.argmax(axis=1) == safe)).astype(np.int32))


def cross_entropy_backward(k: Kernel) -> None:
    rows, vocab = k.grid[0], int(k.constants["vocab"])
    columns = min(k.grid[1] * k.block[0], vocab)
    span = (rows - 1) * vocab + columns
    logits = np.zeros(rows * vocab, dtype=F32)
    logits[:span] = k.pointers["logits"].read(0, span)
    logits = logits.reshape(rows, vocab)
    row_loss = k.pointers["loss"].read(0, rows)
    k.pointers["correct"].read(0, rows)
    targets = k.pointers["targets"].read(0, rows).astype(np.int64)
    counted = (targets >= 0) & (targets != k.scalars["ignoreIndex"])
    safe = np.where(counted, targets, 0)
    lse = row_loss + logits[np.arange(rows), safe]
    exponent = (logits - lse[:, None]) * F32(k.scalars["log2e"])
    gradient = portable.exp2(exponent).astype(F32)
    gradient[np.arange(rows), safe] -= F32(1)
    gradient = np.where(counted[:, None], gradient * F32(k.scalars["scale"]), F32(0))
    out = k.pointers["logitsGradient"]
    existing = out.read(0, span)  # columns past the grid are left as they were
    full = np.zeros(rows * vocab, dtype=F32)
    full[:span] = existing
    full = full.reshape(rows, vocab)
    full[:, :columns] = gradient[:, :columns]
    out.write(0, full.reshape(-1)[:span])


def classifier(k: Kernel) -> None:
    """The fused classifier: each row's loss and hit from its logits, then the logits
    overwritten with their gradient (softmax - one-hot) * scale, stored in the low type."""
    rows, vocab = k.grid[0], int(k.constants["vocab"])
    logits = k.pointers["logits"].read(0, rows * vocab).reshape(rows, vocab)
    targets = k.pointers["targets"].read(0, rows).astype(np.int64)
    counted = (targets >= 0) & (targets != k.scalars["ignoreIndex"]) & (targets < vocab)
    top = logits.max(axis=1)
    lse = top + portable.log(portable.exp(logits - top[:, None]).sum(axis=1, dtype=F32))
    safe = np.where(counted, targets, 0)
    everywhere = np.arange(rows)
    k.pointers["loss"].write(0, np.where(counted, lse - logits[everywhere, safe], F32(0)))
    k.pointers["correct"].write(0, (counted & (logits.argmax(axis=1) == safe)).astype(np.int32))
    gradient = portable.exp(logits - lse[:, None]).astype(F32)
    gradient[everywhere, safe] -= F32(1)
    gradient = np.where(counted[:, None], gradient * F32(k.scalars["scale"]), F32(0))
    k.pointers["logits"].write(0, gradient)


def scatter(k: Kernel) -> None:
    """Every row of the step, whatever the grid: the blocks share out the vocabulary."""
    rows, width, vocab = int(k.constants["rows"]), _width(k), int(k.constants["vocab"])
    ids = k.pointers["ids"].read(0, rows).astype(np.int64)
    if ((ids < 0) | (ids >= vocab)).any():
        raise Fault("data", f"a token id is outside 0 .. {vocab - 1}")
    gradient = k.pointers["gradient"].read(0, rows * width).reshape(rows, width)
    touched = int(ids.max()) + 1
    update = np.zeros((touched, width), dtype=F32)
    np.add.at(update, ids, gradient)
    k.pointers["table"].accumulate(0, update)


def scatter_order(k: Kernel) -> None:
    """The rows sorted by id, the rows of one id in row order."""
    rows = int(k.constants["rows"])
    ids = k.pointers["ids"].read(0, rows).astype(np.int64)
    k.pointers["order"].write(0, np.argsort(ids * rows + np.arange(rows), kind="stable")
                              .astype(np.int32))


def scatter_sorted(k: Kernel) -> None:
    """Every row added to its id's table row, through the order (the kernel's positions go
    grid-stride, so every run of one id is added whatever the grid)."""
    rows, width, vocab = int(k.constants["rows"]), _width(k), int(k.constants["vocab"])
    ids = k.pointers["ids"].read(0, rows).astype(np.int64)
    order = k.pointers["order"].read(0, rows).astype(np.int64)
    if ((ids < 0) | (ids >= vocab)).any():
        raise Fault("data", f"a token id is outside 0 .. {vocab - 1}")
    if ((order < 0) | (order >= rows)).any():
        raise Fault("data", f"an entry of the order is outside 0 .. {rows - 1}")
    gradient = k.pointers["gradient"].read(0, rows * width).reshape(rows, width)
    touched = int(ids.max()) + 1
    update = np.zeros((touched, width), dtype=F32)
    np.add.at(update, ids[order], gradient[order])
    k.pointers["table"].accumulate(0, update)


def zero(k: Kernel) -> None:
    k.pointers["output"].write(0, np.zeros(_elementwise_count(k, 1024), dtype=F32))


def square_sum(k: Kernel) -> None:
    """A block's share, as the kernel's: a grid-stride loop of four elements a thread, so
    block b owns the runs of 4 x threads elements whose index over the run is b modulo the
    grid. Each block's squares are summed in float64 in index order (one addition after
    another: cumsum, never a pairwise sum), whole rounds of the grid's runs at a time, about
    16 x PIECE elements (portable.py: a megabyte's temporaries, not the input's hundreds)."""
    count, blocks, threads = int(k.scalars["count"]), k.grid[0], k.block[0]
    values = k.pointers["input"].read(0, count)
    run, sums = 4 * threads, np.zeros(blocks)
    used = min(blocks, -(-count // run))  # the blocks that own any element (all but a tiny input)
    rounds = max(1, min(16 * portable.PIECE // (run * used), -(-count // (run * used))))
    squares = np.empty(rounds * used * run)
    running = np.empty((used, rounds * run + 1))  # a block's sum so far, then its squares
    for start in range(0, count, squares.size):
        part = values[start:start + squares.size]
        squares[:part.size] = part
        squares[part.size:] = 0  # past the input: squares of 0, which add nothing
        squares *= squares
        running[:, 0] = sums[:used]
        running[:, 1:] = squares.reshape(rounds, used, run).transpose(1, 0, 2) \
            .reshape(used, -1)
        sums[:used] = np.cumsum(running, axis=1)[:, -1]
    k.pointers["partials"].write(0, sums.astype(F32))


def gradient_norm(k: Kernel) -> None:
    partials = k.pointers["normPartials"].read(0, int(k.scalars["partialCount"]))
    # As sqrtf on the GPU: partials that sum below zero (a wrong binding) give a NaN norm,
    # which the clip ignores as fminf does, rather than a Python error.
    with np.errstate(invalid="ignore"):
        norm = F32(np.sqrt(partials.astype(np.float64).sum()))
    clip = F32(k.scalars["clipNorm"]) / (norm + F32(1e-6))
    k.pointers["norm"].write(0, np.array([norm, F32(1) if not clip < 1 else clip], dtype=F32))


def adamw(k: Kernel) -> None:
    n = _elementwise_count(k, 1024)
    s = k.scalars
    clip = k.pointers["norm"].read(1, 2)[0]
    step = int(k.pointers["step"].read(0, 1)[0])
    if step < 1:
        raise Fault("data", "the optimizer step must be advanced before the update")
    matrices = min(int(s["matrices"]), n)
    gradient = k.pointers["gradient"].read(0, n) * clip
    beta1, beta2 = F32(s["beta1"]), F32(s["beta2"])
    m = beta1 * k.pointers["moment1"].read(0, n) + (F32(1) - beta1) * gradient
    v = beta2 * k.pointers["moment2"].read(0, n) + (F32(1) - beta2) * gradient * gradient
    rate = F32(k.pointers["learningRate"].read(0, 1)[0])
    correction1 = F32(1) - portable.power(beta1, step)
    correction2 = F32(1) - portable.power(beta2, step)
    decay = np.where(np.arange(n) < matrices, F32(1) - rate * F32(s["weightDecay"]), F32(1))
    parameter = k.pointers["parameter"].read(0, n) * decay.astype(F32)
    denominator = np.sqrt(v) / np.sqrt(correction2) + F32(s["epsilon"])
    parameter = parameter - (rate / correction1) * m / denominator
    k.pointers["moment1"].write(0, m)
    k.pointers["moment2"].write(0, v)
    k.pointers["parameter"].write(0, parameter)
    if matrices:
        k.pointers["copy"].write(0, parameter[:matrices])


def step_advance(k: Kernel) -> None:
    step = k.pointers["step"]
    step.write(0, step.read(0, 1) + 1)


def _collective(k: Kernel, method: str) -> None:
    """A collective over the `count` elements of `data`, in place, through the run's
    communicator (MPI on CPU ranks; with one rank, data as it is)."""
    data = k.pointers["data"]
    values = np.ascontiguousarray(data.read(0, int(k.scalars["count"])), dtype=np.float32)
    getattr(k.communicator, method)(values)
    data.write(0, values)


def all_reduce(k: Kernel) -> None:
    """data = its mean over the ranks."""
    _collective(k, "all_reduce_average")


def all_reduce_sum(k: Kernel) -> None:
    """data = its sum over the ranks."""
    _collective(k, "all_reduce_sum")


def reduce_scatter(k: Kernel) -> None:
    """This rank's shard of data = its mean over the ranks (the rest as it was)."""
    _collective(k, "reduce_scatter_average")


def all_gather(k: Kernel) -> None:
    """Every rank's shard of data = that rank's."""
    _collective(k, "all_gather")


KERNELS = {
    "cgImageEmbedding": embedding,
    "cgImageLayerNorm": layer_norm,
    "cgImageLayerNormBackward": layer_norm_backward,
    "cgImageLayerNormBackwardAdd": layer_norm_backward_add,
    "cgImageRmsNorm": rms_norm,
    "cgImageRmsNormBackward": rms_norm_backward,
    "cgImageRmsNormBackwardAdd": rms_norm_backward_add,
    "cgImageSwiGlu": swi_glu,
    "cgImageSwiGluBackward": swi_glu_backward,
    "cgImageProductData": product_data,
    "cgImageProductDataLow": product_data,
    "cgImageProductGelu": product_gelu,
    "cgImageProductTransposed": product_transposed,
    "cgImageProductTransposedLow": product_transposed,
    "cgImageProductTransposedGeluBackward": product_transposed_gelu_backward,
    "cgImageProductResidual": product_residual,
    "cgImageProductWeight": product_weight,
    "cgImageProductWeightSet": product_weight_set,
    "cgImageAttention": attention,
    "cgImageAttentionDelta": attention_delta,
    "cgImageRotary": rotary,
    "cgImageAttentionBackward": attention_backward,
    "cgImageGelu": gelu,
    "cgImageGeluBackward": gelu_backward,
    "cgImageCastDown": cast_down,
    "cgImageLoss": loss,
    "cgImageCrossEntropyBackward": cross_entropy_backward,
    "cgImageClassifier": classifier,
    "cgImageScatter": scatter,
    "cgImageScatterOrder": scatter_order,
    "cgImageScatterSorted": scatter_sorted,
    "cgImageZero": zero,
    "cgImageSquareSum": square_sum,
    "cgImageAdamW": adamw,
    "cgImageGradientNorm": gradient_norm,
    "cgImageStepAdvance": step_advance,
    "cgImageAllReduce": all_reduce,
    "cgImageAllReduceSum": all_reduce_sum,
    "cgImageReduceScatter": reduce_scatter,
    "cgImageAllGather": all_gather,
}
