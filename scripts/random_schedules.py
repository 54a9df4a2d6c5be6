#!/usr/bin/env python3
"""Random well-typed schedules, for the checker-against-ground-truth campaign.

Each is a small `.cg` file importing schedules/model.cg and schedules/images.cg that
defines `cgRandom`: one to five phases in sequence, each a launch, a few launches in
sequence, or a repeat of them over a fresh index. A launch takes a random image of
images.cg; its grid and scalars start from a launch of that image in the whole step (as
literals) and are perturbed at random (+1, -1, x2, /2, 1, a small number, the repeat index
added); each pointer is bound to a random declared storage of the declared element type (a
step buffer, an item of a stacked buffer, possibly by the repeat index, an arena slot, a
bank entry or an item of one, a whole bank), most often one at least as large as the
whole step binds, sometimes of another element type; an argument is sometimes left unbound
or bound twice, a launch sometimes outside any phase, a phase sometimes one that may not
write what the launch writes. A careful launch often binds a storage an earlier launch of
the schedule bound (so values flow between launches and slots are rewritten), and now and
then a grid of three quarters of the step's (a write of part of its view): lifetimes for the
memory plan to get right, which the values ground truth checks. The schedules type-check (the front end can still refuse an
item index out of range); what the checker and the ground truths make of them is the test.

`python3 scripts/random_schedules.py N [SEED]` prints the first N of them (the campaign's
"random schedule K" of seed S is the K-th of `N > K` of seed S: `--number K` prints it alone).
"""

from __future__ import annotations

import os
import random
import sys
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

ENTRY = "cgRandom"
# what a random schedule imports: the GPT model (its configurations, banks and entries) and
# the images
IMPORTS = ("model.cg", "images.cg")


@dataclass(frozen=True)
class Place:
    """A storage a pointer can be bound to: its term, declared element, elements, and
    (for a stacked storage) the whole storage's term and item count."""

    term: str
    element: str
    count: int
    stacked: str | None = None
    items: int = 0
    item_count: int = 0
    bank: str | None = None


def places(program) -> list[Place]:
    """Every storage of the model a schedule can name."""
    found = []
    for label, storage in program.storages.items():
        if storage.kind == "bank":
            continue
        term = storage.name if storage.kind == "buffer" else f"(cgArena {storage.name})"
        found.append(Place(term, storage.element, storage.count, term if storage.stack else None,
                           storage.stack or 0, storage.item_count))
    for bank, declaration in program.banks.items():
        for entry in program.entries:
            label = f"{bank}.{entry.name}"
            if declaration.role == "copies" and not entry.matrix:
                continue
            storage = program.storages.get(label)
            count = storage.count if storage else entry.count * (entry.stack or 1)
            item = storage.item_count if storage else entry.count
            term = f"(cgParameter {bank} {entry.name})"
            found.append(Place(term, declaration.element, count, term if entry.stack else None,
                               entry.stack or 0, item, bank))
        layout = program.bank_layouts.get(bank)
        if layout is not None:
            found.append(Place(f"(cgBankAll {bank})", declaration.element, layout[1],
                               bank=bank))
    return found


def launches_by_image(program) -> dict:
    """Each image's launches in the whole step, at their first iteration: (grid, the
    element count of each pointer's view, each scalar's (value, kind))."""
    found: dict = {}
    for launch, phase, point in program.unrolled():
        bound = launch.arguments(point)
        counts = {p.parameter.index: p.view.count for p in bound.pointers}
        scalars = {s.parameter.index: (s.value, s.kind) for s in bound.scalars}
        explicit = {b.index for b in launch.scalars}
        scalars = {i: v for i, v in scalars.items() if i in explicit}
        found.setdefault(launch.image.name, []).append(
            (tuple(int(g) for g in bound.grid), counts, scalars, phase))
    return found


class Generator:
    def __init__(self, program, seed: int):
        self.program = program
        self.rng = random.Random(seed)
        self.places = places(program)
        self.launches = launches_by_image(program)
        self.images = sorted(self.launches)
        self.phases = sorted(program.phases)
        self.banks = program.banks
        self.used: list[Place] = []  # the storages this schedule's launches bound so far

    # ---- terms -------------------------------------------------------------------------

    def place_term(self, place: Place, loop: tuple[str, int] | None, need: int,
                   careful: bool) -> str:
        """The storage's term: itself, or one of its items (by a number, or by the repeat
        index: careful ones stay inside the stack and hold what the launch needs)."""
        rng = self.rng
        if place.stacked is None or not place.items or rng.random() < 0.4 or \
                (careful and place.item_count < need):
            return place.term
        if loop is not None and rng.random() < 0.6 and (not careful or loop[1] <= place.items):
            name = loop[0]
            choices = [name, name, f"(naturalSaturatingSubtract {place.items - 1} {name})"]
            if not careful or loop[1] < place.items:
                choices.append(f"(naturalAdd {name} 1)")
            index = rng.choice(choices)
        else:
            index = str(rng.randrange(place.items + (0 if careful else 1)))
        return f"(cgItem {place.stacked} {index})"

    def place_count(self, place: Place, term: str) -> int:
        return place.item_count if term.startswith("(cgItem") else place.count

    def perturb(self, value: int) -> int:
        rng = self.rng
        choices = [value + 1, value * 2, rng.randint(1, 8)]
        if value > 1:
            choices += [value - 1, value // 2, 1]
        return rng.choice(choices)

    def choose_place(self, parameter, need: int, taken: set, careful: bool) -> Place:
        rng = self.rng
        same = [p for p in self.places if p.element == parameter.element]
        if not careful and rng.random() < 0.1:
            return rng.choice([p for p in self.places if p.element != parameter.element]
                              or same)
        free = [p for p in same if p.term not in taken] or same
        again = [p for p in self.used if p.element == parameter.element
                 and p.term not in taken and p.count >= need]
        if careful and again and rng.random() < 0.4:
            # a storage an earlier launch bound: values flow from launch to launch, and
            # slots are rewritten (in part, where the grid is shortened): real lifetimes
            # for the memory plan to share the arena by
            return rng.choice(again)
        if careful:
            snug = [p for p in free if need <= p.count <= 2 * need]
            large = [p for p in free if p.count >= need]
            return rng.choice(snug if snug and rng.random() < 0.7 else large or free)
        return rng.choice(free)

    def launch(self, loop: tuple[str, int] | None) -> tuple[str, set]:
        """A launch's text, and the banks it writes. Most launches are careful (the grid
        and scalars of a launch of the step, storages at least as large as it binds, none
        twice); the others take one liberty or more (a perturbed grid or scalar, any storage,
        one of another element type, an argument unbound or bound twice)."""
        rng = self.rng
        name = rng.choice(self.images)
        image = self.program.images[name]
        grid, counts, scalars, _ = rng.choice(self.launches[name])
        careful = rng.random() < 0.8
        axes = []
        for axis, value in enumerate(grid):
            text = str(value)
            if not careful and rng.random() < 0.35:
                text = str(self.perturb(value))
            elif careful and axis == 0 and value > 1 and rng.random() < 0.15:
                text = str(value * 3 // 4)  # a write of part of what it bound: in bounds
            if loop is not None and axis == 0 and rng.random() < 0.05:
                text = f"(naturalAdd {text} {loop[0]})"
            axes.append(text)
        slots, bound_terms, writes, taken = [], {}, set(), set()
        for index, parameter in sorted(image.pointers.items()):
            if not careful and rng.random() < 0.05:
                continue  # left unbound
            place = self.choose_place(parameter, counts.get(index, 0), taken, careful)
            taken.add(place.term)
            if place not in self.used:
                self.used.append(place)
            term = self.place_term(place, loop, counts.get(index, 0), careful)
            bound_terms[index] = term
            slots.append(f"(cgPointer (cgArgument {index}) {term}")
            if parameter.access != "read" and place.bank is not None:
                writes.add(place.bank)
            if not careful and rng.random() < 0.03:
                slots.append(f"(cgPointer (cgArgument {index}) {term}")  # bound twice
        for index, parameter in sorted(image.scalars.items()):
            real = scalars.get(index)
            if real is None and (parameter.default is not None or careful
                                 or rng.random() < 0.9):
                continue  # its default (or, rarely, left unbound)
            if parameter.type == "float32":
                value = real[0] if real is not None and (careful or rng.random() < 0.7) else \
                    rng.choice([0.5, 1.0, 0.001, 2.0])
                text = repr(float(value))
                if "e" in text:
                    text = f"{float(value):.12f}"
            else:
                if real is not None and real[1] == "Int":
                    continue
                value = int(real[0]) if real is not None else rng.randint(1, 64)
                if not careful and rng.random() < 0.35:
                    value = self.perturb(value)
                text = str(value)
                if parameter.name == "count" and 0 in bound_terms and rng.random() < 0.6:
                    text = f"(cgCount {bound_terms[0]})"
                elif loop is not None and rng.random() < 0.03:
                    text = f"(naturalAdd {text} {loop[0]})"
            slots.append(f"(cgSlot (cgScalar {index}) {text}")
        body = "cgNoSlots"
        for slot in reversed(slots):
            body = f"{slot} {body})"
        return f"(cgLaunch {name} {' '.join(axes)} {body})", writes

    def sequence(self, items: list[str], concurrent: float = 0.0) -> str:
        """The items one after another; each join, with probability `concurrent`, a
        cgConcurrently instead (branches the checker must prove independent)."""
        text = items[-1]
        for item in reversed(items[:-1]):
            head = "cgConcurrently" if self.rng.random() < concurrent else "cgThen"
            text = f"({head} {item} {text})"
        return text

    def part(self, number: int) -> str:
        """One phase of the schedule."""
        rng = self.rng
        loop = None
        if rng.random() < 0.3:
            loop = (f"i{number}", rng.randint(1, 3))
        made = [self.launch(loop) for _ in range(rng.choice([1, 1, 1, 1, 2, 2, 3]))]
        body = self.sequence([text for text, _ in made])
        if loop is not None:
            body = (f"(nvidiaAffineLaunchRepeat {loop[1]} "
                    f"(lambda unrestricted {loop[0]} : Nat . {body}))")
        writes = set().union(*(w for _, w in made))
        if rng.random() < 0.03:
            return body  # outside any phase
        fitting = [p for p in self.phases if writes <= set(self.program.phases[p].writes)]
        phase = rng.choice(fitting) if fitting and rng.random() < 0.95 else \
            rng.choice(self.phases)
        return f"(cgPhase {phase} {body})"

    def schedule(self, number: int) -> str:
        self.used = []
        parts = [self.part(i) for i in range(self.rng.choice([1, 1, 1, 2, 2, 3, 4]))]
        return (f"-- Random schedule {number} (scripts/random_schedules.py).\n"
                + "".join(f'import "{name}"\n' for name in IMPORTS) + "\n"
                f"def {ENTRY} : (family NvidiaLaunchSchedule) =\n  "
                f"{self.sequence(parts, concurrent=0.35)}\n")


def generate(program, count: int, seed: int) -> list[str]:
    """`count` random schedules over the model and images of `program` (the whole step)."""
    generator = Generator(program, seed)
    return [generator.schedule(number) for number in range(count)]


def write(text: str, folder: str, number: int) -> str:
    """The schedule as a file in `folder`, its imports pointing into schedules/."""
    path = os.path.join(folder, f"random-{number}.cg")
    for name in IMPORTS:
        relative = os.path.relpath(os.path.join(ROOT, "schedules", name), folder)
        text = text.replace(f'import "{name}"', f'import "{relative}"')
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)
    return path


def main() -> int:
    import argparse
    from cgc.pipeline import analyse, evaluate
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("count", type=int, nargs="?", default=3)
    parser.add_argument("seed", type=int, nargs="?", default=0)
    parser.add_argument("--number", type=int, help="print only this one")
    args = parser.parse_args()
    path = os.path.join(ROOT, "schedules", "train.cg")
    program = evaluate(analyse([path]), path, config="tiny", overrides={"cgBatch": 1})
    count = max(args.count, (args.number or 0) + 1)
    for number, text in enumerate(generate(program, count, args.seed)):
        if args.number is None or number == args.number:
            print(text)
    return 0


if __name__ == "__main__":
    from cgc.outputs import script_status
    sys.exit(script_status(main))
