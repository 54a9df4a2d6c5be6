"""Reads source files and the files they import, each once, in dependency order.

Only what can be a schedule is read: a regular file (a FIFO or a device is refused before
it is opened for reading, so it can neither hang nor fill memory) of at most
MAX_SOURCE_BYTES, in UTF-8. An import must name a `.cg` file: anything else is refused
without being read, so a diagnostic never quotes a file that is not a schedule (`import
"/etc/shadow"` says only that it is not a .cg file).
"""

from __future__ import annotations

import os
import stat

from ..core.diagnostics import CompileError, Reporter
from .parse import parse_source
from .syntax import Module, Source

MAX_SOURCE_BYTES = 16 * 1024 * 1024  # 16 MiB: a schedule generated for 96 layers is ~50 KB


class SourceError(Exception):
    """Why a source file cannot be read: one phrase, never the file's content."""


def read_source(path: str) -> str:
    """The text of a schedule file, newlines made '\\n' (as Python's text mode does).
    OSError where it cannot be read; SourceError where it is not what a schedule can be."""
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise SourceError(_not_regular(path))
    # Not blocking: a FIFO put in its place since the stat still cannot hang us.
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    with open(descriptor, "rb", buffering=0, closefd=True) as handle:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            raise SourceError(_not_regular(path))
        data, size = [], 0
        while size <= MAX_SOURCE_BYTES:
            chunk = handle.read(MAX_SOURCE_BYTES + 1 - size)
            if not chunk:
                break
            data.append(chunk)
            size += len(chunk)
    if size > MAX_SOURCE_BYTES:
        raise SourceError(f"larger than {MAX_SOURCE_BYTES // (1024 * 1024)} MiB, the most a "
                          "source file may have")
    try:
        text = b"".join(data).decode("utf-8")
    except UnicodeDecodeError as error:
        raise SourceError(f"not UTF-8 text (at byte {error.start:,})") from None
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _not_regular(path: str) -> str:
    return "Is a directory" if os.path.isdir(path) else \
        "not a regular file (a FIFO, device or socket is never read)"


def load(paths: list[str], report: Reporter) -> list[Module]:
    """Modules in dependency order (imports before importers); errors go to `report`."""
    modules: list[Module] = []
    seen: set[str] = set()

    def visit(path: str, import_span=None) -> None:
        key = os.path.realpath(path)
        if key in seen:
            return
        seen.add(key)
        if import_span is not None and not path.endswith(".cg"):
            report.error(f"cannot import '{path}': not a .cg file (only schedules are imported; "
                         "the file is not read)", import_span)
            return
        try:
            text = read_source(path)
        except (OSError, SourceError) as error:
            reason = error.strerror if isinstance(error, OSError) and error.strerror else error
            report.error(f"cannot read '{path}': {reason}", import_span)
            return
        try:
            module = parse_source(Source(path, text))
        except CompileError as error:
            report.diagnostics.extend(error.diagnostics)
            return
        for item in module.imports:
            visit(os.path.normpath(os.path.join(os.path.dirname(path), item.path)), item.span)
        modules.append(module)

    for path in paths:
        visit(os.path.normpath(path))
    return modules
