"""Diagnostics: collected, sorted, rendered as `path:line:col: error: message` with a caret."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Iterable

from .source import Span


@dataclass(frozen=True, slots=True)
class Note:
    message: str
    span: Span | None = None


@dataclass(frozen=True, slots=True)
class Diagnostic:
    severity: str  # "error" | "warning"
    message: str
    span: Span | None
    notes: tuple[Note, ...] = ()

    def sort_key(self):
        return self.span.sort_key() if self.span else ("", 0, 0)


class CompileError(Exception):
    """Raised when a stage ends with errors; carries every diagnostic it collected."""

    def __init__(self, diagnostics: Iterable[Diagnostic]):
        self.diagnostics = sorted(diagnostics, key=Diagnostic.sort_key)
        super().__init__(f"{len(self.diagnostics)} diagnostic(s)")


@dataclass
class Reporter:
    """Collects diagnostics for one compilation; `raise_if_errors` ends a stage."""

    diagnostics: list[Diagnostic] = field(default_factory=list)

    def error(self, message: str, span: Span | None, *notes: Note) -> None:
        self.diagnostics.append(Diagnostic("error", message, span, tuple(notes)))

    def warning(self, message: str, span: Span | None, *notes: Note) -> None:
        self.diagnostics.append(Diagnostic("warning", message, span, tuple(notes)))

    @property
    def has_errors(self) -> bool:
        return any(d.severity == "error" for d in self.diagnostics)

    def raise_if_errors(self) -> None:
        if self.has_errors:
            raise CompileError(self.diagnostics)


def closest(word: str, candidates: Iterable[str]) -> str | None:
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return close[0] if close else None


def did_you_mean(word: str, candidates: Iterable[str]) -> tuple[Note, ...]:
    """A note suggesting the closest candidate, or none: spread it into a diagnostic."""
    suggestion = closest(word, candidates)
    return (Note(f"did you mean '{suggestion}'?"),) if suggestion else ()


_WIDTH = 100


def _quote(span: Span) -> list[str]:
    text = span.source.line_text(span.line)
    if text is None:
        return []
    text = text.expandtabs(1)
    gutter = f"{span.line:>5} | "
    start = max(span.column - 1, 0)
    if len(text) > _WIDTH and start > _WIDTH // 2:
        # Show a window of a long line around the span.
        cut = start - _WIDTH // 4
        text, start = "..." + text[cut:], start - cut + 3
    if len(text) > _WIDTH:
        text = text[:_WIDTH] + "..."
    if span.end_line == span.line and span.end_column > span.column:
        width = span.end_column - span.column
    else:
        width = max(len(text.rstrip()) - start, 1)
    width = max(1, min(width, max(len(text) - start, 1)))
    marker = " " * start + "^" + "~" * (width - 1)
    return [gutter + text, " " * (len(gutter) - 2) + "| " + marker]


def render(diagnostic: Diagnostic) -> str:
    lines = []
    where = f"{diagnostic.span}: " if diagnostic.span else "cgc: "
    lines.append(f"{where}{diagnostic.severity}: {diagnostic.message}")
    if diagnostic.span:
        lines.extend(_quote(diagnostic.span))
    for note in diagnostic.notes:
        where = f"{note.span}: " if note.span else ""
        lines.append(f"{where}note: {note.message}")
        if note.span:
            lines.extend(_quote(note.span))
    return "\n".join(lines)


def render_all(diagnostics: Iterable[Diagnostic]) -> str:
    diagnostics = sorted(diagnostics, key=Diagnostic.sort_key)
    parts = [render(d) for d in diagnostics]
    errors = sum(d.severity == "error" for d in diagnostics)
    warnings = len(diagnostics) - errors
    if diagnostics:
        parts.append(f"{errors} error{'' if errors == 1 else 's'}, "
                     f"{warnings} warning{'' if warnings == 1 else 's'}")
    return "\n".join(parts)
