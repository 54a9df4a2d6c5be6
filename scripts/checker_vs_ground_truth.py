#!/usr/bin/env python3
"""The static checker against ground truth: mutated variants of the backward schedule.

Each variant changes one thing in the schedules that cgBackward expands to: a grid
dimension off by one (or doubled, or halved), a buffer swapped for another of the same
element type, a slot index moved, a repeat count changed, a declared buffer shrunk. For
every variant that evaluates, the checker gives its verdict and the bounds-checked
reference machine runs it; the table compares the two. A false accept (the checker
accepts, the machine faults) must never happen; false rejects are listed with reasons.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from collections import Counter
from dataclasses import dataclass

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from cgc.checking.check import check_program  # noqa: E402
from cgc.frontend.declarations import elaborate  # noqa: E402
from cgc.core.diagnostics import CompileError, Reporter  # noqa: E402
from cgc.frontend.evaluate import evaluate_program  # noqa: E402
from cgc.frontend.load import load  # noqa: E402
from cgc.backends.numpy.machine import Fault, Machine  # noqa: E402
from cgc.checking.memory import plan_memory  # noqa: E402
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
                                             _with(modules, declaration, 1, grid, new)))
            if head in ("cgArgument", "cgScalar") and isinstance(node.arguments[0], Natural):
                index = node.arguments[0]
                for delta in (1, -1, 5):
                    if index.value + delta >= 0:
                        new = Natural(index.value + delta, index.span)
                        found.append(Variant(f"{head} {index.value} -> {new.value} in {where}",
                                             _with(modules, declaration, 1, index, new)))
            if head == "nvidiaAffineLaunchRepeat":
                count = node.arguments[0]
                for change, new in (("+1", _call(span, "naturalAdd", count, Natural(1, span))),
                                    ("-1", _call(span, "naturalSaturatingSubtract", count,
                                                 Natural(1, span)))):
                    found.append(Variant(f"repeat count {change} in {where}",
                                         _with(modules, declaration, 1, count, new)))
        for node in _walk(body):
            if isinstance(node, Name) and node.text in storage:
                same = [n for n in storage if element[n] == element[node.text]
                        and n != node.text and storage[n].kind == storage[node.text].kind]
                for other in chooser.sample(same, min(3, len(same))):
                    new = Name(other, node.span)
                    found.append(Variant(f"{node.text} -> {other} in {declaration.name.text} at "
                                         f"{node.span}", _with(modules, declaration, 1, node, new)))
    for name, declaration in storage.items():
        count = declaration.terms[1]
        span = count.span
        for change, new in (("-1", _call(span, "naturalSaturatingSubtract", count,
                                         Natural(1, span))),
                            ("/2", _call(span, "naturalDivideUnchecked", count,
                                         Natural(2, span)))):
            found.append(Variant(f"size of {name} {change}",
                                 _with(modules, declaration, 1, count, new)))
    return found


def judge(modules: list[Module]) -> tuple[str, str]:
    """(checker verdict, ground truth) for one variant, each with a reason."""
    report = Reporter()
    try:
        scope = Scope(modules, report)
        declarations = elaborate(scope, report)
        TypeChecker(scope, declarations, report).check_all()
        report.raise_if_errors()
        program = evaluate_program(scope, declarations, SOURCE, ENTRY, CONFIG, OVERRIDES, report)
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


def run(limit: int | None, seed: int, out=sys.stdout) -> Counter:
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
    for description, why in false_accepts:
        print(f"FALSE ACCEPT: {description}: {why}", file=out)
    for description, reason in false_rejects:
        print(f"false reject: {description}: {reason}", file=out)
    table["total"] = total
    table.update({f"fault {kind}": count for kind, count in faults.items()})
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--limit", type=int, help="run a random sample of this many variants")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    table = run(args.limit, args.seed)
    return 1 if table["accepted but faulted (FALSE ACCEPT)"] else 0


if __name__ == "__main__":
    sys.exit(main())
