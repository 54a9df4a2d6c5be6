"""Every output cgc writes goes through one writer (cgc/outputs.py), whatever is at its path:
a regular file is replaced whole (its mode kept), a device, FIFO or terminal is written in
place (a device node stays a device node), a symbolic link is followed and its target
replaced (the link stays a link), a read-only file is refused, and an output that is one of
the command's own inputs is refused before any work.

Each output (`compile -o`, `ir -o`, `run --log --plot --trace`, a checkpoint, `fmt`, a
`doc` page) is tried against nodes this test makes in its own folder, never the machine's:
a character device with /dev/null's numbers (and one with /dev/full's: a clean one-line
error), a FIFO with a reader, a pseudo-terminal (os.openpty) behind a link, a link to a
regular file and a chain of links. Each is run as the test's user and, where the test is
root, as an unprivileged user too (setpriv), since root passes every permission check.
"""

from __future__ import annotations

import functools
import json
import os
import select
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import tty
from pathlib import Path

import pytest

from cgc.cli import main
from conftest import ROOT, SCHEDULES
from pngcheck import png_colours

ROOT_USER = os.geteuid() == 0
NOBODY = 65534
SETPRIV = shutil.which("setpriv")
USERS = ["self", "nobody"]
KINDS = ["device", "fifo", "terminal", "link", "chain"]
# The options of `cgc run` that write a file, by the name the test gives their output.
RUN_OUTPUTS = {"log": "--log", "plot": "--plot", "trace": "--trace"}
CHECKPOINT_NAME = "step-00000001.safetensors"  # what --checkpoint-dir D --steps 1 writes
CHECKPOINT = f"ck/{CHECKPOINT_NAME}"
SMALL = "-- a schedule of one declaration, for doc\ndef cgSmall : Nat = 1\n"
OLD = b"the old text\n"

# Runs each command line of argv[1] (JSON) through cgc's main, in this process, and writes
# [status, stderr] for each into argv[2]: one interpreter for a whole batch.
_DRIVER = """
import contextlib, io, json, sys
sys.path.insert(0, {root!r})
from cgc.cli import main
results = []
for arguments in json.loads(sys.argv[1]):
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        status = main(arguments)
    results.append([status, err.getvalue()])
with open(sys.argv[2], "w") as handle:
    json.dump(results, handle)
"""


def _can_make_devices() -> bool:
    """Whether os.mknod of a character device works here (root, and a container that lets
    it: CAP_MKNOD)."""
    if not ROOT_USER:
        return False
    with tempfile.TemporaryDirectory() as folder:
        try:
            os.mknod(os.path.join(folder, "probe"), stat.S_IFCHR | 0o600,
                     os.stat("/dev/null").st_rdev)
            return True
        except OSError:
            return False


@functools.lru_cache(maxsize=None)
def _unprivileged() -> list[str] | None:
    """The command prefix that runs as uid 65534, keeping only CAP_DAC_READ_SEARCH (so that
    it may read an interpreter installed under a root-only folder such as /root/.pyenv;
    every write is checked as its own); None where that cannot be done here."""
    if not (ROOT_USER and SETPRIV):
        return None
    prefix = [SETPRIV, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
              "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search", "--"]
    probe = subprocess.run([*prefix, sys.executable, "-c", "import numpy, lark"],
                           capture_output=True)
    return prefix if probe.returncode == 0 else None


DEVICES = _can_make_devices()


def _new_folder() -> Path:
    """A folder of the test's own (an unprivileged user can be given it: not under pytest's
    root-only tmp_path), with a copy of the schedules, never the checkout's."""
    path = Path(tempfile.mkdtemp(prefix="cgc-outputs-"))
    shutil.copytree(SCHEDULES, path / "t")
    (path / "small.cg").write_text(SMALL)
    for name in ("ck", "docs", "ref", "cache"):
        (path / name).mkdir()
    return path


@pytest.fixture
def folder():
    path = _new_folder()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _give_away(path: Path) -> None:
    """Everything under `path` owned by the unprivileged user (links themselves too)."""
    for item in [path, *path.rglob("*")]:
        os.lchown(item, NOBODY, NOBODY)


def _run_batch(folder: Path, commands: list[list[str]], user: str) -> list:
    results = folder / "results.json"
    driver = folder / "driver.py"
    driver.write_text(_DRIVER.format(root=str(ROOT)))
    prefix = []
    if user == "nobody":
        _give_away(folder)
        prefix = _unprivileged()
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "HOME": str(folder),
                   "XDG_CACHE_HOME": str(folder / "cache")}
    done = subprocess.run([*prefix, sys.executable, str(driver), json.dumps(commands),
                           str(results)], cwd=folder, env=environment, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(results.read_text())


class _Reader:
    """Reads a FIFO or a terminal's master side while a command writes to it (a writer to a
    full FIFO or terminal waits for its reader), until stopped."""

    def __init__(self, descriptor: int):
        self.descriptor, self.data = descriptor, bytearray()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while True:
            ready, _, _ = select.select([self.descriptor], [], [], 0.05)
            chunk = b""
            if ready:
                try:
                    chunk = os.read(self.descriptor, 1 << 16)
                except OSError:  # a terminal whose other side closed
                    chunk = b""
            if chunk:
                self.data += chunk
            elif self.stop.is_set():
                return
            elif ready:  # a FIFO with no writer reads as its end: wait for one
                self.stop.wait(0.01)

    def finish(self) -> bytes:
        self.stop.set()
        self.thread.join(timeout=30)
        os.close(self.descriptor)
        return bytes(self.data)


class _Node:
    """One output's path, made as `kind`; `after()` checks the node is still what it was
    and returns the bytes it received (None for a device: they are gone)."""

    def __init__(self, folder: Path, path: Path, kind: str, user: str):
        self.path, self.kind, self.reader = path, kind, None
        self.target = folder / f"target-{path.name}"
        if kind in ("device", "full"):
            numbers = os.stat("/dev/null" if kind == "device" else "/dev/full").st_rdev
            os.mknod(path, stat.S_IFCHR | 0o666, numbers)
            os.chmod(path, 0o666)
            self.numbers = numbers
        elif kind == "fifo":
            os.mkfifo(path, 0o666)
            os.chmod(path, 0o666)
            self.reader = _Reader(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
        elif kind == "terminal":
            master, slave = os.openpty()
            tty.setraw(slave)  # the bytes as written: no "\n" made "\r\n"
            self.terminal = os.ttyname(slave)
            if user == "nobody":
                os.chown(self.terminal, NOBODY, -1)
            os.symlink(self.terminal, path)
            self.slave = slave  # kept open: a terminal whose every side closed hangs up
            self.reader = _Reader(master)
        elif kind in ("link", "chain"):
            self.target.write_bytes(OLD)
            os.chmod(self.target, 0o640)
            if kind == "link":
                os.symlink(self.target, path)
            else:
                middle = folder / f"middle-{path.name}"
                os.symlink(self.target.name, middle)  # relative, then absolute
                os.symlink(middle, path)
        else:
            raise AssertionError(kind)

    def after(self) -> tuple[str | None, bytes | None]:
        """What is wrong with the node now (None: nothing), and the bytes it received (None
        for a device: they are gone)."""
        found = os.lstat(self.path)
        if self.kind in ("device", "full"):
            if not stat.S_ISCHR(found.st_mode) or found.st_rdev != self.numbers:
                return f"{self.path}: no longer the device node " \
                       f"({stat.filemode(found.st_mode)})", None
            return None, None
        data = self.reader.finish() if self.reader else None
        if self.kind == "terminal":
            os.close(self.slave)
        if self.kind == "fifo":
            return (None if stat.S_ISFIFO(found.st_mode) else f"{self.path}: no longer a FIFO"), \
                data
        if not stat.S_ISLNK(found.st_mode):
            return f"{self.path}: no longer a link ({stat.filemode(found.st_mode)})", data
        if self.kind == "terminal":
            return (None if os.readlink(self.path) == self.terminal else "link changed"), data
        target = os.path.realpath(self.path)
        if target != str(self.target):
            return f"{self.path}: a link to {target}, not to {self.target}", None
        mode = stat.S_IMODE(os.stat(target).st_mode)
        if mode != 0o640:
            return f"{target}: mode {mode:o}, not the old file's 640", None
        return None, self.target.read_bytes()


def _check_content(name: str, data: bytes, references: dict[str, bytes]) -> None:
    if name in references:
        assert data == references[name], f"{name}: other bytes than the reference"
    elif name == "log":
        records = [json.loads(line) for line in data.decode().splitlines()]
        assert [r["step"] for r in records if r["kind"] == "step"] == [1]
    elif name == "plot":
        path = Path(tempfile.mkstemp(suffix=".png")[1])
        try:
            path.write_bytes(data)
            assert png_colours(path) > 1
        finally:
            path.unlink()
    elif name == "trace":
        assert json.loads(data)["traceEvents"]
    elif name == "checkpoint":  # safetensors: a header's length, the header, the tensors
        size = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + size])
        assert json.loads(header["__metadata__"]["cgc"])["step"] == 1
        assert len(data) == 8 + size + max(end for key, value in header.items()
                                           if key != "__metadata__"
                                           for end in value["data_offsets"])
    elif name == "doc":
        assert data.startswith(b"<!DOCTYPE html>") and b"cgSmall" in data
    else:
        raise AssertionError(name)


def _outputs_scenario(folder: Path, kind: str, user: str):
    """Every output of `cgc`, each at a node made as `kind`, in a folder of its own."""
    area = folder / kind
    for name in ("ck", "docs"):
        (area / name).mkdir(parents=True)
    paths = {name: area / f"out-{name}" for name in ("compile", "ir", *RUN_OUTPUTS)}
    paths.update(checkpoint=area / "ck" / CHECKPOINT_NAME, doc=area / "docs" / "index.html")
    nodes = {name: _Node(area, path, kind, user) for name, path in paths.items()}
    run = ["run", "t/train.cg", "--backend", "numpy", "--steps", "1",
           "--checkpoint-dir", f"{kind}/ck"]
    for name, option in RUN_OUTPUTS.items():
        run += [option, f"{kind}/out-{name}"]
    commands = [["compile", "t/train.cg", "-o", f"{kind}/out-compile"],
                ["ir", "t/train.cg", "-o", f"{kind}/out-ir"],
                run,
                ["doc", "small.cg", "-o", f"{kind}/docs"]]
    return commands, nodes


def _full_scenario(folder: Path, user: str):
    """A device with /dev/full's numbers at each output, one command each."""
    area = folder / "full"
    (area / "ck").mkdir(parents=True)
    base = ["run", "t/train.cg", "--backend", "numpy", "--steps", "1"]
    commands = [["compile", "t/train.cg", "-o", "full/compile"],
                ["ir", "t/train.cg", "-o", "full/ir"],
                *([*base, option, f"full/{name}"] for name, option in RUN_OUTPUTS.items()),
                [*base, "--checkpoint-dir", "full/ck"]]
    nodes = {name: _Node(area, area / name, "full", user)
             for name in ("compile", "ir", *RUN_OUTPUTS)}
    nodes["checkpoint"] = _Node(area, area / "ck" / CHECKPOINT_NAME, "full", user)
    return commands, nodes


def _read_only_scenario(folder: Path, user: str):
    """Each output at a file without a write bit (and -o at a link to one); last, a writable
    file of mode 604, replaced."""
    area = folder / "locked"
    for name in ("ck", "docs"):
        (area / name).mkdir(parents=True)
    paths = {name: area / f"out-{name}" for name in ("compile", "ir", *RUN_OUTPUTS)}
    paths.update(checkpoint=area / "ck" / CHECKPOINT_NAME, doc=area / "docs" / "index.html")
    for path in paths.values():
        path.write_bytes(OLD)
        path.chmod(0o444)
    os.symlink("out-ir", area / "to-locked")
    (area / "kept.cu").write_bytes(OLD)
    (area / "kept.cu").chmod(0o604)
    base = ["run", "t/train.cg", "--backend", "numpy", "--steps", "1"]
    commands = [["compile", "t/train.cg", "-o", "locked/out-compile"],
                ["ir", "t/train.cg", "-o", "locked/out-ir"],
                *([*base, option, f"locked/out-{name}"] for name, option in RUN_OUTPUTS.items()),
                [*base, "--checkpoint-dir", "locked/ck"],
                ["doc", "small.cg", "-o", "locked/docs"],
                ["ir", "t/train.cg", "-o", "locked/to-locked"],
                ["compile", "t/train.cg", "-o", "locked/kept.cu"]]
    return commands, paths


def _fmt_scenario(folder: Path, user: str):
    """fmt of a file behind a link, behind a chain of links, and of a FIFO."""
    area = folder / "fmt"
    area.mkdir()
    nodes = {kind: _Node(area, area / f"{kind}.cg", kind, user)
             for kind in ("link", "chain", "fifo")}
    for kind in ("link", "chain"):
        nodes[kind].target.write_bytes(b"def   cgA : Nat =   1\n")
    return [["fmt", f"fmt/{kind}.cg"] for kind in nodes], nodes


class _Outcome:
    def __init__(self, commands, results, received):
        self.commands, self.results, self.received = commands, results, received

    def statuses(self) -> list[tuple[str, int, str]]:
        return [(" ".join(command), status, err)
                for command, (status, err) in zip(self.commands, self.results)]


@pytest.fixture(scope="module", params=USERS)
def outcomes(request):
    """Every scenario of one user, run in one interpreter (cgc's imports and the first
    step's set-up paid once, not once a scenario): {scenario: _Outcome}."""
    user = request.param
    if user == "nobody" and _unprivileged() is None:
        pytest.skip("not root: this run is itself the unprivileged one" if not ROOT_USER
                    else "setpriv cannot run cgc as another user here")
    folder = _new_folder()
    scenarios = {"references": ([["compile", "t/train.cg", "-o", "ref/train.cu"],
                                 ["ir", "t/train.cg", "-o", "ref/train.ir"]], {})}
    try:
        for kind in KINDS:
            if kind != "device" or DEVICES:
                scenarios[kind] = _outputs_scenario(folder, kind, user)
        if DEVICES:
            scenarios["full"] = _full_scenario(folder, user)
        scenarios["read-only"] = _read_only_scenario(folder, user)
        scenarios["fmt"] = _fmt_scenario(folder, user)
        commands = [line for lines, _ in scenarios.values() for line in lines]
        try:
            results = _run_batch(folder, commands, user)
        finally:  # every reader stopped, whatever happened
            received = {name: {key: node.after() if isinstance(node, _Node) else node
                               for key, node in nodes.items()}
                        for name, (_, nodes) in scenarios.items()}
        found, position = {"folder": folder, "user": user}, 0
        for name, (lines, _) in scenarios.items():
            found[name] = _Outcome(lines, results[position:position + len(lines)],
                                   received[name])
            position += len(lines)
        yield found
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _scenario(outcomes, name: str) -> _Outcome:
    if name not in outcomes:
        pytest.skip("os.mknod of a character device needs root (and CAP_MKNOD); the FIFO "
                    "and the terminal are the in-place cases here")
    return outcomes[name]


@pytest.mark.parametrize("kind", KINDS)
def test_every_output_writes_through_devices_fifos_and_links_and_keeps_them(outcomes, kind):
    """compile -o, ir -o, run --log --plot --trace, a checkpoint and a doc page, each at a
    device node (written in place: it stays the node), a FIFO and a terminal (their readers
    get the bytes), a link and a chain of links (the links stay, the target is replaced,
    its mode kept)."""
    outcome = _scenario(outcomes, kind)
    for command, status, err in outcome.statuses():
        assert status == 0, f"cgc {command}: exit {status}: {err}"
    folder = outcomes["folder"]
    references = {"compile": (folder / "ref" / "train.cu").read_bytes(),
                  "ir": (folder / "ref" / "train.ir").read_bytes()}
    for name, (problem, data) in outcome.received.items():
        assert problem is None, f"{name}: {problem}"
        if data is not None:
            _check_content(name, data, references)
    assert not list((folder / kind).rglob("*.cgc-tmp")), "a temporary file was left"


def test_a_device_that_refuses_the_write_is_one_line_and_exit_1(outcomes):
    """/dev/full's numbers: every write fails with ENOSPC. Each output says so in one line,
    exit 1, and the node is still the node."""
    outcome = _scenario(outcomes, "full")
    for name, (problem, _) in outcome.received.items():
        assert problem is None, f"{name}: {problem}"
    for command, status, err in outcome.statuses():
        lines = [line for line in err.splitlines() if line.startswith("cgc: error")]
        assert status == 1, f"cgc {command}: exit {status}: {err}"
        assert len(lines) == 1 and "No space left on device" in lines[0], err
        assert "Traceback" not in err and "internal error" not in err


def test_a_read_only_output_is_refused_and_kept_and_a_replaced_file_keeps_its_mode(outcomes):
    """A file without a write bit is refused, for root too (root passes os.access), with its
    bytes and mode kept; a link to one likewise. A writable file is replaced with its mode
    (and its owner)."""
    outcome = outcomes["read-only"]
    *refused, kept = outcome.statuses()
    for command, status, err in refused:
        assert status in (1, 2) and "read-only" in err, f"cgc {command}: exit {status}: {err}"
    for path in outcome.received.values():
        assert path.read_bytes() == OLD and stat.S_IMODE(path.stat().st_mode) == 0o444
    assert kept[1] == 0, kept
    path = outcomes["folder"] / "locked" / "kept.cu"
    assert path.read_bytes() != OLD and stat.S_IMODE(path.stat().st_mode) == 0o604
    assert path.stat().st_uid == (NOBODY if outcomes["user"] == "nobody" else os.geteuid())


def test_fmt_rewrites_a_linked_file_through_its_links_and_refuses_what_is_not_a_file(
        outcomes):
    outcome = outcomes["fmt"]
    (_, link, _), (_, chain, _), (_, fifo, fifo_err) = outcome.statuses()
    assert link == chain == 0, outcome.statuses()
    for kind in ("link", "chain"):
        problem, data = outcome.received[kind]
        assert problem is None and data == b"def cgA : Nat = 1\n", (kind, problem, data)
    assert fifo in (1, 2) and "not a regular file" in fifo_err
    assert outcome.received["fifo"] == (None, b"")


def test_an_output_on_a_link_to_standard_output_is_standard_output(folder):
    """`-o /dev/stdout` writes to the descriptor (a `>>` stays an append), not over the
    link. The link is the test's own, to /proc/self/fd/1, never the machine's /dev/stdout."""
    os.symlink("/proc/self/fd/1", folder / "stdout")
    expected = subprocess.run([sys.executable, "-m", "cgc", "ir", "t/train.cg"], cwd=folder,
                              env={**os.environ, "PYTHONPATH": str(ROOT)},
                              capture_output=True, check=True).stdout
    appended = folder / "appended.txt"
    appended.write_bytes(OLD)
    with open(appended, "ab") as handle:
        done = subprocess.run([sys.executable, "-m", "cgc", "ir", "t/train.cg", "-o", "stdout"],
                              cwd=folder, env={**os.environ, "PYTHONPATH": str(ROOT)},
                              stdout=handle, stderr=subprocess.PIPE)
    assert done.returncode == 0, done.stderr
    assert os.readlink(folder / "stdout") == "/proc/self/fd/1"
    assert appended.read_bytes() == OLD + expected


# ---- an output that is one of the command's inputs ---------------------------------------

def _refused(capsys, *arguments, option: str | None = None):
    status = main([str(a) for a in arguments])
    captured = capsys.readouterr()
    assert status == 2, captured.err
    assert "one of this command's inputs" in captured.err, captured.err
    assert len(captured.err.splitlines()) == 1, captured.err
    assert "step 1" not in captured.out  # refused before any work
    return captured.err


def test_an_output_that_is_an_input_is_refused_before_any_work(folder, capsys):
    t = folder / "t"
    before = {path: path.read_bytes() for path in t.iterdir() if path.is_file()}
    os.link(t / "model.cg", folder / "hard.cg")
    os.symlink(t / "optimizer.cg", folder / "soft.cg")
    data = folder / "data.txt"
    data.write_text("some text to train on, " * 200)
    run = ["run", t / "train.cg", "--backend", "numpy", "--steps", "1"]
    _refused(capsys, "compile", t / "train.cg", "-o", t / "train.cg")
    _refused(capsys, "ir", t / "train.cg", "-o", t / "model.cg")  # an import
    _refused(capsys, "ir", t / "train.cg", "-o", folder / "hard.cg")  # a hard link to one
    _refused(capsys, "ir", t / "train.cg", "-o", folder / "soft.cg")  # a symbolic link
    _refused(capsys, *run, "--log", t / "train.cg")
    _refused(capsys, *run, "--plot", t / "model.cg")
    _refused(capsys, *run, "--trace", folder / "soft.cg")
    _refused(capsys, *run, "--data", data, "--log", data)
    _refused(capsys, *run, "--data", folder, "--plot", data)  # a file in a --data folder
    assert {path: path.read_bytes() for path in t.iterdir() if path.is_file()} == before
    assert data.read_text() == "some text to train on, " * 200


def test_a_checkpoint_resumed_from_is_no_output(folder, capsys):
    assert main(["run", str(folder / "t" / "train.cg"), "--backend", "numpy", "--steps", "1",
                 "--checkpoint-dir", str(folder / "ck")]) == 0
    saved = (folder / CHECKPOINT).read_bytes()
    capsys.readouterr()
    _refused(capsys, "run", folder / "t" / "train.cg", "--backend", "numpy", "--steps", "2",
             "--resume", folder / "ck", "--log", folder / CHECKPOINT)
    assert (folder / CHECKPOINT).read_bytes() == saved


def test_two_outputs_on_one_file_or_one_inside_the_dump_are_refused(folder, capsys):
    run = ["run", str(folder / "t" / "train.cg"), "--backend", "numpy", "--steps", "1"]
    twice = str(folder / "twice")
    assert main([*run, "--log", twice, "--plot", twice]) == 2
    assert f"--log and --plot name the same file ({twice})" in capsys.readouterr().err
    assert not os.path.exists(twice)
    (folder / "dump").mkdir()
    assert main([*run, "--dump", str(folder / "dump"), "--trace",
                 str(folder / "dump" / "trace.json")]) == 2
    assert "is replaced whole, and --trace" in capsys.readouterr().err
    assert main([*run, "--dump", str(folder / "dump"), "--checkpoint-dir",
                 str(folder / "dump" / "ck")]) == 2
    assert "is replaced whole, and --checkpoint-dir" in capsys.readouterr().err
    assert os.listdir(folder / "dump") == []  # nothing made in it first
    # a device takes several outputs in turn (the test's own node, where it may make one)
    if DEVICES:
        os.mknod(folder / "null", stat.S_IFCHR | 0o666, os.stat("/dev/null").st_rdev)
        assert main([*run, "--log", str(folder / "null"), "--plot", str(folder / "null")]) == 0


# ---- doc: never two pages at one name ------------------------------------------------------

def test_doc_gives_every_source_its_own_page_and_leaves_the_index_alone(folder, capsys):
    """`a/b.cg` and `a__b.cg` both mapped to a__b.html, and `index.cg` to the index's name:
    a page was written over another. A folder's files are documented together, each other
    folder's in a folder of its own under the output (a/b.cg: a/b.html, beside a/index.html);
    within a folder the first in sorted order keeps its name, the others get NAME-2.html
    (docs: cgc/tools/doc.py, page_names)."""
    sources, docs = folder / "sources", folder / "docs"
    (sources / "a").mkdir(parents=True)
    declarations = {"a/b.cg": "cgFromFolder", "a__b.cg": "cgFromName", "index.cg": "cgIndexed",
                    "Case.cg": "cgUpper", "case.cg": "cgLower"}
    for path, name in declarations.items():
        (sources / path).write_text(f"def {name} : Nat = 1\n")
    if len(list(sources.glob("*ase.cg"))) < 2:
        del declarations["Case.cg"], declarations["case.cg"]  # a file system without case
    assert main(["doc", str(sources), "-o", str(docs)]) == 0
    pages = sorted(p.relative_to(docs).as_posix() for p in docs.rglob("*.html"))
    indexes = ["a/index.html", "index.html"]
    assert len(pages) == len(declarations) + len(indexes), pages
    for name in declarations.values():
        holders = [p for p in pages if p not in indexes and
                   f'id="{name}"' in (docs / p).read_text()]
        assert len(holders) == 1, (name, holders)
        where, _, page = holders[0].rpartition("/")
        index = (docs / where / "index.html").read_text()  # its folder's index links to it
        assert f'href="{page}#{name}"' in index
    assert {"a__b.html", "a/b.html", "index-2.html"} <= set(pages)


def test_an_output_to_a_pipe_whose_reader_left_is_silent_like_print():
    """`cgc compile -o /dev/stdout | head -1`: the reader leaves after one line; cgc says
    nothing and exits 0, as its printed output does (no 'cannot write /dev/stdout')."""
    done = subprocess.run(
        ["sh", "-c", f"{sys.executable} -m cgc compile {SCHEDULES / 'train.cg'} -o /dev/stdout"
                     " | head -c 10 >/dev/null; exit 0"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.stderr == ""


# A library caller whose standard output is a pipe its reader has left: cgc's command (or an
# output written to /dev/stdout) ends, then the caller looks at its own descriptor 1.
CALLER = """
import os, sys
sys.path.insert(0, {root!r})
reader, writer = os.pipe()
os.close(reader)  # the reader has left
os.dup2(writer, 1)
os.close(writer)
before = os.fstat(1)
{call}
after = os.fstat(1)
print(result, os.path.samestat(before, after), file=sys.stderr)
"""


@pytest.mark.parametrize("call", [
    "from cgc.cli import main\n"
    f"result = main(['check', {str(SCHEDULES / 'train.cg')!r}, '--config', 'tiny', '--memory'])",
    "from cgc.outputs import write_file\nresult = write_file('/dev/stdout', 'a line\\n')",
], ids=["cli.main", "write_file"])
def test_a_library_caller_s_descriptors_are_its_own_after_a_reader_left(call):
    """`cgc.cli.main([...])` (or write_file to /dev/stdout) called in a process whose
    standard output's reader had left: cgc put the null device on the caller's descriptor 1
    and left it there (the caller's own later writes vanished without an error). A process's
    own command may (it is about to end); a library call leaves the caller's as it was."""
    done = subprocess.run([sys.executable, "-c", CALLER.format(root=str(ROOT), call=call)],
                          capture_output=True, text=True, timeout=120)
    assert done.stderr.split()[-2:] == ["0" if "main" in call else "False", "True"], done.stderr
