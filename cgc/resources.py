"""Locates the grammar and templates, in an installed package or in a source checkout."""

from __future__ import annotations

import os
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


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


def write_atomically(path: str, data: str | bytes) -> None:
    """`data` (text as UTF-8) into `path` through a temporary file beside it, renamed into
    place when whole: a full disk or a kill leaves the old file (or none), never a cut one.
    OSError as open() gives it; the temporary file is removed."""
    import tempfile
    folder = os.path.dirname(os.path.abspath(path))
    descriptor, temporary = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.",
                                             suffix=".cgc-tmp", dir=folder)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            _write_all(handle, data.encode("utf-8") if isinstance(data, str) else data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temporary, 0o666 & ~_umask())
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise


def _write_all(handle, data: bytes) -> None:
    """The file's bytes, in pieces of 1 MiB (a kill between two pieces leaves a partial
    temporary file, which is what tests/test_checkpoint.py does to prove it is never read)."""
    view = memoryview(data)
    for start in range(0, len(view), 1 << 20):
        handle.write(view[start:start + (1 << 20)])


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
