"""The type system: a handful of base types, element-typed storage, and functions.

Element types are `float32`, `bfloat16`, `int32` and `low`: the configuration's
low-precision type (bfloat16, or float32 in a float32 configuration). Checking is by
declared element type, so a schedule that checks in one configuration checks in all.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from ..core.elements import ELEMENT_NAMES as ELEMENTS

BASE_TYPES = ("Nat", "Float", "Int", "Schedule", "Image", "Phase", "Slots", "Entry",
              "Argument", "Scalar")
STORAGE_TYPES = ("Buffer", "Bank", "Arena")


@dataclass(frozen=True, slots=True)
class Base:
    name: str

    def __str__(self):
        return self.name


@dataclass(frozen=True, slots=True)
class ElementVar:
    """An unknown element type in a built-in's signature, fixed by unification."""

    number: int

    def __str__(self):
        return "e" if self.number < 0 else f"e{self.number}"


@dataclass(frozen=True, slots=True)
class Storage:
    kind: str  # Buffer | Bank | Arena
    element: "str | ElementVar"

    def __str__(self):
        return f"({self.kind} {self.element})"


@dataclass(frozen=True, slots=True)
class Function:
    argument: "Type"
    result: "Type"

    def __str__(self):
        parts, node = [], self
        while isinstance(node, Function):
            parts.append(str(node.argument))
            node = node.result
        parts.append(str(node))
        return "(" + " -> ".join(parts) + ")"


Type = Base | Storage | Function

NAT, FLOAT, INT = Base("Nat"), Base("Float"), Base("Int")
SCHEDULE, IMAGE, PHASE, SLOTS = Base("Schedule"), Base("Image"), Base("Phase"), Base("Slots")
ENTRY, ARGUMENT, SCALAR = Base("Entry"), Base("Argument"), Base("Scalar")
# The value of a scalar slot: a Nat, an Int or a Float; the image decides which fits.
NUMBER = Base("Number")


def function(*parts: Type) -> Type:
    result = parts[-1]
    for argument in reversed(parts[:-1]):
        result = Function(argument, result)
    return result


class Unifier:
    """Solves element variables while one application is type-checked."""

    _counter = itertools.count()

    def __init__(self):
        self.solution: dict[int, str | ElementVar] = {}

    @classmethod
    def fresh(cls) -> ElementVar:
        return ElementVar(next(cls._counter))

    def resolve(self, element):
        while isinstance(element, ElementVar) and element.number in self.solution:
            element = self.solution[element.number]
        return element

    def apply(self, t: Type) -> Type:
        if not self.solution:
            return t
        if isinstance(t, Storage):
            return Storage(t.kind, self.resolve(t.element))
        if isinstance(t, Function):
            return Function(self.apply(t.argument), self.apply(t.result))
        return t

    def unify(self, expected: Type, actual: Type) -> bool:
        if expected is actual:
            return True
        if expected == NUMBER and actual in (NAT, INT, FLOAT):
            return True
        if isinstance(expected, Base) or isinstance(actual, Base):
            return expected == actual
        if isinstance(expected, Storage) and isinstance(actual, Storage):
            if expected.kind != actual.kind:
                return False
            left, right = self.resolve(expected.element), self.resolve(actual.element)
            if left == right:
                return True
            if isinstance(left, ElementVar):
                self.solution[left.number] = right
                return True
            if isinstance(right, ElementVar):
                self.solution[right.number] = left
                return True
            return False
        if isinstance(expected, Function) and isinstance(actual, Function):
            return self.unify(expected.argument, actual.argument) and \
                self.unify(expected.result, actual.result)
        return False


def is_polymorphic(t: Type) -> bool:
    if isinstance(t, Storage):
        return isinstance(t.element, ElementVar)
    if isinstance(t, Function):
        return is_polymorphic(t.argument) or is_polymorphic(t.result)
    return False


def instantiate(t: Type) -> Type:
    """Fresh element variables for one use of a polymorphic built-in."""
    if not is_polymorphic(t):
        return t
    mapping: dict[int, ElementVar] = {}

    def go(node):
        if isinstance(node, Storage) and isinstance(node.element, ElementVar):
            fresh = mapping.setdefault(node.element.number, Unifier.fresh())
            return Storage(node.kind, fresh)
        if isinstance(node, Function):
            return Function(go(node.argument), go(node.result))
        return node

    return go(t)
