"""Which write each read sees: one analysis of the step buffers and arena slots, element by
element, serving the checker's read-before-write rule (check.py) and the memory plan's live
ranges (memory.py), so that the two cannot disagree on what a write leaves alive.

The program is followed launch by launch as it runs (every iteration of every repeat, each
stack item apart). Each access reaches the elements its pointer's extent covers at that
iteration (the whole view where the extent cannot be computed). A write replaces the value
of the elements it reaches, and of no others: a write of part of a slot leaves the rest of
the slot's previous value alive. A read (or a read-modify-write) sees, for each element it
reaches, the launch that last wrote it, or nothing (a value from before the program, or
given by the runtime for the roles that flow in).

A slot is live wherever one of its values is: from each write to every read that sees it,
and at every launch that touches it. The memory plan numbers a repeat's body once, so these
spans, taken in the unrolled step, are projected onto the program's launch positions: a
value carried from one iteration into a later one covers what the iterations between it run
(docs/checker.md, "The memory plan").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core.ir import BindingError, Launch, Program, Repeat, concrete
from ..core.roles import flowing

READS = ("read", "readwrite", "accumulate")  # accesses that see what the elements held
WRITES = ("write", "readwrite", "accumulate")
TRACKED = ("buffer", "arena")  # banks persist across steps: they have no live ranges
# The analysis follows every iteration while a program makes at most this many launches;
# past it, each launch is taken once with its whole views (docs/checker.md).
UNROLL_LIMIT = 200_000
GIVEN = -1  # the writer of what the runtime gives the step (the roles that flow in)


def reach(launch: Launch, parameter, view, point) -> tuple[int, int]:
    """The elements of a view's storage a launch's pointer reaches at one iteration (the
    whole view when the iteration is unknown or the extent cannot be computed)."""
    if point is None:
        return 0, view.storage.count
    offset = concrete(view.offset, point)
    extent = launch.extents.get(parameter.index)
    try:
        count = view.count if extent is None else min(extent.at(point), view.count)
    except BindingError:
        count = view.count
    return offset, offset + max(count, 0)


def elements_of(storage, low: int, high: int) -> str:
    """'Elements low..high-1 of ' a storage, by stack item where it is a stack; nothing when
    they are all of it: how a diagnostic names the elements it is about."""
    if (low, high) == (0, storage.count):
        return ""
    return element_range(storage, low, high) + " of "


def element_range(storage, low: int, high: int) -> str:
    if storage.stack and low % storage.item_count == 0 and high % storage.item_count == 0:
        first, last = low // storage.item_count, high // storage.item_count - 1
        return f"item {first}" if first == last else f"items {first} to {last}"
    if high - low == 1:
        return f"element {low}"
    return f"elements {low} to {high - 1}"


class Values:
    """A storage's elements, each with the time (the launch's place in the unrolled program)
    that last wrote it, or None where nothing has: sorted, disjoint [low, high, writer]."""

    def __init__(self, count: int):
        self.segments: list[list] = [[0, count, None]] if count > 0 else []

    def write(self, low: int, high: int, writer: int) -> None:
        if low >= high:
            return
        kept = []
        for a, b, w in self.segments:
            if b <= low or a >= high:
                kept.append([a, b, w])
                continue
            if a < low:
                kept.append([a, low, w])
            if b > high:
                kept.append([high, b, w])
        kept.append([low, high, writer])
        kept.sort(key=lambda s: s[0])
        self.segments = kept

    def sources(self, low: int, high: int) -> list[tuple[int, int, int | None]]:
        """(low, high, writer) for each run of [low, high) that one write (or none) left."""
        return [(max(a, low), min(b, high), w) for a, b, w in self.segments
                if a < high and b > low]

    def first_gap(self, low: int, high: int) -> tuple[int, int] | None:
        """The first run inside [low, high) that nothing wrote, if any."""
        return next(((a, b) for a, b, w in self.sources(low, high) if w is None), None)


@dataclass(frozen=True)
class Place:
    """A launch of the unrolled program: its position in the program (a repeat's body
    numbered once) and its enclosing repeats, outermost first, as (repeat, iteration,
    count, first position, last position)."""

    position: int
    repeats: tuple


@dataclass
class Read:
    """One pointer's read of a tracked storage, and the writes it sees."""

    launch: Launch
    binding: object
    parameter: object
    point: dict | None
    time: int
    low: int
    high: int
    sources: list  # (low, high, writer time, GIVEN or None)


@dataclass
class Flow:
    program: Program
    exact: bool  # every iteration followed (else each launch once, whole views)
    positions: int = 0  # launches in the program, a repeat's body once
    places: list[Place] = field(default_factory=list)  # by time
    reads: list[Read] = field(default_factory=list)
    touched: dict[str, list[int]] = field(default_factory=dict)  # storage -> times
    values: dict[str, Values] = field(default_factory=dict)  # at the end of the program

    def live_ranges(self) -> dict[str, list[list[int]]]:
        """Each arena slot's live ranges, as sorted disjoint [first, last] positions."""
        spans: dict[str, list] = {}
        storages = self.program.storages
        last = self.positions - 1
        if not self.exact:  # what a write leaves alive is not followed: live throughout
            return {name: [[0, last]] for name in self.touched
                    if storages[name].kind == "arena"}
        for name, times in self.touched.items():
            if storages[name].kind == "arena":
                spans[name] = [[self.places[t].position] * 2 for t in set(times)]
        carried: dict[str, list[tuple[int, int]]] = {}  # elements read before any write
        for read in self.reads:
            name = read.binding.view.storage.name
            if name not in spans:
                continue
            place = self.places[read.time]
            for low, high, writer in read.sources:
                if writer is None or writer == GIVEN:
                    spans[name].append([0, _latest(place, 0)])
                    if writer is None:
                        carried.setdefault(name, []).append((low, high))
                else:
                    spans[name].extend(_between(self.places[writer], place))
        # A value read before the program writes it comes from its previous run: what the
        # program last writes there lives to the end.
        for name, runs in carried.items():
            for low, high in runs:
                for _, _, writer in self.values[name].sources(low, high):
                    if writer is not None and writer != GIVEN:
                        spans[name].append([_earliest(self.places[writer], 0), last])
        return {name: merged(found) for name, found in spans.items()}


def _earliest(place: Place, level: int) -> int:
    """The first position the program runs from this launch on, within the repeats from
    `level` in: a repeat's earlier positions come back in its next iterations."""
    found = place.position
    for _, iteration, count, first, _ in place.repeats[level:]:
        if iteration < count - 1:
            return min(found, first)  # an outer repeat's start is earlier still
    return found


def _latest(place: Place, level: int) -> int:
    """The last position the program has run by this launch, within the repeats from `level`
    in: a repeat's later positions ran in its earlier iterations."""
    found = place.position
    for _, iteration, _, _, last in place.repeats[level:]:
        if iteration > 0:
            return max(found, last)
    return found


def _between(writer: Place, reader: Place) -> list[list[int]]:
    """The positions the program runs from the writer's launch to the reader's."""
    level = 0
    for a, b in zip(writer.repeats, reader.repeats):
        if a[:2] != b[:2]:
            break
        level += 1
    if level < len(writer.repeats) and level < len(reader.repeats) and \
            writer.repeats[level][0] == reader.repeats[level][0]:
        # one repeat, a later iteration: the rest of the writer's, the start of the reader's
        _, early, _, first, last = writer.repeats[level]
        late = reader.repeats[level][1]
        tail = [_earliest(writer, level + 1), last]
        head = [first, _latest(reader, level + 1)]
        if late - early > 1 or head[1] + 1 >= tail[0]:
            return [[first, last]]
        return [head, tail]
    return [[_earliest(writer, level), _latest(reader, level)]]


def merged(spans: list[list[int]]) -> list[list[int]]:
    merged: list[list[int]] = []
    for low, high in sorted(spans):
        if merged and low <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], high)
        else:
            merged.append([low, high])
    return merged


def _walk(program: Program, unroll: bool):
    """(launch, phase, point, place) for every launch the program makes (unroll), or for
    each launch once (point None)."""
    def size(nodes) -> int:
        return sum(1 if isinstance(n, Launch) else size(n.body) for n in nodes)

    position = 0

    def go(nodes, phase, point, repeats):
        nonlocal position
        for node in nodes:
            if isinstance(node, Launch):
                yield node, phase, point, Place(position, repeats)
                position += 1
            elif isinstance(node, Repeat):
                first, body = position, size(node.body)
                count = node.variable.count if unroll else 1
                for iteration in range(count):
                    position = first
                    key = (id(node), first)  # one repeat, wherever else its object appears
                    inner = repeats + ((key, iteration, count, first, first + body - 1),)
                    yield from go(node.body, phase,
                                  None if point is None else {**point, node.variable: iteration},
                                  inner)
                position = first + body
            else:  # a phase, or concurrent branches taken in order (one interleaving)
                yield from go(node.body, getattr(node, "phase", phase), point, repeats)

    yield from go(program.body, None, {} if unroll else None, ())


def follow(program: Program) -> Flow:
    """The flow of values through the program's step buffers and arena slots."""
    exact = program.launches_made() <= UNROLL_LIMIT
    flow = Flow(program, exact)
    storages = program.storages
    values = flow.values
    for role in flowing("in"):
        label = program.roles.get(role)
        if label in storages and storages[label].kind in TRACKED:
            storage = storages[label]
            values.setdefault(storage.name, Values(storage.count)).write(0, storage.count, GIVEN)
    for time, (launch, phase, point, place) in enumerate(_walk(program, exact)):
        flow.places.append(place)
        writes = []
        for binding in launch.pointers:
            parameter = launch.image.pointers.get(binding.index)
            storage = binding.view.storage
            if storage.kind not in TRACKED:
                continue
            flow.touched.setdefault(storage.name, []).append(time)  # its bytes are in use
            if parameter is None:
                continue
            known = values.setdefault(storage.name, Values(storage.count))
            low, high = reach(launch, parameter, binding.view, point)
            if parameter.access in READS:  # a launch reads what it reads before it writes
                flow.reads.append(Read(launch, binding, parameter, point, time, low, high,
                                       known.sources(low, high)))
            if parameter.access in WRITES:
                writes.append((known, low, high))
        for known, low, high in writes:
            known.write(low, high, time)
    flow.positions = sum(1 for _ in program.launches())
    return flow
