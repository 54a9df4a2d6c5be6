"""Reads source files and the files they import, each once, in dependency order."""

from __future__ import annotations

import os

from ..core.diagnostics import CompileError, Reporter
from .parse import parse_source
from .syntax import Module, Source


def load(paths: list[str], report: Reporter) -> list[Module]:
    """Modules in dependency order (imports before importers); errors go to `report`."""
    modules: list[Module] = []
    seen: set[str] = set()

    def visit(path: str, import_span=None) -> None:
        key = os.path.realpath(path)
        if key in seen:
            return
        seen.add(key)
        try:
            with open(path, encoding="utf-8") as handle:
                text = handle.read()
        except (OSError, UnicodeDecodeError) as error:
            reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
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
