"""The bounds-checked reference machine: runs a launch program with each image's NumPy
reference semantics (cgc/reference.py), on memory laid out by the memory plan.

Every access a kernel makes goes through a Pointer, which checks it against the extent the
image declares and against the buffer actually bound; after each launch the machine checks
that no two pointers touched the same bytes where one wrote, unless the image allows the
pair. A violation raises Fault naming the launch and the slot. The machine resolves slot
bindings itself, so it runs programs the static checker never saw: that is how the checker
is tested against ground truth.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import numpy as np

from ...checking.memory import MemoryPlan, storage_home
from ...core.elements import element_bytes
from ...core.ir import BindingError, Launch, Program, View
from ..base import RunFault
from ..numerics import decode, encode, storage_dtype
from ..parallel import Communicator, SingleRank

WRITES = ("write", "readwrite", "accumulate")


class Fault(RunFault):
    """A launch did something unsafe: the message names the launch and the slot."""

    def __init__(self, kind: str, message: str):
        self.kind = kind  # slot | bounds | extent | alias | permission | data | reference
        super().__init__(message)


class Pointer:
    """One pointer argument of one launch: typed, bounded access to the bound view."""

    def __init__(self, launch_name: str, index: int, name: str, access: str, element: str,
                 low: str, array: np.ndarray, extent: int | None, home: str, base: int,
                 item_bytes: int):
        self.launch_name, self.index, self.name, self.access = launch_name, index, name, access
        self.element, self.low, self.array = element, low, array
        self.extent = extent
        self.home, self.base, self.item_bytes = home, base, item_bytes
        self.touched: list[tuple[int, int, bool]] = []  # element ranges, written?

    def _where(self) -> str:
        return f"pointer {self.index} '{self.name}' of {self.launch_name}"

    def _check(self, start: int, stop: int, writing: bool) -> None:
        if writing and self.access == "read":
            raise Fault("slot", f"{self._where()} is declared read-only, but the kernel writes it")
        if start < 0 or stop > len(self.array):
            raise Fault("bounds", f"{self._where()} touches elements {start} .. {stop - 1}, "
                                  f"outside the {len(self.array)} of its buffer")
        if self.extent is not None and stop > self.extent:
            raise Fault("extent", f"{self._where()} touches element {stop - 1}, past its "
                                  f"declared extent {self.extent}")
        self.touched.append((start, stop, writing))

    def read(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        stop = self.extent if stop is None else stop
        self._check(start, stop, False)
        return decode(self.array[start:stop], self.element, self.low)

    def write(self, start: int, values) -> None:
        values = np.asarray(values).reshape(-1)
        self._check(start, start + len(values), True)
        self.array[start:start + len(values)] = encode(values, self.element, self.low)

    def accumulate(self, start: int, values) -> None:
        values = np.asarray(values).reshape(-1)
        self._check(start, start + len(values), True)
        current = decode(self.array[start:start + len(values)], self.element, self.low)
        self.array[start:start + len(values)] = encode(current + values, self.element, self.low)

    def byte_ranges(self):
        """(first byte, last byte + 1, written?) in the pointer's allocation."""
        for start, stop, writing in self.touched:
            if stop > start:
                yield (self.base + start * self.item_bytes, self.base + stop * self.item_bytes,
                       writing)


@dataclass
class Kernel:
    """What a reference kernel sees: its pointers and scalars by name, grid, block, and the
    model's shape by role (`width`, `vocab`, ...: cgc/core/roles.py)."""

    pointers: dict[str, Pointer]
    scalars: dict[str, object]
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    constants: dict[str, object]
    communicator: Communicator = field(default_factory=SingleRank)  # what collectives span


class Machine:
    def __init__(self, program: Program, plan: MemoryPlan, kernels: dict):
        self.program, self.plan = program, plan
        self.kernels = kernels
        self.low = program.low
        self.memory: dict[str, np.ndarray] = {}
        for bank, (_, _, size, _) in plan.banks.items():
            self.memory[bank] = np.zeros(size, dtype=np.uint8)
        self.memory["buffers"] = np.zeros(max(plan.buffers_bytes, 1), dtype=np.uint8)
        self.memory["arena"] = np.zeros(max(plan.arena_bytes, 1), dtype=np.uint8)
        self.launch_count = 0
        self.communicator: Communicator = SingleRank()  # the run's: set by the backend
        # What the kernels see of the model: its shape, by role.
        self.constants = {role: value for role, value in program.roles.items()
                          if not isinstance(value, str)}

    # ---- memory --------------------------------------------------------------------

    def home(self, view: View) -> tuple[str, int]:
        return storage_home(self.program, self.plan, view.storage)

    def storage_array(self, view: View) -> np.ndarray:
        storage = view.storage
        home, start = self.home(view)
        size = element_bytes(storage.element, self.low)
        raw = self.memory[home][start:start + storage.count * size]
        return raw.view(storage_dtype(storage.element, self.low))

    def array(self, label: str) -> np.ndarray:
        """A whole storage by label (`cgLogits`, `cgBankP.cgQkvWeight`), decoded."""
        storage = self.program.storages[label]
        view = View(storage, 0, storage.count)
        return decode(self.storage_array(view), storage.element, self.low)

    def store(self, label: str, values) -> None:
        storage = self.program.storages[label]
        array = self.storage_array(View(storage, 0, storage.count))
        array[:] = encode(np.asarray(values).reshape(-1), storage.element, self.low)

    # ---- running -------------------------------------------------------------------

    def run(self, trace: list | None = None, order=None) -> None:
        """The whole program; with `trace`, each launch's (image, phase, start, end) times;
        with `order`, its launches in that order (an interleaving of concurrent branches:
        checking/concurrency.py) instead of the program's."""
        for launch, phase, point in order if order is not None else self.program.unrolled():
            start = time.perf_counter()
            self.launch(launch, phase, point)
            if trace is not None:
                trace.append((launch.image.name, phase, start, time.perf_counter()))

    def launch(self, launch: Launch, phase: str | None, point: dict) -> None:
        try:
            self._launch(launch, phase, point)
        except Fault as fault:
            if fault.span is None:  # where in the schedule: for the diagnostic
                fault.span, fault.trace = launch.span, launch.trace
            raise

    def _launch(self, launch: Launch, phase: str | None, point: dict) -> None:
        image = launch.image
        where = f"launch {self.launch_count} of '{image.name}' ({launch.span})"
        self.launch_count += 1
        try:
            arguments = launch.arguments(point)
        except BindingError as error:
            raise Fault("slot", f"{where}: {error}") from None
        grid, block = arguments.grid, image.block or (1, 1, 1)
        if min(grid) < 1:
            raise Fault("slot", f"{where} has an empty grid {grid}")

        scalars: dict[str, object] = {}
        for scalar in arguments.scalars:
            parameter, value = scalar.parameter, scalar.value
            if (parameter.type == "float32") != (scalar.kind == "Float"):
                raise Fault("slot", f"{where}: scalar {parameter.index} '{parameter.name}' is a "
                                    f"{parameter.type}, bound to a {scalar.kind}")
            if parameter.type == "int32" and not -2 ** 31 <= value < 2 ** 31:
                raise Fault("slot", f"{where}: scalar {parameter.index} '{parameter.name}' = "
                                    f"{value} does not fit in an int32")
            scalars[parameter.name] = value

        pointers: dict[str, Pointer] = {}
        writable = set(self.program.phases[phase].writes) if phase in self.program.phases \
            else set()
        for bound in arguments.pointers:
            parameter, view, offset = bound.parameter, bound.view, bound.offset
            index = parameter.index
            if view.storage.element != parameter.element:
                raise Fault("slot", f"{where}: pointer {index} '{parameter.name}' takes "
                                    f"{parameter.element}, bound to {view.storage.element} "
                                    f"'{view.label}'")
            if parameter.access in WRITES and view.storage.kind == "bank" and \
                    view.storage.name not in writable:
                raise Fault("permission", f"{where}: phase '{phase}' may not write bank "
                                          f"'{view.storage.name}'")
            array = self.storage_array(view)[offset:offset + view.count]
            extent = None
            if parameter.has_extent:
                try:
                    extent = launch.extents[index].at(point)
                except (KeyError, BindingError) as error:
                    raise Fault("extent", f"{where}: the extent of pointer {index} "
                                          f"'{parameter.name}' is unknown ({error})") from None
            home, base = self.home(view)
            item = element_bytes(view.storage.element, self.low)
            pointers[parameter.name] = Pointer(where, index, parameter.name, parameter.access,
                                               parameter.element, self.low, array, extent,
                                               home, base + offset * item, item)

        kernel = self.kernels[image.name]
        try:
            kernel(Kernel(pointers, scalars, grid, block, self.constants, self.communicator))
        except Fault:
            raise
        except Exception as error:
            if getattr(kernel, "__module__", "").startswith("cgc."):
                raise  # cgc's own reference function: a bug in cgc, told as one
            # a reference function of the user's (--kernels DIR): their code's fault, at the launch
            raise Fault("reference", f"{where}: its reference function "
                                     f"{getattr(kernel, '__qualname__', kernel)!s} raised "
                                     f"{type(error).__name__}: {error}") from None
        self.check_aliasing(where, image, pointers)

    def check_aliasing(self, where: str, image, pointers: dict[str, Pointer]) -> None:
        by_index = {p.index: p for p in pointers.values()}
        for first, second in itertools.combinations(sorted(by_index), 2):
            if frozenset((first, second)) in image.aliases:
                continue
            a, b = by_index[first], by_index[second]
            if a.home != b.home:
                continue
            for (a0, a1, aw), (b0, b1, bw) in itertools.product(a.byte_ranges(), b.byte_ranges()):
                if (aw or bw) and a0 < b1 and b0 < a1:
                    raise Fault("alias", f"{where}: pointers {first} '{a.name}' and {second} "
                                         f"'{b.name}' touch the same memory, and one writes it")
