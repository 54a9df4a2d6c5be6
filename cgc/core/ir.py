"""The launch program: phases, launches with concrete grids and slot bindings, repeats as loops.

It is self-contained: evaluation computes everything later stages need (each image's
signature with its block and scalar defaults, the extent of every pointer at every launch,
the model's roles) and stores it here, so nothing after this module reads the front end.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from . import affine
from .affine import Affine, Int, LoopVariable, Nat, format_nat
from .source import Span


class BindingError(Exception):
    """A launch's slots do not give every argument exactly once (the checker reports these
    as diagnostics; runtimes that run unchecked programs raise them)."""


# The collectives that deal their buffer out in equal shards, one a rank (docs/language.md):
# a reduce-scatter leaves this rank's shard reduced, an all-gather fills every rank's.
SHARDED_COLLECTIVES = ("reduceScatter", "allGather")


@dataclass(frozen=True)
class PointerParameter:
    index: int
    name: str
    element: str
    access: str  # read | write | readwrite | accumulate
    has_extent: bool
    span: Span


@dataclass(frozen=True)
class ScalarParameter:
    index: int
    name: str
    type: str  # float32 | int32
    default: "Nat | float | None"
    span: Span


@dataclass(frozen=True)
class Image:
    """A kernel image's signature, evaluated in the program's configuration."""

    name: str
    block: tuple[int, int, int] | None  # None for a library image (or a bad block)
    library: str | None  # cublas, or nccl for a collective: a host call, not a kernel
    pointers: dict[int, PointerParameter]
    scalars: dict[int, ScalarParameter]
    aliases: frozenset[frozenset[int]]
    span: Span
    doc: str | None
    alignments: dict[int, tuple[int, Span]] = field(default_factory=dict)  # pointer -> bytes
    covers: dict[int, Span] = field(default_factory=dict)  # pointers a launch must cover
    collective: tuple[str, str | None] | None = None  # (operation, reduction): across ranks
    # (deviceState): the kernel keeps state of its own between launches (a `__device__`
    # counter), so no two launches of it may run at the same time.
    device_state: Span | None = None

    def __hash__(self) -> int:
        return hash(self.name)


@dataclass(frozen=True)
class StorageRef:
    """Where a buffer lives: a declared buffer, an arena slot, or a bank entry (or whole bank)."""

    kind: str  # buffer | arena | bank
    name: str  # the buffer, arena slot or bank
    entry: str | None  # the bank entry; None for a whole bank
    element: str  # declared element type: float32, bfloat16, int32 or low
    item_count: int  # elements in one item
    stack: int | None  # number of items when declared with (stack N)

    @property
    def count(self) -> int:
        return self.item_count * (self.stack or 1)

    @property
    def label(self) -> str:
        return f"{self.name}.{self.entry}" if self.entry else self.name


@dataclass(frozen=True)
class View:
    """A contiguous range of a storage: `count` elements from `offset` (affine in repeats)."""

    storage: StorageRef
    offset: Nat
    count: int
    item: Nat | None = None

    @property
    def label(self) -> str:
        suffix = f"[{format_nat(self.item)}]" if self.item is not None else ""
        return self.storage.label + suffix


@dataclass(frozen=True)
class Extent:
    """How many elements a launch's pointer reaches, over every iteration of its repeats.

    `value` when the extent is affine in the repeat indices; else `table`, the extent at
    every combination of the `variables` it depends on; else `problem` says why neither
    could be computed.
    """

    value: Nat | None = None
    variables: tuple[LoopVariable, ...] = ()
    table: dict[tuple[int, ...], int] | None = None
    problem: str | None = None

    def at(self, point: dict[LoopVariable, int]) -> int:
        if self.value is not None:
            return concrete(self.value, point)
        if self.table is not None:
            return self.table[tuple(point[v] for v in self.variables)]
        raise BindingError(self.problem or "the extent is unknown")

    def extremes(self):
        """(largest, its point, smallest, its point); points name only the variables the
        extent depends on."""
        if self.value is not None:
            low, high = affine.bounds(self.value)
            return (high, extreme_point(self.value, True), low,
                    extreme_point(self.value, False))
        assert self.table is not None, self.problem
        items = list(self.table.items())
        largest = max(items, key=lambda item: item[1])
        smallest = min(items, key=lambda item: item[1])
        return (largest[1], dict(zip(self.variables, largest[0])), smallest[1],
                dict(zip(self.variables, smallest[0])))


def extreme_point(value: Nat, largest: bool) -> dict[LoopVariable, int]:
    """The repeat indices at which an affine value is largest (or smallest)."""
    point = {}
    if isinstance(value, Affine):
        for variable, k in value.terms:
            point[variable] = variable.count - 1 if (k > 0) == largest else 0
    return point


def concrete(value, point: dict[LoopVariable, int]):
    """A bound value at one iteration: affine values evaluated, Int as a plain int."""
    if isinstance(value, Affine):
        return value.at(point)
    return int(value) if isinstance(value, Int) else value


@dataclass(frozen=True)
class PointerBinding:
    index: int
    view: View
    span: Span


@dataclass(frozen=True)
class ScalarBinding:
    index: int
    value: "Nat | float"
    kind: str  # Nat | Int | Float
    span: Span


@dataclass(frozen=True)
class Launch:
    image: Image
    grid: tuple[Nat, Nat, Nat]
    pointers: tuple[PointerBinding, ...]
    scalars: tuple[ScalarBinding, ...]
    span: Span
    trace: tuple[Span, ...] = ()  # the call sites that led here, outermost first
    extents: dict[int, Extent] = field(default_factory=dict, compare=False)  # by pointer

    def arguments(self, point: dict[LoopVariable, int] | None = None) -> "Arguments":
        """The launch's grid and arguments, each declared one once, in index order: at one
        iteration (`point`), or as affine values of the repeat indices (no point)."""
        image = self.image
        value = (lambda v: v) if point is None else (lambda v: concrete(v, point))
        for binding in self.pointers:
            if binding.index not in image.pointers:
                raise BindingError(f"the image has no pointer {binding.index}")
        for binding in self.scalars:
            if binding.index not in image.scalars:
                raise BindingError(f"the image has no scalar {binding.index}")
        pointers = []
        for index, parameter in sorted(image.pointers.items()):
            bound = [b for b in self.pointers if b.index == index]
            if len(bound) != 1:
                raise BindingError(f"pointer {index} '{parameter.name}' is "
                                   f"{'not bound' if not bound else 'bound twice'}")
            view = bound[0].view
            pointers.append(BoundPointer(parameter, view, value(view.offset), bound[0]))
        scalars = []
        for index, parameter in sorted(image.scalars.items()):
            bound = [b for b in self.scalars if b.index == index]
            if len(bound) > 1:
                raise BindingError(f"scalar {index} '{parameter.name}' is bound twice")
            if bound:
                scalars.append(BoundScalar(parameter, value(bound[0].value), bound[0].kind))
            elif parameter.default is not None:
                kind = "Float" if isinstance(parameter.default, float) else "Nat"
                scalars.append(BoundScalar(parameter, value(parameter.default), kind))
            else:
                raise BindingError(f"scalar {index} '{parameter.name}' is not bound")
        return Arguments(tuple(value(g) for g in self.grid), tuple(pointers), tuple(scalars))


@dataclass(frozen=True)
class BoundPointer:
    parameter: PointerParameter
    view: View
    offset: Nat  # the view's first element in its storage (an int at a point)
    binding: PointerBinding


@dataclass(frozen=True)
class BoundScalar:
    parameter: ScalarParameter
    value: "Nat | float"
    kind: str  # Nat | Int | Float: what the schedule gave


@dataclass(frozen=True)
class Arguments:
    grid: tuple
    pointers: tuple[BoundPointer, ...]
    scalars: tuple[BoundScalar, ...]

    def scalar_values(self) -> dict[str, object]:
        return {s.parameter.name: s.value for s in self.scalars}


@dataclass(frozen=True)
class Repeat:
    variable: LoopVariable
    body: tuple["Node", ...]
    span: Span


@dataclass(frozen=True)
class PhaseRegion:
    phase: str
    body: tuple["Node", ...]
    span: Span


@dataclass(frozen=True)
class Concurrent:
    """Branches that may run at the same time (`cgConcurrently`): any interleaving of their
    launches, and of the launches' blocks; what follows waits for every branch. The checker
    proves no branch touches what another writes (checking/concurrency.py), so running the
    branches one after another, in order, is one of the interleavings and gives the same
    values: `body`, the branches in order, is how a sequential reader takes them."""

    branches: tuple[tuple["Node", ...], ...]
    span: Span

    @property
    def body(self) -> tuple["Node", ...]:
        return tuple(node for branch in self.branches for node in branch)


Node = Launch | Repeat | PhaseRegion | Concurrent


@dataclass(frozen=True)
class Bank:
    name: str
    element: str
    role: str  # parameters | gradients | state | copies
    span: Span


@dataclass(frozen=True)
class Phase:
    name: str
    stage: str | None
    writes: tuple[str, ...]  # the banks it may write
    write_spans: tuple[Span, ...]
    span: Span


@dataclass(frozen=True)
class Entry:
    """A bank entry: its size, whether it is a matrix (with a 16-bit copy), how it starts."""

    name: str
    count: int
    stack: int | None
    matrix: bool
    init: str  # normal | ones | zeros
    std: float | None  # for normal
    span: Span


@dataclass
class Program:
    source: str
    entry: str
    config: str
    low: str
    body: tuple[Node, ...]
    constants: dict[str, object] = field(default_factory=dict)
    storages: dict[str, StorageRef] = field(default_factory=dict)  # by label
    images: dict[str, Image] = field(default_factory=dict)  # every declared image
    warnings: list = field(default_factory=list)  # diagnostics that did not stop evaluation
    bank_layouts: dict[str, tuple[dict[str, int], int]] = field(default_factory=dict)
    banks: dict[str, "Bank"] = field(default_factory=dict)
    phases: dict[str, "Phase"] = field(default_factory=dict)
    entries: tuple["Entry", ...] = ()  # the bank entries, in declaration order
    roles: dict[str, object] = field(default_factory=dict)  # role -> storage label or value
    role_spans: dict[str, Span] = field(default_factory=dict)
    # Folders of the user's own kernels (`--kernels DIR`): NAME.cu.j2 templates and a
    # reference.py whose KERNELS the numpy backend runs, beside cgc's own (docs/tutorial.md).
    kernel_folders: tuple[str, ...] = ()
    # The rank this program was evaluated for, and how many ranks run it (cgRank, cgRanks):
    # a data-parallel step that shards (ZeRO-1) is one program per rank (docs/parallel.md).
    rank: int = 0
    ranks: int = 1
    # Step buffers declared (sharded): each rank holds its shard, the rank-th of `ranks`
    # equal parts of a whole (a checkpoint keeps the whole, in rank order).
    sharded: tuple[str, ...] = ()
    # The constants the command line set (`--set NAME=VALUE`), in the order given: what
    # `cgc compile` needs besides the configuration to make the same file again.
    overrides: tuple[tuple[str, object], ...] = ()

    @property
    def blocks(self) -> dict[str, tuple[int, int, int]]:
        return {name: image.block for name, image in self.images.items()
                if image.block is not None}

    def bank_of_role(self, role: str) -> list[str]:
        """The banks of a role that the program lays out (those its launches touch)."""
        return [name for name, bank in self.banks.items()
                if bank.role == role and name in self.bank_layouts]

    def shard(self, low: int, high: int) -> tuple[int, int]:
        """This rank's shard of the elements [low, high): the rank-th of `ranks` equal parts
        (what a reduce-scatter reduces, an all-gather sends)."""
        size = (high - low) // self.ranks
        return low + self.rank * size, low + (self.rank + 1) * size

    def carried_buffers(self) -> list[str]:
        """The step buffers whose first access in the step reads what the previous step left
        (readwrite or accumulate): state the run carries from step to step."""
        first: dict[str, str] = {}
        for launch, _, _ in self.launches():
            for binding in launch.pointers:
                parameter = launch.image.pointers.get(binding.index)
                storage = binding.view.storage
                if parameter is None or storage.kind != "buffer":
                    continue
                first.setdefault(storage.label, parameter.access)
        return [label for label, access in first.items() if access in ("readwrite", "accumulate")]

    def role(self, name: str):
        """The storage label or the value a role names; KeyError names what is missing."""
        if name not in self.roles:
            raise KeyError(f"the schedule declares no '{name}' role (a `roles` declaration "
                           "names the model's buffers and constants: docs/language.md)")
        return self.roles[name]

    def kernel_constants(self) -> list[tuple[str, int]]:
        """The shape constants the kernels see, by their C names, in table order."""
        from .roles import KERNEL_CONSTANTS
        return [(c_name, int(self.roles[role])) for c_name, role in KERNEL_CONSTANTS.items()
                if role in self.roles]

    def address(self, view: View) -> tuple[str, Nat]:
        """The allocation a view lies in, and its first element's offset there."""
        storage = view.storage
        if storage.kind == "bank" and storage.entry is not None:
            base = self.bank_layouts[storage.name][0][storage.entry]
            return storage.name, affine.add(base, view.offset)
        return storage.name, view.offset

    def _walk(self, unroll: bool):
        def go(nodes, phase, loops, point):
            for node in nodes:
                if isinstance(node, Launch):
                    yield node, phase, (point if unroll else loops)
                elif isinstance(node, Repeat) and unroll:
                    for value in range(node.variable.count):
                        yield from go(node.body, phase, loops, {**point, node.variable: value})
                elif isinstance(node, Repeat):
                    yield from go(node.body, phase, loops + (node.variable,), point)
                else:
                    yield from go(node.body, getattr(node, "phase", phase), loops, point)

        yield from go(self.body, None, (), {})

    def launches_made(self) -> int:
        """How many launches the program makes, every repeat unrolled."""
        def count(nodes) -> int:
            return sum(1 if isinstance(node, Launch) else
                       count(node.body) * (node.variable.count if isinstance(node, Repeat) else 1)
                       for node in nodes)
        return count(self.body)

    def launches(self):
        """Every launch with its innermost phase and enclosing loops, in program order."""
        return self._walk(unroll=False)

    def unrolled(self):
        """Every launch the program makes, in order, with its phase and repeat indices."""
        return self._walk(unroll=True)


def _where(span: Span, root: str) -> str:
    path = os.path.relpath(span.path, root) if root else span.path
    return f"{path}:{span.line}:{span.column}"


def _scalar_text(binding: ScalarBinding) -> str:
    if binding.kind == "Float":
        return repr(float(binding.value))
    return format_nat(binding.value)


def format_program(program: Program) -> str:
    """Stable, readable text: one line per launch, then one line per slot.

    Each launch line ends with where it was written and the calls that led there,
    innermost first: `library.cg:32:9 < backward.cg:49:2`.
    """
    root = os.path.dirname(program.source)
    lines = [
        "-- cgc launch program",
        f"-- source {os.path.basename(program.source)}, entry {program.entry}, "
        f"config {program.config} (low = {program.low})",
    ]

    def emit(nodes, depth):
        pad = "  " * depth
        for node in nodes:
            if isinstance(node, PhaseRegion):
                lines.append(f"{pad}phase {node.phase} {{")
                emit(node.body, depth + 1)
                lines.append(f"{pad}}}")
            elif isinstance(node, Concurrent):
                lines.append(f"{pad}concurrently {{")
                for number, branch in enumerate(node.branches):
                    lines.append(f"{pad}  branch {number} {{")
                    emit(branch, depth + 2)
                    lines.append(f"{pad}  }}")
                lines.append(f"{pad}}}")
            elif isinstance(node, Repeat):
                variable = node.variable
                lines.append(f"{pad}repeat {variable.name} in 0 .. {variable.count - 1} {{")
                emit(node.body, depth + 1)
                lines.append(f"{pad}}}")
            else:
                grid = ", ".join(format_nat(g) for g in node.grid)
                block = program.blocks.get(node.image.name)
                shape = f" block ({', '.join(map(str, block))})" if block else " (library)"
                chain = " < ".join(_where(span, root) for span in (node.span, *reversed(node.trace)))
                lines.append(f"{pad}launch {node.image.name} grid ({grid}){shape}  -- {chain}")
                for binding in node.pointers:
                    parameter = node.image.pointers.get(binding.index)
                    name = parameter.name if parameter else "?"
                    view = binding.view
                    lines.append(f"{pad}  pointer {binding.index} {name} = {view.label}: "
                                 f"{view.storage.element}[{view.count}]")
                for binding in node.scalars:
                    parameter = node.image.scalars.get(binding.index)
                    name = parameter.name if parameter else "?"
                    lines.append(f"{pad}  scalar {binding.index} {name} = {_scalar_text(binding)}")

    emit(program.body, 0)
    return "\n".join(lines) + "\n"
