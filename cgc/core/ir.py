"""The launch program: phases, launches with concrete grids and slot bindings, repeats as loops."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from . import affine
from .affine import LoopVariable, Nat, format_nat
from ..frontend.declarations import ImageDeclaration
from .source import Span


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
    image: ImageDeclaration
    grid: tuple[Nat, Nat, Nat]
    pointers: tuple[PointerBinding, ...]
    scalars: tuple[ScalarBinding, ...]
    span: Span
    trace: tuple[Span, ...] = ()  # the call sites that led here, outermost first


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


Node = Launch | Repeat | PhaseRegion


@dataclass
class Program:
    source: str
    entry: str
    config: str
    low: str
    body: tuple[Node, ...]
    constants: dict[str, object] = field(default_factory=dict)
    storages: dict[str, StorageRef] = field(default_factory=dict)  # by label
    blocks: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # image -> block
    warnings: list = field(default_factory=list)  # diagnostics that did not stop evaluation
    bank_layouts: dict[str, tuple[dict[str, int], int]] = field(default_factory=dict)
    evaluator: object = None  # evaluates image formulas (extents) in this configuration

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
                    yield from go(node.body, node.phase, loops, point)

        yield from go(self.body, None, (), {})

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
