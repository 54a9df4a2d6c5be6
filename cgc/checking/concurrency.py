"""Concurrent branches, proven independent, and the streams they run on.

`(cgConcurrently a b)` lets the launches of its branches run in any interleaving, and their
blocks too. That is safe exactly when no branch touches an element another branch writes,
so the checker proves it for every pair of launches in different branches, at every
iteration of the repeats around them (and of the repeats inside the branches), counting
every way two names can share bytes:

- memory: each launch's reach (flow.reach: its pointer's extent at that iteration) placed
  in its allocation, so a bank entry, a whole-bank view and a range of entries meet where
  their elements do; arena slots are told apart by name, because the memory plan never
  lets two slots of one concurrent region share bytes (`regions`, used by memory.py);
- the library's workspace: cuBLASLt's, one per stream, so it counts as the stream's;
- a kernel's own device state: an image declared `(deviceState)` (the layer-norm backward's
  `__device__` ticket counter) is one resource, written by every launch of it;
- the communicator: the ranks' collectives run one at a time, in one order on every rank,
  so two collectives may not be concurrent (a collective is otherwise a launch like any
  other: it reads and writes the buffer it reduces).

A proven program runs the same on every interleaving, so taking the branches one after the
other in order (`Concurrent.body`), as the NumPy machine and the flow analysis do, gives the
values every other order gives.

Streams: the first branch stays on its parent's stream, each other branch takes the lowest
side stream no enclosing branch holds, and a branch of collectives alone runs on the
communicator's own stream; the assignment is a function of the program's shape alone, so
the emitted program is the same on every run (`branch_streams`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from ..core.diagnostics import Note
from ..core.ir import Concurrent, Launch, PhaseRegion, Program, Repeat, concrete
from .flow import UNROLL_LIMIT, elements_of, reach

WRITES = ("write", "readwrite", "accumulate")
COMMUNICATOR = -1  # the stream of a branch of collectives alone


def branch_streams(node: Concurrent, parent: int, busy: frozenset[int]) -> list[int]:
    """The stream each branch of `node` runs on, entered on stream `parent` while the
    streams in `busy` (its parent's among them) belong to enclosing branches."""
    taken = set(busy) | {parent}
    streams = []
    for number, branch in enumerate(node.branches):
        if _collectives_only(branch):
            streams.append(COMMUNICATOR)
        elif number == 0:
            streams.append(parent)
        else:
            stream = next(s for s in range(len(taken) + 2) if s not in taken)
            taken.add(stream)
            streams.append(stream)
    return streams


def on_streams(node: Concurrent, stream: int, busy: frozenset[int]):
    """Each branch of `node` with the stream it runs on (`branch_streams`), and the streams
    held inside the branches: what every walk of the program passes down."""
    streams = branch_streams(node, stream, busy)
    return list(zip(node.branches, streams)), busy | {s for s in streams if s >= 0}


def _collectives_only(nodes) -> bool:
    """Whether the nodes launch collectives and nothing else (stops at the first other)."""
    found = False
    for launch in _launches(nodes):
        if not launch.image.collective:
            return False
        found = True
    return found


def _launches(nodes):
    for node in nodes:
        if isinstance(node, Launch):
            yield node
        else:
            yield from _launches(node.body)


def stream_count(program: Program) -> tuple[int, bool]:
    """How many compute streams the program uses (the step's own one included), and whether
    it has a communicator stream."""
    most, communicator = 1, False

    def walk(nodes, stream, busy):
        nonlocal most, communicator
        for node in nodes:
            if isinstance(node, Concurrent):
                branches, inner = on_streams(node, stream, busy)
                for branch, branch_stream in branches:
                    communicator |= branch_stream == COMMUNICATOR
                    most = max(most, branch_stream + 1)
                    walk(branch, branch_stream, inner)
            elif not isinstance(node, Launch):
                walk(node.body, stream, busy)

    walk(program.body, 0, frozenset({0}))
    return most, communicator


def regions(program: Program) -> list[tuple[int, int, set[str]]]:
    """Each concurrent region's first and last launch positions (a repeat's body numbered
    once, as the memory plan numbers them) and the arena slots its launches touch: those are
    live together across the region, so the plan gives each its own bytes."""
    found = []
    position = 0

    def walk(nodes):
        nonlocal position
        for node in nodes:
            if isinstance(node, Launch):
                position += 1
            elif isinstance(node, Concurrent):
                first = position
                walk(node.body)
                slots = {binding.view.storage.name for launch in _launches(node.body)
                         for binding in launch.pointers if binding.view.storage.kind == "arena"}
                found.append((first, position - 1, slots))
            else:
                walk(node.body)

    walk(program.body)
    return found


@dataclass(frozen=True)
class Touch:
    """What one launch at one iteration reaches of one resource: [low, high) of it."""

    resource: tuple
    low: int
    high: int
    writes: bool
    launch: Launch
    binding: object  # the pointer binding, or None for a resource no pointer names
    parameter: object
    point: dict | None
    shift: int  # the allocation's element of the storage's element 0 (memory only)


def _launch_touches(program: Program, launch: Launch, point, stream: int):
    image = launch.image
    for binding in launch.pointers:
        parameter = image.pointers.get(binding.index)
        if parameter is None:
            continue  # the slot checks report it
        home, start = program.address(binding.view)
        low, high = reach(launch, parameter, binding.view, point)
        shift = 0 if point is None else \
            concrete(start, point) - concrete(binding.view.offset, point)
        if point is None and binding.view.storage.kind == "bank":
            low, high, shift = 0, program.bank_layouts[home][1], 0  # the whole bank
        yield Touch(("memory", home), low + shift, high + shift, parameter.access in WRITES,
                    launch, binding, parameter, point, shift)
    if image.device_state is not None:
        yield Touch(("state", image.name), 0, 1, True, launch, None, None, point, 0)
    if image.library == "cublas":
        yield Touch(("workspace", stream), 0, 1, True, launch, None, None, point, 0)
    if image.collective is not None:
        yield Touch(("communicator",), 0, 1, True, launch, None, None, point, 0)


def _where(point) -> str:
    if not point:
        return ""
    return " at " + ", ".join(f"{v.name} = {value}" for v, value in point.items())


class Cover:
    """Which touch first reached each element of one resource, among those given so far:
    disjoint segments sorted by their start, and the gaps no touch has reached yet. A touch
    fills only the gaps it meets, so each of its elements keeps the first touch that reached
    it, and a query finds a touch that shares an element with a range in O(log n)."""

    def __init__(self):
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.owners: list[tuple] = []  # (branch, touch)
        self.gap_starts: list[int] = [0]
        self.gap_ends: list[float] = [float("inf")]

    def find(self, low: int, high: int):
        """(branch, touch) of a segment sharing an element with [low, high), or None."""
        at = bisect.bisect_right(self.starts, low) - 1
        for index in (at, at + 1):
            if 0 <= index < len(self.starts) and self.starts[index] < high and \
                    self.ends[index] > low:
                return self.owners[index]
        return None

    def add(self, low: int, high: int, owner: tuple) -> None:
        at = max(bisect.bisect_right(self.gap_starts, low) - 1, 0)
        while at < len(self.gap_starts) and self.gap_starts[at] < high:
            start, end = self.gap_starts[at], self.gap_ends[at]
            a, b = max(start, low), min(end, high)
            if a >= b:
                at += 1
                continue
            where = bisect.bisect_left(self.starts, a)
            self.starts.insert(where, a)
            self.ends.insert(where, b)
            self.owners.insert(where, owner)
            leftovers = [(x, y) for x, y in ((start, a), (b, end)) if x < y]
            self.gap_starts[at:at + 1] = [x for x, _ in leftovers]
            self.gap_ends[at:at + 1] = [y for _, y in leftovers]
            at += len(leftovers)


# The accesses the proof compares, every concurrent region counting those of its branches
# (a region inside another counts again there): past this, cgc says so rather than run on.
TOUCH_LIMIT = 250_000


class _TooMany(Exception):
    """The proof's budget spent, at this region."""

    def __init__(self, node: Concurrent):
        self.node = node


class Independence:
    """The proof for one program: every concurrent region, at every iteration point."""

    def __init__(self, program: Program, checker):
        self.program = program
        self.checker = checker  # reports, with the call chains of check.py
        self.said: set[tuple] = set()
        self.compared = 0

    def run(self) -> None:
        exact = self.program.launches_made() <= UNROLL_LIMIT
        try:
            self.walk(self.program.body, {} if exact else None, 0, frozenset({0}))
        except _TooMany as too_many:
            self.checker.report.error(
                f"the concurrent regions of this program make more than {TOUCH_LIMIT:,} "
                "accesses to compare (a region inside another counts its accesses again), "
                "more than cgc proves independent: nest fewer regions, or make them "
                "smaller", too_many.node.span)

    def walk(self, nodes, point, stream: int, busy: frozenset[int]) -> list[Touch]:
        """What the launches of `nodes` touch at `point` (every iteration of the repeats
        inside them), each concurrent region among them proven on the way."""
        found: list[Touch] = []
        for node in nodes:
            if isinstance(node, Launch):
                found.extend(_launch_touches(self.program, node, point, stream))
            elif isinstance(node, Repeat):
                for iteration in range(node.variable.count if point is not None else 1):
                    inner = None if point is None else {**point, node.variable: iteration}
                    found.extend(self.walk(node.body, inner, stream, busy))
            elif isinstance(node, Concurrent):
                pairs, inner = on_streams(node, stream, busy)
                branches = [self.walk(branch, point, branch_stream, inner)
                            for branch, branch_stream in pairs]
                self.compared += sum(map(len, branches))
                if self.compared > TOUCH_LIMIT:
                    raise _TooMany(node)
                self.prove(node, branches)
                for touched in branches:
                    found.extend(touched)
            else:
                assert isinstance(node, PhaseRegion)
                found.extend(self.walk(node.body, point, stream, busy))
        return found

    def prove(self, node: Concurrent, branches: list[list[Touch]]) -> None:
        """Each touch against what the branches before its own touched: a write against
        every access, a read against the writes."""
        writes: dict[tuple, Cover] = {}
        accesses: dict[tuple, Cover] = {}
        for number, touched in enumerate(branches):
            for touch in touched:
                cover = (accesses if touch.writes else writes).get(touch.resource)
                found = cover.find(touch.low, touch.high) if cover is not None else None
                if found is not None:
                    self.conflict(node, found[0], found[1], number, touch)
            if number == len(branches) - 1:
                break  # nothing comes after the last branch to compare with it
            for touch in touched:
                if touch.low < touch.high:
                    for table, wanted in ((accesses, True), (writes, touch.writes)):
                        if wanted:
                            if touch.resource not in table:
                                table[touch.resource] = Cover()
                            table[touch.resource].add(touch.low, touch.high, (number, touch))

    def conflict(self, node: Concurrent, first: int, other: Touch, second: int,
                 touch: Touch) -> None:
        key = (id(node), id(touch.launch), touch.resource[0],
               touch.binding and touch.binding.index)
        if key in self.said:
            return  # one error for each pointer of a launch a region's branches share, at
        self.said.add(key)  # the first launch and iteration found
        launch, image, rival = touch.launch, touch.launch.image, other.launch.image.name
        kind = touch.resource[0]
        if kind == "memory":
            storage = touch.binding.view.storage
            low, high = max(touch.low, other.low), min(touch.high, other.high)
            elements = elements_of(storage, low - touch.shift, high - touch.shift)
            what = f"{elements}'{storage.label if elements else touch.binding.view.label}'"
            verb = "writes" if touch.writes else "reads"
            other_verb = "writes" if other.writes else "reads"
            message = (f"'{image.name}' in branch {second} {verb} {what} through pointer "
                       f"{touch.binding.index} '{touch.parameter.name}'{_where(touch.point)}, "
                       f"which '{rival}' in branch {first} {other_verb} through pointer "
                       f"{other.binding.index} '{other.parameter.name}' "
                       f"('{other.binding.view.label}'){_where(other.point)}: concurrent "
                       "branches may not touch what another branch writes")
            span = touch.binding.span
        elif kind == "state":
            message = (f"'{image.name}' is launched in branch {second} and in branch {first}, "
                       f"which may run at the same time{_where(touch.point)}: the image keeps "
                       "state of its own on the device (deviceState), so no two launches of it "
                       "may run at the same time")
            span = launch.span
        elif kind == "communicator":
            message = (f"the collectives '{image.name}' in branch {second} and '{rival}' in "
                       f"branch {first} are concurrent{_where(touch.point)}: the ranks' "
                       "communicator runs one collective at a time, in the same order on every "
                       "rank; put them in one branch")
            span = launch.span
        else:
            message = (f"'{image.name}' in branch {second} and '{rival}' in branch {first} "
                       f"share stream {touch.resource[1]}'s cuBLASLt workspace"
                       f"{_where(touch.point)}")
            span = launch.span
        notes = [*self.checker._trace_notes(launch),
                 Note(f"'{rival}' is launched here, in branch {first}", other.launch.span),
                 *[Note("which is reached from the call here", note.span)
                   for note in self.checker._trace_notes(other.launch)],
                 Note("the branches may run at the same time from here", node.span)]
        if kind == "state":
            notes.append(Note(f"'{image.name}' says so here", image.device_state))
        self.checker.report.error(message, span, *notes)


@dataclass(frozen=True)
class StreamStep:
    """One thing a host program does, in order: a launch on its stream, or a fork or join
    between a parent stream and a branch's (`stream` is the parent's). Streams are numbered
    as `stream_count` counts them, the communicator's last."""

    kind: str  # launch | fork | join
    stream: int
    branch: int = 0
    launch: Launch | None = None
    phase: str | None = None
    point: dict | None = None


def scheduled(program: Program):
    """Every launch the program makes, with its stream, and the forks and joins between."""
    compute, _ = stream_count(program)

    def number(stream: int) -> int:
        return compute if stream == COMMUNICATOR else stream

    def walk(nodes, phase, point, stream, busy):
        for node in nodes:
            if isinstance(node, Launch):
                yield StreamStep("launch", number(stream), launch=node, phase=phase,
                                 point=point)
            elif isinstance(node, Repeat):
                for iteration in range(node.variable.count):
                    yield from walk(node.body, phase, {**point, node.variable: iteration},
                                    stream, busy)
            elif isinstance(node, Concurrent):
                branches, inner = on_streams(node, stream, busy)
                side = [number(s) for _, s in branches if s != stream]
                yield from (StreamStep("fork", number(stream), s) for s in side)
                for branch, branch_stream in branches:
                    yield from walk(branch, phase, point, branch_stream, inner)
                yield from (StreamStep("join", number(stream), s) for s in side)
            else:
                yield from walk(node.body, node.phase, point, stream, busy)

    yield from walk(program.body, None, {}, 0, frozenset({0}))


def interleaved(program: Program, seed: int):
    """(launch, phase, point) for every launch the program makes, in one interleaving of its
    concurrent branches drawn from `seed` (each branch's own order kept): what a machine runs
    to show that a region's order does not matter where the checker says so."""
    import random
    rng = random.Random(seed)

    def walk(nodes, phase, point):
        found = []
        for node in nodes:
            if isinstance(node, Launch):
                found.append((node, phase, point))
            elif isinstance(node, Repeat):
                for iteration in range(node.variable.count):
                    found += walk(node.body, phase, {**point, node.variable: iteration})
            elif isinstance(node, Concurrent):
                branches = [walk(branch, phase, point) for branch in node.branches]
                branches = [list(reversed(b)) for b in branches if b]
                while branches:
                    branch = rng.choice(branches)
                    found.append(branch.pop())
                    if not branch:
                        branches.remove(branch)
            else:
                found += walk(node.body, node.phase, point)
        return found

    return walk(program.body, None, {})
