"""Data parallelism's one communicator interface, the ranks' side of the backends.

A run on N ranks (processes started by `mpirun -n N`) holds one communicator: its rank,
how many ranks there are, and the few collectives a data-parallel step needs. The schedule's
collective images (`(collective allReduce average)`, docs/language.md) call it: the numpy
backend from the image's reference function, the emulated backend from the CPU twin of
NCCL (cgc/backends/cuda_cpu/include/nccl.h) through a callback, and the GPU through NCCL
itself, whose communicator is made from an id that rank 0 draws and this one broadcasts
(llm.c's split: MPI starts the ranks and shares the id, NCCL moves the gradients).

Two implementations: `SingleRank` (no MPI: every collective is the identity) and
`MpiCommunicator` (mpi4py). No home-made transport: MPI is the engine on the CPU. Each
rank's share of the data and the launcher of the ranks are the training run's
(cgc/training/ranks.py).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod

from ..resources import install_hint

# NumPy is imported where it is used: `cgc compile` loads no NumPy (tests/test_startup.py).

# The variables an MPI launcher sets in every rank's environment: Open MPI, MPICH / Intel
# MPI (PMI), PMIx launchers. Without one, cgc runs as one rank and never loads MPI (whose
# start-up as a singleton costs a second and may need a network).
LAUNCHER_SIZE_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS")
# ... and this process's rank among them, before MPI is up (a stop request's message, which
# rank 0 alone gives)
LAUNCHER_RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")


class CommunicatorError(RuntimeError):
    """A collective failed: another rank is gone, or MPI refused the call."""


class Communicator(ABC):
    """The ranks of one run, and the collectives a data-parallel step uses."""

    rank: int = 0
    size: int = 1

    @abstractmethod
    def all_reduce_average(self, values: np.ndarray) -> None:
        """values = the mean of `values` over the ranks, in place; afterwards every rank holds
        the same bits."""

    @abstractmethod
    def all_reduce_sum(self, values: np.ndarray) -> None:
        """values = the sum of `values` over the ranks, in place, the same bits on every rank."""

    @abstractmethod
    def reduce_scatter_average(self, values: np.ndarray) -> None:
        """This rank's shard of `values` (the rank-th of `size` equal parts) = its mean over
        the ranks, in place, the bits all_reduce_average gives there; the rest as it was."""

    @abstractmethod
    def all_gather(self, values: np.ndarray) -> None:
        """Each rank's shard of `values` (the rank-th of `size` equal parts) = that rank's,
        in place, on every rank."""

    @abstractmethod
    def broadcast(self, values: np.ndarray, root: int = 0) -> None:
        """values = rank `root`'s values, in place."""

    @abstractmethod
    def broadcast_object(self, value, root: int = 0):
        """Rank `root`'s value of a small picklable object (an NCCL unique id)."""

    @abstractmethod
    def barrier(self) -> None:
        """Returns once every rank has called it."""

    def average_scalar(self, value: float) -> float:
        """The mean of a float64 over the ranks (the loss of one step)."""
        import numpy as np
        array = np.array([value], dtype=np.float64)
        self.all_reduce_average(array)
        return float(array[0])

    @property
    def lead(self) -> bool:
        """Whether this rank prints, dumps and checkpoints (rank 0)."""
        return self.rank == 0

    def describe(self) -> str:
        return "1 rank" if self.size == 1 else f"{self.size} ranks (MPI)"


class SingleRank(Communicator):
    """One rank alone: every collective leaves the values as they are."""

    def all_reduce_average(self, values: np.ndarray) -> None:
        pass

    def all_reduce_sum(self, values: np.ndarray) -> None:
        pass

    def reduce_scatter_average(self, values: np.ndarray) -> None:
        pass

    def all_gather(self, values: np.ndarray) -> None:
        pass

    def broadcast(self, values: np.ndarray, root: int = 0) -> None:
        pass

    def broadcast_object(self, value, root: int = 0):
        return value

    def barrier(self) -> None:
        pass


class MpiCommunicator(Communicator):
    """MPI_COMM_WORLD through mpi4py.

    A reduction is a reduce to rank 0 and a broadcast of its result, not MPI_Allreduce: an
    all-reduce may add the ranks' values in a different order on each rank (its algorithm
    chooses), and data parallelism needs every rank's parameters to stay bit-identical.
    The average is the sum divided by the number of ranks, as NCCL's ncclAvg."""

    def __init__(self, comm=None):
        from mpi4py import MPI  # starts MPI: only when a launcher started this process
        self.MPI = MPI
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        # Errors come back as exceptions (CommunicatorError), not as an abort with no reason.
        self.comm.Set_errhandler(MPI.ERRORS_RETURN)
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()

    def _call(self, what: str, function, *arguments):
        try:
            return function(*arguments)
        except self.MPI.Exception as error:
            raise CommunicatorError(f"rank {self.rank} of {self.size}: the {what} failed: "
                                    f"{error.Get_error_string()} (did another rank stop?)") \
                from None

    def _reduce(self, values: np.ndarray, average: bool) -> None:
        if not values.flags.c_contiguous:
            raise ValueError("a collective reduces a contiguous array in place")
        import numpy as np
        result = np.empty_like(values) if self.rank == 0 else None
        self._call("reduction", self.comm.Reduce, values, result, self.MPI.SUM, 0)
        if self.rank == 0:
            if average:
                result /= values.dtype.type(self.size)
            values[...] = result
        self._call("broadcast of the reduction", self.comm.Bcast, values, 0)

    def all_reduce_average(self, values: np.ndarray) -> None:
        self._reduce(values, average=True)

    def all_reduce_sum(self, values: np.ndarray) -> None:
        self._reduce(values, average=False)

    def _shard(self, values: np.ndarray) -> np.ndarray:
        if not values.flags.c_contiguous or values.size % self.size:
            raise ValueError(f"a shard collective takes a contiguous array that divides by "
                             f"{self.size} ranks, not {values.size} elements")
        shard = values.size // self.size
        return values[self.rank * shard:(self.rank + 1) * shard]

    def reduce_scatter_average(self, values: np.ndarray) -> None:
        """The reduce to rank 0 of _reduce (so the shard holds the bits an all-reduce of the
        same buffer gives), then rank 0's mean scattered, a shard to each rank."""
        import numpy as np
        mine = self._shard(values)
        result = np.empty_like(values) if self.rank == 0 else None
        self._call("reduction", self.comm.Reduce, values, result, self.MPI.SUM, 0)
        if self.rank == 0:
            result /= values.dtype.type(self.size)
        self._call("scatter of the reduction", self.comm.Scatter, result, mine, 0)

    def all_gather(self, values: np.ndarray) -> None:
        self._shard(values)
        self._call("all-gather", self.comm.Allgather, self.MPI.IN_PLACE, values)

    def broadcast(self, values: np.ndarray, root: int = 0) -> None:
        self._call("broadcast", self.comm.Bcast, values, root)

    def broadcast_object(self, value, root: int = 0):
        return self._call("broadcast", self.comm.bcast, value, root)

    def barrier(self) -> None:
        self._call("barrier", self.comm.Barrier)


def _launcher_number(names: tuple, default: int) -> int:
    """The first of these environment variables that holds a whole number, or `default`."""
    for name in names:
        text = os.environ.get(name, "")
        if text.isdigit():
            return int(text)
    return default


def launched_size() -> int:
    """How many ranks an MPI launcher started (1 when none did)."""
    return _launcher_number(LAUNCHER_SIZE_VARIABLES, 1)


def launched_rank() -> int:
    """This process's rank, as its MPI launcher told it (0 when none did)."""
    return _launcher_number(LAUNCHER_RANK_VARIABLES, 0)


def world() -> Communicator:
    """This process's communicator: MPI's world when an MPI launcher started it with more than
    one rank, else a single rank. Raises CommunicatorError when a launcher asked for ranks
    but mpi4py is missing."""
    if launched_size() <= 1:
        return SingleRank()
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        raise CommunicatorError(f"{launched_size()} ranks were started, but mpi4py is not "
                                f"installed: {install_hint('parallel')} (mpi4py and Open "
                                "MPI)") \
            from None
    return MpiCommunicator()
