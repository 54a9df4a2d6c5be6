"""Built-in names: primitives of the language, their types, and type-level names."""

from __future__ import annotations

from .types import (
    ARGUMENT, ELEMENTS, ENTRY, FLOAT, IMAGE, INT, NAT, NUMBER, PHASE, SCALAR, SCHEDULE, SLOTS,
    ElementVar, Storage, function,
)

_E = ElementVar(-1)  # the element variable of polymorphic signatures

_NAT2 = function(NAT, NAT, NAT)
_FLOAT2 = function(FLOAT, FLOAT, FLOAT)

PRIMITIVES = {
    # schedules
    "cgThen": function(SCHEDULE, SCHEDULE, SCHEDULE),
    "cgConcurrently": function(SCHEDULE, SCHEDULE, SCHEDULE),
    "cgPhase": function(PHASE, SCHEDULE, SCHEDULE),
    "cgNothing": SCHEDULE,
    "cgLaunch": function(IMAGE, NAT, NAT, NAT, SLOTS, SCHEDULE),
    "nvidiaAffineLaunchRepeat": function(NAT, function(NAT, SCHEDULE), SCHEDULE),
    # argument slots
    "cgPointer": function(ARGUMENT, Storage("Buffer", _E), SLOTS, SLOTS),
    "cgSlot": function(SCALAR, NUMBER, SLOTS, SLOTS),
    "cgNoSlots": SLOTS,
    "cgArgument": function(NAT, ARGUMENT),
    "cgScalar": function(NAT, SCALAR),
    # buffers
    "cgParameter": function(Storage("Bank", _E), ENTRY, Storage("Buffer", _E)),
    "cgArena": function(Storage("Arena", _E), Storage("Buffer", _E)),
    "cgItem": function(Storage("Buffer", _E), NAT, Storage("Buffer", _E)),
    "cgBankAll": function(Storage("Bank", _E), Storage("Buffer", _E)),
    "cgEntries": function(Storage("Bank", _E), ENTRY, ENTRY, Storage("Buffer", _E)),
    "cgCount": function(Storage("Buffer", _E), NAT),
    "cgElements": function(Storage("Buffer", _E), NAT, NAT, Storage("Buffer", _E)),
    # the ranks of a data-parallel run: this program's rank, and how many there are
    "cgRank": NAT,
    "cgRanks": NAT,
    # natural arithmetic: exact, checked
    "naturalAdd": _NAT2,
    "naturalMultiply": _NAT2,
    "naturalDivideUnchecked": _NAT2,
    "naturalDivideCeiling": _NAT2,
    "naturalModulo": _NAT2,
    "naturalSubtract": _NAT2,
    "naturalSaturatingSubtract": _NAT2,
    "naturalMinimum": _NAT2,
    "naturalMaximum": _NAT2,
    # integers and floats (constants only: they never depend on a repeat index)
    "integerOfNatural": function(NAT, INT),
    "integerNegate": function(INT, INT),
    "floatOfNatural": function(NAT, FLOAT),
    "floatAdd": _FLOAT2,
    "floatSubtract": _FLOAT2,
    "floatMultiply": _FLOAT2,
    "floatDivide": _FLOAT2,
    "floatSquareRoot": function(FLOAT, FLOAT),
    "float32Log2E": FLOAT,
}

# Names that may stand in type positions: `Nat`, `(Buffer float32)`, `(family NvidiaLaunchSchedule)`.
TYPE_NAMES = ("Nat", "Float", "Int", "Schedule", "Image", "Phase", "Slots", "Entry", "Argument",
              "Scalar", "Buffer", "Bank", "Arena", "family", "NvidiaLaunchSchedule")

ELEMENT_NAMES = ELEMENTS  # the element table's names (cgc/core/elements.py)

# Names bound inside an image's extent formulas.
GRID_NAMES = ("gridX", "gridY", "gridZ", "blockX", "blockY", "blockZ")

RESERVED = set(PRIMITIVES) | set(TYPE_NAMES) | set(ELEMENT_NAMES)
