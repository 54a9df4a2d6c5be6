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


# The one writer of user outputs is cgc/outputs.py; this is its older name.
from .outputs import write_file as write_atomically  # noqa: E402
