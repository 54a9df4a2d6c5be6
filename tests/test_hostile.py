"""Hostile inputs: bounded work, nothing hangs, nothing lost, nothing injected, the same run
everywhere.

1. 100,000 unknown names against 10,000 declarations get their diagnostics in seconds
   (did-you-mean is indexed, not quadratic), each printed once, at most 200 of them.
2. Inputs that are not regular files (a FIFO, /dev/zero) are refused, never read; source
   files are at most 16 MiB; an integer literal of thousands of digits is a diagnostic;
   an import of a file that is not a .cg schedule is refused without reading it.
3. `cgc fmt` and `--dump` are killed (SIGKILL) while they write: the file is always the old
   bytes or the new, the dump folder absent, old or complete. fmt on a file that is not
   UTF-8 or is read-only is an error, not an internal error.
4. `cgc doc` copies no raw HTML and no javascript: link from documentation comments (checked
   in headless Chromium too); diagnostics escape terminal control characters.
5. The default training text is a file shipped with cgc: fixed bytes, a fixed SHA-256, and
   so a fixed first loss.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import random
import re
import resource
import shutil
import signal
import stat
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from cgc.cli import main
from cgc.core.diagnostics import Diagnostic, render_all
from cgc.frontend.builtins import PRIMITIVES

from conftest import ROOT, SCHEDULES

ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def cgc(*arguments, timeout=60, memory=None, **options):
    """`python -m cgc ARGUMENTS` from this checkout, in a process of its own (optionally with
    its address space limited to `memory` bytes)."""
    limit = None
    if memory:
        def limit():
            resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    return subprocess.run([sys.executable, "-m", "cgc", *map(str, arguments)], cwd=ROOT,
                          env=ENV, capture_output=True, text=True, timeout=timeout,
                          preexec_fn=limit, **options)


def python(code: str, timeout=30, **options):
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=timeout, **options)


# ---- 1. bounded work: did-you-mean, printing ---------------------------------------------------


def test_100000_unknown_names_against_10000_declarations_take_seconds(tmp_path):
    """Half the unknown names are typos of declared ones (two letters swapped), half are
    names like nothing declared; 100 to a line. Before the index this never finished."""
    lines = [f"constant cgValue{i:05d} : Nat = {i}" for i in range(10_000)]
    for row in range(1_000):
        names = [f"cgVlaue{(i * 7919) % 10_000:05d}" if i % 2 else f"cgZq{i:06d}x"
                 for i in range(row * 100, row * 100 + 100)]
        lines.append(f"def cgUse{row:04d} : Nat = (cgPlus {' '.join(names)})")
    path = tmp_path / "hostile.cg"
    path.write_text("\n".join(lines) + "\n")
    started = time.monotonic()
    result = cgc("check", path)
    seconds = time.monotonic() - started
    print(f"cgc check: {seconds:.1f} s")
    assert result.returncode == 1, result.stderr[-2000:]
    assert seconds < 15
    err = result.stderr
    assert len(re.findall(r"^\S+: error: ", err, re.M)) == 200  # the first 200, then a count
    assert re.search(r"^cgc: \.\.\. 100,?800 more diagnostics not shown \(only the first 200 "
                     r"are printed\)$", err, re.M)
    assert err.rstrip().endswith("101000 errors, 0 warnings")
    assert "error: unknown name 'cgVlaue07919'" in err
    assert "note: did you mean the constant 'cgValue07919'?" in err


def test_a_repeated_diagnostic_is_printed_once():
    twice = [Diagnostic("error", "the same thing", None)] * 2
    assert render_all(twice) == "cgc: error: the same thing\n1 error, 0 warnings"


def test_the_index_suggests_what_difflib_suggests_for_typos_of_schedule_names():
    """One-edit typos of every name the schedules declare: the indexed search gives
    difflib's own answer (the golden tests check the rest)."""
    from cgc.core.diagnostics import Suggester
    from cgc.pipeline import analyse
    names = sorted({*analyse([str(SCHEDULES / "train.cg")]).scope.declarations, *PRIMITIVES})
    assert len(names) > 64  # the indexed path, not the exact one
    suggester = Suggester(names)
    generator = random.Random(0)
    for name in names:
        i = generator.randrange(1, len(name) - 1)
        for typo in (name[:i] + name[i + 1:], name[:i] + "x" + name[i:],
                     name[:i] + name[i + 1] + name[i] + name[i + 2:]):
            expected = difflib.get_close_matches(typo, names, n=1)
            assert suggester.closest(typo) == (expected[0] if expected else None), typo


# ---- 2. inputs that are not regular files; sizes -------------------------------------------------


def test_a_fifo_imported_is_refused_at_the_import_not_waited_for(tmp_path):
    os.mkfifo(tmp_path / "pipe.cg")
    main_file = tmp_path / "main.cg"
    main_file.write_text('import "pipe.cg"\ndef cgX : Nat = 1\n')
    result = cgc("check", main_file, timeout=30)
    assert result.returncode == 1
    assert f"{main_file}:1:1: error: cannot read '{tmp_path / 'pipe.cg'}': not a regular file" \
        in result.stderr


def test_a_fifo_given_to_the_loader_or_as_data_is_refused(tmp_path):
    """The command line's own check (cli._readable) opens what it is given; the loader and
    the data reader, which read, refuse without opening a FIFO for reading."""
    fifo = tmp_path / "pipe.cg"
    os.mkfifo(fifo)
    result = python(
        "from cgc.core.diagnostics import Reporter\n"
        "from cgc.frontend.load import load\n"
        "from cgc.training.data import load_corpus\n"
        f"report = Reporter(); load([{str(fifo)!r}], report)\n"
        "print(report.diagnostics[0].message)\n"
        f"try:\n    load_corpus([{str(fifo)!r}])\n"
        "except OSError as error:\n    print(error.strerror)\n", timeout=20)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("not a regular file") == 2, result.stdout


@pytest.mark.parametrize("how", ["file", "import", "data"])
def test_dev_zero_is_refused_not_read_into_memory(how, tmp_path):
    """With 2 GB of address space: reading /dev/zero would fill it, or never end."""
    link = tmp_path / "zero.cg"
    link.symlink_to("/dev/zero")
    main_file = tmp_path / "main.cg"
    main_file.write_text('import "zero.cg"\n')
    arguments = {"file": ["check", link], "import": ["check", main_file],
                 "data": ["run", SCHEDULES / "train.cg", "--backend", "numpy", "--steps", "1",
                          "--data", "/dev/zero"]}[how]
    result = cgc(*arguments, timeout=60, memory=2 << 30)
    assert "not a regular file" in result.stderr, result.stderr[-1000:]
    # A path on the command line that cannot be used is a usage error (2); an import of
    # one is a diagnostic in the source (1).
    assert result.returncode == (1 if how == "import" else 2)


def test_data_is_read_up_to_its_cap_not_whole(tmp_path):
    """A 64 GiB (sparse) --data file: 256 MiB of it are read, in 2 GB of address space."""
    huge = tmp_path / "huge.txt"
    with open(huge, "wb") as handle:
        handle.truncate(64 << 30)
    result = subprocess.run(
        [sys.executable, "-c", "from cgc.training.data import DATA_LIMIT, load_corpus\n"
                               f"print(load_corpus([{str(huge)!r}]).size == DATA_LIMIT)"],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=60,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30)))
    assert result.stdout == "True\n", result.stderr[-1000:]


def test_a_source_file_past_16_mib_is_refused_unread(tmp_path, capsys):
    big = tmp_path / "big.cg"
    with open(big, "w") as handle:
        handle.write("def cgX : Nat = cgUnknown\n")
        handle.write(("-- " + "x" * 1020 + "\n") * (17 * 1024))
    assert main(["check", str(big)]) == 1
    err = capsys.readouterr().err
    assert f"cgc: error: cannot read '{big}': larger than 16 MiB" in err
    assert "cgUnknown" not in err  # refused before it was parsed


@pytest.mark.parametrize("digits", [31, 5000, 100_000])
def test_a_long_integer_literal_is_a_diagnostic_not_an_internal_error(digits, tmp_path, capsys):
    path = tmp_path / "long.cg"
    path.write_text(f"constant cgX : Nat = {'9' * digits}\ndef cgY : Nat = -{'1' * digits}\n")
    assert main(["check", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"{path}:1:22: error: this integer literal has {digits:,} digits; a literal may " \
           "have at most 30" in err
    assert "internal error" not in err and err.rstrip().endswith("2 errors, 0 warnings")


def test_an_import_of_a_file_that_is_not_a_schedule_never_shows_its_content(tmp_path):
    secret = tmp_path / "shadow"
    secret.write_text("root:TOPSECRET-HASH:19000:0:99999:7:::\n")
    not_utf8 = tmp_path / "binary.cg"
    not_utf8.write_bytes(b"TOPSECRET-BYTES \xff\xfe\n")
    main_file = tmp_path / "main.cg"
    main_file.write_text(f'import "{secret}"\nimport "binary.cg"\nimport "/etc/shadow"\n')
    result = cgc("check", main_file)
    assert result.returncode == 1
    assert "TOPSECRET" not in result.stderr and "root:" not in result.stderr
    assert f"error: cannot import '{secret}': not a .cg file" in result.stderr
    assert "error: cannot import '/etc/shadow': not a .cg file" in result.stderr
    assert f"error: cannot read '{not_utf8}': not UTF-8 text (at byte 16)" in result.stderr


# ---- 3. nothing lost: fmt and --dump, killed while they write ----------------------------------


def _snapshot(folder: Path, path: Path):
    """What a writer changes first: the folder's entries, the file (or a dump's run.json)."""
    def status(path):
        try:
            found = path.stat()
            return found.st_size, found.st_mtime_ns, found.st_ino
        except OSError:  # absent, or not a folder
            return None
    return status(path), status(path / "run.json"), sorted(os.listdir(folder))


def _kill_while_writing(arguments, folder: Path, watched: Path, delay: float | None):
    """Starts the writer (`python ARGUMENTS`); at the first change it makes in `folder` (a
    temporary file, the file truncated, a folder made) waits up to `delay` seconds and
    kills it (SIGKILL). Returns whether it was killed before it finished; with no delay,
    lets it finish and returns the seconds from its first change to its end."""
    before = _snapshot(folder, watched)
    process = subprocess.Popen([sys.executable, *arguments], cwd=ROOT, env=ENV,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while process.poll() is None and _snapshot(folder, watched) == before:
        assert time.monotonic() < deadline, "the writer never wrote"
    changed = time.monotonic()
    if delay is None:
        assert process.wait(timeout=60) == 0
        return time.monotonic() - changed
    try:
        process.wait(timeout=delay)
        return False
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGKILL)
        process.wait()
        return True


def test_fmt_killed_while_it_writes_leaves_the_old_bytes_or_the_new(tmp_path):
    folder = tmp_path / "fmt"
    folder.mkdir()
    path = folder / "big.cg"
    lines = ["def   cgA : Nat =   1"]
    lines += [f"-- comment {i:06d}: trailing blanks go, so the whole file is rewritten   "
              for i in range(60_000)]
    lines.append("def cgB : Nat = (cgA)   ")
    old = ("\n".join(lines) + "\n").encode()
    path.write_bytes(old)
    os.chmod(path, 0o640)
    fmt = ["-m", "cgc", "fmt", str(path)]
    window = _kill_while_writing(fmt, folder, path, None)
    new = path.read_bytes()
    assert new != old and len(new) > 4_000_000
    assert stat.S_IMODE(path.stat().st_mode) == 0o640  # the mode is kept
    generator = random.Random(1)
    killed, outcomes = 0, set()
    for attempt in range(ATTEMPTS):
        path.write_bytes(old)
        for leftover in folder.glob(".big.cg.*"):
            leftover.unlink()  # a temporary file a SIGKILL left behind
        delay = generator.uniform(0, window) * (0.1, 0.75, 1.0)[attempt % 3]
        killed += _kill_while_writing(fmt, folder, path, delay)
        data = path.read_bytes()
        assert data in (old, new), f"a kill after {delay:.3f} s left {len(data):,} bytes"
        outcomes.add("new" if data == new else "old")
    print(f"fmt: writing takes {window:.3f} s; {killed} of {ATTEMPTS} runs killed while "
          f"writing; outcomes {sorted(outcomes)}")
    assert killed >= ATTEMPTS // 3


ATTEMPTS = 12


_DUMP_WRITER = """
import sys, types
import numpy as np
from cgc.training.loop import write_dump
seed = int(sys.argv[1]) if len(sys.argv) > 1 else {seed}
entries = [types.SimpleNamespace(name=f"cgEntry{{i:02d}}", count=1 << 17, stack=None,
                                 matrix=False) for i in range(24)]
program = types.SimpleNamespace(entries=entries, constants={{"cgBatch": 4}}, config="tiny",
                                low="float32", roles={{"batch": 4}})
run = types.SimpleNamespace(program=program, name="numpy", seed=seed)
values = {{e.name: np.full(e.count, seed, dtype=np.float32) for e in entries}}
ids = np.zeros((2, 256), dtype=np.int32)
write_dump({folder!r}, run, [5.0, 4.0], ids, ids, values, values, values, values)
"""


def _dump_state(folder: Path) -> str:
    """'absent', or the seed of the complete dump the folder holds; fails on anything else."""
    if not folder.exists():
        return "absent"
    manifest = json.loads((folder / "run.json").read_text())
    assert manifest["format"] == "cgc-dump-1"
    seed = manifest["seed"]
    assert np.load(folder / "ids.npy").shape == (2, 256)
    for part in ("before", "gradients", "after", "final"):
        names = sorted(p.name for p in (folder / part).iterdir())
        assert names == [f"cgEntry{i:02d}.npy" for i in range(24)], (part, names)
        for name in names:
            values = np.load(folder / part / name)
            assert values.shape == (1 << 17,) and (values == seed).all()
    return f"seed {seed}"


def test_a_dump_killed_while_it_is_written_is_absent_old_or_complete(tmp_path):
    """An earlier dump (seed 1) is replaced by another (seed 2), killed at random points."""
    parent = tmp_path / "dumps"
    parent.mkdir()
    folder = parent / "run"
    assert python(_DUMP_WRITER.format(seed=1, folder=str(folder))).returncode == 0
    assert _dump_state(folder) == "seed 1"
    old = {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}

    def restore():
        for leftover in parent.glob(".run.*"):
            shutil.rmtree(leftover)
        if folder.exists():
            shutil.rmtree(folder)
        for relative, data in old.items():
            (folder / relative).parent.mkdir(parents=True, exist_ok=True)
            (folder / relative).write_bytes(data)

    writer = ["-c", _DUMP_WRITER.format(seed=2, folder=str(folder))]
    restore()
    window = _kill_while_writing(writer, parent, folder, None)
    assert _dump_state(folder) == "seed 2"
    generator = random.Random(2)
    killed, outcomes = 0, set()
    for attempt in range(ATTEMPTS):
        restore()
        delay = generator.uniform(0, window) * (0.1, 0.75, 1.0)[attempt % 3]
        killed += _kill_while_writing(writer, parent, folder, delay)
        outcomes.add(_dump_state(folder))
    print(f"dump: writing takes {window:.3f} s; {killed} of {ATTEMPTS} runs killed while "
          f"writing; outcomes {sorted(outcomes)}")
    assert killed >= ATTEMPTS // 3


def test_a_dump_replaces_an_earlier_dump_whole_and_records_the_corpus(tmp_path):
    from cgc.training.data import CORPUS_SHA256 as shipped
    folder = tmp_path / "run"
    result = cgc("run", SCHEDULES / "train.cg", "--backend", "numpy", "--steps", "2",
                 "--dump", folder)
    assert result.returncode == 0, result.stderr
    (folder / "stale.txt").write_text("not part of the next dump")
    result = cgc("run", SCHEDULES / "train.cg", "--backend", "numpy", "--steps", "1",
                 "--dump", folder)
    assert result.returncode == 0, result.stderr
    manifest = json.loads((folder / "run.json").read_text())
    assert manifest["steps"] == 1 and not (folder / "stale.txt").exists()
    assert manifest["corpus_sha256"] == shipped == CORPUS_SHA256
    assert [p.name for p in tmp_path.iterdir()] == ["run"]  # nothing left beside it


def test_a_dump_into_a_folder_of_other_files_is_refused_before_the_steps(tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("not a dump")
    result = cgc("run", SCHEDULES / "train.cg", "--backend", "numpy", "--steps", "1",
                 "--dump", folder)
    assert result.returncode == 1
    assert f"cgc: error: --dump {folder}: the folder holds files that are not a cgc dump" \
        in result.stderr
    assert "step 1/1" not in result.stdout
    assert sorted(os.listdir(folder)) == ["notes.txt"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".mine.")]


def test_fmt_that_fails_to_write_leaves_the_file_and_no_temporary(tmp_path, capsys,
                                                                   monkeypatch):
    path = tmp_path / "full.cg"
    path.write_text("def   cgX : Nat = 1\n")

    def disk_full(*arguments):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", disk_full)
    assert main(["fmt", str(path)]) == 1  # a write the disk refused, as for every output
    assert capsys.readouterr().err == \
        f"cgc: error: cannot write {path}: No space left on device\n"
    assert path.read_text() == "def   cgX : Nat = 1\n"
    assert os.listdir(tmp_path) == ["full.cg"]


def test_fmt_of_a_file_that_is_not_utf8_is_an_error_not_a_crash(tmp_path, capsys):
    path = tmp_path / "latin1.cg"
    path.write_bytes(b"-- caf\xe9\ndef cgX : Nat = 1\n")
    assert main(["fmt", str(path)]) == 1
    assert capsys.readouterr().err.startswith(
        f"cgc: error: cannot read '{path}': not UTF-8 text (at byte 6)")
    assert path.read_bytes() == b"-- caf\xe9\ndef cgX : Nat = 1\n"


def test_fmt_of_a_read_only_file_is_refused_and_the_file_kept(tmp_path, capsys):
    path = tmp_path / "locked.cg"
    path.write_text("def   cgX : Nat = 1\n")
    path.chmod(0o444)
    assert main(["fmt", str(path)]) == 2
    assert capsys.readouterr().err == f"cgc: error: cannot write {path}: the file is read-only\n"
    assert path.read_text() == "def   cgX : Nat = 1\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o444
    assert os.listdir(tmp_path) == ["locked.cg"]


# ---- 4. nothing injected: doc pages, terminal escapes ------------------------------------------

PAYLOADS = """\
--- <script>document.title = "pwned-script"</script>
--- <img src="x" onerror="document.title = 'pwned-onerror'">
--- <div><script>document.body.insertAdjacentHTML('beforeend', '<p id=pwned>')</script></div>
--- [a link](javascript:document.title='pwned-link') [data](data:text/html,<script>1</script>)
--- [vb](VBScript:msgbox) [spaced]( JaVa&#x53;cript:alert(1)) [ok](https://example.org/)
--- <a href="javascript:alert(1)">raw</a> `a < b` stays code
def cgHostile : Nat = 1
"""


@pytest.fixture(scope="module")
def hostile_pages(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hostile-doc")
    source = folder / "hostile.cg"
    source.write_text(PAYLOADS)
    assert main(["doc", str(source), "-o", str(folder / "out")]) == 0
    return folder / "out" / "hostile.html"


class _Elements(HTMLParser):
    """Every element's tag and attributes, and the document's title."""

    def __init__(self):
        super().__init__()
        self.elements, self.title, self._in_title = [], "", False

    def handle_starttag(self, tag, attributes):
        self.elements.append((tag, dict(attributes)))
        self._in_title = tag == "title"

    def handle_endtag(self, tag):
        self._in_title = False

    def handle_data(self, data):
        if self._in_title:
            self.title += data


def _elements(page: str) -> _Elements:
    parser = _Elements()
    parser.feed(page)
    return parser


def test_doc_copies_no_raw_html_and_no_script_links(hostile_pages):
    page = hostile_pages.read_text()
    parsed = _elements(page)
    tags = {tag for tag, _ in parsed.elements}
    assert not tags & {"script", "img", "div", "iframe", "object"}, tags
    for tag, attributes in parsed.elements:
        assert not [a for a in attributes if a.startswith("on")], (tag, attributes)
        for name in ("href", "src"):
            target = re.sub(r"[\x00-\x20]", "", attributes.get(name) or "").lower()
            assert not target.startswith(("javascript:", "data:", "vbscript:")), (tag, attributes)
    assert "&lt;script&gt;document.title" in page  # shown as text
    assert 'href="https://example.org/"' in page and "<code>a &lt; b</code>" in page


def test_doc_payloads_do_nothing_in_a_browser(hostile_pages):
    """The page as Chromium leaves it once its scripts (there should be none) have run."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    assert browser, "Chromium is not installed: run scripts/setup-tests.sh"
    result = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu",
                             "--virtual-time-budget=3000", "--dump-dom",
                             hostile_pages.as_uri()],
                            capture_output=True, text=True, timeout=120)
    parsed = _elements(result.stdout)
    assert parsed.elements, result.stderr[-2000:]
    assert parsed.title == "hostile.cg: cgc"  # no payload set it
    assert not [attributes for _, attributes in parsed.elements
                if attributes.get("id") == "pwned"]  # no payload wrote to the page
    assert "hostile.cg" in result.stdout and "cgHostile" in result.stdout


@pytest.mark.parametrize("content, shown", [
    (b"def cgX : Nat = cgNope -- \x1b]0;owned\x07\x1b[2J\r\n",  # a quoted line
     "    1 | def cgX : Nat = cgNope -- \\x1b]0;owned\\x07\\x1b[2J\n"),
    (b"import \"\x1b[31mred\x1b[0m.cg\"\n",  # a path in a message
     "\\x1b[31mred\\x1b[0m.cg': No such file or directory"),
    (b"def cgY : Nat = 1 \xe2\x80\xae\n",  # a bidirectional override: caret under it
     "    1 | def cgY : Nat = 1 \\u202e\n      |                   ^~~~~~\n"),
], ids=["line", "path", "bidi"])
def test_diagnostics_escape_terminal_control_characters(content, shown, tmp_path):
    path = tmp_path / "escape.cg"
    path.write_bytes(content)
    result = cgc("check", path)
    assert result.returncode == 1
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f\u202e]", result.stderr), result.stderr
    assert shown in result.stderr


# ---- 5. the same run on every machine ------------------------------------------------------------

CORPUS_SHA256 = "7c3b166dc3b88e484bdaf539f1d85c123c98446aabfbd0c34f9fc85fc7505973"
FIRST_LOSS = 5.4896  # numpy backend, config tiny, seed 0, the shipped corpus


def test_the_default_corpus_is_the_shipped_file():
    from cgc.training import data
    corpus = data.load_corpus(None)
    shipped = (ROOT / "cgc" / "training" / "corpus.txt").read_bytes()
    same = corpus.tobytes() == shipped  # a bool: pytest would diff 619 KB byte by byte
    assert same
    assert len(shipped) == 619_466
    assert shipped.startswith(b"cgc training corpus 1: cgc's own Python and Markdown files")
    assert hashlib.sha256(shipped).hexdigest() == CORPUS_SHA256 == data.CORPUS_SHA256
    assert data.corpus_sha256() == CORPUS_SHA256
    assert f"sha256 {CORPUS_SHA256[:12]}" in data.describe(None)
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'"cgc\.training" = \[[^\]]*"corpus\.txt"', pyproject)


def test_the_first_loss_is_a_constant_of_the_version():
    result = cgc("run", SCHEDULES / "train.cg", "--backend", "numpy", "--steps", "1",
                 "--seed", "0")
    assert result.returncode == 0, result.stderr
    assert f"of cgc's own sources (corpus.txt, sha256 {CORPUS_SHA256[:12]})" in result.stderr
    first = float(re.search(r"loss (\d+\.\d+) ", result.stdout).group(1))
    assert first == FIRST_LOSS, result.stdout


def test_a_fifo_on_the_command_line_is_refused_without_waiting(tmp_path):
    import os
    import threading

    from cgc.cli import main
    fifo = tmp_path / "pipe.cg"
    os.mkfifo(fifo)
    result = []
    worker = threading.Thread(target=lambda: result.append(main(["check", str(fifo)])),
                              daemon=True)
    worker.start()
    worker.join(10)
    assert result == [2], "cgc waited on a FIFO named on the command line"


def test_a_step_past_the_memory_is_refused_before_allocating():
    """gpt2's memory plan (some 5.5 GiB) in 2 GiB of address space: once NumPy's "Unable to
    allocate" (exit 3) after the checking; now refused before any allocation, with both
    figures (backends/base.py: memory_problem)."""
    result = cgc("run", SCHEDULES / "train.cg", "--backend", "numpy", "--steps", "1",
                 "--config", "gpt2", timeout=120, memory=2 << 30)
    assert result.returncode == 1, result.stderr[-2000:]
    assert re.match(r"cgc: error: the step needs [\d,]+ bytes \(5\.\d\d GiB\) \(its memory "
                    r"plan's banks, step buffers and arena, as cgc check --memory shows them\), "
                    r"more than this process's address-space limit \(ulimit -v\): "
                    r"2,147,483,648 bytes \(2\.00 GiB\)\n", result.stderr), result.stderr[-2000:]


def test_a_fifo_as_a_dump_folders_run_json_is_not_waited_for(tmp_path):
    """--dump reads the folder's run.json to tell an earlier dump: once a FIFO there hung
    the run before its first step; now it is no dump, and the folder is refused."""
    folder = tmp_path / "dump"
    folder.mkdir()
    os.mkfifo(folder / "run.json")
    result = cgc("run", SCHEDULES / "train.cg", "--backend", "numpy", "--steps", "1",
                 "--dump", folder, timeout=60)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "the folder holds files that are not a cgc dump" in result.stderr


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "huge"])
def test_cache_entries_that_are_no_small_regular_file_are_rebuilt_not_read(tmp_path, kind):
    """The parser's tables and Jinja's compiled templates, cached under $XDG_CACHE_HOME/cgc:
    once a FIFO in their place hung every command (Jinja's and the parser's reads open
    whatever has the name) and /dev/zero was read whole; now each is a miss, rebuilt."""
    environment = {**ENV, "XDG_CACHE_HOME": str(tmp_path)}
    output = tmp_path / "train.cu"
    first = subprocess.run([sys.executable, "-m", "cgc", "compile", SCHEDULES / "train.cg",
                            "-o", output], cwd=ROOT, env=environment, capture_output=True,
                           text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    entries = sorted((tmp_path / "cgc").glob("parser-*.json")) + \
        sorted((tmp_path / "cgc" / "jinja").glob("*.cache"))
    assert len(entries) > 2
    for entry in entries:
        entry.unlink()
        if kind == "fifo":
            os.mkfifo(entry)
        elif kind == "dev-zero":
            entry.symlink_to("/dev/zero")
        else:
            with open(entry, "wb") as handle:
                handle.truncate(2 << 30)  # sparse, and under the limit: read, not refused
    # Its peak memory is measured: reading /dev/zero or the sparse file until the 4 GB limit's
    # MemoryError, which the cache readers took as a miss, fails this too. The peak is the
    # process's own (VmHWM of its memory after exec), not wait4's ru_maxrss, which counts the
    # pytest process it was forked from (over 1 GiB late in a whole suite).
    again = subprocess.run([sys.executable, "-c", _PEAK_REPORTING, "compile",
                            SCHEDULES / "train.cg", "-o", tmp_path / "again.cu"], cwd=ROOT,
                           env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-2000:]
    peak = int(again.stderr.rsplit("VmHWM", 1)[1].split()[0])
    assert peak < 1 << 20, peak  # KiB: under 1 GiB
    assert (tmp_path / "again.cu").read_bytes() == output.read_bytes()


# cgc's main under a 4 GB address-space limit, then its own peak resident memory (KiB).
_PEAK_REPORTING = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
from cgc.cli import main
status = main(sys.argv[1:])
with open("/proc/self/status") as handle:
    peak = next(line for line in handle if line.startswith("VmHWM")).split()[1]
sys.stderr.write(f"\\nVmHWM {peak}\\n")
sys.exit(status)
"""
