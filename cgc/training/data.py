"""Training data without a download: byte-level tokens from text files, or llm.c's token
files.

By default the tokens are the bytes of `corpus.txt`, shipped beside this module: cgc's own
Python and Markdown files, frozen into one file (its first line says what it is; MIT, as
cgc). The same bytes on every machine, so a seed gives the same run everywhere:
`CORPUS_SHA256` names them, and is checked when they are read (`cgc run` prints its start;
a dump records the SHA-256 of whatever text its run used). Each step takes B windows of T + 1 bytes at offsets
drawn from a seeded generator: the ids are a window's first T bytes, the targets its last T
(the next byte of each).

A `.bin` file named with --data is one of llm.c's token files: a header of 256 int32 (magic
20240520, version 1, the token count), then the tokens as uint16; the header and every
token (below the vocabulary) are checked. Text and `.bin` files are not mixed in one run.

Documents: each --data file is one; the shipped corpus's are its sections (each begins at a
line '==> PATH <=='); a `.bin` file's begin at each end-of-text token (50256, GPT-2's, which
llm.c puts before every document). With validation, whole documents are held out: every
tenth (documents 9, 19, ...), or the last one where there are fewer than ten; the training
windows never reach into them.

Only regular files are read (a FIFO or a device named with --data is refused before it is
opened for reading), and at most `limit` bytes in all (DATA_LIMIT by default): a file is
read up to what is still missing, never whole and then cut.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..resources import open_regular, read_at_most

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


def _read_regular(path: Path, wanted: int) -> bytearray:
    """At most `wanted` bytes of a regular file; anything else raises OSError before a read
    (resources.open_regular: opened without blocking, checked on the descriptor)."""
    handle, _ = open_regular(path)
    with handle:
        return read_at_most(handle, wanted)


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
    files = _expand(paths)
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


LLM_C_MAGIC = 20240520
LLM_C_VERSION = 1  # uint16 tokens
LLM_C_TOKEN = np.dtype("<u2")  # a token in llm.c's files: little-endian uint16
LLM_C_HEADER_INTS = 256
END_OF_TEXT = 50256  # GPT-2's <|endoftext|>: llm.c's files begin every document with it
HELD_OUT_EVERY = 10  # validation holds out every tenth document
_SECTION = b"\n==> "  # the shipped corpus's section lines: '==> PATH <=='


@dataclass
class Tokens:
    """The run's tokens, and where each document starts."""

    tokens: np.ndarray  # uint8 (bytes of text) or uint16 (llm.c tokens)
    starts: list[int]  # each document's first token, ascending, starting with 0
    kind: str  # bytes | tokens

    @property
    def sha256(self) -> str:
        return hashlib.sha256(np.ascontiguousarray(self.tokens).data).hexdigest()

    def describe(self) -> str:
        return (f"{self.tokens.size:,} {'bytes' if self.kind == 'bytes' else 'tokens'} in "
                f"{len(self.starts):,} document{'' if len(self.starts) == 1 else 's'}")

    def documents(self) -> list[np.ndarray]:
        ends = self.starts[1:] + [self.tokens.size]
        return [self.tokens[a:b] for a, b in zip(self.starts, ends)]


def _is_token_file(path) -> bool:
    return os.fspath(path).endswith(".bin")


def read_token_file(path, vocab: int | None, limit: int = DATA_LIMIT) -> np.ndarray:
    """An llm.c token file's tokens, its header and every token checked (ValueError, naming
    the file, for anything else)."""
    header_bytes = LLM_C_HEADER_INTS * 4
    data = _read_regular(Path(path), header_bytes + limit)
    if len(data) < header_bytes:
        raise ValueError(f"{path}: {len(data)} bytes, shorter than llm.c's header of "
                         f"{header_bytes} bytes")
    header = np.frombuffer(bytes(data[:header_bytes]), dtype="<i4")
    if int(header[0]) != LLM_C_MAGIC:
        raise ValueError(f"{path}: not an llm.c token file (magic {int(header[0])}, not "
                         f"{LLM_C_MAGIC})")
    if int(header[1]) != LLM_C_VERSION:
        raise ValueError(f"{path}: llm.c token file version {int(header[1])}; cgc reads "
                         f"version {LLM_C_VERSION} (uint16 tokens)")
    count = int(header[2])
    body = len(data) - header_bytes
    if count < 0 or (2 * count > body and body < limit):  # short of what it says: cut off
        raise ValueError(f"{path}: the header says {count:,} tokens, the file holds "
                         f"{body // 2:,} (truncated?)")
    count = min(count, limit // 2)
    tokens = np.frombuffer(bytes(data[header_bytes:header_bytes + 2 * count]), dtype=LLM_C_TOKEN)
    if vocab is not None and tokens.size and int(tokens.max()) >= vocab:
        where = int(np.flatnonzero(tokens >= vocab)[0])
        raise ValueError(f"{path}: token {where:,} is {int(tokens[where])}, past the "
                         f"vocabulary (0 .. {vocab - 1})")
    return tokens.astype(LLM_C_TOKEN.newbyteorder("="))


def write_token_file(path, tokens) -> None:
    """An llm.c token file (for tests and tools): the header, then the uint16 tokens."""
    tokens = np.asarray(tokens, dtype=LLM_C_TOKEN)
    header = np.zeros(LLM_C_HEADER_INTS, dtype="<i4")
    header[:3] = (LLM_C_MAGIC, LLM_C_VERSION, tokens.size)
    from ..outputs import write_file
    write_file(path, header.tobytes() + tokens.tobytes())


def load_tokens(paths: list[str] | None, vocab: int | None = None) -> Tokens:
    """The --data files as tokens with their documents: text as bytes, `.bin` files as llm.c
    tokens (every token below `vocab`)."""
    files = _expand(paths) if paths else []
    binary = [f for f in files if _is_token_file(f)]
    if binary and len(binary) != len(files):
        raise ValueError("--data mixes llm.c token files (.bin) with text files; give one "
                         "kind")
    if binary:
        parts, starts, total = [], [], 0
        for file in binary:
            tokens = read_token_file(file, vocab, DATA_LIMIT - 2 * total)
            inside = [int(i) for i in np.flatnonzero(tokens == END_OF_TEXT) if i > 0]
            starts += [total] + [total + i for i in inside]
            parts.append(tokens)
            total += tokens.size
            if 2 * total >= DATA_LIMIT:
                break
        joined = np.concatenate(parts) if len(parts) > 1 else parts[0]
        if joined.size < 2:
            raise ValueError(f"the token files hold {joined.size} tokens; give more")
        return Tokens(joined, starts, "tokens")
    corpus = load_corpus(paths)
    if vocab is not None and int(corpus.max()) >= vocab:
        raise ValueError(f"a byte value ({int(corpus.max())}) is past the vocabulary ({vocab})")
    if not paths:
        text = corpus.tobytes()
        starts, at = [0], text.find(_SECTION)
        while at >= 0:
            if at + 1 > starts[-1]:
                starts.append(at + 1)
            at = text.find(_SECTION, at + 1)
        return Tokens(corpus, starts, "bytes")
    starts, total = [], 0
    for file in files:
        if total >= corpus.size:
            break
        starts.append(total)
        total += min(os.stat(file).st_size, corpus.size - total)
    return Tokens(corpus, starts or [0], "bytes")


def _expand(paths) -> list[Path]:
    files: list[Path] = []
    for path in paths:
        path = Path(path)
        files.extend(sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir()
                     else [path])
    return files


def split_documents(tokens: Tokens, held_out: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """The training tokens and, with `held_out`, the held-out documents' (every tenth, or the
    last where there are fewer than ten), each joined in order."""
    if not held_out:
        return tokens.tokens, None
    documents = tokens.documents()
    if len(documents) < 2:
        raise ValueError("validation holds out whole documents, and the data has one; give "
                         "--data several files (or a token file with several documents)")
    chosen = {i for i in range(len(documents)) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1} \
        or {len(documents) - 1}
    training = np.concatenate([d for i, d in enumerate(documents) if i not in chosen])
    validation = np.concatenate([d for i, d in enumerate(documents) if i in chosen])
    return training, validation


class Batches:
    """Deterministic windows of a corpus: the same seed gives the same ids and targets."""

    def __init__(self, corpus: np.ndarray, batch: int, context: int, seed: int):
        if corpus.size < context + 1:
            raise ValueError(f"the text has {corpus.size} tokens; a window needs "
                             f"{context + 1}")
        self.corpus, self.batch, self.context = corpus, batch, context
        self.generator = np.random.default_rng([seed, 0x5eed])

    def position(self) -> dict:
        """Where the windows have got to: the generator's state (JSON), for a checkpoint."""
        return self.generator.bit_generator.state

    def restore(self, position: dict) -> None:
        """Continues from a checkpoint's position: the windows after it, as the run had."""
        self.generator.bit_generator.state = position

    def next(self) -> tuple[np.ndarray, np.ndarray]:
        starts = self.generator.integers(0, self.corpus.size - self.context, size=self.batch)
        windows = np.stack([self.corpus[s:s + self.context + 1] for s in starts]).astype(np.int32)
        return windows[:, :-1].reshape(-1), windows[:, 1:].reshape(-1)


def describe(paths: list[str] | None) -> str:
    return ", ".join(os.fspath(p) for p in paths) if paths else \
        f"cgc's own sources (corpus.txt, sha256 {corpus_sha256()[:12]})"
