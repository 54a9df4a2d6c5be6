"""The ranks of a data-parallel run: each rank's share of the data, and the launcher that
starts them (`cgc run --ranks N` runs mpirun, which runs cgc on every rank).

The communicator itself, which the backends' collectives call, is the backends' interface
(cgc/backends/parallel.py).
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import time

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


def launched_by_cgc() -> bool:
    """This process is a rank that `cgc run --ranks N` started (LAUNCHED_RANK)."""
    return bool(os.environ.get(LAUNCHED_RANK))

# Set in the environment of the ranks launch_ranks starts: a folder where each rank, once
# its communicator is up (and its stop handlers set: cli.main sets them first), makes an
# empty file named by its rank (check_in). Open MPI's start-up can fail without ending (under
# a small file-size limit, `ulimit -f`, prterun may wait for ever on a rank that has exited),
# and a stop request passed on before a rank has set its handlers would kill that rank: so
# the launcher ends a job whose ranks are not all up in RANKS_START_SECONDS (the variable
# CGC_RANKS_START_SECONDS may set it), and a stop request before then ends it at once.
CHECK_IN = "CGC_RANKS_CHECK_IN"
RANKS_START_SECONDS = 120.0
START_SECONDS_VARIABLE = "CGC_RANKS_START_SECONDS"
# How long mpirun has to end after SIGTERM before its process group is killed
END_GRACE_SECONDS = 5.0


def check_in(rank: int) -> None:
    """This rank is up (CHECK_IN): said to the launcher that started it, if one did."""
    folder = os.environ.get(CHECK_IN)
    if folder:
        try:
            with open(os.path.join(folder, str(rank)), "w"):
                pass
        except OSError:  # the launcher's folder gone: it has ended the job, or is ending it
            pass


def start_seconds() -> float:
    """How long the ranks have to be up (CHECK_IN): RANKS_START_SECONDS, or the number of
    seconds above 0 that START_SECONDS_VARIABLE gives (inf: no limit). ValueError, saying
    why, for anything else."""
    text = os.environ.get(START_SECONDS_VARIABLE)
    if text is None:
        return RANKS_START_SECONDS
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not seconds > 0:  # NaN too
        raise ValueError(f"{START_SECONDS_VARIABLE} in the environment must be a number of "
                         f"seconds above 0 (inf: no limit), not {text!r}")
    return seconds


class Launch:
    """One mpirun that launch_ranks started: the process, and the folder its ranks check in
    to (CHECK_IN) by a deadline."""

    def __init__(self, process, ranks: int, folder: str, seconds: float):
        self.process, self.ranks, self.folder = process, ranks, folder
        self.deadline = time.monotonic() + seconds
        self.seconds = seconds
        self.abandoned = False  # ended for its ranks not all up by the deadline
        self.ended = False  # ended by this process (end): its status is no failure of its own

    def up(self) -> int:
        """How many of the ranks have checked in."""
        try:
            return len(os.listdir(self.folder))
        except OSError:
            return 0

    def starting(self) -> bool:
        return self.up() < self.ranks

    def overdue(self) -> bool:
        return not self.abandoned and time.monotonic() > self.deadline and self.starting()

    def end(self) -> None:
        """SIGTERM to mpirun, which ends the job; then, END_GRACE_SECONDS later at most, its
        process group (its own: launch_ranks) killed, mpirun too if it has not heeded the
        SIGTERM (a start-up that hangs may not): nothing of the job is left running, or
        holding the pipes the relay reads."""
        self.ended = True
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(END_GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except OSError:  # none left
            pass


def file_size_limit() -> int | None:
    """This process's limit on the size of a file it writes (`ulimit -f`), in bytes, or
    None where there is none."""
    try:
        import resource
    except ImportError:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else soft


class LaunchFailed(Exception):
    """mpirun ended without the run's own outcome: the ranks did not all start, or it ended
    with a status no rank of cgc's gives. The message says which, and what may be why."""


def _failure(launch: Launch, status: int) -> LaunchFailed | None:
    """Why the launch failed, or None where its status is a rank's own (0, 1 or 2: cgc's)."""
    up = launch.up()
    if launch.abandoned:
        what = (f"{up} of the {launch.ranks} ranks were up after {launch.seconds:g} s "
                f"({START_SECONDS_VARIABLE} sets the time), and mpirun was ended")
    elif status in (0, 1, 2) or launch.ended:
        return None
    else:
        what = (f"mpirun was killed by {signal.Signals(-status).name}" if status < 0 else
                f"mpirun ended with status {status}")
        if up < launch.ranks:
            what += f" after starting {up} of the {launch.ranks} ranks"
    limit = file_size_limit()
    if limit is not None and up < launch.ranks:  # a start-up that failed
        what += (f"; files are limited to {limit:,} bytes here (`ulimit -f`), and Open MPI's "
                 "start-up writes its shared memory as files: raise the limit, or run one "
                 "rank (no --ranks)")
    return LaunchFailed(what)


# Open MPI refuses to run as root unless told (containers and CI run as root).
ROOT_ENVIRONMENT = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


# The mpirun a `cgc run --ranks N` started, while it runs: a stop request (SIGTERM, Ctrl-C)
# that reaches cgc alone is passed on to it, which passes it to every rank.
_LAUNCHED: list = []


def launch_ranks(ranks: int, arguments: list[str],
                 seconds: float = RANKS_START_SECONDS) -> int:
    """Runs `cgc ARGUMENTS` on `ranks` MPI ranks and returns mpirun's exit status. What the
    ranks print passes through this process (relay), so the rules of cgc's standard streams
    (cgc/outputs.py) hold for the whole run: a reader that left stops the ranks after their
    step, quietly (exit 0); a standard output the device refuses stops them too, and is
    WriteFailed once they have ended. A job whose ranks are not all up in `seconds`
    (CHECK_IN; the command's is start_seconds()), or whose status is no rank's, is
    LaunchFailed."""
    import atexit
    import tempfile
    command = mpirun_command(ranks, arguments)
    try:
        folder = tempfile.mkdtemp(prefix="cgc-ranks-")
    except OSError as error:
        raise LaunchFailed(f"cannot make a folder for the ranks to say they are up in "
                           f"({tempfile.gettempdir()}): {error.strerror or error}") from None

    def remove_folder() -> None:
        shutil.rmtree(folder, ignore_errors=True)
    # also where this process ends first (a stop request that ended the job: main returns
    # while this thread is still here)
    atexit.register(remove_folder)
    environment = {**os.environ, LAUNCHED_RANK: "1", CHECK_IN: folder}
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        environment.update(ROOT_ENVIRONMENT)
    try:
        # its own process group: a Ctrl-C at the terminal reaches cgc alone, which passes it
        # on as a stop request (forward_stop) while mpirun goes on passing the ranks' lines
        # through; were it in cgc's group, mpirun would end the job at once and drop what
        # they print
        process = subprocess.Popen(command, env=environment, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, start_new_session=True)
        launch = Launch(process, ranks, folder, seconds)
        _LAUNCHED.append(launch)
        try:
            refused = relay(launch)
            status = process.wait()
        finally:
            _LAUNCHED.remove(launch)
        failure = _failure(launch, status)
    finally:
        remove_folder()
        atexit.unregister(remove_folder)
    if refused is not None:
        raise refused
    if failure is not None:
        raise failure
    # ended by this process: its reader left before the ranks were all up (a stop request
    # that ended it has its status from cli.main)
    return 0 if launch.ended else status


def relay(launch: Launch):
    """Passes mpirun's standard output and error on to this process's (sys.stdout and
    sys.stderr, cgc's guarded streams), as they come, until both end. Where the standard
    output's reader left or its device refused a write, the ranks are asked to stop after
    the step under way, quietly (QUIET_STOP_SIGNAL), and what they print after is passed
    into nothing; where the ranks are not all up by the deadline, the job is ended
    (Launch.abandoned). Returns the refusal (WriteFailed), or None."""
    import selectors
    from ..outputs import WriteFailed
    process = launch.process
    targets = {process.stdout: sys.stdout, process.stderr: sys.stderr}
    refused, stopped = None, False
    with selectors.DefaultSelector() as selector:
        for pipe in targets:
            selector.register(pipe, selectors.EVENT_READ)
        while selector.get_map():
            for key, _ in selector.select(_POLL_SECONDS):
                data = os.read(key.fd, 1 << 16)
                if not data:
                    selector.unregister(key.fileobj)
                    continue
                try:
                    targets[key.fileobj].write_bytes(data)  # cgc's guarded streams
                except WriteFailed as error:  # the standard output's (StandardOutput)
                    refused = refused or error
                if not stopped and (refused or sys.stdout.reader_left):
                    if launch.starting():  # nothing to keep yet (starting_launch)
                        launch.end()
                    else:
                        forward_stop(QUIET_STOP_SIGNAL)
                    stopped = True
            if launch.overdue():
                launch.abandoned = True
                launch.end()
    for pipe in targets:
        pipe.close()
    return refused


# How often the relay looks at the start-up deadline while mpirun prints nothing
_POLL_SECONDS = 0.5


# What mpirun passes on to every rank: Open MPI ends the job on SIGTERM and SIGINT but
# forwards SIGUSR1 and SIGUSR2, so a rank takes SIGUSR1 as a stop request (cli.py), and
# SIGUSR2 as one made quietly (no message, exit 0): the launcher's reader left, or its
# device refused what the ranks print, and the launcher tells the outcome.
STOP_SIGNAL = signal.SIGUSR1
QUIET_STOP_SIGNAL = signal.SIGUSR2


def _running_launch() -> Launch | None:
    """The mpirun this process launched, while it runs; else None."""
    return next((launch for launch in _LAUNCHED if launch.process.poll() is None), None)


def end_launched() -> bool:
    """Ends the ranks this process launched at once (mpirun ended: no final checkpoint);
    False if it launched none still running."""
    launch = _running_launch()
    if launch is not None:
        launch.end()
    return launch is not None


def starting_launch() -> Launch | None:
    """The job this process launched if its ranks are not all up yet (CHECK_IN): asked to
    stop then, there is nothing to keep, and a rank that has not set its handlers would die
    of a request passed on (forward_stop): it is ended (Launch.end). Else None."""
    launch = _running_launch()
    return launch if launch is not None and launch.starting() else None


def forward_stop(signal_number: int = STOP_SIGNAL) -> bool:
    """Passes a stop request to the ranks this process launched (as `signal_number`, through
    mpirun); False if it launched none, or if they are not all up yet (starting_launch).
    The ranks agree on the step to stop after (the
    training loop's stop is decided by all of them), then checkpoint, as one run does."""
    launch = _running_launch()
    if launch is None or launch.starting():
        return False
    launch.process.send_signal(signal_number)
    return True


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
