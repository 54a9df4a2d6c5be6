"""The roles a model's schedule declares for the runtime and the kernels.

The compiler knows no model's names: a `roles` declaration in the `.cg` files says which
buffer holds the token ids, the targets and the loss, and which constants give the
model's shape. The runtimes read buffers and constants by role; the CUDA kernels see the
shape as the C constants named here (kWidth, ...). One table, in the order the kernels'
constants are emitted.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Role:
    name: str
    kind: str  # buffer | Nat | Float | Schedule
    element: str | tuple | None  # a buffer's element type (or those it may be)
    kernel_constant: str | None  # its C name in the kernels, for a Nat
    meaning: str
    flow: str | None = None  # "in": the runtime writes it before each step; "out": reads it after
    least: int = 1  # the smallest value a Nat role may take (a switch may be 0)


ROLES: dict[str, Role] = {role.name: role for role in (
    Role("ids", "buffer", "int32", None, "the input token ids, one per row", "in"),
    Role("targets", "buffer", "int32", None, "the next-token targets, one per row (-1: ignored)",
         "in"),
    Role("loss", "buffer", "float32", None, "the cross-entropy of each row", "out"),
    Role("logits", "buffer", ("float32", "low"), None,
         "the logits of every row, rows x vocabulary (what `cgc sample` reads)"),
    Role("rows", "Nat", None, "kRows", "token rows per step (batch x context)"),
    Role("batch", "Nat", None, "kBatch", "sequences per step"),
    Role("context", "Nat", None, "kContext", "tokens per sequence"),
    Role("vocab", "Nat", None, "kVocab", "vocabulary size"),
    Role("width", "Nat", None, "kWidth", "width of the residual stream"),
    Role("layers", "Nat", None, "kLayers", "transformer layers"),
    Role("heads", "Nat", None, "kHeads", "attention heads (query heads)"),
    Role("kvHeads", "Nat", None, "kKvHeads",
         "key/value heads: each serves heads / kvHeads query heads (grouped-query attention)"),
    Role("headWidth", "Nat", None, "kHeadWidth", "width of one attention head"),
    Role("attentionTile", "Nat", None, "kAttentionTile", "query rows per attention block"),
    Role("attentionHopper", "Nat", None, "kAttentionHopper",
         "1: the attention forward on Hopper's wgmma, TMA and mbarrier (sm_90a), 0: mma.sync",
         least=0),
    Role("learningRate", "buffer", "float32", None,
         "the step's learning rate: one float32 the runtime writes before each step, read by "
         "the optimizer on the device (a captured graph need not change)", "in"),
    Role("peakLearningRate", "Float", None, None,
         "the learning rate `cgc run` uses unless told otherwise (--lr)"),
    Role("gradientSquares", "buffer", "float32", None,
         "partial sums of squares of the step's gradient before clipping: the square root of "
         "their sum is the gradient norm"),
    Role("step", "Schedule", None, None,
         "the whole training step: nothing in it may read a step buffer or arena slot before "
         "it writes it, and it must write all of the roles the runtime reads after it"),
)}

KERNEL_CONSTANTS = {role.kernel_constant: role.name for role in ROLES.values()
                    if role.kernel_constant}
# What `cgc run` needs to feed a step and read its loss.
TRAINING_ROLES = ("ids", "targets", "loss", "batch", "context", "vocab")


def flowing(direction: str) -> tuple[str, ...]:
    """The buffer roles the runtime writes before each step ("in") or reads after it ("out")."""
    return tuple(role.name for role in ROLES.values() if role.flow == direction)
