"""Locates the grammar and templates, in an installed package or in a source checkout."""

from __future__ import annotations

import os
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent

# The name pip installs cgc by: `cgc` on PyPI is another project (a card-games converter),
# so a hint that named `cgc` with an extra would fetch it. The import and the command
# stay `cgc`.
DISTRIBUTION = "cgc-compiler"


def install_hint(extra: str) -> str:
    """The command that installs cgc with one of its extras (pyproject.toml), from the
    package index and from a checkout of cgc's source."""
    return (f"pip install '{DISTRIBUTION}[{extra}]' (in a checkout of cgc: "
            f"pip install '.[{extra}]')")


def data_dir(name: str) -> Path:
    """`grammar` or `templates`: installed beside the modules, or at the checkout's top.

    CGC_TEMPLATES names another templates folder, for working on the kernels.
    """
    override = os.environ.get("CGC_TEMPLATES") if name == "templates" else None
    if override:
        return Path(override)
    for candidate in (_PACKAGE / name, _PACKAGE.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"cgc is installed without its {name}/ folder")


def grammar_path() -> Path:
    return data_dir("grammar") / "cg.lark"


def cache_dir() -> Path | None:
    """Where cgc keeps what it can rebuild (the parser's tables): $XDG_CACHE_HOME/cgc, by
    default ~/.cache/cgc; None where there is no home to put it in."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):  # unset, empty or relative: the XDG default
        try:
            base = str(Path.home() / ".cache")
        except RuntimeError:
            return None
    return Path(base) / "cgc"


def sync_to_disk(path: str) -> None:
    """Flushes a file, or a folder's entries (a rename into it), to the disk, where the
    system allows it: what makes a write-then-rename survive a power cut, not only a kill."""
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def open_regular(path) -> tuple:
    """`path` opened for reading as an unbuffered binary file, with its os.stat_result, if it
    is a regular file; OSError (EINVAL, 'not a regular file') for a FIFO, a device, a socket
    or a folder. Opened without blocking, so that a FIFO never hangs the open, and checked on
    the opened descriptor, so that what is read is what was checked (no swap between a stat
    and the open)."""
    import errno
    import stat
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode):
            raise OSError(errno.EINVAL, "not a regular file (a FIFO, device or socket is never "
                                        "read)", os.fspath(path))
    except BaseException:
        os.close(descriptor)
        raise
    return open(descriptor, "rb", buffering=0, closefd=True), status


def read_at_most(handle, count: int) -> bytearray:
    """Up to `count` bytes from `handle`, fewer only at its end: never more than asked,
    whatever the file's size says or becomes. Memory goes with what the file holds (its
    size, then 1 MiB pieces should it grow), not with `count`."""
    try:
        size = os.fstat(handle.fileno()).st_size
    except (OSError, AttributeError, ValueError):
        size = 0
    data = bytearray(min(count, size))
    view, done = memoryview(data), 0
    while done < len(data):
        got = handle.readinto(view[done:])
        if not got:  # shorter than it said
            break
        done += got
    view.release()
    del data[done:]
    while done == len(data) and len(data) < count:  # longer than it said: it grows
        chunk = handle.read(min(count - len(data), 1 << 20))
        if not chunk:
            break
        data += chunk
        done = len(data)
    return data  # a bytearray: no copy of what may be 256 MiB


def read_regular(path, limit: int) -> bytearray | None:
    """A regular file's bytes if it has at most `limit` of them; None if it has more (what
    is read is bounded by `limit` too, should it grow). OSError as open_regular gives it."""
    handle, status = open_regular(path)
    with handle:
        if status.st_size > limit:
            return None
        data = read_at_most(handle, limit + 1)
    return None if len(data) > limit else data
