#!/usr/bin/env python3
"""The static checker against ground truth: mutants of every schedule, and random schedules.

Two campaigns share the mutations and the judging:

- `run(limit, seed, out)` (no option; what tests/test_machine.py runs): every mutation of
  the schedules behind `cgBackward` (a grid dimension off by one, doubled or halved; a buffer
  swapped for another of the same element type; a slot index moved; a repeat count changed;
  a declared buffer shrunk), each checked statically and run on the bounds-checked NumPy
  machine (ground truth 1). 629 variants, about 10 s.

- `--all`: mutants of every schedule (SCHEDULES: the whole steps of train.cg,
  train_recompute.cg, train_parallel.cg and train_zero.cg (one rank), which include the forward pass, the backward
  pass, the optimizer and the library, sample.cg's forward, and each of `cgForward`,
  `cgBackward` and `cgOptimizer` on its own), of every kind: grids (+1, -1, x2,
  /2, =1), repeat counts (+1, -1, x2, =1), bindings (a storage, bank or entry swapped for
  another of the same element type, a slot index moved, a pointer or scalar dropped, an item
  index moved, a scalar's value changed, a launch put in another phase or in none), removed
  launches (a launch, or one side of a `cgThen`, replaced by `cgNothing`), reordered launches
  (the two sides of a `cgThen` swapped, or two neighbours), concurrency (a `cgThen` made a
  `cgConcurrently`, the launches after a join moved into one of its branches, a branch's
  arena slot renamed to one the other branch uses), storage sizes (-1, /2, a stack
  one item short), write extents shortened (a grid dimension or scalar that a write-only
  pointer's extent depends on taken to three quarters, a count to 16), slot lifetimes moved
  (an arena slot renamed to another, or two exchanged, throughout one definition), pairs of
  those, and constants (random small values of the model's shape, as `--set` does); and
  random well-typed schedules (scripts/random_schedules.py; a third of their joins
  concurrent). Each is judged by the checker, by ground truth 1, by the values ground truth
  (ground truth 1 on the memory plan's shared arena against ground truth 1 with a slot each,
  and, for a program with concurrent branches, against ground truth 1 with the branches'
  launches interleaved in orders drawn from INTERLEAVINGS: the reference is deterministic,
  so where nothing read is another slot's leftover and no branch touches what another
  writes, they all end with the same bits), and by ground
  truth 2: the emitted kernels run on the CPU under AddressSanitizer and
  UndefinedBehaviorSanitizer, each launch fenced to the views it binds, its outputs
  poisoned (scripts/ground_truth_emulated.py). The run's
  tables are in docs/checker.md, its figures in docs/benchmarks.md. `--report RECORDS`
  prints the tables again from a run's `--records`.

A FALSE ACCEPT is a variant the checker accepts and a ground truth faults on (a memory
fault of the NumPy machine: bounds, extent, slot, alias or permission; results of the
shared arena that differ from those of a slot each; or a sanitizer report, a kernel fault
or a failed launch of the emitted code). What the machines see
besides is reported apart: a value no launch wrote reaching the results (the poison), data
the reference refuses, constants the kernels do not compile for. Rejects are classified by
the checker's rule and by what confirms them; the machines do not see everything the
checker proves (an output a grid leaves uncovered, a read before any write, what a
requirement protects).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import tempfile
import time
from collections import Counter, defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from cgc.checking.check import check_program  # noqa: E402
from cgc.frontend.declarations import elaborate  # noqa: E402
from cgc.core.diagnostics import CompileError, Reporter  # noqa: E402
from cgc.frontend.evaluate import evaluate_program  # noqa: E402
from cgc.frontend.load import load  # noqa: E402
from cgc.backends.numpy.machine import Fault, Machine  # noqa: E402
from cgc.checking.concurrency import interleaved  # noqa: E402
from cgc.checking.memory import plan_memory  # noqa: E402
from cgc.core.ir import Concurrent  # noqa: E402
from cgc.backends.numpy.reference import KERNELS  # noqa: E402
from cgc.frontend.resolve import Scope  # noqa: E402
from cgc.frontend.syntax import Apply, Declaration, Lambda, Module, Name, Natural, Span  # noqa: E402
from cgc.frontend.typecheck import TypeChecker  # noqa: E402

SOURCE = os.path.join(ROOT, "schedules", "backward.cg")
ENTRY, CONFIG = "cgBackward", "tiny"
OVERRIDES = {"cgBatch": 1}  # 64 token rows: the same program, a quicker machine


@dataclass
class Variant:
    description: str
    modules: list[Module]
    kind: str = ""
    overrides: dict | None = None  # constants: what --set would change


def _replace(term, target, new):
    """The term with the node `target` (by identity) replaced by `new`."""
    if term is target:
        return new
    if isinstance(term, Apply):
        function = _replace(term.function, target, new)
        arguments = tuple(_replace(a, target, new) for a in term.arguments)
        if function is term.function and all(a is b for a, b in zip(arguments, term.arguments)):
            return term
        return Apply(function, arguments, term.span)
    if isinstance(term, Lambda):
        body = _replace(term.body, target, new)
        return term if body is term.body else term._replace(body=body)
    return term


def _with(modules, declaration: Declaration, position: int, target, new) -> list[Module]:
    term = declaration.terms[position]
    changed = declaration._replace(terms=declaration.terms[:position]
                                   + (_replace(term, target, new),)
                                   + declaration.terms[position + 1:])
    return [m._replace(declarations=tuple(changed if d is declaration else d
                                          for d in m.declarations)) for m in modules]


def _call(span: Span, function: str, *arguments) -> Apply:
    return Apply(Name(function, span), tuple(arguments), span)


def _walk(term):
    stack = [term]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, Apply):
            stack.append(node.function)
            stack.extend(node.arguments)
        elif isinstance(node, Lambda):
            stack.append(node.body)


def variants(modules: list[Module], seed: int) -> list[Variant]:
    """The backward campaign's mutations (run()): unchanged, so its figures stay comparable."""
    chooser = random.Random(seed)
    declarations = {d.name.text: d for m in modules for d in m.declarations}
    storage = {name: d for name, d in declarations.items() if d.kind in ("buffer", "arena")}
    element = {name: d.terms[0].text for name, d in storage.items()}
    found: list[Variant] = []
    schedule_defs = [d for d in declarations.values() if d.kind == "def"
                     and os.path.basename(d.span.path) in ("backward.cg", "library.cg")]
    for declaration in schedule_defs:
        body = declaration.terms[1]
        for node in _walk(body):
            if not isinstance(node, Apply) or not isinstance(node.function, Name):
                continue
            head, span = node.function.text, node.span
            where = f"{declaration.name.text} at {span}"
            if head == "cgLaunch":
                for axis, grid in enumerate(node.arguments[1:4]):
                    for change, new in (("+1", _call(span, "naturalAdd", grid, Natural(1, span))),
                                        ("-1", _call(span, "naturalSaturatingSubtract", grid,
                                                     Natural(1, span))),
                                        ("x2", _call(span, "naturalMultiply", grid,
                                                     Natural(2, span)))):
                        found.append(Variant(f"grid {'xyz'[axis]} {change} in {where}",
                                             _with(modules, declaration, 1, grid, new), "grid"))
            if head in ("cgArgument", "cgScalar") and isinstance(node.arguments[0], Natural):
                index = node.arguments[0]
                for delta in (1, -1, 5):
                    if index.value + delta >= 0:
                        new = Natural(index.value + delta, index.span)
                        found.append(Variant(f"{head} {index.value} -> {new.value} in {where}",
                                             _with(modules, declaration, 1, index, new),
                                             "binding"))
            if head == "nvidiaAffineLaunchRepeat":
                count = node.arguments[0]
                for change, new in (("+1", _call(span, "naturalAdd", count, Natural(1, span))),
                                    ("-1", _call(span, "naturalSaturatingSubtract", count,
                                                 Natural(1, span)))):
                    found.append(Variant(f"repeat count {change} in {where}",
                                         _with(modules, declaration, 1, count, new), "repeat"))
        for node in _walk(body):
            if isinstance(node, Name) and node.text in storage:
                same = [n for n in storage if element[n] == element[node.text]
                        and n != node.text and storage[n].kind == storage[node.text].kind]
                for other in chooser.sample(same, min(3, len(same))):
                    new = Name(other, node.span)
                    found.append(Variant(f"{node.text} -> {other} in {declaration.name.text} at "
                                         f"{node.span}", _with(modules, declaration, 1, node, new),
                                         "binding"))
    for name, declaration in storage.items():
        count = declaration.terms[1]
        span = count.span
        for change, new in (("-1", _call(span, "naturalSaturatingSubtract", count,
                                         Natural(1, span))),
                            ("/2", _call(span, "naturalDivideUnchecked", count,
                                         Natural(2, span)))):
            found.append(Variant(f"size of {name} {change}",
                                 _with(modules, declaration, 1, count, new), "storage"))
    return found


# ---- mutants of every schedule ---------------------------------------------------------

# (file, entry): the schedules, each judged with its own entry.
SCHEDULES = (("train.cg", "cgTrainStep"), ("backward.cg", "cgBackward"),
             ("forward.cg", "cgForward"), ("optimizer.cg", "cgOptimizer"),
             ("train_recompute.cg", "cgRecomputeTrainStep"),
             ("train_parallel.cg", "cgTrainParallelStep"), ("train_zero.cg", "cgZeroStep"),
             ("sample.cg", "cgSampleStep"))
MUTATED_FILES = tuple(schedule for schedule, _ in SCHEDULES) + ("library.cg", "launches.cg")
KINDS = ("grid", "repeat", "binding", "removed", "reordered", "concurrency", "storage",
         "extent", "lifetime",
         "combined", "constants", "random")
# How the second-order mutants are shared among the schedules.
COMBINED_SHARE = {"train.cg": 0.40, "train_recompute.cg": 0.15, "train_parallel.cg": 0.05,
                  "train_zero.cg": 0.05,
                  "backward.cg": 0.15, "forward.cg": 0.1, "optimizer.cg": 0.05,
                  "sample.cg": 0.05}
# The model's shape, and the values constant mutants draw from (the kernels' constants
# change with them: each distinct set is its own sanitized build).
CONSTANT_CHOICES = {
    "cgBatch": (1, 2, 3),
    "cgContext": (32, 64, 96, 128),
    "cgWidth": (16, 32, 48, 64, 72, 96, 128),
    "cgHeads": (1, 2, 3, 4, 8),
    "cgLayers": (1, 2, 3),
    "cgVocab": (64, 128, 192, 256, 320, 384),
    "cgThreads": (32, 64, 128, 256),
    "cgAttentionTile": (16, 32, 64, 128),
}


def _reachable(declarations: dict, entry: str) -> set[str]:
    seen, stack = set(), [entry]
    while stack:
        name = stack.pop()
        if name in seen or name not in declarations:
            continue
        seen.add(name)
        declaration = declarations[name]
        if declaration.kind != "def":
            continue
        for node in _walk(declaration.terms[1]):
            if isinstance(node, Name) and node.text in declarations:
                stack.append(node.text)
    return seen


def _head(term) -> str | None:
    """The name a term applies, if it is an application of a name."""
    return term.function.text if isinstance(term, Apply) and isinstance(term.function, Name) \
        else None


def _natural_binders(term) -> set[str]:
    return {node.binder.text for node in _walk(term) if isinstance(node, Lambda)
            and isinstance(node.binder_type, Name) and node.binder_type.text == "Nat"}


def _is_natural(term, binders: set[str], naturals: set[str]) -> bool:
    if isinstance(term, Natural):
        return True
    if isinstance(term, Name):
        return term.text in binders or term.text in naturals
    return isinstance(term, Apply) and isinstance(term.function, Name) and \
        (term.function.text.startswith("natural") or term.function.text == "cgCount")


@dataclass
class Mutant:
    """A mutation as edits of declarations: (name, position, target node, new node), or
    (name, None, None, the whole new declaration); applied to the loaded modules on demand."""

    kind: str
    description: str
    edits: tuple

    def apply(self, modules: list[Module]) -> list[Module] | None:
        """The mutated modules; None where one edit's target is gone (a combined mutant
        whose second edit lies inside what the first replaced)."""
        declarations = {d.name.text: d for m in modules for d in m.declarations}
        current: dict[str, Declaration] = {}
        for name, position, target, new in self.edits:
            declaration = current.get(name, declarations[name])
            if position is None:
                current[name] = new
                continue
            term = declaration.terms[position]
            if not any(node is target for node in _walk(term)):
                return None
            current[name] = declaration._replace(terms=declaration.terms[:position]
                                                 + (_replace(term, target, new),)
                                                 + declaration.terms[position + 1:])
        return [m._replace(declarations=tuple(current.get(d.name.text, d)
                                              for d in m.declarations)) for m in modules]


def mutants(modules: list[Module], entry: str, seed: int, swaps: int = 5) -> list[Mutant]:
    """Every mutation of the definitions `entry` reaches in the schedule files, by kind (a
    storage, bank or entry swapped for up to `swaps` others, chosen at random)."""
    chooser = random.Random(seed)
    declarations = {d.name.text: d for m in modules for d in m.declarations}
    reach = _reachable(declarations, entry)
    kinds = {name: d.kind for name, d in declarations.items()}
    storage = {n: d for n, d in declarations.items() if d.kind in ("buffer", "arena")}
    element = {n: d.terms[0].text for n, d in storage.items()}
    banks = {n: d.terms[0].text for n, d in declarations.items() if d.kind == "bank"}
    entries = [n for n, d in declarations.items() if d.kind == "entry"]
    phases = [n for n, d in declarations.items() if d.kind == "phase"]
    naturals = {n for n, d in declarations.items()
                if (d.kind == "constant" and isinstance(d.terms[0], Name)
                    and d.terms[0].text == "Nat")
                or (d.kind == "def" and isinstance(d.terms[0], Name) and d.terms[0].text == "Nat")}
    found: list[Mutant] = []
    one = lambda span: Natural(1, span)  # noqa: E731
    for declaration in sorted((declarations[n] for n in reach if kinds.get(n) == "def"
                               and os.path.basename(declarations[n].span.path) in MUTATED_FILES),
                              key=lambda d: (d.span.path, d.span.sort_key())):
        body = declaration.terms[1]
        binders = _natural_binders(body)
        name = declaration.name.text

        def add(kind, description, node, new):
            found.append(Mutant(kind, description, ((name, 1, node, new),)))

        removed = set()
        for node in _walk(body):
            if not isinstance(node, Apply) or not isinstance(node.function, Name):
                continue
            head, span = node.function.text, node.span
            where = f"{name} at {span}"
            nothing = Name("cgNothing", span)
            if head == "cgLaunch":
                for axis, grid in enumerate(node.arguments[1:4]):
                    changes = [("+1", _call(span, "naturalAdd", grid, one(span))),
                               ("-1", _call(span, "naturalSaturatingSubtract", grid, one(span))),
                               ("x2", _call(span, "naturalMultiply", grid, Natural(2, span))),
                               ("/2", _call(span, "naturalDivideUnchecked", grid,
                                            Natural(2, span)))]
                    if not (isinstance(grid, Natural) and grid.value == 1):
                        changes.append(("=1", one(span)))
                    for change, new in changes:
                        add("grid", f"grid {'xyz'[axis]} {change} in {where}", grid, new)
                if id(node) not in removed:
                    removed.add(id(node))
                    add("removed", f"launch removed in {where}", node, nothing)
            elif head in ("cgArgument", "cgScalar") and isinstance(node.arguments[0], Natural):
                index = node.arguments[0]
                for delta in (1, -1, 5):
                    if index.value + delta >= 0:
                        new = Natural(index.value + delta, index.span)
                        add("binding", f"{head} {index.value} -> {new.value} in {where}", index,
                            new)
            elif head == "cgPointer":
                add("binding", f"pointer {_index_text(node)} dropped in {where}", node,
                    node.arguments[2])
            elif head == "cgSlot":
                add("binding", f"scalar {_index_text(node)} dropped in {where}", node,
                    node.arguments[2])
                value = node.arguments[1]
                if _is_natural(value, binders, naturals):
                    for change, new in (("+1", _call(span, "naturalAdd", value, one(span))),
                                        ("-1", _call(span, "naturalSaturatingSubtract", value,
                                                     one(span))),
                                        ("x2", _call(span, "naturalMultiply", value,
                                                     Natural(2, span))),
                                        ("/2", _call(span, "naturalDivideUnchecked", value,
                                                     Natural(2, span)))):
                        add("binding", f"scalar {_index_text(node)} value {change} in {where}",
                            value, new)
            elif head == "cgItem":
                index = node.arguments[1]
                for change, new in (("+1", _call(span, "naturalAdd", index, one(span))),
                                    ("-1", _call(span, "naturalSaturatingSubtract", index,
                                                 one(span)))):
                    add("binding", f"item index {change} in {where}", index, new)
            elif head == "nvidiaAffineLaunchRepeat":
                count = node.arguments[0]
                for change, new in (("+1", _call(span, "naturalAdd", count, one(span))),
                                    ("-1", _call(span, "naturalSaturatingSubtract", count,
                                                 one(span))),
                                    ("x2", _call(span, "naturalMultiply", count,
                                                 Natural(2, span))),
                                    ("=1", one(span))):
                    add("repeat", f"repeat count {change} in {where}", count, new)
            elif head == "cgPhase":
                phase = node.arguments[0]
                if isinstance(phase, Name):
                    others = [p for p in phases if p != phase.text]
                    for other in chooser.sample(others, min(3, len(others))):
                        add("binding", f"phase {phase.text} -> {other} in {where}", phase,
                            Name(other, phase.span))
                add("binding", f"phase {_text(phase)} removed (no phase) in {where}", node,
                    node.arguments[1])
            elif head == "cgThen":
                first, second = node.arguments
                add("reordered", f"cgThen sides swapped in {where}", node,
                    Apply(node.function, (second, first), span))
                concurrently = Name("cgConcurrently", node.function.span)
                add("concurrency", f"cgThen made cgConcurrently in {where}", node,
                    Apply(concurrently, (first, second), span))
                if _head(first) == "cgConcurrently":  # what follows the join moved into a branch
                    left, right = first.arguments
                    add("concurrency", f"the launches after a join moved into its last branch "
                                       f"in {where}", node,
                        Apply(first.function, (left, Apply(node.function, (right, second),
                                                                  span)), span))
                    add("concurrency", f"the launches after a join moved into its first branch "
                                       f"in {where}", node,
                        Apply(first.function, (Apply(node.function, (left, second), span),
                                               right), span))
            elif head == "cgConcurrently":
                left, right = node.arguments
                theirs = sorted({n.text for n in _walk(right) if isinstance(n, Name)
                                 and n.text in storage and storage[n.text].kind == "arena"})
                for mine in [n for n in _walk(left) if isinstance(n, Name) and n.text in storage
                             and storage[n.text].kind == "arena"][:3]:
                    same = [t for t in theirs if t != mine.text and element[t] == element[mine.text]]
                    for other in chooser.sample(same, min(2, len(same))):
                        add("concurrency", f"branch 0's {mine.text} -> branch 1's {other} (a "
                                           f"slot shared) in {where}", mine,
                            Name(other, mine.span))
                if isinstance(second, Apply) and isinstance(second.function, Name) and \
                        second.function.text == "cgThen":
                    inner_first, rest = second.arguments
                    swapped = Apply(node.function, (inner_first, Apply(
                        second.function, (first, rest), second.span)), span)
                    add("reordered", f"neighbours swapped in {where}", node, swapped)
                for side, operand in (("first", first), ("second", second)):
                    if id(operand) in removed:
                        continue
                    removed.add(id(operand))
                    add("removed", f"{side} side of cgThen removed in {where}", operand,
                        Name("cgNothing", operand.span))
        for node in _walk(body):
            if not isinstance(node, Name):
                continue
            text, where = node.text, f"{name} at {node.span}"
            if text in storage:
                same = [n for n in storage if element[n] == element[text]
                        and n != text and storage[n].kind == storage[text].kind]
                for other in chooser.sample(same, min(swaps, len(same))):
                    add("binding", f"{text} -> {other} in {where}", node,
                        Name(other, node.span))
            elif text in banks:
                for other in sorted(b for b in banks if b != text and banks[b] == banks[text]):
                    add("binding", f"bank {text} -> {other} in {where}", node,
                        Name(other, node.span))
            elif text in entries:
                others = [e for e in entries if e != text]
                for other in chooser.sample(others, min(swaps, len(others))):
                    add("binding", f"entry {text} -> {other} in {where}", node,
                        Name(other, node.span))
    found.extend(_extent_mutants(declarations, reach, kinds))
    found.extend(_lifetime_mutants(declarations, reach, kinds, chooser))
    used = {node.text for n in reach if kinds.get(n) == "def"
            for node in _walk(declarations[n].terms[1]) if isinstance(node, Name)}
    for name, declaration in declarations.items():
        if declaration.kind not in ("buffer", "arena", "entry") or name not in used:
            continue
        position = 1 if declaration.kind != "entry" else 0
        count = declaration.terms[position]
        span = count.span
        for change, new in (("-1", _call(span, "naturalSaturatingSubtract", count, one(span))),
                            ("/2", _call(span, "naturalDivideUnchecked", count,
                                         Natural(2, span)))):
            found.append(Mutant("storage", f"size of {name} {change}",
                                ((name, position, count, new),)))
        for clause in declaration.clauses:
            if clause.keyword.text == "stack" and clause.arguments:
                items = clause.arguments[0]
                shorter = clause._replace(arguments=(_call(
                    clause.span, "naturalSaturatingSubtract", items, one(clause.span)),))
                changed = declaration._replace(clauses=tuple(
                    shorter if c is clause else c for c in declaration.clauses))
                found.append(Mutant("storage", f"stack of {name} -1",
                                    ((name, None, None, changed),)))
    return found


def _mutated_defs(declarations, reach, kinds):
    return sorted((declarations[n] for n in reach if kinds.get(n) == "def"
                   and os.path.basename(declarations[n].span.path) in MUTATED_FILES),
                  key=lambda d: (d.span.path, d.span.sort_key()))


def _write_shapes(image: Declaration) -> tuple[set[int], set[int]]:
    """(grid axes, scalar indices) that the extent of one of an image's write-only pointers
    depends on: shrinking one shortens what the launch writes."""
    scalars = {c.arguments[1].text: c.arguments[0].value for c in image.clauses
               if c.keyword.text == "scalar" and len(c.arguments) >= 2}
    axes, indices = set(), set()
    for clause in image.clauses:
        if clause.keyword.text != "pointer" or len(clause.arguments) < 5 or \
                _text(clause.arguments[3]) != "write":
            continue
        for node in _walk(clause.arguments[4]):
            if isinstance(node, Name):
                if node.text in ("gridX", "gridY", "gridZ"):
                    axes.add("XYZ".index(node.text[-1]))
                elif node.text in scalars:
                    indices.add(scalars[node.text])
    return axes, indices


def _extent_mutants(declarations, reach, kinds) -> list[Mutant]:
    """A write's extent shortened, the rest of the launch as it was: a grid dimension or a
    scalar the extent of a write-only pointer depends on taken to three quarters, or a
    scalar count to 16 (the rest of the output keeps what it held before: the memory plan
    must keep that alive wherever it is read again)."""
    found = []
    libraries = [d for d in declarations.values() if d.kind == "image"
                 and any(c.keyword.text == "library" for c in d.clauses)]
    for declaration in _mutated_defs(declarations, reach, kinds):
        name = declaration.name.text
        for node in _walk(declaration.terms[1]):
            if not (isinstance(node, Apply) and isinstance(node.function, Name)
                    and node.function.text == "cgLaunch" and node.arguments
                    and isinstance(node.arguments[0], Name)):
                continue
            image = declarations.get(node.arguments[0].text)
            if image is not None and image.kind == "image":
                axes, indices = _write_shapes(image)
            else:  # the image is a parameter (the products' one launch): any library image
                axes, indices = set(), set()
                for other in libraries:
                    indices |= _write_shapes(other)[1]
            span, where = node.span, f"{name} at {node.span}"
            for axis in sorted(axes):
                grid = node.arguments[1 + axis]
                new = _call(span, "naturalDivideUnchecked",
                            _call(span, "naturalMultiply", grid, Natural(3, span)),
                            Natural(4, span))
                found.append(Mutant("extent", f"write shortened: grid {'xyz'[axis]} x3/4 in "
                                              f"{where}", ((name, 1, grid, new),)))
            for slot in _walk(node):
                if not (isinstance(slot, Apply) and isinstance(slot.function, Name)
                        and slot.function.text == "cgSlot"):
                    continue
                index = slot.arguments[0]
                if not (isinstance(index, Apply) and index.arguments
                        and isinstance(index.arguments[0], Natural)
                        and index.arguments[0].value in indices):
                    continue
                value, at = slot.arguments[1], slot.span
                for change, new in (("x3/4", _call(at, "naturalDivideUnchecked", _call(
                                        at, "naturalMultiply", value, Natural(3, at)),
                                        Natural(4, at))),
                                    ("=16", Natural(16, at))):
                    found.append(Mutant("extent", f"write shortened: scalar "
                                                  f"{index.arguments[0].value} {change} in "
                                                  f"{where}", ((name, 1, value, new),)))
    return found


def _renamed(term, mapping: dict):
    """The term with every name in `mapping` renamed; untouched subterms kept (by identity),
    so that a second mutation's target can still be found in it."""
    if isinstance(term, Name):
        return Name(mapping[term.text], term.span) if term.text in mapping else term
    if isinstance(term, Apply):
        function = _renamed(term.function, mapping)
        arguments = tuple(_renamed(a, mapping) for a in term.arguments)
        if function is term.function and all(a is b for a, b in zip(arguments, term.arguments)):
            return term
        return Apply(function, arguments, term.span)
    if isinstance(term, Lambda):
        body = _renamed(term.body, mapping)
        return term if body is term.body else term._replace(body=body)
    return term


def with_slots_renamed(declaration, mapping: dict):
    """`declaration` with every use of each arena slot of `mapping` renamed: a slot-lifetime
    mutant's edit."""
    return declaration._replace(terms=(declaration.terms[0],
                                       _renamed(declaration.terms[1], mapping))
                                + declaration.terms[2:])


def _lifetime_mutants(declarations, reach, kinds, chooser) -> list[Mutant]:
    """Slot lifetimes moved: within one definition, every use of an arena slot renamed to
    another slot of its element type, or two slots' uses exchanged. The definition computes
    what it did, in other bytes; what it leaves in the slots, and when, changes, and so do
    the live ranges the memory plan shares the arena by."""
    found = []
    arena = {n: d.terms[0].text for n, d in declarations.items() if d.kind == "arena"}
    for declaration in _mutated_defs(declarations, reach, kinds):
        name, body = declaration.name.text, declaration.terms[1]
        used = sorted({node.text for node in _walk(body)
                       if isinstance(node, Name) and node.text in arena})
        for slot in used:
            same = sorted(n for n in arena if arena[n] == arena[slot] and n != slot)
            for other in chooser.sample(same, min(2, len(same))):
                mapping = {slot: other, other: slot} if other in used else {slot: other}
                verb = "exchanged with" if other in used else "renamed"
                changed = with_slots_renamed(declaration, mapping)
                found.append(Mutant("lifetime", f"slot {slot} {verb} {other} throughout "
                                                f"{name}", ((name, None, None, changed),)))
    return found


def combined(single: list[Mutant], count: int, seed: int) -> list[Mutant]:
    """`count` second-order mutants: two single mutations of different kinds or places,
    drawn at random, applied one after the other."""
    chooser = random.Random(seed * 104729 + 3)
    found, seen = [], set()
    attempts = 0
    while len(found) < count and attempts < count * 20:
        attempts += 1
        a, b = chooser.sample(range(len(single)), 2)
        first, second = single[a], single[b]
        if (min(a, b), max(a, b)) in seen or first.description == second.description:
            continue
        seen.add((min(a, b), max(a, b)))
        found.append(Mutant("combined", f"{first.description}; and {second.description}",
                            first.edits + second.edits))
    return found


def schedule_mutants(schedule: str, entry: str, modules, seed: int, pairs: int) -> list[Mutant]:
    """A schedule's single mutants, then its share of `pairs` second-order ones."""
    single = mutants(modules, entry, seed)
    return single + combined(single, round(pairs * COMBINED_SHARE.get(schedule, 0)), seed)


def _index_text(node: Apply) -> str:
    index = node.arguments[0]
    if isinstance(index, Apply) and index.arguments and isinstance(index.arguments[0], Natural):
        return str(index.arguments[0].value)
    return "?"


def _text(term) -> str:
    return term.text if isinstance(term, Name) else "?"


# The shape the constant mutants start from: config tiny with OVERRIDES.
BASE_SHAPE = {"cgBatch": 1, "cgContext": 64, "cgWidth": 64, "cgHeads": 4, "cgLayers": 2,
              "cgVocab": 256, "cgThreads": 128, "cgAttentionTile": 64}


def constant_sets(count: int, seed: int) -> list[dict]:
    """`count` distinct overrides of the model's shape, each changing one to three constants
    of config tiny with cgBatch 1 to other small values."""
    chooser = random.Random(seed * 7919 + 17)
    found, seen = [], set()
    while len(found) < count:
        chosen = dict(OVERRIDES)
        for name in chooser.sample(sorted(CONSTANT_CHOICES), chooser.randint(1, 3)):
            chosen[name] = chooser.choice([v for v in CONSTANT_CHOICES[name]
                                           if v != BASE_SHAPE[name]])
        key = tuple(sorted(chosen.items()))
        if key in seen:
            continue
        seen.add(key)
        found.append(chosen)
    return found


# ---- judging ---------------------------------------------------------------------------

RULES = (  # (rule, a pattern of its message), checked in order
    ("requirement", r"the model requires|but the other roles make it"),
    ("linearity", r"binder .* must be used"),
    ("no such bank entry", r"has no copy in bank"),
    ("item of a non-stack", r"cgItem takes a stacked buffer"),
    ("storage size", r"element count of .* must be a positive"),
    ("item out of range", r"is out of range: .* items"),
    ("not bound", r"is not bound"),
    ("bound twice", r"is bound twice"),
    ("no such argument", r"has no (pointer|scalar) argument"),
    ("element type", r"takes \w+, but '.*' holds"),
    ("scalar kind or range", r"is a float32; found|is an int32|does not fit in"),
    ("extent not affine", r"is not affine in the repeat indices|the extent of pointer"),
    ("concurrency", r"concurrent branches may not touch|state of its own on the device|"
                    r"communicator runs one collective"),
    ("bounds", r"elements of '.*' through pointer"),
    ("covers", r"must cover all of"),
    ("alignment", r"needs \d+-byte alignment"),
    ("read before write", r"but nothing earlier in the step"),
    ("grid", r"grid dimension"),
    ("block", r"block dimension|threads a block"),
    ("outside a phase", r"outside any phase"),
    ("permission", r"may not write bank|phase and may not write"),
    ("aliasing", r"overlap in '"),
    ("not affine", r"not affine"),
    ("launch limit", r"more than cgc's limit"),
    ("division by zero", r"division by zero"),
)


# A variant broken several ways is counted under the first of its rules in this order:
# what leaves no C program first, then the shape, bounds, placement and order.
PRECEDENCE = ("linearity", "no such bank entry", "item of a non-stack", "storage size",
              "not bound", "bound twice", "no such argument", "element type",
              "scalar kind or range", "requirement", "item out of range", "not affine",
              "division by zero", "launch limit", "grid", "block", "extent not affine",
              "bounds", "alignment", "aliasing", "outside a phase", "permission", "covers",
              "concurrency", "read before write", "front end")


def rule_of(message: str) -> str:
    for rule, pattern in RULES:
        if re.search(pattern, message):
            return rule
    return "front end"


def primary_rule(rules: list[str]) -> str:
    return min(rules, key=lambda r: PRECEDENCE.index(r) if r in PRECEDENCE else
               len(PRECEDENCE)) if rules else "front end"


@contextmanager
def requirements_off():
    """Evaluation without the model's `require` declarations: what a requirement rejects can
    still run on the ground truths (the script's own switch; cgc always checks them)."""
    from cgc.frontend.evaluate import Evaluator
    original = Evaluator.check_requirements
    Evaluator.check_requirements = lambda self, roles: None
    try:
        yield
    finally:
        Evaluator.check_requirements = original


def front_end(modules, source, entry, config, overrides):
    """The front end on loaded modules: the evaluated program, or CompileError."""
    report = Reporter()
    scope = Scope(modules, report)
    declarations = elaborate(scope, report)
    TypeChecker(scope, declarations, report).check_all()
    report.raise_if_errors()
    return evaluate_program(scope, declarations, source, entry, config, overrides, report)


def evaluate_variant(modules, source, entry, config, overrides):
    """(program or None, checker verdict, rules, first message, warned?)."""
    try:
        program = front_end(modules, source, entry, config, overrides)
    except CompileError as error:
        errors = [d.message for d in error.diagnostics if d.severity == "error"]
        rules = sorted({rule_of(m) for m in errors})
        if rules == ["requirement"]:
            with requirements_off():
                try:
                    program = front_end(modules, source, entry, config, overrides)
                except CompileError:
                    return None, "front end", rules, errors[0], False
            return program, "rejected", rules, errors[0], False
        return None, "front end", rules, errors[0] if errors else "", False
    except RecursionError:
        return None, "front end", ["front end"], "too deep", False
    check_report = Reporter()
    check_program(program, check_report)
    errors = [d.message for d in check_report.diagnostics if d.severity == "error"]
    warned = any(d.severity == "warning" for d in check_report.diagnostics) or \
        bool(program.warnings)
    if errors:
        return program, "rejected", sorted({rule_of(m) for m in errors}), errors[0], warned
    return program, "accepted", [], "", warned


def tokens_for(program, seed: int = 1):
    generator = np.random.default_rng(seed)
    vocab = int(program.roles.get("vocab", program.constants.get("cgVocab", 2)))
    found = []
    for role in ("ids", "targets"):
        label = program.roles.get(role)
        count = program.storages[label].count if label in program.storages else 0
        found.append(generator.integers(0, vocab, count))
    return found


MEMORY_FAULTS = ("bounds", "extent", "slot", "alias", "permission")


def ground_truth_1(program, parameters=None, share: bool = True, machines=None,
                   interleaving: int | None = None) -> tuple[str, str]:
    """The NumPy machine: ("safe", "") or ("faulted", "KIND: message"); the machine is
    appended to `machines`, for its memory to be compared. `share`: the memory plan's
    shared arena, or a slot each. `interleaving`: the launches of concurrent branches in
    the interleaving that seed draws, not in program order."""
    plan = plan_memory(program, share=share)
    machine = Machine(program, plan, KERNELS)
    if machines is not None:
        machines.append(machine)
    for role, values in zip(("ids", "targets"), tokens_for(program)):
        label = program.roles.get(role)
        if label in program.storages:
            machine.store(label, values)
    label = program.roles.get("learningRate")
    if label in program.storages:  # the runtime writes the step's rate: the schedule's peak
        rate = float(program.roles.get("peakLearningRate", 1e-3))
        machine.store(label, np.full(program.storages[label].count, rate, dtype=np.float32))
    if parameters is not None:
        for bank, declaration in program.banks.items():
            if declaration.role in ("parameters", "copies"):
                for name, values in parameters.items():
                    label = f"{bank}.{name}"
                    if label in program.storages:
                        count = program.storages[label].count
                        machine.store(label, np.resize(values, count))
    try:
        with np.errstate(all="ignore"):
            machine.run(order=None if interleaving is None else
                        interleaved(program, interleaving))
    except Fault as fault:
        return "faulted", f"{fault.kind}: {fault}"
    except (ValueError, IndexError, ZeroDivisionError, KeyError) as error:
        # A reference function whose arithmetic fails on the values (not a checked access).
        return "faulted", f"crash: {type(error).__name__}: {error}"
    return "safe", ""


def ground_truth_values(program, parameters, shared: Machine) -> tuple[str, str]:
    """The values ground truth: the run on the memory plan's shared arena against a run in
    which every arena slot has bytes of its own, and, where the program has concurrent
    branches, against runs of the shared arena with the branches' launches interleaved
    (INTERLEAVINGS seeds). The reference is deterministic, so a program whose meaning fixes
    its results (nothing it reads is another slot's leftover, no branch touches what another
    writes) ends with the same bits in every bank and step buffer: ("same", ""), or
    ("differ", what first differs)."""
    others = [("with a slot each", {"share": False})]
    if any(isinstance(node, Concurrent) for node in _nodes(program.body)):
        others += [(f"with the branches interleaved (seed {seed})", {"interleaving": seed})
                   for seed in INTERLEAVINGS]
    for what, options in others:
        machines = []
        verdict, why = ground_truth_1(program, parameters, machines=machines, **options)
        if verdict != "safe":
            return "differ", f"the run {what} faults where the first does not: {why}"
        difference = _first_difference(program, shared, machines[0])
        if difference:
            return "differ", f"{difference}, {what}"
    return "same", ""


INTERLEAVINGS = (1, 2)


def _nodes(nodes):
    for node in nodes:
        yield node
        if hasattr(node, "body"):
            yield from _nodes(node.body)


def _first_difference(program, shared: Machine, other: Machine) -> str:
    """The first storage (but the arena's) whose bits differ between two runs, or ''."""
    for home in sorted(h for h in shared.memory if h != "arena"):
        if np.array_equal(shared.memory[home], other.memory[home]):
            continue
        for label, storage in program.storages.items():  # which storage, for the message
            if storage.kind == "arena" or (storage.kind == "bank") != (home != "buffers"):
                continue
            a, b = shared.array(label), other.array(label)
            if a.tobytes() != b.tobytes():
                count = int(np.sum(a.view(np.uint8) != b.view(np.uint8)))
                return f"{label} ({count} bytes differ)"
        return home
    return ""


def judge(modules: list[Module]) -> tuple[str, str]:
    """(checker verdict, ground truth) for one variant of the backward campaign (run())."""
    try:
        program = front_end(modules, SOURCE, ENTRY, CONFIG, OVERRIDES)
    except CompileError as error:
        return "front end", error.diagnostics[0].message
    check_report = Reporter()
    check_program(program, check_report)
    errors = [d.message for d in check_report.diagnostics if d.severity == "error"]
    verdict = ("rejected", errors[0]) if errors else ("accepted", "")
    plan = plan_memory(program)
    machine = Machine(program, plan, KERNELS)
    generator = np.random.default_rng(1)
    for name in ("cgIds", "cgTargets"):
        count = program.storages[name].count
        machine.store(name, generator.integers(0, program.constants["cgVocab"], count))
    try:
        with np.errstate(all="ignore"):
            machine.run()
    except Fault as fault:
        return verdict, ("faulted", f"{fault.kind}: {fault}")
    return verdict, ("safe", "")


def run(limit: int | None, seed: int, out=None) -> Counter:
    """The backward campaign: the checker against the NumPy machine (tests/test_machine.py);
    its table on `out` (the standard output as it is at the call, where not given)."""
    out = sys.stdout if out is None else out
    modules = load([SOURCE], Reporter())
    found = variants(modules, seed)
    if limit is not None and len(found) > limit:
        found = random.Random(seed).sample(found, limit)
    table: Counter = Counter()
    faults: Counter = Counter()
    false_accepts, false_rejects = [], []
    for variant in found:
        verdict, truth = judge(variant.modules)
        if verdict == "front end":
            table["rejected by the front end (not run)"] += 1
            continue
        (said, reason), (happened, why) = verdict, truth
        if happened == "faulted":
            faults[why.split(":")[0]] += 1
        if said == "accepted" and happened == "safe":
            table["accepted and safe"] += 1
        elif said == "rejected" and happened == "faulted":
            table["rejected, and the machine faults"] += 1
        elif said == "accepted":
            table["accepted but faulted (FALSE ACCEPT)"] += 1
            false_accepts.append((variant.description, why))
        else:
            table["rejected but safe (false reject)"] += 1
            false_rejects.append((variant.description, reason))
    total = sum(table.values())
    print(f"{total} variants of {os.path.relpath(SOURCE, ROOT)} ({ENTRY}, config {CONFIG}, "
          f"cgBatch 1), seed {seed}:", file=out)
    for row in ("accepted and safe", "rejected, and the machine faults",
                "accepted but faulted (FALSE ACCEPT)", "rejected but safe (false reject)",
                "rejected by the front end (not run)"):
        print(f"  {row:<40} {table[row]:>5}", file=out)
    print("  faults by kind: " + ", ".join(f"{kind} {count}" for kind, count in
                                           sorted(faults.items())), file=out)
    by_rule = Counter(rule_of(reason) for _, reason in false_rejects)
    if by_rule:
        print("  false rejects by rule (what the machine cannot see): " + ", ".join(
            f"{rule} {count}" for rule, count in sorted(by_rule.items())), file=out)
    for description, why in false_accepts:
        print(f"FALSE ACCEPT: {description}: {why}", file=out)
    for description, reason in false_rejects:
        print(f"false reject: {description}: {reason}", file=out)
    table["total"] = total
    table.update({f"fault {kind}": count for kind, count in faults.items()})
    return table


# ---- the whole campaign ----------------------------------------------------------------


@dataclass
class Case:
    """One variant to judge, as a recipe every lane can rebuild."""

    number: int
    schedule: str  # file in schedules/, or "random"
    entry: str
    kind: str
    description: str
    index: int = -1  # into mutants(...) of the schedule, for syntax mutants
    overrides: dict = field(default_factory=lambda: dict(OVERRIDES))
    text: str = ""  # a random schedule's source
    emulate: bool = True  # judged by ground truth 2 too


class Lane:
    """A process's share of the campaign: the schedules' modules and mutants, rebuilt once,
    and its own ground-truth-2 workers."""

    def __init__(self, seed: int, pairs: int, libraries: dict, emulated: bool, budget: float,
                 threads: int, scratch: str | None = None, values: str = "all"):
        self.seed = seed
        self.values = values  # the values ground truth on "all" safe variants, or "accepted"
        self.modules, self.mutants = {}, {}
        for schedule, entry in SCHEDULES:
            path = os.path.join(ROOT, "schedules", schedule)
            modules = load([path], Reporter())
            self.modules[schedule] = modules
            self.mutants[schedule] = schedule_mutants(schedule, entry, modules, seed, pairs)
        self.libraries = libraries  # library_key -> path, or "!reason"
        self.emulated = emulated
        self.workers = None
        if emulated:
            import ground_truth_emulated
            self.workers = ground_truth_emulated.Workers(threads=threads, budget=budget)
        self.owned = scratch is None  # where random schedules are written, to be loaded
        self.scratch = tempfile.mkdtemp(prefix="cgc-random-") if scratch is None else scratch
        self.parameters = {}

    def close(self):
        if self.workers is not None:
            self.workers.stop()
        if self.owned:
            import shutil
            shutil.rmtree(self.scratch, ignore_errors=True)

    def _parameters(self, program):
        from cgc.backends.base import initial_parameters
        key = tuple(sorted((e.name, e.count) for e in program.entries))
        if key not in self.parameters:
            self.parameters[key] = initial_parameters(program, 0)
        return self.parameters[key]

    def judge(self, case: Case) -> dict:
        started = time.perf_counter()
        record = {"number": case.number, "schedule": case.schedule, "entry": case.entry,
                  "kind": case.kind, "description": case.description}
        if case.schedule == "random":
            import random_schedules
            path = random_schedules.write(case.text, self.scratch, case.number)
            modules = load([path], Reporter())
            source = path
        else:
            source = os.path.join(ROOT, "schedules", case.schedule)
            modules = self.modules[case.schedule]
            if case.index >= 0:
                modules = self.mutants[case.schedule][case.index].apply(modules)
                if modules is None:
                    record.update(verdict="void", rules=[], message="", warned=False,
                                  gt1="not run", gt2="not run", seconds=0.0)
                    return record
        program, verdict, rules, message, warned = evaluate_variant(
            modules, source, case.entry, CONFIG, case.overrides)
        record.update(verdict=verdict, rules=rules, rule=primary_rule(rules) if rules else "",
                      message=message[:300], warned=warned)
        if program is None:
            record.update(gt1="not run", gt2="not run", seconds=time.perf_counter() - started)
            return record
        record["whole_step"] = program.roles.get("step") == program.entry
        parameters = self._parameters(program)
        machines = []
        record["gt1"], record["gt1_why"] = ground_truth_1(program, parameters,
                                                          machines=machines)
        record["gt1_seconds"] = time.perf_counter() - started
        if record["gt1"] == "safe" and (self.values == "all" or verdict == "accepted"):
            record["values"], record["values_why"] = ground_truth_values(
                program, parameters, machines[0])
        else:
            record["values"] = "not run"
        if self.emulated and case.emulate:
            import ground_truth_emulated as gt2
            key = repr(gt2.library_key(program))
            library = self.libraries.get(key)
            if library is None:
                record["gt2"], record["gt2_why"] = "not run", "no library for these constants"
            elif library.startswith("!"):
                record["gt2"], record["gt2_why"] = "unbuilt", library[1:]
            else:
                plan = plan_memory(program, red_zone=gt2.RED_ZONE)
                job = gt2.make_job(program, plan, parameters,
                                   [list(map(int, t)) for t in tokens_for(program)])
                verdict2, why, seconds = self.workers.run(library, job)
                record.update(gt2=verdict2, gt2_why=why[:400], gt2_seconds=seconds)
        else:
            record["gt2"] = "not run"
        record["seconds"] = time.perf_counter() - started
        return record


_LANE: Lane | None = None


def _lane_start(seed, pairs, libraries, emulated, budget, threads, scratch, values):
    global _LANE
    from multiprocessing.util import Finalize
    _LANE = Lane(seed, pairs, libraries, emulated, budget, threads, scratch, values)
    Finalize(_LANE, _LANE.close, exitpriority=10)  # its workers stopped as the pool closes


def _lane_judge(case: Case) -> dict:
    try:
        return _LANE.judge(case)
    except Exception as error:  # noqa: BLE001 - a script bug must not lose the campaign
        import traceback
        return {"number": case.number, "schedule": case.schedule, "entry": case.entry,
                "kind": case.kind, "description": case.description, "verdict": "error",
                "rules": [], "message": f"{type(error).__name__}: {error}",
                "trace": traceback.format_exc()[-2000:], "gt1": "not run", "gt2": "not run"}


def cases(seed: int, limit: int | None, randoms: int, constants: int, pairs: int,
          kinds: tuple | None = None) -> list[Case]:
    """Every case of the campaign: the mutants of each schedule (a sample of `limit` of them
    in all, spread over the schedules in proportion; only those of `kinds` where given),
    constant mutants of each schedule, and random schedules."""
    found: list[Case] = []
    syntax = []
    for schedule, entry in SCHEDULES:
        path = os.path.join(ROOT, "schedules", schedule)
        modules = load([path], Reporter())
        for index, variant in enumerate(schedule_mutants(schedule, entry, modules, seed, pairs)):
            if kinds is None or variant.kind in kinds:
                syntax.append((schedule, entry, variant.kind, variant.description, index))
    if limit is not None and len(syntax) > limit:
        # a few of every kind, however rare (the second-order and concurrency mutants are
        # few among thousands), and the rest at random
        chooser = random.Random(seed)
        by_kind = defaultdict(list)
        for item in syntax:
            by_kind[item[2]].append(item)
        kept = [item for kind in sorted(by_kind) for item in
                chooser.sample(by_kind[kind], min(5, len(by_kind[kind])))]
        rest = [item for item in syntax if item not in kept]
        kept += chooser.sample(rest, max(0, limit - len(kept)))
        syntax = sorted(kept, key=lambda s: (s[0], s[4]))
    for schedule, entry, kind, description, index in syntax:
        found.append(Case(len(found), schedule, entry, kind, description, index))
    for overrides in constant_sets(constants, seed):
        changed = ", ".join(f"{k}={v}" for k, v in overrides.items() if OVERRIDES.get(k) != v)
        for schedule, entry in SCHEDULES:
            found.append(Case(len(found), schedule, entry, "constants", f"--set {changed}",
                              overrides=overrides))
    if randoms:
        import random_schedules
        base = base_program(OVERRIDES)
        for number, text in enumerate(random_schedules.generate(base, randoms, seed)):
            found.append(Case(len(found), "random", random_schedules.ENTRY, "random",
                              f"random schedule {number} (seed {seed})", text=text))
    return found


# Every image a schedule of the campaign launches: the training step, its recomputing,
# data-parallel and ZeRO-1 twins (the collectives) and the seed's backward (its own loss, cross-entropy,
# scatter and accumulating products); sample.cg's forward is the training step's.
LIBRARY_SCHEDULE = """import "{folder}/train.cg"
import "{folder}/train_recompute.cg"
import "{folder}/train_parallel.cg"
import "{folder}/train_zero.cg"
def cgGroundTruthLibrary : (family NvidiaLaunchSchedule) =
  (cgThen cgTrainStep (cgThen cgRecomputeTrainStep
    (cgThen cgAllReduceOutside (cgThen cgZeroStep (cgThen cgZeroGradients cgBackward)))))
"""


def base_program(overrides: dict):
    """A program launching every image a variant may use, with these constants
    (requirements not enforced): what a library of kernels is built from."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "library.cg")
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(LIBRARY_SCHEDULE.format(
                folder=os.path.relpath(os.path.join(ROOT, "schedules"), folder)))
        with requirements_off():
            return front_end(load([path], Reporter()), path, "cgGroundTruthLibrary", CONFIG,
                             overrides)


def build_libraries(override_sets: list[dict], jobs: int, out) -> dict:
    """library_key -> the sanitized library's path (or "!why" where the kernels do not
    compile for those constants), each distinct set of kernel constants built once."""
    import concurrent.futures
    import ground_truth_emulated as gt2
    from cgc.backends.cuda.emulated import BuildFailed
    programs = {}
    for overrides in override_sets:
        try:
            program = base_program(overrides)
        except CompileError:
            continue
        programs.setdefault(repr(gt2.library_key(program)), program)

    def one(item):
        key, program = item
        try:
            return key, gt2.build_library(program)
        except BuildFailed as error:
            found = re.search(r"(static assertion failed[^\n]*|error: [^\n]*)", str(error))
            return key, "!the kernels do not compile for these constants: " + (
                found.group(1) if found else str(error)[-200:])

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max(jobs, 1)) as pool:
        libraries = dict(pool.map(one, programs.items()))
    failed = sum(1 for v in libraries.values() if v.startswith("!"))
    print(f"kernel libraries: {len(libraries)} sets of kernel constants, {failed} refused by "
          f"the kernels' static_asserts, {time.perf_counter() - started:.0f} s", file=out)
    return libraries


def campaign(seed: int = 0, limit: int | None = None, randoms: int = 500, constants: int = 40,
             pairs: int = 1200, jobs: int = 2, emulated: bool = True, budget: float = 60.0,
             out=None, records_path: str | None = None, progress: bool = False,
             emulated_limit: int | None = None, values: str = "all",
             kinds: tuple | None = None) -> dict:
    """The whole campaign; returns the summary (and prints the tables). `emulated_limit`:
    ground truth 2 judges only a random sample of that many variants (all: None).
    `values`: the values ground truth on every variant GT1 runs safely ("all"), or on the
    accepted ones only ("accepted": all that false accepts need). The tables on `out` (the
    standard output as it is at the call, where not given)."""
    import multiprocessing
    out = sys.stdout if out is None else out
    started = time.perf_counter()
    found = cases(seed, limit, randoms, constants, pairs, kinds)
    if emulated_limit is not None and emulated_limit < len(found):
        chosen = set(random.Random(seed + 1).sample(range(len(found)), emulated_limit))
        for case in found:
            case.emulate = case.number in chosen
    override_sets = [dict(OVERRIDES)] + [c.overrides for c in found if c.kind == "constants"]
    libraries = build_libraries(override_sets, jobs, out) if emulated else {}
    threads = 1 if jobs > 1 else 2
    records = []
    # Cases grouped by their constants, so that a lane's worker stays on one library.
    order = sorted(found, key=lambda c: (repr(sorted(c.overrides.items())), c.number))
    context = multiprocessing.get_context("fork")
    stream = open(records_path, "w", encoding="utf-8") if records_path else None
    scratch = tempfile.TemporaryDirectory(prefix="cgc-random-")
    try:
        with context.Pool(jobs, _lane_start, (seed, pairs, libraries, emulated, budget,
                                              threads, scratch.name, values)) as pool:
            for count, record in enumerate(pool.imap_unordered(_lane_judge, order, chunksize=4),
                                           1):
                records.append(record)
                if stream is not None:  # as they come: a campaign cut short keeps its records
                    stream.write(json.dumps(record) + "\n")
                    stream.flush()
                if progress and count % 100 == 0:
                    elapsed = time.perf_counter() - started
                    print(f"  {count}/{len(order)} judged, {elapsed:.0f} s", file=sys.stderr,
                          flush=True)
            pool.close()
            pool.join()
        if stream is not None:
            stream.write(json.dumps({"campaign": {
                "seconds": time.perf_counter() - started, "seed": seed, "jobs": jobs,
                "date": time.strftime("%Y-%m-%d")}}) + "\n")
    finally:
        if stream is not None:
            stream.close()
        scratch.cleanup()
    records.sort(key=lambda r: r["number"])
    summary = report(records, seed, time.perf_counter() - started, emulated, out)
    return summary


# ---- the report ------------------------------------------------------------------------


def false_accept(record: dict) -> bool:
    """The checker accepted it (with or without a warning), and a ground truth saw a memory
    fault, or the shared arena's results differ from those of a slot each (what a read saw
    depended on which slot had the bytes before: the memory plan broke a value the checker
    proved written)."""
    if record["verdict"] != "accepted":
        return False
    return _gt1(record) == "fault" or record.get("gt2") in ("faulted", "refused") or \
        record.get("values") == "differ"


def _gt1(record) -> str:
    """safe; data (the reference refuses the values: a token id, the step counter, or its
    arithmetic fails on them, such as a square root of a negative "sum of squares"); fault (a
    memory fault: bounds, extent, slot, alias, permission); or not run."""
    if record.get("gt1") != "faulted":
        return record.get("gt1", "not run")
    kind = record.get("gt1_why", "").split(":")[0]
    return "data" if kind in ("data", "crash") else "fault"


GT2_SHORT = {"clean": "clean", "poisoned": "poison", "nan": "NaN", "faulted": "fault",
             "refused": "refused", "unbuilt": "unbuilt", "timeout": "timeout", "not run": "-"}


def report(records: list[dict], seed: int, seconds: float, emulated: bool, out) -> dict:
    def p(*parts):  # paths relative to the repository, as the docs show them
        print(*(str(part).replace(ROOT + os.sep, "") for part in parts), file=out)

    errors = [r for r in records if r["verdict"] == "error"]
    by_kind = defaultdict(Counter)
    for r in records:
        row = by_kind[r["kind"]]
        row["variants"] += 1
        row[r["verdict"]] += 1
        row["gt1 fault"] += _gt1(r) == "fault"
        row["gt2 fault"] += r.get("gt2") in ("faulted", "refused", "unbuilt")
        row["gt2 poisoned"] += r.get("gt2") == "poisoned"
        row["gt2 nan"] += r.get("gt2") == "nan"
        row["values differ"] += r.get("values") == "differ"
        row["false accepts"] += false_accept(r)
    mutants_count = sum(v["variants"] for k, v in by_kind.items() if k != "random")
    p(f"checker against ground truth: {mutants_count} mutants of "
      f"{', '.join(s for s, _ in SCHEDULES)} and {by_kind['random']['variants']} random "
      f"schedules; config {CONFIG}, cgBatch 1, seed {seed}; {seconds / 60:.1f} min")
    p("GT1: the NumPy machine; values: GT1 on the shared arena against GT1 with a slot each; "
      "GT2: the emitted kernels on the CPU under ASan + UBSan, each launch fenced to its views, "
      "outputs poisoned" + ("" if emulated else " (not run)"))
    p("")
    p(f"  {'kind':<10}{'variants':>9}{'front end':>10}{'accepted':>9}{'rejected':>9}"
      f"{'GT1 fault':>10}{'values':>7}{'GT2 fault':>10}{'poison':>7}{'NaN':>5}"
      f"{'FALSE ACC':>10}")
    total = Counter()
    for kind in KINDS:
        row = by_kind.get(kind)
        if not row:
            continue
        total.update(row)
        p(f"  {kind:<10}{row['variants']:>9}{row['front end']:>10}{row['accepted']:>9}"
          f"{row['rejected']:>9}{row['gt1 fault']:>10}{row['values differ']:>7}"
          f"{row['gt2 fault']:>10}{row['gt2 poisoned']:>7}{row['gt2 nan']:>5}"
          f"{row['false accepts']:>10}")
    p(f"  {'total':<10}{total['variants']:>9}{total['front end']:>10}{total['accepted']:>9}"
      f"{total['rejected']:>9}{total['gt1 fault']:>10}{total['values differ']:>7}"
      f"{total['gt2 fault']:>10}{total['gt2 poisoned']:>7}{total['gt2 nan']:>5}"
      f"{total['false accepts']:>10}")
    if total["void"]:
        p(f"  ({total['void']} second-order mutants void: the second edit lay inside the first)")
    p("")
    cells = defaultdict(Counter)
    for r in records:
        if r["verdict"] not in ("accepted", "rejected"):
            continue
        verdict = r["verdict"] + (", warned" if r["verdict"] == "accepted" and r["warned"]
                                  else "")
        cells[(_gt1(r), GT2_SHORT.get(r.get("gt2", "not run"), "-"))][verdict] += 1
    p("verdicts of the variants that evaluate: what the ground truths saw (rows) x the checker "
      "(columns)")
    p(f"  {'GT1':<7}{'GT2':<9}{'accepted':>10}{'+warning':>10}{'rejected':>10}")
    for g1 in ("safe", "data", "fault"):
        for g2 in ("clean", "poison", "NaN", "fault", "refused", "unbuilt", "timeout", "-"):
            row = cells.get((g1, g2))
            if row:
                p(f"  {g1:<7}{g2:<9}{row['accepted']:>10}{row['accepted, warned']:>10}"
                  f"{row['rejected']:>10}")
    p("  GT1 safe: no fault; data: the reference refuses the values (a token id, the step "
      "counter, a square root of a negative sum); fault: a memory fault (bounds, extent, slot, "
      "alias, permission).")
    p("  GT2 clean: no report, no NaN in the results; poison: a value no launch wrote reached "
      "the results (NaN with memory poisoned, none with it zeroed); NaN: NaN however memory "
      "starts; fault: a sanitizer report, a kernel fault or a failed launch; refused: no C "
      "call exists for it; unbuilt: the kernels' static_asserts refuse the constants.")
    p("")
    accepts = [r for r in records if false_accept(r)]
    p(f"FALSE ACCEPTS (accepted; a memory fault of GT1, results of the shared arena that "
      f"differ from a slot each's, or a fault of GT2): {len(accepts)}")
    for r in accepts:
        p(f"  FALSE ACCEPT [{r['schedule']} {r['kind']}] {r['description']}: "
          f"GT1 {r.get('gt1')} {r.get('gt1_why', '')[:200]} | values {r.get('values')} "
          f"{r.get('values_why', '')[:200]} | GT2 {r.get('gt2')} {r.get('gt2_why', '')[:300]}")
    compared = [r for r in records if r.get("values") in ("same", "differ")]
    differ = [r for r in compared if r["values"] == "differ"]
    p(f"values: {len(compared)} variants run on the shared arena and on a slot each; results "
      f"differ in {len(differ)}, all rejected by the checker: "
      f"{all(r['verdict'] == 'rejected' for r in differ)} (by rule: " + (", ".join(
          f"{rule} {count}" for rule, count in Counter(
              r.get("rule", "") for r in differ).most_common()) or "none") + ")")
    unbuilt = [r for r in records if r["verdict"] == "accepted" and r.get("gt2") == "unbuilt"]
    if unbuilt:
        p(f"accepted, but the kernels do not compile for the constants: {len(unbuilt)}")
        grouped = defaultdict(list)
        for r in unbuilt:
            grouped[(r["description"], r.get("gt2_why", "").split(": ", 1)[-1])].append(
                r["schedule"])
        for (description, why), schedules in grouped.items():
            p(f"  {description} ({', '.join(schedules)}): {why[:120]}")
    rules = defaultdict(Counter)
    for r in records:
        if r["verdict"] not in ("rejected", "front end"):
            continue
        found = r["rules"]
        if found == ["front end"]:
            found = [rule_of(r["message"])]
        row = rules[(r["verdict"], primary_rule(found))]
        row["rejects"] += 1
        if r["verdict"] == "front end":
            continue
        g1, g2 = _gt1(r) == "fault", r.get("gt2") in ("faulted", "refused", "unbuilt")
        row["GT1 fault"] += g1
        row["GT2 fault"] += g2
        row["both"] += g1 and g2
        row["values"] += r.get("values") == "differ"
        quiet = not g1 and not g2
        row["poison"] += quiet and r.get("gt2") == "poisoned"
        row["NaN/data"] += quiet and r.get("gt2") != "poisoned" and (
            _gt1(r) == "data" or r.get("gt2") == "nan")
        row["neither"] += quiet and _gt1(r) != "data" and r.get("gt2") in ("clean", "timeout")
    p("")
    p("rejects by rule (a variant broken several ways counts under its first rule): confirmed "
      "by a fault of GT1 or GT2; else by a poisoned value reaching the results (poison); else "
      "by NaN or values the reference refuses (NaN/data); or by neither; values: the shared "
      "arena's results differ from a slot each's (whatever else confirms it)")
    p(f"  {'rule':<24}{'rejects':>8}{'GT1 fault':>10}{'GT2 fault':>10}{'both':>6}"
      f"{'poison':>7}{'NaN/data':>9}{'neither':>8}{'values':>7}")
    for (verdict, rule), row in sorted(rules.items(), key=lambda item: (
            item[0][0] != "rejected", PRECEDENCE.index(item[0][1])
            if item[0][1] in PRECEDENCE else 99)):
        if verdict == "front end":
            p(f"  {rule:<24}{row['rejects']:>8}   front end: no program, not run")
        else:
            p(f"  {rule:<24}{row['rejects']:>8}{row['GT1 fault']:>10}{row['GT2 fault']:>10}"
              f"{row['both']:>6}{row['poison']:>7}{row['NaN/data']:>9}{row['neither']:>8}"
              f"{row['values']:>7}")
    disagree = Counter()
    for r in records:
        g1, g2 = _gt1(r), r.get("gt2")
        if g2 in ("not run", "timeout", None) or g1 == "not run":
            continue
        gt2_fault = g2 in ("faulted", "refused", "unbuilt")
        if g1 == "fault" and not gt2_fault:
            disagree["GT1 " + r.get("gt1_why", "").split(":")[0]] += 1
        if g1 != "fault" and gt2_fault:
            disagree["GT2 " + g2] += 1
    p("")
    p("where only one ground truth faults: " + (", ".join(
        f"{k} {v}" for k, v in sorted(disagree.items())) or "never"))
    gt2_seconds = [r["gt2_seconds"] for r in records if "gt2_seconds" in r]
    timeouts = sum(1 for r in records if r.get("gt2") == "timeout")
    if gt2_seconds:
        p(f"GT2: {len(gt2_seconds)} runs, mean {np.mean(gt2_seconds):.2f} s, longest "
          f"{max(gt2_seconds):.1f} s, {timeouts} over the budget")
    stale = [r for r in records if r["verdict"] == "accepted" and not r["warned"]
             and r.get("gt2") == "poisoned"]
    p(f"accepted without a warning, yet a value no launch wrote reaches the results (GT2 "
      f"poison): {len(stale)}")
    for r in stale[:30]:
        p(f"  [{r['schedule']} {r['kind']}] {r['description']}: {r.get('gt2_why', '')[:110]}")
    data = [r for r in records if r["verdict"] == "accepted" and _gt1(r) == "data"]
    p(f"accepted, and the reference refuses the values (GT1 data; no memory fault): "
      f"{len(data)}: " + ", ".join(f"{why} {count}" for why, count in Counter(
          r.get("gt1_why", "")[:60] for r in data).most_common()))
    if errors:
        p(f"SCRIPT ERRORS: {len(errors)}")
        for r in errors[:10]:
            p(f"  {r['description']}: {r['message']}\n{r.get('trace', '')}")
    return {"records": len(records), "mutants": mutants_count,
            "values compared": len(compared), "values differ": len(differ),
            "random": by_kind["random"]["variants"], "false accepts": len(accepts),
            "unbuilt accepts": len(unbuilt), "stale accepts": len(stale),
            "data accepts": len(data),
            "errors": len(errors), "by kind": {k: dict(v) for k, v in by_kind.items()},
            "seconds": seconds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--all", action="store_true",
                        help="mutants of every schedule, of every kind, and random schedules, "
                             "against both ground truths")
    parser.add_argument("--limit", type=int, help="a random sample of this many mutants")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--random", type=int, default=500, help="random schedules (--all)")
    parser.add_argument("--constants", type=int, default=40,
                        help="sets of constants, each a mutant of every schedule (--all)")
    parser.add_argument("--pairs", type=int, default=1200,
                        help="second-order mutants (two mutations at once), over the schedules")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--budget", type=float, default=60.0,
                        help="seconds a variant may take on ground truth 2")
    parser.add_argument("--no-emulated", action="store_true", help="ground truth 1 only")
    parser.add_argument("--emulated-limit", type=int,
                        help="ground truth 2 on a random sample of this many variants only")
    parser.add_argument("--values", choices=("all", "accepted"), default="all",
                        help="the values ground truth (shared arena against a slot each) on "
                             "every variant GT1 runs safely, or on the accepted ones only")
    parser.add_argument("--kinds", help="only the mutants of these kinds, by commas (extent,"
                                        "lifetime): a slice that exercises them")
    parser.add_argument("--records", help="write every variant's verdicts here (JSON lines)")
    parser.add_argument("--report", metavar="RECORDS",
                        help="print the tables of a campaign's records again, and exit")
    args = parser.parse_args()
    if args.report:
        with open(args.report, encoding="utf-8") as handle:
            lines = [json.loads(line) for line in handle]
        records = sorted((r for r in lines if "number" in r), key=lambda r: r["number"])
        run_info = next((r["campaign"] for r in lines if "campaign" in r),
                        {"seconds": float("nan"), "seed": args.seed})
        summary = report(records, run_info["seed"], run_info["seconds"], not args.no_emulated,
                         sys.stdout)
        return 1 if summary["false accepts"] or summary["errors"] else 0
    if not args.all:
        table = run(args.limit, args.seed)
        return 1 if table["accepted but faulted (FALSE ACCEPT)"] else 0
    summary = campaign(args.seed, args.limit, args.random, args.constants, args.pairs, args.jobs,
                       not args.no_emulated, args.budget, records_path=args.records,
                       progress=True, emulated_limit=args.emulated_limit, values=args.values,
                       kinds=tuple(args.kinds.split(",")) if args.kinds else None)
    return 1 if summary["false accepts"] or summary["errors"] else 0


if __name__ == "__main__":
    from cgc.outputs import script_status
    sys.exit(script_status(main))
