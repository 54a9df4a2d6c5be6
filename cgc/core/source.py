"""Source files and spans: where every node, launch and diagnostic comes from.

Shared by every stage: the front end makes spans, the IR keeps them, the checker and
the backends report at them.
"""

from __future__ import annotations

from bisect import bisect_right


class Source:
    """One source file's text, with the line table that turns offsets into lines."""

    __slots__ = ("path", "text", "_line_starts")

    def __init__(self, path: str, text: str):
        self.path, self.text, self._line_starts = path, text, None

    @property
    def line_starts(self) -> list[int]:
        if self._line_starts is None:
            starts = [0]
            find, position = self.text.find, 0
            while (position := find("\n", position) + 1) > 0:
                starts.append(position)
            self._line_starts = starts
        return self._line_starts

    def position(self, offset: int) -> tuple[int, int]:
        """(line, column), both 1-based, of a character offset."""
        line = bisect_right(self.line_starts, offset)
        return line, offset - self.line_starts[line - 1] + 1

    def line_text(self, line: int) -> str | None:
        starts = self.line_starts
        if not 0 < line <= len(starts):
            return None
        end = starts[line] - 1 if line < len(starts) else len(self.text)
        return self.text[starts[line - 1]:end].rstrip("\r")


class Span:
    """A region of one source file, kept as character offsets (end exclusive).

    Lines and columns (1-based, end column exclusive) are worked out only when asked:
    the parser makes a span for every node, and most are never printed.
    """

    __slots__ = ("source", "start", "end")

    def __init__(self, source: Source, start: int, end: int):
        self.source, self.start, self.end = source, start, end

    @property
    def path(self) -> str:
        return self.source.path

    @property
    def line(self) -> int:
        return self.source.position(self.start)[0]

    @property
    def column(self) -> int:
        return self.source.position(self.start)[1]

    @property
    def end_line(self) -> int:
        return self.source.position(max(self.end - 1, self.start))[0]

    @property
    def end_column(self) -> int:
        line, column = self.source.position(max(self.end - 1, self.start))
        return column + (1 if self.end > self.start else 0)

    def __eq__(self, other) -> bool:
        return isinstance(other, Span) and (self.path, self.start, self.end) == \
            (other.path, other.start, other.end)

    def __hash__(self) -> int:
        return hash((self.path, self.start, self.end))

    def __repr__(self) -> str:
        return f"Span({self.path!r}, {self.start}, {self.end})"

    def __str__(self) -> str:
        line, column = self.source.position(self.start)
        return f"{self.path}:{line}:{column}"

    def sort_key(self) -> tuple[str, int]:
        return (self.path, self.start)
