"""The ranks of a data-parallel run: each rank's share of the data, and the launcher that
starts them (`cgc run --ranks N` runs mpirun, which runs cgc on every rank).

The communicator itself, which the backends' collectives call, is the backends' interface
(cgc/backends/parallel.py).
"""

from __future__ import annotations

import os
import signal
import sys

# NumPy is imported where it is used: cli.py reads STOP_SIGNAL for every command, and
# `cgc compile` loads no NumPy (tests/test_startup.py).

from ..backends.parallel import Communicator, CommunicatorError
from ..resources import install_hint


class ShardedBatches:
    """Rank `rank`'s share of each step's windows: the step draws the windows of all the
    ranks from one seeded generator (the `batch * size` windows one rank would take on the
    whole batch) and this rank takes its `batch` consecutive ones. Disjoint across ranks,
    the same for a seed on any number of ranks, and one rank with `batch * size` sequences
    sees exactly the union of what the N ranks see."""

    def __init__(self, whole, rank: int, size: int):
        if whole.batch % size:
            raise ValueError(f"{whole.batch} sequences do not split over {size} ranks")
        self.whole, self.rank, self.size = whole, rank, size
        self.batch, self.context = whole.batch // size, whole.context
        self.corpus = whole.corpus

    def position(self) -> dict:
        return self.whole.position()

    def restore(self, position: dict) -> None:
        self.whole.restore(position)

    def next(self):
        ids, targets = self.whole.next()
        rows = self.batch * self.context
        share = slice(self.rank * rows, (self.rank + 1) * rows)
        return ids[share], targets[share]


class Discard:
    """An output that keeps nothing: a rank's progress past rank 0's, or a library caller's
    who asked for no progress lines."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def quiet_unless_lead(communicator: Communicator):
    """Where a rank writes its progress: stdout on rank 0, nowhere on the others."""
    return sys.stdout if communicator.lead else Discard()


def mpirun_command(ranks: int, arguments: list[str]) -> list[str]:
    """`mpirun -n RANKS python -m cgc ARGUMENTS`: what `cgc run --ranks N` runs. mpirun is
    given --oversubscribe whatever the count: cgc itself has refused more ranks than CPUs
    unless the user asked (Open MPI's own count is of physical cores, which may be fewer);
    as root, Open MPI must be told that it may run (the variables below, set in its
    environment)."""
    import shutil
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise CommunicatorError(f"--ranks {ranks} starts the ranks with mpirun, which is not "
                                f"installed: {install_hint('parallel')} (Open MPI and mpi4py), "
                                "or start them yourself: mpirun -n N cgc run ...")
    return [mpirun, "-n", str(ranks), "--oversubscribe", sys.executable, "-m", "cgc",
            *arguments]


# Set in the environment of the ranks launch_ranks starts: a rank's stop, whatever asked for
# it (its own signal, or another rank's, agreed at a step), ends with status 0, and cgc, the
# launcher, tells the run's outcome (130 or 143 for a stop it passed on, 0 where its reader
# left, 1 where its standard output was refused). A rank's own status would hang on which
# rank's signal came first, and mpirun reports any but 0 as a rank's failure.
LAUNCHED_RANK = "CGC_LAUNCHED_RANK"

# Open MPI refuses to run as root unless told (containers and CI run as root).
ROOT_ENVIRONMENT = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


# The mpirun a `cgc run --ranks N` started, while it runs: a stop request (SIGTERM, Ctrl-C)
# that reaches cgc alone is passed on to it, which passes it to every rank.
_LAUNCHED: list = []


def launch_ranks(ranks: int, arguments: list[str]) -> int:
    """Runs `cgc ARGUMENTS` on `ranks` MPI ranks and returns mpirun's exit status. What the
    ranks print passes through this process (relay), so the rules of cgc's standard streams
    (cgc/outputs.py) hold for the whole run: a reader that left stops the ranks after their
    step, quietly (exit 0); a standard output the device refuses stops them too, and is
    WriteFailed once they have ended."""
    import subprocess
    command = mpirun_command(ranks, arguments)
    environment = {**os.environ, LAUNCHED_RANK: "1"}
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        environment.update(ROOT_ENVIRONMENT)
    # its own process group: a Ctrl-C at the terminal reaches cgc alone, which passes it on
    # as a stop request (forward_stop) while mpirun goes on passing the ranks' lines through;
    # were it in cgc's group, mpirun would end the job at once and drop what they print
    process = subprocess.Popen(command, env=environment, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, start_new_session=True)
    _LAUNCHED.append(process)
    try:
        refused = relay(process)
        status = process.wait()
    finally:
        _LAUNCHED.remove(process)
    if refused is not None:
        raise refused
    return status


def relay(process):
    """Passes the process's standard output and error on to this process's (sys.stdout and
    sys.stderr, cgc's guarded streams), as they come, until both end. Where the standard
    output's reader left or its device refused a write, the ranks are asked to stop after
    the step under way, quietly (QUIET_STOP_SIGNAL), and what they print after is passed
    into nothing. Returns the refusal (WriteFailed), or None."""
    import selectors
    from ..outputs import WriteFailed
    targets = {process.stdout: sys.stdout, process.stderr: sys.stderr}
    refused, stopped = None, False
    with selectors.DefaultSelector() as selector:
        for pipe in targets:
            selector.register(pipe, selectors.EVENT_READ)
        while selector.get_map():
            for key, _ in selector.select():
                data = os.read(key.fd, 1 << 16)
                if not data:
                    selector.unregister(key.fileobj)
                    continue
                try:
                    targets[key.fileobj].write_bytes(data)  # cgc's guarded streams
                except WriteFailed as error:  # the standard output's (StandardOutput)
                    refused = refused or error
                if not stopped and (refused or sys.stdout.reader_left):
                    forward_stop(QUIET_STOP_SIGNAL)
                    stopped = True
    for pipe in targets:
        pipe.close()
    return refused


# What mpirun passes on to every rank: Open MPI ends the job on SIGTERM and SIGINT but
# forwards SIGUSR1 and SIGUSR2, so a rank takes SIGUSR1 as a stop request (cli.py), and
# SIGUSR2 as one made quietly (no message, exit 0): the launcher's reader left, or its
# device refused what the ranks print, and the launcher tells the outcome.
STOP_SIGNAL = signal.SIGUSR1
QUIET_STOP_SIGNAL = signal.SIGUSR2


def _running_launch():
    """The mpirun this process launched, while it runs; else None."""
    return next((process for process in _LAUNCHED if process.poll() is None), None)


def end_launched() -> bool:
    """Ends the ranks this process launched at once (SIGTERM to mpirun, which ends the job:
    no final checkpoint); False if it launched none still running."""
    process = _running_launch()
    if process is not None:
        process.terminate()
    return process is not None


def forward_stop(signal_number: int = STOP_SIGNAL) -> bool:
    """Passes a stop request to the ranks this process launched (as `signal_number`, through
    mpirun); False if it launched none. The ranks agree on the step to stop after (the
    training loop's stop is decided by all of them), then checkpoint, as one run does."""
    process = _running_launch()
    if process is not None:
        process.send_signal(signal_number)
    return process is not None


def without_ranks(arguments: list[str]) -> list[str]:
    """The command line with --ranks N (or --ranks=N) taken out: what each rank runs."""
    kept, skip = [], False
    for argument in arguments:
        if skip:
            skip = False
        elif argument == "--ranks":
            skip = True
        elif not argument.startswith("--ranks="):
            kept.append(argument)
    return kept
