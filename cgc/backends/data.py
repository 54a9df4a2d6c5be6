"""Training data without a download: byte-level tokens from text files.

By default the tokens are the bytes of the Python standard library's own source files,
found at run time, so every machine with Python has the same corpus. Each step takes B
windows of T + 1 bytes at offsets drawn from a seeded generator: the ids are a window's
first T bytes, the targets its last T (the next byte of each).
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import numpy as np

DEFAULT_LIMIT = 8 * 1024 * 1024  # bytes of the default corpus: plenty for the tiny model


def default_files() -> list[Path]:
    """The standard library's top-level .py files, in a stable order."""
    folder = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in folder.glob("*.py") if p.is_file())


def load_corpus(paths: list[str] | None = None, limit: int | None = None) -> np.ndarray:
    files: list[Path] = []
    for path in paths or []:
        path = Path(path)
        files.extend(sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir()
                     else [path])
    if not paths:
        files = default_files()
        limit = limit or DEFAULT_LIMIT
    chunks, total = [], 0
    for file in files:
        data = file.read_bytes()
        chunks.append(data)
        total += len(data)
        if limit and total >= limit:
            break
    corpus = np.frombuffer(b"".join(chunks)[:limit] if limit else b"".join(chunks),
                           dtype=np.uint8)
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
        "the Python standard library's source files"
