"""The static checker: every launch of an evaluated program, before anything runs.

Per launch it proves: every argument slot bound exactly once with the right element or
scalar type; every access inside its buffer for every grid index and every repeat
iteration; no write outside what the launch's phase may write; no buffer bound to two
pointers of which one writes, unless the image allows that pair to alias. It warns when a
write leaves part of its output untouched. All problems are reported together.

Repeats are checked without unrolling: a launch's grid, scalars and buffer offsets are
affine in the repeat indices, and so are the extents computed from them, so their largest
and smallest values over all iterations are at the ends of the ranges (docs/checker.md).
"""

from __future__ import annotations

import itertools

from ..core import affine
from ..core.affine import LoopVariable, bounds, format_nat
from ..core.diagnostics import Note, Reporter
from ..core.elements import element_bytes
from ..core.ir import (
    SHARDED_COLLECTIVES, Image, Launch, PointerBinding, PointerParameter, Program, Repeat,
    concrete, extreme_point,
)
from ..core.roles import flowing
from .concurrency import Independence
from .flow import Values, element_range, elements_of, follow, reach

WRITES = ("write", "readwrite", "accumulate")
INT32 = (-(2 ** 31), 2 ** 31 - 1)
GRID_LIMITS = (2 ** 31 - 1, 65535, 65535)
BLOCK_LIMITS = (1024, 1024, 64)
# Which banks each stage may name in (writes ...): parameters and optimizer state belong
# to the optimizer, gradients to the backward pass.
STAGE_ROLES = {"forward": (), "data": (), "backward": ("gradients",),
               "optimizer": ("parameters", "state", "copies")}


def _pronoun(storage, low: int, high: int) -> str:
    return "it" if element_range(storage, low, high).startswith(("item ", "element ")) or \
        (low, high) == (0, storage.count) else "them"


def _where(variables: tuple[LoopVariable, ...], values: dict[LoopVariable, int]) -> str:
    """` at i = 3, j = 0`: every enclosing repeat's index (0 where the value does not care)."""
    if not variables:
        return ""
    return " at " + ", ".join(f"{v.name} = {values.get(v, 0)}" for v in variables)


class Checker:
    def __init__(self, program: Program, report: Reporter):
        self.program = program
        self.report = report
        self.repeat_spans = set()

        def repeats(nodes):
            for node in nodes:
                if isinstance(node, Repeat):
                    self.repeat_spans.add(node.span)
                if not isinstance(node, Launch):
                    repeats(node.body)
        repeats(program.body)

    def run(self) -> None:
        self.check_images()
        self.check_phases()
        for launch, phase, loops in self.program.launches():
            self.check_launch(launch, phase, loops)
        Independence(self.program, self).run()
        if self.program.roles.get("step") == self.program.entry:
            self.check_reads_follow_writes()
            self.check_collective_placement()
            if not self.report.has_errors:  # a misplaced collective parts them already
                self.check_ranks_agree()

    # ---- the whole step ------------------------------------------------------------

    def check_reads_follow_writes(self) -> None:
        """In the whole step (the `step` role), no launch reads elements of a step buffer or
        an arena slot that nothing earlier in the step wrote: such a read sees the previous
        step's leftovers or another arena slot's bytes. Tracked element by element, over the
        step unrolled (every iteration of every repeat, each stack item apart), as far as
        each write's grid reaches. What the runtime gives the step (roles that flow in: the
        ids and targets) counts as written; what it takes from the step (roles that flow
        out: the loss) must be written whole by the end. A read-modify-write (readwrite,
        accumulate) is the kernel's own business (state kept across steps, such as the
        optimizer's step counter, or a sum into zeroed memory)."""
        program, roles = self.program, self.program.roles
        step = program.entry
        flow = follow(program)  # the analysis the memory plan's live ranges come from
        reported: set[str] = set()
        rule = Note(f"'{step}' is the whole step (its `step` role): every value it reads it "
                    "must first write, but for what the runtime gives it (the "
                    f"{' and '.join(f'`{r}`' for r in flowing('in'))} roles)")
        for read in flow.reads:
            binding, parameter, point = read.binding, read.parameter, read.point
            storage = binding.view.storage
            if parameter.access != "read" or storage.name in reported:
                continue
            hole = next(((a, b) for a, b, writer in read.sources if writer is None), None)
            if hole is None:
                continue
            reported.add(storage.name)  # said once
            kind = "step buffer" if storage.kind == "buffer" else "arena slot"
            where = "" if point is None else _where(tuple(point), point)
            self.error(read.launch, f"'{read.launch.image.name}' reads "
                                    f"{elements_of(storage, *hole)}the {kind} '{storage.name}' "
                                    f"through pointer {binding.index} '{parameter.name}'{where}, "
                                    f"but nothing earlier in the step '{step}' writes "
                                    f"{_pronoun(storage, *hole)}", binding.span, rule)
        for role in flowing("out"):
            if role not in roles:
                continue
            storage = program.storages[roles[role]]
            values = flow.values.get(storage.name)
            hole = (0, storage.count) if values is None else values.first_gap(0, storage.count)
            if hole is not None:
                self.report.error(
                    f"the step '{step}' never writes {elements_of(storage, *hole)}"
                    f"'{storage.name}', its `{role}` role: the runtime reads all of it after "
                    "every step", program.role_spans.get("step"),
                    Note(f"'{storage.name}' is given the `{role}` role here",
                         program.role_spans.get(role)))

    def touched(self, launch, point, wanted):
        """(binding, parameter, allocation, low, high) for each pointer of the launch whose
        access is in `wanted`, in its allocation's elements (a bank entry inside its bank),
        at one iteration of the unrolled step."""
        for binding in launch.pointers:
            parameter = launch.image.pointers.get(binding.index)
            if parameter is None or parameter.access not in wanted:
                continue
            home, start = self.program.address(binding.view)
            low, high = reach(launch, parameter, binding.view, point)
            shift = concrete(start, point) - concrete(binding.view.offset, point)
            yield binding, parameter, home, low + shift, high + shift

    def check_collective_placement(self) -> None:
        """In the whole step, a collective (an all-reduce of the gradients, say) stands between
        what computes its elements and what consumes them: no launch writes elements a
        collective reduced after it (that rank's write would never reach the others, and the
        ranks would part ways); no launch of an optimizer-stage phase reads elements a later
        reduction reduces (it would read this rank's share alone); and no optimizer-stage
        launch reads an element the backward wrote that no reduction reduced in between (a
        gradient outside this rank's shard of a reduce-scatter, say). What a collective
        reduces is exact: an all-reduce its whole buffer, a reduce-scatter this rank's shard
        (cgRank of cgRanks); an all-gather reduces nothing, it gathers. Tracked element by
        element in each allocation (a bank entry and the whole bank overlap), over the step
        unrolled."""
        program = self.program
        if not any(launch.image.collective for launch, _, _ in program.launches()):
            return
        step = program.entry
        unrolled = list(program.unrolled())

        touched = self.touched

        def note(launch, verb):
            return Note(f"the collective '{launch.image.name}' {verb} here", launch.span)

        # Every collective call of the step: its place in the unrolled step, the elements it
        # leaves the same on every rank (reduced, or gathered), and whether it reduces.
        calls = []
        for position, (launch, _, point) in enumerate(unrolled):
            if launch.image.collective:
                operation = launch.image.collective[0]
                for _, _, home, low, high in touched(launch, point, WRITES):
                    if operation == "reduceScatter":
                        low, high = program.shard(low, high)
                    calls.append((position, home, low, high, launch, operation != "allGather"))
        said: set[tuple] = set()

        def overlapping(home, low, high, before: bool, position: int, reducing=False):
            for at, where, a, b, other, reduces in calls:
                if where == home and a < high and low < b and (at < position) == before \
                        and (reduces or not reducing):
                    yield other

        written: list[tuple] = []  # (position, allocation, low, high, launch) of the backward
        for position, (launch, phase, point) in enumerate(unrolled):
            if launch.image.collective:
                continue
            stage = program.phases[phase].stage if phase in program.phases else None
            if stage == "optimizer":
                for binding, parameter, home, low, high in touched(launch, point, ("read",)):
                    for other in overlapping(home, low, high, False, position, reducing=True):
                        if ("read", id(other)) in said:  # the first such read, once
                            continue
                        said.add(("read", id(other)))
                        said.add(("unreduced", id(launch), binding.index))
                        self.error(launch, f"'{launch.image.name}' in the optimizer phase "
                                           f"'{phase}' reads '{binding.view.label}' through "
                                           f"pointer {binding.index} '{parameter.name}' before "
                                           f"the collective '{other.image.name}' reduces it "
                                           "across the ranks: it would see this rank's share "
                                           "alone", binding.span,
                                   note(other, "comes later in the step"))
                    self.check_reduced_before(launch, phase, binding, parameter, point,
                                              (home, low, high), position, written, calls,
                                              said)
            for binding, parameter, home, low, high in touched(launch, point, WRITES):
                late = list(overlapping(home, low, high, True, position))
                if stage == "backward" and not late:  # a late write is its own error
                    written.append((position, home, low, high, launch))
                for other in late:
                    if ("write", id(other)) in said:  # the first such write, once
                        continue
                    said.add(("write", id(other)))
                    self.error(launch, f"'{launch.image.name}' writes '{binding.view.label}' "
                                       f"through pointer {binding.index} '{parameter.name}' "
                                       f"after the collective '{other.image.name}' reduced it "
                                       f"across the ranks in the step '{step}': the other "
                                       "ranks never see this write, and the ranks part ways",
                               binding.span, note(other, "reduced it"))

    def check_reduced_before(self, launch, phase, binding, parameter, point, read, position,
                             written, calls, said) -> None:
        """An optimizer read (`read`: elements [low, high) of allocation `home`) at `position`
        sees, of what the backward wrote, only elements a reduction reduced after that
        write: else reported, once."""
        home, low, high = read
        if ("unreduced", id(launch), binding.index) in said:
            return
        gaps = []  # (low, high, writer): what a write left that no reduction reduced
        for at, where, a, b, writer in written:
            if where != home or not (a < high and low < b):
                continue
            left, right = max(a, low), min(b, high)
            covers = sorted((max(c, left), min(d, right))
                            for when, place, c, d, _, reduces in calls
                            if reduces and place == home and at < when < position
                            and c < right and left < d)
            for c, d in covers + [(right, right)]:
                if c > left:
                    gaps.append((left, c, writer))
                left = max(left, d)
        if not gaps:
            return
        gaps.sort(key=lambda gap: gap[:2])
        first, end, writer = gaps[0]
        writers = {id(writer)}
        for a, b, other in gaps[1:]:  # the first run of unreduced elements, whole
            if a > end:
                break
            end, _ = max(end, b), writers.add(id(other))
        gap = (first, end)
        which = "" if len(writers) == 1 else "the first of "
        said.add(("unreduced", id(launch), binding.index))
        storage = binding.view.storage
        start = concrete(self.program.address(binding.view)[1], point)
        shift = start - concrete(binding.view.offset, point)  # allocation -> storage
        self.report.error(
            f"'{launch.image.name}' in the optimizer phase '{phase}' reads "
            f"{elements_of(storage, gap[0] - shift, gap[1] - shift)}'{binding.view.label}' "
            f"through pointer {binding.index} '{parameter.name}', which the backward wrote "
            "and no collective reduced across the ranks before this read: it would see "
            "this rank's share alone", binding.span, *self._trace_notes(launch),
            Note(f"'{writer.image.name}' writes {which}"
                 f"{_pronoun(storage, gap[0] - shift, gap[1] - shift)} here, in the backward",
                 writer.span),
            *self._trace_notes(writer))

    def check_ranks_agree(self) -> None:
        """In a data-parallel step, what one step leaves for the next (the parameters, the
        optimizer's state, the copies, the buffers a step carries) is the same on every rank
        after it, but for buffers declared (sharded), each rank's own. Followed element by
        element over the step unrolled: the data (the ids and targets) and the sharded
        buffers differ from rank to rank; a launch that reads an element that differs writes
        elements that differ; an all-reduce and an all-gather leave their buffer the same on
        every rank, a reduce-scatter its shard this rank's own. (ZeRO-1 without its
        all-gather leaves each rank its own parameters.)"""
        program = self.program
        if not any(launch.image.collective for launch, _, _ in program.launches()):
            return

        def count(home):
            return program.bank_layouts[home][1] if home in program.bank_layouts \
                else program.storages[home].count
        spread: dict[str, Values] = {}

        def values(home) -> Values:
            return spread.setdefault(home, Values(count(home)))
        for label in [program.roles.get(r) for r in ("ids", "targets")] + list(program.sharded):
            if label in program.storages:
                values(label).write(0, count(label), ("differs", label))

        for launch, _, point in program.unrolled():
            collective = launch.image.collective
            if collective is not None:
                for _, _, home, low, high in self.touched(launch, point, WRITES):
                    if collective[0] == "reduceScatter":
                        values(home).write(*program.shard(low, high), (launch, home))
                    else:
                        values(home).write(low, high, None)
                continue
            source = next(((binding.view.label if isinstance(cause[0], Launch) else cause[1])
                           for binding, _, home, low, high in self.touched(
                               launch, point, ("read", "readwrite", "accumulate"))
                           for _, _, cause in values(home).sources(low, high)
                           if cause is not None), None)
            for _, _, home, low, high in self.touched(launch, point, WRITES):
                values(home).write(low, high, None if source is None else (launch, source))
        kept = [b for b in program.bank_layouts
                if program.banks[b].role in ("parameters", "state", "copies")]
        kept += [b for b in program.carried_buffers() if b not in program.sharded]
        parted = [(home, *part) for home in kept
                  for part in [next(((a, b, cause) for a, b, cause in values(home).segments
                                     if cause is not None), None)] if part is not None]
        if not parted:
            return
        (home, low, high, (writer, source)), others = parted[0], parted[1:]
        # one fault, said once: what the first storage's parting makes part after it, a note
        self.error(writer, f"after the step '{program.entry}', elements {low} to {high - 1} of "
                           f"'{home}' differ from rank to rank: '{writer.image.name}' wrote "
                           f"them from '{source}', which differs from rank to rank, and no "
                           "all-reduce or all-gather made them the same before the step "
                           "ends: the ranks part ways", None,
                   *[Note(f"and so do elements {a} to {b - 1} of '{other}', which "
                          f"'{cause[0].image.name}' wrote from '{cause[1]}'", cause[0].span)
                     for other, a, b, cause in others])

    # ---- declarations ------------------------------------------------------------

    def check_images(self) -> None:
        for image in self.program.images.values():
            block = image.block
            if block is None:
                continue
            for axis, (size, limit) in enumerate(zip(block, BLOCK_LIMITS)):
                if size > limit:
                    self.report.error(f"block dimension {'xyz'[axis]} of image '{image.name}' is "
                                      f"{size}; CUDA allows at most {limit}", image.span)
            threads = block[0] * block[1] * block[2]
            if threads > 1024:
                self.report.error(f"image '{image.name}' has {threads} threads a block; CUDA "
                                  "allows at most 1024", image.span)

    def check_phases(self) -> None:
        banks = self.program.banks
        for phase in self.program.phases.values():
            allowed = STAGE_ROLES.get(phase.stage or "forward", ())
            for name, span in zip(phase.writes, phase.write_spans):
                role = banks[name].role
                if role not in allowed:
                    owner = {"gradients": "backward", "parameters": "optimizer",
                             "state": "optimizer", "copies": "optimizer"}[role]
                    self.report.error(
                        f"phase '{phase.name}' is a {phase.stage or 'forward'} phase and may not "
                        f"write bank '{name}' ({role}): only {owner} phases write {role}",
                        span)

    # ---- launches ----------------------------------------------------------------

    def _image_note(self, image: Image) -> Note:
        return Note(f"image '{image.name}' is declared here", image.span)

    def _trace_notes(self, launch: Launch) -> list[Note]:
        """The calls that led to the launch, innermost first, back to the user's own line
        (a repeat applies its body like a call, but is no call of the user's)."""
        return [Note("required from the call here", span) for span in reversed(launch.trace)
                if span not in self.repeat_spans]

    def error(self, launch: Launch, message: str, span=None, *notes: Note) -> None:
        self.report.error(message, span or launch.span, *notes, *self._trace_notes(launch))

    def check_launch(self, launch: Launch, phase: str | None, loops) -> None:
        image = launch.image
        if phase is None:
            self.error(launch, f"launch of '{image.name}' is outside any phase, so what it may "
                               "write is unknown; wrap it in (cgPhase PHASE ...)")
        pointers = self.check_pointer_slots(launch)
        scalars_fine = self.check_scalar_slots(launch, loops)
        self.check_grid(launch, loops)
        if image.collective is not None:
            self.check_collective_grid(launch, loops)
            self.check_collective_shards(launch, loops)
        if image.library is None and image.block is None:
            return
        self.check_alignment(launch, pointers, loops)
        for index, binding in sorted(pointers.items()):
            parameter = image.pointers[index]
            if parameter.has_extent and scalars_fine:
                self.check_extent(launch, parameter, binding, loops)
            if phase is not None and parameter.access in WRITES:
                self.check_permission(launch, parameter, binding, phase)
        self.check_aliasing(launch, pointers, loops)

    def bindings(self, launch: Launch, bindings, declared: dict, what: str):
        """Each declared argument's binding by index; unknown and repeated indices reported.
        Returns (bound, fine): fine is False when a binding was refused."""
        image, bound, fine = launch.image, {}, True
        for binding in bindings:
            parameter = declared.get(binding.index)
            if parameter is None:
                known = ", ".join(str(i) for i in sorted(declared)) or "none"
                self.error(launch, f"'{image.name}' has no {what} argument {binding.index} "
                                   f"(its {what}s: {known})", binding.span,
                           self._image_note(image))
                fine = False
            elif binding.index in bound:
                self.error(launch, f"{what} argument {binding.index} '{parameter.name}' of "
                                   f"'{image.name}' is bound twice", binding.span,
                           Note("first bound here", bound[binding.index].span),
                           Note(f"'{parameter.name}' is declared here", parameter.span))
                fine = False
            else:
                bound[binding.index] = binding
        return bound, fine

    def unbound(self, launch: Launch, index: int, parameter, what: str, why: str = "") -> None:
        self.error(launch, f"{what} argument {index} '{parameter.name}' of '{launch.image.name}' "
                           f"is not bound{why}", launch.span,
                   Note(f"'{parameter.name}' is declared here", parameter.span))

    def check_pointer_slots(self, launch: Launch) -> dict[int, PointerBinding]:
        """The pointers bound once with the right element type, by index."""
        image = launch.image
        bound, _ = self.bindings(launch, launch.pointers, image.pointers, "pointer")
        for index, binding in bound.items():
            parameter, element = image.pointers[index], binding.view.storage.element
            if element != parameter.element:
                self.error(launch, f"pointer argument {index} '{parameter.name}' of "
                                   f"'{image.name}' takes {parameter.element}, but "
                                   f"'{binding.view.label}' holds {element}", binding.span,
                           Note(f"'{parameter.name}' is declared here", parameter.span))
        for index, parameter in sorted(image.pointers.items()):
            if index not in bound:
                self.unbound(launch, index, parameter, "pointer")
        return {i: b for i, b in bound.items()
                if b.view.storage.element == image.pointers[i].element}

    def check_scalar_slots(self, launch: Launch, loops) -> bool:
        """Whether every scalar is given once (bound or by default) with a fitting value."""
        image = launch.image
        bound, fine = self.bindings(launch, launch.scalars, image.scalars, "scalar")
        for index, parameter in sorted(image.scalars.items()):
            if index in bound:
                binding = bound[index]
                fine &= self.scalar_fits(launch, parameter, binding.value, binding.kind,
                                         binding.span)
            elif parameter.default is None:
                self.unbound(launch, index, parameter, "scalar", ", and it has no default")
                fine = False
        return fine

    def scalar_fits(self, launch, parameter, value, kind: str, span) -> bool:
        if parameter.type == "float32":
            if kind != "Float":
                self.error(launch, f"scalar argument {parameter.index} '{parameter.name}' of "
                                   f"'{launch.image.name}' is a float32; found a {kind} "
                                   f"({format_nat(value)}); write it as a float, e.g. "
                                   f"{format_nat(value)}.0", span,
                           Note(f"'{parameter.name}' is declared here", parameter.span))
                return False
            if abs(value) > 3.4028234663852886e38:
                self.error(launch, f"{value!r} does not fit in a float32", span)
                return False
            return True
        if kind == "Float":
            self.error(launch, f"scalar argument {parameter.index} '{parameter.name}' of "
                               f"'{launch.image.name}' is an int32; found the Float {value!r}",
                       span, Note(f"'{parameter.name}' is declared here", parameter.span))
            return False
        low, high = bounds(value)
        if low < INT32[0] or high > INT32[1]:
            self.error(launch, f"scalar argument {parameter.index} '{parameter.name}' of "
                               f"'{launch.image.name}' is an int32, but its value reaches "
                               f"{high if high > INT32[1] else low}", span)
            return False
        return True

    def check_grid(self, launch: Launch, loops) -> None:
        for axis, (size, limit) in enumerate(zip(launch.grid, GRID_LIMITS)):
            low, high = bounds(size)
            if low < 1:
                point = extreme_point(size, largest=False)
                self.error(launch, f"grid dimension {'xyz'[axis]} of this launch of "
                                   f"'{launch.image.name}' is {low}{_where(loops, point)}: a "
                                   "grid has at least one block in each dimension")
            if high > limit:
                point = extreme_point(size, largest=True)
                self.error(launch, f"grid dimension {'xyz'[axis]} of this launch of "
                                   f"'{launch.image.name}' is {high}{_where(loops, point)}; "
                                   f"CUDA allows at most {limit}")

    def check_collective_grid(self, launch: Launch, loops) -> None:
        """A collective is one call over its whole buffer on every rank, not a kernel: it has
        no block index to share its work by, so a grid of more than one would only run the
        whole exchange again, once a block."""
        for axis, size in enumerate(launch.grid):
            low, high = bounds(size)
            if high > 1 and low >= 1:
                point = extreme_point(size, largest=True)
                self.error(launch, f"grid dimension {'xyz'[axis]} of this launch of the "
                                   f"collective '{launch.image.name}' is {high}"
                                   f"{_where(loops, point)}: a collective runs once over its "
                                   "whole buffer, on a grid of 1 x 1 x 1",
                           None, self._image_note(launch.image))
                return

    def check_collective_shards(self, launch: Launch, loops) -> None:
        """A reduce-scatter or an all-gather deals its buffer out in equal shards, one a rank
        (NCCL's counts are per rank): the count must divide by the ranks."""
        if launch.image.collective[0] not in SHARDED_COLLECTIVES:
            return
        ranks = self.program.ranks
        for binding in launch.pointers:
            count = binding.view.count
            if count % ranks:
                self.error(launch, f"the {launch.image.collective[0]} '{launch.image.name}' "
                                   f"deals '{binding.view.label}' ({count} elements) out to "
                                   f"{ranks} ranks in equal shards, but {count} is not a "
                                   f"multiple of {ranks}{_where(loops, {})}", binding.span)

    # ---- extents -----------------------------------------------------------------

    def check_extent(self, launch, parameter: PointerParameter, binding: PointerBinding,
                     loops) -> None:
        extent = launch.extents.get(parameter.index)
        if extent is None:
            return
        if extent.problem is not None:
            self.error(launch, f"the extent of pointer {parameter.index} '{parameter.name}' is "
                               f"{extent.problem}", None,
                       Note("the extent is declared here", parameter.span))
            return
        largest, at_largest, smallest, at_smallest = extent.extremes()
        view = binding.view
        verb = {"read": "reads", "write": "writes", "readwrite": "reads and writes",
                "accumulate": "accumulates into"}[parameter.access]
        if largest > view.count:
            self.error(launch, f"'{launch.image.name}' {verb} {largest} elements of "
                               f"'{view.label}' through pointer {parameter.index} "
                               f"'{parameter.name}'{_where(loops, at_largest)}, but "
                               f"'{view.label}' holds {view.count} ({view.storage.element}"
                               f"[{view.count}])", binding.span,
                       Note(f"the extent of '{parameter.name}' is declared here", parameter.span))
        elif parameter.index in launch.image.covers and smallest < view.count:
            self.error(launch, f"'{launch.image.name}' must cover all of '{view.label}' "
                               f"through pointer {parameter.index} '{parameter.name}', but this "
                               f"grid reaches only {smallest} of its {view.count} elements"
                               f"{_where(loops, at_smallest)}", binding.span,
                       Note(f"'{launch.image.name}' says so with (covers ...) here",
                            launch.image.covers[parameter.index]),
                       Note(f"the extent of '{parameter.name}' is declared here", parameter.span))
        elif parameter.access == "write" and smallest < view.count:
            self.report.warning(
                f"'{launch.image.name}' writes only up to element {smallest} of the {view.count} of "
                f"'{view.label}'{_where(loops, at_smallest)}: at least {view.count - smallest} "
                "are left untouched (does the grid leave a tail uncovered?)", binding.span,
                Note(f"the extent of '{parameter.name}' is declared here", parameter.span),
                *self._trace_notes(launch))

    # ---- alignment ---------------------------------------------------------------

    def check_alignment(self, launch: Launch, pointers: dict[int, PointerBinding], loops) -> None:
        """A pointer the kernel reads or writes with wide vector accesses starts on a
        multiple of their width, in every iteration. Allocations, step buffers, arena slots
        and bank entries all start on 256 bytes, so what remains to prove is the view's
        own offset: its constant part and each repeat index's coefficient, in bytes."""
        image = launch.image
        for index, (size, span) in sorted(image.alignments.items()):
            binding = pointers.get(index)
            if binding is None:
                continue
            storage = binding.view.storage
            _, start = self.program.address(binding.view)
            bytes_each = element_bytes(storage.element, self.program.low)
            constant, terms = affine.parts(affine.scale(start, bytes_each))
            if constant % size == 0 and all(k % size == 0 for k in terms.values()):
                continue
            point = {v: 1 for v, k in terms.items() if k % size}
            misaligned = constant + sum(k * point.get(v, 0) for v, k in terms.items())
            parameter = image.pointers[index]
            self.error(launch, f"pointer {index} '{parameter.name}' of '{image.name}' needs "
                               f"{size}-byte alignment, but '{binding.view.label}' starts "
                               f"{misaligned % size} bytes past a {size}-byte boundary"
                               f"{_where(loops, point)}",
                       binding.span,
                       Note(f"'{image.name}' reads and writes '{parameter.name}' {size} bytes "
                            "at a time (aligned here)", span))

    # ---- permissions and aliasing ------------------------------------------------

    def check_permission(self, launch, parameter, binding, phase: str) -> None:
        storage = binding.view.storage
        if storage.kind != "bank":
            return
        declaration = self.program.phases[phase]
        if storage.name in declaration.writes:
            return
        role = self.program.banks[storage.name].role
        self.error(launch, f"phase '{phase}' may not write bank '{storage.name}' ({role}), but "
                           f"pointer {parameter.index} '{parameter.name}' of "
                           f"'{launch.image.name}' writes '{binding.view.label}'", binding.span,
                   Note(f"phase '{phase}' is declared here; its (writes ...) clause lists the "
                        "banks it may write", declaration.span))

    def check_aliasing(self, launch: Launch, pointers: dict[int, PointerBinding], loops) -> None:
        image = launch.image
        placed = {index: self.program.address(binding.view) for index, binding in pointers.items()}
        for first, second in itertools.combinations(sorted(pointers), 2):
            accesses = (image.pointers[first].access, image.pointers[second].access)
            if not any(access in WRITES for access in accesses):
                continue  # two reads of one buffer are harmless
            if frozenset((first, second)) in image.aliases:
                continue
            (home_a, start_a), (home_b, start_b) = placed[first], placed[second]
            if home_a != home_b:
                continue
            count_a, count_b = pointers[first].view.count, pointers[second].view.count
            # [a, a + count_a) and [b, b + count_b) overlap when -count_b < b - a < count_a,
            # for some iteration: b - a is affine, so its range is between its extremes.
            difference = affine.add(start_b, start_a, -1)
            low, high = bounds(difference)
            if high <= -count_b or low >= count_a:
                continue
            names = [f"{i} '{image.pointers[i].name}'" for i in (first, second)]
            self.error(launch, f"pointers {names[0]} and {names[1]} of '{image.name}' overlap "
                               f"in '{pointers[first].view.label}' and "
                               f"'{pointers[second].view.label}', and "
                               f"'{image.name}' does not allow them to alias",
                       pointers[second].span,
                       Note("the other pointer is bound here", pointers[first].span),
                       Note(f"an image that works in place says so with (alias {first} "
                            f"{second})", image.span))


def check_program(program: Program, report: Reporter) -> None:
    Checker(program, report).run()
