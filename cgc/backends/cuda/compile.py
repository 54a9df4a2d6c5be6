"""`cgc compile`: emit a checked program as CUDA, optionally compile it and report."""

from __future__ import annotations

from pathlib import Path

from ...core.diagnostics import Diagnostic, Note
from .emit import Emitted
from ...resources import data_dir
from ...core.source import Source, Span
from .toolchain import messages


def compiler_diagnostics(emitted: Emitted, log: str, emitted_name: str) -> list[Diagnostic]:
    """Compiler messages as diagnostics at the template line that produced them."""
    found = []
    emitted_source = Source(emitted_name, emitted.text)
    for message in messages(log):
        origin = emitted.origin(message.line)
        starts = emitted_source.line_starts
        start = starts[min(message.line, len(starts)) - 1]
        at_emitted = Span(emitted_source, start, start + 1)
        if origin is None:
            found.append(Diagnostic(message.severity, message.text, at_emitted))
            continue
        kernel, line = origin
        path = Path(kernel.template_file) if kernel.template_file else \
            data_dir("templates") / kernel.template
        template = Source(str(path), path.read_text(encoding="utf-8"))
        begin = template.line_starts[min(line, len(template.line_starts)) - 1]
        found.append(Diagnostic(
            message.severity, f"{message.text} (in the kernel of image '{kernel.image}')",
            Span(template, begin, begin + 1),
            (Note(f"emitted as line {message.line} of {emitted_name}", at_emitted),)))
    return found


def default_output(source: str, config: str, chosen: str | None) -> str:
    return chosen or f"{Path(source).stem}.{config}.cu"
