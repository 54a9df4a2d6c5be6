"""Affine functions of repeat indices: `c + k1*i1 + k2*i2 ...`, with exact integer range."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

_numbers = itertools.count()


class Int(int):
    """A signed integer value (type Int), told apart from a natural for scalar slots."""


@dataclass(frozen=True, eq=False)
class LoopVariable:
    """The index of one `nvidiaAffineLaunchRepeat`: takes the values 0 .. count-1."""

    name: str
    count: int
    number: int

    @staticmethod
    def fresh(name: str, count: int) -> "LoopVariable":
        return LoopVariable(name, count, next(_numbers))


@dataclass(frozen=True)
class Affine:
    constant: int
    terms: tuple[tuple[LoopVariable, int], ...]  # nonzero coefficients, by variable number

    @staticmethod
    def of(variable: LoopVariable) -> "Affine":
        return Affine(0, ((variable, 1),))

    def minimum(self) -> int:
        return self.constant + sum(min(0, k * (v.count - 1)) for v, k in self.terms)

    def maximum(self) -> int:
        return self.constant + sum(max(0, k * (v.count - 1)) for v, k in self.terms)

    def at(self, values: dict[LoopVariable, int]) -> int:
        return self.constant + sum(k * values[v] for v, k in self.terms)

    def __str__(self) -> str:
        return format_nat(self)


Nat = int | Affine


def normal(constant: int, coefficients: dict[LoopVariable, int]) -> Nat:
    terms = tuple(sorted(((v, k) for v, k in coefficients.items() if k), key=lambda t: t[0].number))
    return Affine(constant, terms) if terms else constant


def parts(value: Nat) -> tuple[int, dict[LoopVariable, int]]:
    if isinstance(value, int):
        return value, {}
    return value.constant, dict(value.terms)


def add(left: Nat, right: Nat, sign: int = 1) -> Nat:
    if isinstance(left, int) and isinstance(right, int):
        return left + sign * right
    c1, t1 = parts(left)
    c2, t2 = parts(right)
    for variable, k in t2.items():
        t1[variable] = t1.get(variable, 0) + sign * k
    return normal(c1 + sign * c2, t1)


def scale(value: Nat, factor: int) -> Nat:
    if isinstance(value, int):
        return value * factor
    return normal(value.constant * factor, {v: k * factor for v, k in value.terms})


def bounds(value: Nat) -> tuple[int, int]:
    if isinstance(value, int):
        return value, value
    return value.minimum(), value.maximum()


def format_nat(value: Nat) -> str:
    if isinstance(value, int):
        return str(value)
    pieces = []
    for variable, k in value.terms:
        magnitude = abs(k)
        word = variable.name if magnitude == 1 else f"{magnitude}*{variable.name}"
        if not pieces:
            pieces.append(word if k > 0 else f"-{word}")
        else:
            pieces.append(("+ " if k > 0 else "- ") + word)
    if value.constant:
        if pieces and value.terms[0][1] < 0:
            # Lead with the constant so the common `L - 1 - i` reads as written.
            return f"{value.constant} " + " ".join(
                [("- " + pieces[0][1:]) if pieces[0].startswith("-") else "+ " + pieces[0]]
                + pieces[1:])
        pieces.append(f"+ {value.constant}" if value.constant > 0 else f"- {-value.constant}")
    return " ".join(pieces)
