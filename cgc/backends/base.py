"""The one interface every backend implements, and what they all share.

A backend is a module in cgc/backends/ with a `Run` subclass and a line in the registry
(cgc/backends/__init__.py). A run holds one checked launch program in one place (host
memory, a GPU, ...): it stores and fetches whole storages by label (`cgBankP.cgQkvWeight`,
the buffer a role names), and runs steps. Parameter banks, the loss, the first parameters
and the dump are written once, here, on top of those.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from ..checking.memory import MemoryPlan
from ..checking.memory import _bytes as byte_count  # 1,234 bytes (1.21 KiB)
from ..core.diagnostics import Diagnostic
from ..core.ir import Program
from .parallel import Communicator, SingleRank

BANK_ROLES = ("parameters", "gradients", "state", "copies")
# The banks a run carries from one step to the next (a checkpoint keeps them); gradients are
# written by every step before it reads them.
SAVED_BANK_ROLES = ("parameters", "state", "copies")


def initial_parameters(program: Program, seed: int) -> dict[str, np.ndarray]:
    """Every entry's starting value, in declaration order from one seeded generator."""
    generator = np.random.default_rng(seed)
    values = {}
    for entry in program.entries:
        if entry.init == "normal":
            values[entry.name] = (generator.standard_normal(entry.count, dtype=np.float32)
                                  * np.float32(entry.std))
        elif entry.init == "ones":
            values[entry.name] = np.ones(entry.count, dtype=np.float32)
        else:
            values[entry.name] = np.zeros(entry.count, dtype=np.float32)
    return values


# ---- the state a run carries from step to step (what a checkpoint keeps) ----------

def carried_buffers(program) -> list[str]:
    """The step buffers the run carries from step to step, kept by a checkpoint."""
    return program.carried_buffers()


def saved_labels(program) -> list[str]:
    """Every storage a checkpoint keeps, by label, in a stable order."""
    labels = []
    for role in SAVED_BANK_ROLES:
        for bank in program.bank_of_role(role):
            labels += [f"{bank}.{entry.name}" for entry in program.entries
                       if f"{bank}.{entry.name}" in program.storages]
    return labels + carried_buffers(program)


def saved_dtype(program, label: str) -> np.dtype:
    import ml_dtypes

    from ..core.elements import concrete
    element = concrete(program.storages[label].element, program.low).name
    return {"float32": np.dtype(np.float32), "int32": np.dtype(np.int32),
            "bfloat16": np.dtype(ml_dtypes.bfloat16)}[element]


def state_tensors(run: "Run", gather: bool = True) -> dict[str, np.ndarray]:
    """What the run's checkpoint holds, each storage in its own element type (a 16-bit copy
    as bfloat16: fetch widens it to float32 exactly, and narrowing it back is exact too).
    A sharded storage is gathered whole (a collective: every rank calls it), or with
    `gather` False kept as this rank's shard (what the rank itself puts back)."""
    program = run.program
    return {label: np.ascontiguousarray(
                (_whole(run, label) if gather else run.fetch(label))
                .astype(saved_dtype(program, label)))
            for label in saved_labels(program)}


def _whole(run: "Run", label: str) -> np.ndarray:
    """A storage's values; of a sharded one, every rank's shard in rank order (gathered: a
    collective, so every rank calls it), which any number of ranks can resume from."""
    values = run.fetch(label)
    if label not in run.program.sharded:
        return values
    whole = np.zeros(values.size * run.communicator.size, dtype=np.float32)
    rank = run.communicator.rank
    whole[rank * values.size:(rank + 1) * values.size] = values
    run.communicator.all_gather(whole)
    return whole


def saved_count(program, label: str) -> int:
    """How many elements a checkpoint holds of a storage: of a sharded one, every rank's."""
    count = program.storages[label].count
    return count * program.ranks if label in program.sharded else count


def restore_state(run: "Run", values: dict[str, np.ndarray]) -> None:
    """Stores a checkpoint's tensors into the run (widened to float32 or int32 for `store`,
    which rounds them to the storage's type: exact, as they came from that type)."""
    program = run.program
    for label, array in values.items():
        wide = array.astype(np.int32 if array.dtype == np.int32 else np.float32)
        if label in program.sharded and wide.size != program.storages[label].count:
            # the whole (a checkpoint's): this rank's shard of it
            count = program.storages[label].count
            wide = wide[program.rank * count:(program.rank + 1) * count]
        run.store(label, wide)


@dataclass
class StepResult:
    loss: float
    seconds: float  # the step's own time: wall clock on the CPU, CUDA events on a GPU
    note: str = ""  # e.g. "eager, before capture"


class RunFault(Exception):
    """A step went wrong on a backend (an access outside a buffer, a failed launch): the
    message names the launch and the slot; `span` and `trace`, where the backend knows them,
    the launch's .cg line and the calls that led there."""

    span = None
    trace: tuple = ()


class DataError(ValueError):
    """A batch the model cannot take; the message names the first row at fault."""


def check_tokens(ids: np.ndarray, targets: np.ndarray, vocab: int | None) -> None:
    """Every id inside the vocabulary, every target inside it or -1 (ignored): checked on
    the host before a step, the same on every backend (a kernel would skip or misread)."""
    if vocab is None:
        return
    ids, targets = np.asarray(ids).reshape(-1), np.asarray(targets).reshape(-1)
    bad = np.flatnonzero((ids < 0) | (ids >= vocab))
    if bad.size:
        row = int(bad[0])
        raise DataError(f"row {row}: token id {int(ids[row])} is outside the vocabulary "
                        f"0 .. {vocab - 1}")
    bad = np.flatnonzero((targets < -1) | (targets >= vocab))
    if bad.size:
        row = int(bad[0])
        raise DataError(f"row {row}: target {int(targets[row])} is outside the vocabulary "
                        f"0 .. {vocab - 1} (or -1, ignored)")


def host_memory() -> tuple[int, str] | None:
    """The bytes this process can have in host memory, and what bounds them: the machine's
    physical memory, or less where a cgroup (a container's limit) or the address-space limit
    (ulimit -v) says so; None where the system says nothing."""
    import os
    import resource

    from ..resources import read_regular
    bounds = []
    try:
        bounds.append((os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
                       "this machine's physical memory"))
    except (AttributeError, ValueError, OSError):
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = (read_regular(path, 64) or b"").decode("ascii").strip()
        except (OSError, UnicodeDecodeError):
            continue
        if text.isdigit():
            bounds.append((int(text), f"this container's memory limit ({path})"))
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        bounds.append((soft, "this process's address-space limit (ulimit -v)"))
    return min(bounds) if bounds else None


def memory_problem(run_class, plan: MemoryPlan, program: Program) -> Diagnostic | None:
    """An error if the step's memory plan (banks, step buffers and arena: allocated once,
    before the first step), with what the backend allocates beside it (Run.beside_plan), is
    more than the backend's memory (Run.memory_limit), with both figures; checked before
    anything is allocated, not told by the allocator's failure."""
    limit = run_class.memory_limit()
    beside, what = run_class.beside_plan(program)
    if limit is None or plan.total_bytes + beside <= limit[0]:
        return None
    also = f" and {byte_count(beside)} of {what} beside it" if beside else ""
    return Diagnostic("error", f"the step needs {byte_count(plan.total_bytes + beside)} (its "
                      "memory plan's banks, step buffers and arena, as cgc check --memory shows "
                      f"them{also}), more than {limit[1]}: {byte_count(limit[0])}", None)


class Unavailable(Exception):
    """The backend cannot run here; the message says why and what to do, in one sentence."""


class Run(ABC):
    """One checked program, set up on a backend with its first parameters."""

    name: str = ""  # the registry's name for the backend
    peak_flops: float | None = None  # for MFU, where the hardware's peak is known
    # The ranks of a data-parallel run (cgc/backends/parallel.py): the schedule's collectives
    # reduce over them, and the loss is their mean. One rank unless the caller sets it.
    communicator: Communicator = SingleRank()
    rate_written = False  # whether set_learning_rate has written the step's rate

    def __init__(self, program: Program, plan: MemoryPlan, seed: int):
        self.program, self.plan, self.seed = program, plan, seed
        self.banks = {role: program.bank_of_role(role) for role in BANK_ROLES}

    # ---- what a backend provides ---------------------------------------------------

    @staticmethod
    def unavailable() -> str | None:
        """Why this backend cannot run on this machine (None: it can)."""
        return None

    @staticmethod
    def problems(program: Program) -> list[Diagnostic]:
        """What the backend lacks to run this program (an image it has no kernel for)."""
        return []

    @staticmethod
    def memory_limit() -> tuple[int, str] | None:
        """The bytes a run's memory plan may take here, and what they are (None: unknown).
        Host memory by default; a GPU backend says its device's."""
        return host_memory()

    @staticmethod
    def beside_plan(program: Program) -> tuple[int, str]:
        """The bytes the backend allocates for the program beside its memory plan, and what
        they are (a library's workspace); none by default."""
        return 0, ""

    @abstractmethod
    def store(self, label: str, values) -> None:
        """A whole storage, from float32 or int32 values (rounded to its element type)."""

    @abstractmethod
    def fetch(self, label: str) -> np.ndarray:
        """A whole storage's values (bfloat16 widened to float32)."""

    @abstractmethod
    def view(self, label: str):
        """A whole storage's memory itself, not a copy: writing it changes the run. A NumPy
        array on the CPU, a CuPy array on a GPU (which `torch.from_dlpack` takes without a
        copy), in the storage's own type (bfloat16 as its uint16 bit patterns)."""

    @abstractmethod
    def run_step(self, trace: list | None) -> float:
        """Runs the program once on the ids and targets stored; returns the step's seconds.
        With `trace`, appends (image, phase, start seconds, end seconds) per launch."""

    # ---- shared ----------------------------------------------------------------------

    def step(self, ids: np.ndarray, targets: np.ndarray, trace: list | None = None) -> StepResult:
        vocab = self.program.roles.get("vocab")
        check_tokens(ids, targets, int(vocab) if vocab is not None else None)
        if not self.rate_written:  # a caller that never sets one steps at the peak rate
            self.set_learning_rate(None)
        self.store(self.program.role("ids"), ids)
        self.store(self.program.role("targets"), targets)
        seconds = self.run_step(trace)
        return StepResult(self.mean_loss(), seconds)

    def entries(self) -> list[str]:
        return [entry.name for entry in self.program.entries]

    def load_parameters(self, values: dict[str, np.ndarray]) -> None:
        """Each entry into every parameter bank, and into the copies bank if it has one."""
        for name, value in values.items():
            for bank in self.banks["parameters"]:
                self.store(f"{bank}.{name}", value)
            for bank in self.banks["copies"]:
                if f"{bank}.{name}" in self.program.storages:
                    self.store(f"{bank}.{name}", value)

    def bank_values(self, role: str) -> dict[str, np.ndarray]:
        """The entries of the (first) bank with this role."""
        bank = self.banks[role][0]
        return {name: self.fetch(f"{bank}.{name}") for name in self.entries()}

    def write_bank(self, role: str, values: dict[str, np.ndarray]) -> None:
        for bank in self.banks[role]:
            for name, value in values.items():
                self.store(f"{bank}.{name}", value)

    # ---- the optimizer's scalars, and the state a checkpoint keeps --------------------

    def set_learning_rate(self, rate: float | None) -> float:
        """Writes this step's learning rate into the buffer of the `learningRate` role (one
        float32 the optimizer reads on the device: a captured graph need not change). With
        no rate, the buffer keeps the schedule's peak (the `peakLearningRate` role). Returns
        the rate the step uses."""
        label = self.program.roles.get("learningRate")
        if rate is None:
            rate = float(self.program.roles.get("peakLearningRate", 0.0))
        if label is None:
            return float(np.float32(self.program.roles.get("peakLearningRate", rate)))
        self.store(label, np.array([rate], dtype=np.float32))
        self.rate_written = True
        return float(np.float32(rate))

    def gradient_norm(self) -> float:
        """The global norm of the last step's gradient, before clipping: the square root of
        the sum (in float64) of the partial sums of squares the step computed (the
        `gradientSquares` role), or of every gradient's square where it declares none."""
        label = self.program.roles.get("gradientSquares")
        if label is not None:
            squares = self.fetch(label).astype(np.float64).sum()
        else:
            squares = sum(float(np.square(value.astype(np.float64)).sum())
                          for value in self.bank_values("gradients").values())
        return float(np.sqrt(squares))

    def evaluate(self, ids: np.ndarray, targets: np.ndarray) -> float:
        """The loss of one batch with the parameters as they are, which stay as they are: the
        step runs (its forward pass computes the loss) and the state a checkpoint keeps is
        put back as it was, bit for bit."""
        saved = state_tensors(self, gather=False)
        loss = self.step(ids, targets).loss
        restore_state(self, saved)
        return loss

    def mean_loss(self) -> float:
        losses = self.fetch(self.program.role("loss")).astype(np.float64)
        return self.communicator.average_scalar(float(losses.sum() / losses.size))

    @property
    def constants(self) -> dict:
        return self.program.constants
