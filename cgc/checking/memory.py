"""The memory plan: every bank and its entries, the step buffers, and the arena.

Everything is allocated once, before the step: one allocation per bank, one for the step
buffers and one for the arena. Arena slots whose lifetimes never overlap share memory.
A slot is live from each write to the last read that sees that write's elements, element by
element: its live ranges come from the analysis the checker's read-before-write rule uses
(flow.py), so a write of part of a slot leaves the rest of its value alive; the slots a
concurrent region touches are live together across the whole region (concurrency.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core.elements import element_bytes
from ..core.ir import Program
from .concurrency import regions
from .flow import merged, follow

ALIGNMENT = 256  # bytes: every allocation and arena slot starts on a 256-byte boundary


def _align(size: int) -> int:
    return -(-size // ALIGNMENT) * ALIGNMENT


@dataclass
class Placed:
    name: str
    element: str
    count: int
    bytes: int
    offset: int  # bytes from the start of its allocation
    live: list = field(default_factory=list)  # arena only: [first, last] launch positions


@dataclass
class MemoryPlan:
    config: str
    low: str
    banks: dict[str, tuple[str, str, int, list[Placed]]] = field(default_factory=dict)
    buffers: list[Placed] = field(default_factory=list)
    buffers_bytes: int = 0
    arena: list[Placed] = field(default_factory=list)
    arena_bytes: int = 0
    arena_unshared_bytes: int = 0
    unused_slots: list[str] = field(default_factory=list)
    unused_banks: list[str] = field(default_factory=list)  # declared, touched by no launch
    sharded: list[str] = field(default_factory=list)  # buffers a rank holds a shard of
    rank: int = 0
    ranks: int = 1
    peak_bytes: int = 0
    launches: int = 0
    offsets: dict[str, int] = field(default_factory=dict)  # buffer or arena slot -> byte
    red_zone: int = 0  # bytes after every buffer and arena slot (sanitizer builds)
    entry: str = ""
    # Arena slots stacked one item per layer (activations a forward keeps for the backward):
    # the memory a schedule spends to read rather than recompute them.
    stacked_slots: list[str] = field(default_factory=list)
    stacked_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return sum(size for _, _, size, _ in self.banks.values()) + self.buffers_bytes + \
            self.arena_bytes


def _overlap(a: list[list[int]], b: list[list[int]]) -> bool:
    return any(x[0] <= y[1] and y[0] <= x[1] for x in a for y in b)


def plan_memory(program: Program, red_zone: int = 0, share: bool = True) -> MemoryPlan:
    """The plan; with `red_zone`, that many bytes (a multiple of 256) follow every step
    buffer and arena slot, for a sanitizer build to poison: an access one element past a
    buffer then lands in a red zone, even inside the one allocation buffers share. Without
    `share`, every arena slot has bytes of its own (what the campaign compares a shared
    arena's results with: scripts/checker_vs_ground_truth.py)."""
    low = program.low
    plan = MemoryPlan(program.config, low, entry=program.entry, rank=program.rank,
                      ranks=program.ranks, sharded=list(program.sharded),
                      unused_banks=[b for b in program.banks if b not in program.bank_layouts])
    plan.red_zone = red_zone

    def _spaced(size: int) -> int:  # a buffer or slot and its red zone, aligned
        return _align(size + red_zone)

    for bank, (offsets, total) in program.bank_layouts.items():
        declaration = program.banks[bank]
        size = element_bytes(declaration.element, low)
        entries = []
        for entry, offset in offsets.items():
            storage = program.storages[f"{bank}.{entry}"]
            entries.append(Placed(entry, declaration.element, storage.count,
                                  storage.count * size, offset * size))
        plan.banks[bank] = (declaration.role, declaration.element, _align(total * size), entries)

    offset = 0
    for name, storage in program.storages.items():
        if storage.kind == "buffer":
            size = storage.count * element_bytes(storage.element, low)
            plan.buffers.append(Placed(name, storage.element, storage.count, size, offset))
            offset += _spaced(size)
    plan.buffers_bytes = offset

    flow = follow(program)
    ranges, plan.launches = flow.live_ranges(), flow.positions
    # The slots a concurrent region touches are live together across it: whatever order
    # its branches run in, no two of them share bytes.
    for first, last, names in regions(program):
        for name in names & ranges.keys():
            ranges[name] = merged(ranges[name] + [[first, last]])
    slots = []
    for name, storage in program.storages.items():
        if storage.kind != "arena":
            continue
        if name not in ranges:
            plan.unused_slots.append(name)
            continue
        size = storage.count * element_bytes(storage.element, low)
        slots.append(Placed(name, storage.element, storage.count, size, 0, ranges[name]))
        if storage.stack:
            plan.stacked_slots.append(name)
            plan.stacked_bytes += _spaced(size)
    # First fit, largest first: each slot takes the lowest offset clear of every placed
    # slot that is live at the same time as it.
    placed: list[Placed] = []
    for slot in sorted(slots, key=lambda s: (-s.bytes, s.name)):
        busy = sorted((other.offset, other.offset + _spaced(other.bytes)) for other in placed
                      if not share or _overlap(other.live, slot.live))
        candidate = 0
        for start, end in busy:
            if candidate + _spaced(slot.bytes) <= start:
                break
            candidate = max(candidate, end)
        slot.offset = candidate
        placed.append(slot)
    plan.arena = sorted(placed, key=lambda s: (s.offset, s.name))
    plan.offsets = {p.name: p.offset for p in (*plan.buffers, *plan.arena)}
    plan.arena_bytes = max((s.offset + _spaced(s.bytes) for s in placed), default=0)
    plan.arena_unshared_bytes = sum(_spaced(s.bytes) for s in placed)
    fixed = plan.total_bytes - plan.arena_bytes
    live_arena = max((sum(_spaced(s.bytes) for s in placed
                          if any(a <= position <= b for a, b in s.live))
                      for position in range(plan.launches)), default=0)
    plan.peak_bytes = fixed + live_arena
    return plan


def storage_home(program: Program, plan: MemoryPlan, storage) -> tuple[str, int]:
    """The allocation ("buffers", "arena" or a bank's name) holding a storage, and the byte
    where the storage starts in it."""
    if storage.kind == "bank":
        offset = program.bank_layouts[storage.name][0][storage.entry] if storage.entry else 0
        return storage.name, offset * element_bytes(storage.element, program.low)
    return ("buffers" if storage.kind == "buffer" else "arena"), plan.offsets[storage.name]


def _bytes(size: int) -> str:
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if size >= scale:
            return f"{size:,} bytes ({size / scale:.2f} {unit})"
    return f"{size:,} bytes"


def format_memory_plan(plan: MemoryPlan) -> str:
    of = f" of {plan.entry}" if plan.entry else ""
    lines = [f"memory plan{of}, config {plan.config} (low = {plan.low})", ""]
    for bank, (role, element, size, entries) in plan.banks.items():
        lines.append(f"bank {bank} ({role}, {element}): {_bytes(size)}")
        lines.append(f"  {'offset':>14} {'elements':>12} {'bytes':>14}  entry")
        for entry in entries:
            lines.append(f"  {entry.offset:>14,} {entry.count:>12,} {entry.bytes:>14,}  "
                         f"{entry.name}")
        lines.append("")
    if plan.unused_banks:
        lines.append(f"banks no launch touches, not allocated: {', '.join(plan.unused_banks)}")
        lines.append("")
    lines.append(f"step buffers: {_bytes(plan.buffers_bytes)}")
    lines.append(f"  {'offset':>14} {'elements':>12} {'bytes':>14}  buffer")
    for buffer in plan.buffers:
        lines.append(f"  {buffer.offset:>14,} {buffer.count:>12,} {buffer.bytes:>14,}  "
                     f"{buffer.name}: {buffer.element}")
    lines.append("")
    saved = plan.arena_unshared_bytes - plan.arena_bytes
    lines.append(f"arena: {_bytes(plan.arena_bytes)}; with a slot each it would take "
                 f"{plan.arena_unshared_bytes:,} bytes: sharing saves {saved:,} bytes")
    lines.append(f"  {'offset':>14} {'bytes':>14}  slot, and the launches it is live across")
    for slot in plan.arena:
        live = ", ".join(f"{a}..{b}" for a, b in slot.live)
        lines.append(f"  {slot.offset:>14,} {slot.bytes:>14,}  {slot.name}: {slot.element}, "
                     f"live {live}")
    if plan.unused_slots:
        lines.append(f"  not used by this schedule, not allocated: {', '.join(plan.unused_slots)}")
    if plan.stacked_slots:
        lines.append(f"  kept across the layers (stacked slots, an item per layer): "
                     f"{_bytes(plan.stacked_bytes)} in {len(plan.stacked_slots)} slots")
    else:
        lines.append("  kept across the layers (stacked slots): none; what the backward needs "
                     "of a layer's inside, it recomputes")
    lines.append("")
    if plan.sharded and plan.ranks > 1:
        share = sum(b.bytes for b in plan.buffers if b.name in plan.sharded)
        lines.append(f"sharded over {plan.ranks} ranks (this is rank {plan.rank}'s shard of "
                     f"each): {', '.join(plan.sharded)}: {_bytes(share)} a rank, "
                     f"{_bytes(share * plan.ranks)} in all")
    lines.append(f"total: {_bytes(plan.total_bytes)}")
    lines.append(f"peak live: {_bytes(plan.peak_bytes)} (banks and buffers, and the arena slots "
                 f"live at the busiest of {plan.launches} launches)")
    return "\n".join(lines) + "\n"


def format_rank_totals(plans: list[MemoryPlan]) -> str:
    """Each rank's total, one program a rank: what `cgc check --memory --ranks N` adds."""
    return (f"each rank's total ({len(plans)} ranks): "
            + ", ".join(f"rank {p.rank} {_bytes(p.total_bytes)}" for p in plans) + "\n")
