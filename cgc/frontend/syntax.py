"""The syntax tree: small immutable nodes, each carrying its source span.

Nodes are named tuples: immutable, and cheap to make by the hundred thousand.
"""

from __future__ import annotations

from typing import NamedTuple, Union

from ..core.source import Source, Span  # noqa: F401  (re-exported: the nodes carry spans)


# ---- terms -------------------------------------------------------------------------


class Name(NamedTuple):
    text: str
    span: Span


class Natural(NamedTuple):
    value: int
    span: Span


class Integer(NamedTuple):
    value: int
    span: Span


class Floating(NamedTuple):
    value: float
    text: str
    span: Span


class Apply(NamedTuple):
    function: "Term"
    arguments: tuple["Term", ...]
    span: Span


class Lambda(NamedTuple):
    usage: str  # "linear" | "affine" | "unrestricted"
    binder: Name
    binder_type: "Term"
    body: "Term"
    span: Span


class Arrow(NamedTuple):
    """A function type `(A -> B -> C)`, kept as its parts (right-associative)."""

    parts: tuple["Term", ...]
    span: Span


Term = Union[Name, Natural, Integer, Floating, Apply, Lambda, Arrow]

# ---- declarations --------------------------------------------------------------------


class Clause(NamedTuple):
    """`(keyword arg ...)` inside a declaration, e.g. `(stack cgLayers)`."""

    keyword: Name
    arguments: tuple[Term, ...]
    span: Span


class Import(NamedTuple):
    path: str
    span: Span


class Declaration(NamedTuple):
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


class Module(NamedTuple):
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
