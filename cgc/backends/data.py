"""Training data without a download: byte-level tokens from text files.

By default the tokens are the bytes of `corpus.txt`, shipped beside this module: cgc's own
Python and Markdown files, frozen into one file (its first line says what it is; MIT, as
cgc). The same bytes on every machine, so a seed gives the same run everywhere:
`CORPUS_SHA256` names them, and is checked when they are read (`cgc run` prints its start;
a dump records the SHA-256 of whatever text its run used). Each step takes B windows of T + 1 bytes at offsets
drawn from a seeded generator: the ids are a window's first T bytes, the targets its last T
(the next byte of each).

Only regular files are read (a FIFO or a device named with --data is refused before it is
opened for reading), and at most `limit` bytes in all (DATA_LIMIT by default): a file is
read up to what is still missing, never whole and then cut.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from pathlib import Path

import numpy as np

DEFAULT_CORPUS = Path(__file__).resolve().parent / "corpus.txt"
# The shipped corpus's SHA-256: checked when it is read, so that a copy changed on the way
# (newlines converted, a file truncated) is an error, not a different run.
CORPUS_SHA256 = "7c3b166dc3b88e484bdaf539f1d85c123c98446aabfbd0c34f9fc85fc7505973"
DEFAULT_LIMIT = 8 * 1024 * 1024  # bytes of the default corpus read at most (it has 620 KB)
DATA_LIMIT = 256 * 1024 * 1024  # bytes of --data read at most; the rest is not read


def default_files() -> list[Path]:
    """The default training text: the one shipped file."""
    return [DEFAULT_CORPUS]


def corpus_sha256() -> str:
    """The SHA-256 of the shipped corpus (hex)."""
    return CORPUS_SHA256


def sha256_of(corpus: np.ndarray) -> str:
    """The SHA-256 (hex) of a corpus's bytes: what a dump records."""
    return hashlib.sha256(np.ascontiguousarray(corpus, dtype=np.uint8).data).hexdigest()


def _not_regular(path: Path) -> OSError:
    return OSError(errno.EINVAL, "not a regular file (a FIFO, device or socket is never "
                                 "read)", os.fspath(path))


def _read_regular(path: Path, wanted: int) -> bytearray:
    """At most `wanted` bytes of a regular file; anything else raises OSError before a read
    (opened without blocking, so a FIFO cannot hang the run, and checked again once open)."""
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise _not_regular(path)
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    with open(descriptor, "rb", buffering=0, closefd=True) as handle:
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode):
            raise _not_regular(path)
        data = bytearray(min(wanted, status.st_size))
        view, done = memoryview(data), 0
        while done < len(data):
            count = handle.readinto(view[done:])
            if not count:  # shorter than it said
                del view
                del data[done:]
                return data
            done += count
        del view
        while len(data) < wanted:  # longer than it said: it grows as we read
            chunk = handle.read(min(wanted - len(data), 1 << 20))
            if not chunk:
                break
            data += chunk
        return data


def load_corpus(paths: list[str] | None = None, limit: int | None = None) -> np.ndarray:
    """The bytes of the --data files (folders: every file under them, in sorted order), at
    most `limit` (DATA_LIMIT); with no paths, the shipped corpus, checked against its
    SHA-256 (then cut to `limit`, if one is given)."""
    if not paths:
        text = _read_regular(DEFAULT_CORPUS, DEFAULT_LIMIT)
        if hashlib.sha256(text).hexdigest() != CORPUS_SHA256:
            raise ValueError(f"{DEFAULT_CORPUS} is not the file cgc shipped (its SHA-256 is "
                             f"not {CORPUS_SHA256[:12]}...); reinstall cgc, or give --data")
        return np.frombuffer(bytes(text[:limit] if limit else text), dtype=np.uint8)
    files: list[Path] = []
    for path in paths:
        path = Path(path)
        files.extend(sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir()
                     else [path])
    limit = limit or DATA_LIMIT
    chunks, total = [], 0
    for file in files:
        if total >= limit:
            break
        data = _read_regular(file, limit - total)
        chunks.append(data)
        total += len(data)
    corpus = np.frombuffer(chunks[0] if len(chunks) == 1 else b"".join(chunks), dtype=np.uint8)
    corpus.flags.writeable = False  # as the default corpus: the text is never changed
    if corpus.size < 2:
        raise ValueError(f"the training text has {corpus.size} byte{'' if corpus.size == 1 else 's'}"
                         "; give --data files with some text")
    return corpus


class Batches:
    """Deterministic windows of a corpus: the same seed gives the same ids and targets."""

    def __init__(self, corpus: np.ndarray, batch: int, context: int, seed: int):
        if corpus.size < context + 1:
            raise ValueError(f"the training text has {corpus.size} bytes; a window needs "
                             f"{context + 1}")
        self.corpus, self.batch, self.context = corpus, batch, context
        self.generator = np.random.default_rng([seed, 0x5eed])

    def next(self) -> tuple[np.ndarray, np.ndarray]:
        starts = self.generator.integers(0, self.corpus.size - self.context, size=self.batch)
        windows = np.stack([self.corpus[s:s + self.context + 1] for s in starts]).astype(np.int32)
        return windows[:, :-1].reshape(-1), windows[:, 1:].reshape(-1)


def describe(paths: list[str] | None) -> str:
    return ", ".join(os.fspath(p) for p in paths) if paths else \
        f"cgc's own sources (corpus.txt, sha256 {corpus_sha256()[:12]})"
