"""The syntax tree: small immutable nodes, each carrying its source span."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union


@dataclass(frozen=True, slots=True)
class Span:
    """A region of one source file; lines and columns are 1-based, end column exclusive."""

    path: str
    line: int
    column: int
    end_line: int
    end_column: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line}:{self.column}"

    def sort_key(self) -> tuple[str, int, int]:
        return (self.path, self.line, self.column)


# ---- terms -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Name:
    text: str
    span: Span


@dataclass(frozen=True, slots=True)
class Natural:
    value: int
    span: Span


@dataclass(frozen=True, slots=True)
class Integer:
    value: int
    span: Span


@dataclass(frozen=True, slots=True)
class Floating:
    value: float
    text: str
    span: Span


@dataclass(frozen=True, slots=True)
class Apply:
    function: "Term"
    arguments: tuple["Term", ...]
    span: Span


@dataclass(frozen=True, slots=True)
class Lambda:
    usage: str  # "linear" | "affine" | "unrestricted"
    binder: Name
    binder_type: "Term"
    body: "Term"
    span: Span


@dataclass(frozen=True, slots=True)
class Arrow:
    """A function type `(A -> B -> C)`, kept as its parts (right-associative)."""

    parts: tuple["Term", ...]
    span: Span


Term = Union[Name, Natural, Integer, Floating, Apply, Lambda, Arrow]

# ---- declarations --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Clause:
    """`(keyword arg ...)` inside a declaration, e.g. `(stack cgLayers)`."""

    keyword: Name
    arguments: tuple[Term, ...]
    span: Span


@dataclass(frozen=True, slots=True)
class Import:
    path: str
    span: Span


@dataclass(frozen=True, slots=True)
class Declaration:
    """Every named declaration: `kind` says which (def, constant, buffer, ...).

    `terms` holds the positional terms in source order: for def the type and the
    body; for constant the type and optional default; for buffer and arena the
    element type and the element count; for bank the element type; for entry the
    element count. `parent` is the base configuration of `config NAME from BASE`.
    """

    kind: str
    name: Name
    terms: tuple[Term, ...]
    clauses: tuple[Clause, ...]
    doc: str | None
    span: Span
    parent: Name | None = None


@dataclass(frozen=True, slots=True)
class Module:
    path: str
    imports: tuple[Import, ...]
    declarations: tuple[Declaration, ...]


def walk(term: Term):
    """Yield a term and all its subterms, parents first."""
    stack = [term]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, Apply):
            stack.extend(reversed(node.arguments))
            stack.append(node.function)
        elif isinstance(node, Lambda):
            stack.append(node.body)
            stack.append(node.binder_type)
        elif isinstance(node, Arrow):
            stack.extend(reversed(node.parts))
