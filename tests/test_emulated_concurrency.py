"""Launches that run at the same time, on the CPU (docs/emulation.md, "Streams and the shadow";
cgc/backends/cuda_cpu/README.md, "Streams and events", "Interleaving", "The shadow").

- Streams forked and joined by events (cgc/backends/cuda_cpu/tests/streams.cu, "clean"): the
  same bits under three interleaving seeds, in the plain build and in the shadow build, and no
  shadow report.
- The shadow reports every pair of ops that nothing orders and that touch the same bytes, one
  writing ("conflict"): kernel and kernel, kernel and cuBLASLt, NCCL and kernel, two products
  on one workspace, two launches' atomics (in device memory and in a __device__ variable), a
  non-blocking stream and the legacy stream; each named with both kernels, both sites and the
  offset (memsets of fresh memory too, which the shadow keeps as fills); and none of the same
  pairs once an event, a host wait or the legacy stream's
  implicit synchronisation orders them. The plain build of the same program reports nothing,
  so these tests fail if the shadow is taken away.
- The interleaving interleaves: two launches' blocks take tickets mixed, in an order that
  depends on the seed and, with one worker, on nothing else; one stream keeps its order.
- ThreadSanitizer's racecheck still finds a shared-memory race inside a launch with streams
  in use, and a queued launch's fault names its site.
- The shipped schedules (train.cg, train_recompute.cg, tiny) in the shadow build over three
  seeds: no report, the same losses and dumps bit for bit, equal to the plain build's, and
  the losses of the numpy backend within the tolerances tests/test_emulated.py uses; with a
  fork or a join of the step skipped (CG_CPU_SKIP_WAIT) the shadow reports the ops it
  leaves unordered, by name and buffer.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cgc.backends.cuda.emit import emit_program
from cgc.backends.cuda.emulated import (HEADERS, RACECHECK_ENVIRONMENT, RACECHECK_FLAGS,
                                        SHADOW_FLAGS, SHADOW_LIBRARY_FLAGS, SHADOW_LIBRARY_LINK,
                                        SHADOW_LINK, STANDALONE_FLAGS, BuildFailed,
                                        ConcurrencyConflict, build, compiler_missing,
                                        driver_source, parse_racecheck, parse_shadow, shadow_run)
from cgc.pipeline import analyse, open_run
from cgc.training.data import Batches, load_corpus
from cgc.training.loop import train

from conftest import SCHEDULES
from test_reference import BFLOAT16_TOLERANCES

SOURCE = HEADERS.parent / "tests" / "streams.cu"
INCLUDE = (f"-I{SOURCE.parent}",)
SEEDS = (0, 1, 2)


def _tsan_missing() -> str | None:
    if compiler_missing() is not None:
        return compiler_missing()
    try:
        build('#include <cstdio>\nint main() { std::puts("ok"); }\n', "tsan-probe",
              flags=RACECHECK_FLAGS)
    except BuildFailed as error:
        return f"g++ cannot build with -fsanitize=thread: {str(error)[-300:]}"
    return None


_MISSING = _tsan_missing()
pytestmark = pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))


@pytest.fixture(scope="module")
def programs():
    """streams.cu built three ways (in parallel, cached by content)."""
    text = SOURCE.read_text()
    with ThreadPoolExecutor(max_workers=2) as pool:
        jobs = {
            "plain": pool.submit(build, text, "streams", STANDALONE_FLAGS, INCLUDE),
            "shadow": pool.submit(build, text, "streams-shadow", SHADOW_FLAGS, INCLUDE,
                                  SHADOW_LINK),
            "racecheck": pool.submit(build, text, "streams-racecheck", RACECHECK_FLAGS, INCLUDE),
        }
        return {name: job.result() for name, job in jobs.items()}


def _run(binary: Path, *args: str, seed: int | None = None, threads: int = 2,
         environment: dict | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CG_CPU_")}
    env.update(environment or {}, CG_CPU_THREADS=str(threads))
    if seed is not None:
        env["CG_CPU_INTERLEAVE_SEED"] = str(seed)
    return subprocess.run([str(binary), *args], capture_output=True, text=True, env=env,
                          timeout=120)


# ---- (a) forked and joined: the same bits, nothing to report ---------------------------

def test_forked_and_joined_streams_give_the_same_bits_under_every_seed(programs):
    hashes = set()
    for build_name in ("plain", "shadow"):
        for seed in SEEDS:
            done = _run(programs[build_name], "clean", seed=seed)
            assert done.returncode == 0 and "clean: ok" in done.stdout, done.stdout + done.stderr
            assert "cuda_cpu" not in done.stderr, done.stderr  # no report, no fault
            hashes.add(re.search(r"clean hash: (\w+)", done.stdout).group(1))
    assert len(hashes) == 1, hashes


# ---- (a') a graph replays the calls it captured -------------------------------------------

def test_a_captured_graph_replays_the_round_with_the_same_bits_and_refuses_what_cuda_does(programs):
    """streams.cu's graph mode checks each replay against the eager round, the replay count,
    and each refused call's error (CUDA's) inside the program; here every build and seed agree
    and nothing is reported."""
    hashes = set()
    for build_name in ("plain", "shadow", "racecheck"):
        for seed in SEEDS[:2]:
            done = _run(programs[build_name], "graph", seed=seed)
            assert done.returncode == 0 and "graph: ok" in done.stdout, done.stdout + done.stderr
            assert "cuda_cpu" not in done.stderr and "ThreadSanitizer" not in done.stderr, done.stderr
            hashes.add(re.search(r"graph hash: (\w+)", done.stdout).group(1))
    assert len(hashes) == 1, hashes


def test_the_shadow_reports_a_race_inside_each_replay_of_a_graph(programs):
    done = _run(programs["shadow"], "graph-conflict", seed=1)
    assert done.returncode == 0 and "graph-conflict: ok" in done.stdout, done.stdout + done.stderr
    replays = _cases(done.stderr, marker="streams: replay ")
    assert set(replays) == {"0", "1"}, replays
    expected = (("write_range", "streams.cu:graph writer", "write"),
                ("read_all", "streams.cu:graph reader", "read"), "global", None, 16384, 0, 1024)
    for replay in ("0", "1"):
        assert [_summary(c) for c in replays[replay]] == [expected], replays[replay]


# ---- (b) the shadow reports what nothing orders ----------------------------------------

def _cases(stderr: str, marker: str = "streams: case ") -> dict:
    """The shadow's conflicts of each case of streams.cu's conflict mode (each replay of its
    graph-conflict mode, with the marker "streams: replay ")."""
    cases, name, lines = {}, None, []
    for line in stderr.splitlines() + [marker + "<end>"]:
        if line.startswith(marker):
            if name is not None:
                cases[name] = parse_shadow("\n".join(lines))
            name, lines = line[len(marker):], []
        else:
            lines.append(line)
    return cases


def _summary(conflict) -> tuple:
    a, b = conflict.first, conflict.second
    return ((a.kernel, a.site, a.access), (b.kernel, b.site, b.access), conflict.memory,
            conflict.symbol, conflict.size, conflict.offset, conflict.bytes)


# Each case: the one conflict expected (first op, second op, memory, symbol, allocation
# bytes, offset, extent), or None: nothing may be reported.
EXPECTED = {
    # x[64..128) written, all of x read: bytes 256 to 512 of x's 16384
    "kernel-kernel": (("write_range", "streams.cu:writer", "write"),
                      ("read_all", "streams.cu:reader", "read"), "global", None, 16384, 256, 256),
    "kernel-product": (("write_range", "streams.cu:x writer", "write"),
                       ("cublasLtMatmul", "streams.cu:product", "read"), "global", None, 16384, 0,
                       4096),
    "nccl-kernel": (("ncclAllReduce", "streams.cu:all-reduce", "write"),
                    ("read_all", "streams.cu:y reader", "read"), "global", None, 16384, 0, 16384),
    "workspace": (("cublasLtMatmul", "streams.cu:product 1", "write"),
                  ("cublasLtMatmul", "streams.cu:product 2", "write"), "global", None, 4096, 0,
                  4096),
    "atomics": (("take_ticket", "streams.cu:tickets 1", "atomic"),
                ("take_ticket", "streams.cu:tickets 2", "atomic"), "global", None, 4, 0, 4),
    "device-variable": (("bump_device_variable", "streams.cu:bump 1", "atomic"),
                        ("bump_device_variable", "streams.cu:bump 2", "atomic"), "symbol",
                        "g_counter", 4, 0, 4),
    # 1024 floats from float 4096 of a fresh 65536-byte allocation, which a memset fills
    "memset-kernel": (("cudaMemsetAsync", "streams.cu:memset", "write"),
                      ("read_all", "streams.cu:fresh reader", "read"), "global", None, 65536,
                      16384, 4096),
    "memset-memset": (("cudaMemsetAsync", "streams.cu:memset 1", "write"),
                      ("cudaMemsetAsync", "streams.cu:memset 2", "write"), "global", None, 65536,
                      32768, 32768),
    "nonblocking-legacy": (("write_range", "streams.cu:non-blocking writer", "write"),
                           ("read_all", "streams.cu:legacy reader", "read"), "global", None,
                           16384, 0, 16384),
    "ordered-event": None, "ordered-fill": None, "ordered-host": None, "ordered-legacy": None,
    "end": None,
}


@pytest.mark.parametrize("seed,threads", [(1, 2), (2, 1)])
def test_the_shadow_reports_each_unordered_pair_and_nothing_ordered(programs, seed, threads):
    done = _run(programs["shadow"], "conflict", seed=seed, threads=threads)
    assert done.returncode == 0 and "conflict: ok" in done.stdout, done.stdout + done.stderr
    found = _cases(done.stderr)
    assert set(found) == set(EXPECTED), found
    for case, expected in EXPECTED.items():
        got = [_summary(c) for c in found[case]]
        assert got == ([expected] if expected else []), (case, got)
    # the allocations named are real: one base for x in the three cases that touch it
    bases = {found[case][0].base for case in ("kernel-kernel", "kernel-product",
                                              "nonblocking-legacy")}
    assert len(bases) == 1 and None not in bases
    assert "write by write_range (streams.cu:writer)" in str(found["kernel-kernel"][0])


def test_without_the_shadow_nothing_is_reported(programs):
    """The plain build runs the same conflicts: no report (what the test above sees is the
    shadow's, and only the shadow's)."""
    done = _run(programs["plain"], "conflict", seed=1)
    assert done.returncode == 0 and "conflict: ok" in done.stdout
    assert parse_shadow(done.stderr) == [] and "cuda_cpu shadow" not in done.stderr


# ---- (c) the interleaving interleaves ---------------------------------------------------

def _tickets(done) -> list[tuple[str, int]]:
    assert done.returncode == 0 and "interleave: ok" in done.stdout, done.stdout + done.stderr
    listed = re.search(r"interleave: (.*)", done.stdout).group(1).split()
    return [(item[0], int(item[1:])) for item in listed]


def test_blocks_of_concurrent_launches_are_interleaved_by_the_seed(programs):
    orders = {}
    for seed in SEEDS:
        order = _tickets(_run(programs["plain"], "interleave", seed=seed, threads=1))
        assert len(order) == 48
        for launch in "AB":  # each launch's own blocks keep their order
            assert [b for l, b in order if l == launch] == list(range(24)), (seed, order)
        letters = "".join(launch for launch, _ in order)
        assert letters.rstrip("B").count("B") > 0 and letters.rstrip("A").count("A") > 0, letters
        assert not (letters.startswith("A" * 24) or letters.startswith("B" * 24)), letters
        orders[seed] = letters
        # one worker: the order is the seed's alone
        again = _tickets(_run(programs["plain"], "interleave", seed=seed, threads=1))
        assert "".join(launch for launch, _ in again) == letters
    assert orders[0] == "AB" * 24  # seed 0: round robin
    assert len(set(orders.values())) == len(SEEDS), orders
    # two workers still mix them
    letters = "".join(l for l, _ in _tickets(_run(programs["plain"], "interleave", seed=1)))
    assert not letters.startswith("A" * 24) and not letters.startswith("B" * 24), letters


def test_one_stream_keeps_its_order_under_every_seed(programs):
    for seed in SEEDS:
        order = _tickets(_run(programs["plain"], "interleave", "same", seed=seed, threads=1))
        assert order == [("A", b) for b in range(24)] + [("B", b) for b in range(24)], order


# ---- (d) racecheck inside a launch, streams in use; faults ------------------------------

def test_racecheck_finds_a_shared_memory_race_beside_another_stream(programs):
    environment = {**RACECHECK_ENVIRONMENT}
    done = _run(programs["racecheck"], "racecheck", seed=1, environment=environment)
    assert "racecheck: ok" in done.stdout, done.stdout + done.stderr[-3000:]
    assert done.returncode == 66, done.stderr[-3000:]  # ThreadSanitizer reported
    races = parse_racecheck(done.stderr, programs["racecheck"], "streams-racecheck.cpp")
    assert races, done.stderr[-3000:]
    assert {race.kernel for race in races} == {"racy_shared"}, "\n".join(map(str, races))
    for race in races:
        assert race.memory == "dynamic shared" and race.offset == 40, race  # words[10]
        assert set(race.threads) == {5, 9}, race


def test_a_queued_launch_fault_is_reported_when_waited_for_with_its_site(programs):
    done = _run(programs["plain"], "fault")
    assert done.returncode == 0 and "fault: ok" in done.stdout, done.stdout + done.stderr
    assert re.search(r"cuda_cpu: kernel deadlock, block \(0,0,0\).*deadlock: .* "
                     r"\(launched at streams\.cu:the deadlock\)", done.stderr), done.stderr


# ---- the shipped schedules, in the shadow build ------------------------------------------

SCHEDULE_RUNS = ("train", "train_recompute")
PLAIN_TOO = "train"  # also run in the plain build (test_emulated.py builds that one anyway)


@pytest.fixture(scope="module")
def schedule_builds():
    """The shadow libraries of the shipped schedules (tiny), built in parallel beforehand so
    that each run finds its build in the cache."""
    jobs = []
    with ThreadPoolExecutor(max_workers=2) as pool:
        for name in SCHEDULE_RUNS:
            path = str(SCHEDULES / f"{name}.cg")
            run = open_run("numpy", analyse([path]), path, "tiny", {}, 0)
            text = emit_program(run.program, run.plan).text
            assert "cg_streams[1]" in text and "cg_fork(" in text, \
                f"{name}.cg emits no concurrent branch: the test would prove nothing"
            source = driver_source(run.program, run.plan, text)
            jobs.append(pool.submit(build, source, "step-shadow", SHADOW_LIBRARY_FLAGS, (),
                                    SHADOW_LIBRARY_LINK))
            if name == PLAIN_TOO:
                jobs.append(pool.submit(build, source, "step"))
        for job in jobs:
            job.result()


def _train(path: str, folder: Path, backend: str = "emulated", seed: int | None = None):
    run = open_run(backend, analyse([path]), path, "tiny", {}, 0)
    if seed is not None:
        assert run.shadow and run.shadow_active  # this run's own shadow, recording
        run.set_interleave_seed(seed)
    program = run.program
    batches = Batches(load_corpus(None), program.role("batch"), program.role("context"), 0)
    result = train(run, batches, 2, out=io.StringIO(), dump=str(folder))
    return run, result.losses


def _dump_files(folder: Path) -> dict:
    files = {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*.npy"))}
    manifest = json.loads((folder / "run.json").read_text())
    files["losses"] = json.dumps(manifest["losses"]).encode()
    return files


@pytest.mark.slow
@pytest.mark.parametrize("name", SCHEDULE_RUNS)
def test_the_shipped_schedules_have_no_conflict_under_three_seeds(name, schedule_builds,
                                                                    tmp_path, monkeypatch):
    """Two tiny steps in the shadow build, per seed: no report; losses and dumps the same bits
    under every seed (and as the plain build's, for train.cg); the losses within the numpy
    backend's tolerance."""
    path = str(SCHEDULES / f"{name}.cg")
    monkeypatch.setenv("CGC_EMULATED_SHADOW", "1")
    dumps, losses = [], []
    for seed in SEEDS:
        run, run_losses = _train(path, tmp_path / f"shadow-{seed}", seed=seed)
        assert run.conflicts == []
        dumps.append(_dump_files(tmp_path / f"shadow-{seed}"))
        losses.append(run_losses)
    monkeypatch.delenv("CGC_EMULATED_SHADOW")
    if name == PLAIN_TOO:
        plain, plain_losses = _train(path, tmp_path / "plain")
        assert not plain.shadow and not plain.shadow_active
        dumps.append(_dump_files(tmp_path / "plain"))
        losses.append(plain_losses)
    assert all(other == losses[0] for other in losses), losses
    for other in dumps[1:]:
        assert other.keys() == dumps[0].keys()
        assert all(other[key] == dumps[0][key] for key in other), \
            [key for key in other if other[key] != dumps[0][key]]
    _, reference = _train(path, tmp_path / "numpy", backend="numpy")
    for ours, theirs in zip(losses[0], reference):
        assert abs(ours - theirs) <= BFLOAT16_TOLERANCES["loss"] * theirs, (losses[0], reference)


def _wait_index(text: str) -> tuple[int, str]:
    """How many stream waits the emitted step makes before the first cg_fork of its layer
    backward (each cg_fork and cg_join makes one), and that fork's site: the step's own waits
    and those of the phases it calls before the first layer-backward phase that forks (the
    top layer's, before the backward's turned loop), in the order cg_step makes them."""
    step = text[text.index("void cg_step(cudaStream_t stream) {"):]
    step = step[:step.index("\n}\n")]
    waits = 0
    for line in step.splitlines():
        waits += line.count("cg_fork(") + line.count("cg_join(")
        called = re.search(r"(cg_phase_\d+_\w+)\(stream", line)
        if called is None:
            continue
        body = text[text.index(f"static void {called.group(1)}("):]
        body = body[:body.index("\n}\n")]
        site = re.search(r'cg_fork\(stream, [^,]+, [^,]+, "([^"]+)"\)', body)
        if site is not None and "LayerBackward" in called.group(1):
            return waits, site.group(1)
        waits += body.count("cg_fork(") + body.count("cg_join(")
    raise AssertionError("no layer-backward phase of the step forks")


@pytest.mark.slow
def test_a_missing_fork_or_join_is_reported(schedule_builds, tmp_path, monkeypatch):
    """CG_CPU_SKIP_WAIT drops one stream wait of the step: the fork of the layer backward's
    first branches (the side branch then reads what the parent has not finished writing), or
    its join (the parent then reads what the side branch has not finished writing). The
    shadow's fault names both ops and the buffer; with every wait kept, nothing."""
    path = str(SCHEDULES / "train.cg")
    monkeypatch.setenv("CGC_EMULATED_SHADOW", "1")
    probe = open_run("emulated", analyse([path]), path, "tiny", {}, 0)
    fork, site = _wait_index(probe.emitted.text)
    program = probe.program
    ids, targets = Batches(load_corpus(None), program.role("batch"), program.role("context"),
                           0).next()
    probe.step(ids, targets)
    assert probe.conflicts == []
    for skipped in (fork, fork + 1):
        monkeypatch.setenv("CG_CPU_SKIP_WAIT", str(skipped))
        run = open_run("emulated", analyse([path]), path, "tiny", {}, 0)
        assert run.shadow_active
        with pytest.raises(ConcurrencyConflict) as raised:
            run.step(ids, targets)
        conflicts = raised.value.conflicts
        print(f"\nwait {skipped} (the {'fork' if skipped == fork else 'join'} at {site}) "
              f"skipped:\n" + "\n".join(f"  {c}" for c in conflicts))
        assert conflicts and all(c.memory == "global" and c.buffers for c in conflicts)
        assert all("write" in (c.first.access, c.second.access) for c in conflicts)
        kernels = {k for c in conflicts for k in c.kernels}
        assert "cublasLtMatmul" in kernels, kernels  # the backward's branches are products


@pytest.mark.slow
def test_the_standalone_program_in_the_shadow_build_replays_a_dump(tmp_path, monkeypatch):
    """emulated.shadow_run: the emitted program's own main in the shadow build, replaying a
    numpy run's dump: its losses, and no report; with the layer backward's first join skipped,
    the reports on its stderr, each named with the storages of the memory home its allocation's
    size says."""
    path = str(SCHEDULES / "train.cg")
    run, losses = _train(path, tmp_path / "dump", backend="numpy")
    program = run.program
    clean = shadow_run(program, str(tmp_path / "dump"), steps=2, seed=1, threads=2)
    assert clean.status == 0 and clean.conflicts == [], clean.stderr[-3000:]
    printed = [float(x) for x in re.findall(r"loss (\S+)", clean.stdout)]
    assert len(printed) == 2
    for ours, theirs in zip(printed, losses):
        assert abs(ours - theirs) <= BFLOAT16_TOLERANCES["loss"] * theirs, (printed, losses)
    fork, _ = _wait_index(emit_program(program, run.plan).text)
    monkeypatch.setenv("CG_CPU_SKIP_WAIT", str(fork + 1))
    broken = shadow_run(program, str(tmp_path / "dump"), steps=1, seed=2, threads=2)
    assert broken.status == 0, broken.stderr[-3000:]  # reported, not a fault: the step runs
    assert broken.conflicts and all(c.buffers for c in broken.conflicts), broken.stderr[-3000:]
    assert len(parse_shadow(broken.stderr)) == len(broken.conflicts)



@pytest.mark.slow
def test_the_shadow_catches_branches_the_checker_would_refuse(tmp_path, monkeypatch):
    """The checker's verdict turned off for a step whose optimizer runs beside the backward
    that writes the gradients it reads: the shadow build reports the two launches and the
    gradient bank. With the verdict on, the same step never reaches a backend."""
    import shutil
    from cgc.checking import concurrency
    from cgc.core.diagnostics import CompileError
    for source in SCHEDULES.glob("*.cg"):
        shutil.copy(source, tmp_path / source.name)
    train = tmp_path / "train.cg"
    text = train.read_text()
    step = "(cgThen cgSavedBackward cgOptimizer)"
    assert step in text
    train.write_text(text.replace(step, "(cgConcurrently cgSavedBackward cgOptimizer)"))
    path = str(train)
    with pytest.raises(CompileError, match="concurrent branches may not touch"):
        open_run("emulated", analyse([path]), path, "tiny", {}, 0)
    monkeypatch.setattr(concurrency.Independence, "run", lambda self: None)
    monkeypatch.setenv("CGC_EMULATED_SHADOW", "1")
    run = open_run("emulated", analyse([path]), path, "tiny", {}, 0)
    assert run.shadow_active
    program = run.program
    ids, targets = Batches(load_corpus(None), program.role("batch"), program.role("context"),
                           0).next()
    with pytest.raises(ConcurrencyConflict) as raised:
        run.step(ids, targets)
    conflicts = raised.value.conflicts
    assert conflicts and any("cgBankG" in " ".join(map(str, c.buffers)) for c in conflicts), \
        conflicts
    assert any("cgImageAdamW" in " ".join(c.kernels) or "cgImageSquareSum" in
               " ".join(c.kernels) for c in conflicts), conflicts
