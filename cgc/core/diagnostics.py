"""Diagnostics: collected, sorted, rendered as `path:line:col: error: message` with a caret."""

from __future__ import annotations

import difflib
import re
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from itertools import chain
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
    """Raised when a stage ends with errors; carries every diagnostic it collected.
    `str(error)` is the diagnostics as `cgc` prints them (path:line:col, the line, a caret,
    the notes)."""

    def __init__(self, diagnostics: Iterable[Diagnostic]):
        self.diagnostics = sorted(diagnostics, key=Diagnostic.sort_key)
        super().__init__(f"{len(self.diagnostics)} diagnostic(s)")

    def __str__(self) -> str:
        return render_all(self.diagnostics)


class OptionError(ValueError):
    """A value given to cgc (a command's option, a library call's argument) that it cannot
    act on, with the reason; the command prints its usage and exits 2."""


class PathError(OptionError):
    """A path given to cgc that cannot be read or must not be written: one line, exit 2."""


class RunError(Exception):
    """A run that cannot start or go on for a reason no schedule's line holds (data that
    does not fit the model, a missing tool, a failed step): one line, exit 1."""


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


# ---- did you mean ----------------------------------------------------------------------
# The suggestion is the candidate difflib.get_close_matches(word, candidates, n=1,
# cutoff=0.6) would give: the highest SequenceMatcher ratio of at least 0.6, the greater
# name on a tie. Scoring every candidate for every unknown word is quadratic (1,000 unknown
# names against 1,000 declarations took 9 s of CPU, 100,000 never finished; one ratio
# costs tens of microseconds), so:
#   - a set of more than EXACT_CANDIDATES is indexed once, and a word is scored only
#     against the candidates one deletion away from it (a typo: a character dropped, added,
#     changed, or two swapped) and the SHORTLIST sharing most of its rarest character
#     pairs (reading at most POSTINGS index entries); smaller sets are scored in full;
#   - each distinct word is looked up once per set (a cache);
#   - a Budget shared by the suggestions of one compilation (the name resolver's) allows
#     RATIO_BUDGET scorings in all; past it, unknown names get no suggestion. Only the first
#     SHOWN_DIAGNOSTICS diagnostics are printed, and those have theirs long before.

CUTOFF = 0.6
EXACT_CANDIDATES = 64  # sets up to this size: every candidate scored, exactly as difflib
SHORTLIST = 12  # larger sets: at most this many of the pair-sharing candidates scored
POSTINGS = 400  # larger sets: at most this many index entries read per word
LONGEST = 100  # a word (or candidate) longer than this gets (or is) no suggestion
RATIO_BUDGET = 25_000  # scorings per Budget: about a second
_CACHED_WORDS = 1 << 16


class Budget:
    """How many more candidate scorings the suggestions sharing it may make."""

    __slots__ = ("left",)

    def __init__(self, scorings: int = RATIO_BUDGET):
        self.left = scorings


def _pairs(text: str) -> set[str]:
    padded = f"\x00{text}\x00"
    return {padded[i:i + 2] for i in range(len(padded) - 1)}


def _deletions(text: str) -> set[str]:
    return {text[:i] + text[i + 1:] for i in range(len(text))}


class Suggester:
    """The closest of a fixed set of candidates to a word, in bounded work per word."""

    def __init__(self, candidates: Iterable[str], budget: Budget | None = None):
        self.candidates = sorted({c for c in candidates if len(c) <= LONGEST})
        self.exact = len(self.candidates) <= EXACT_CANDIDATES
        self.budget = budget
        self._cache: dict[str, tuple[float, str] | None] = {}
        self._pairs: dict[str, list[int]] | None = None
        self._deletions: dict[str, list[int]] | None = None

    def _index(self) -> None:
        pairs: dict[str, list[int]] = {}
        deletions: dict[str, list[int]] = {}
        for number, candidate in enumerate(self.candidates):
            for pair in _pairs(candidate):
                pairs.setdefault(pair, []).append(number)
            for key in (candidate, *_deletions(candidate)):
                found = deletions.setdefault(key, [])
                if len(found) < SHORTLIST:
                    found.append(number)
        self._pairs, self._deletions = pairs, deletions

    def _shortlist(self, word: str) -> list[str]:
        """Candidates one deletion (each side) from `word`, and those sharing most pairs."""
        if self._pairs is None:
            self._index()
        deletions, pairs = self._deletions, self._pairs
        chosen: set[int] = set()
        for key in (word, *_deletions(word)):
            chosen.update(deletions.get(key, ()))
        lists = sorted((len(pairs[p]), p) for p in _pairs(word) if p in pairs)
        read, taken = 0, []
        for size, pair in lists:
            if read + size > POSTINGS:
                break
            read += size
            taken.append(pairs[pair])
        if taken:
            counts = Counter(chain.from_iterable(taken))
            low, high = 3 * len(word) / 7 - 1, 7 * len(word) / 3 + 1  # the lengths that can
            candidates = self.candidates                                # reach the cutoff
            chosen.update([number for number, _ in counts.most_common(2 * SHORTLIST)
                           if low <= len(candidates[number]) <= high][:SHORTLIST])
        return [self.candidates[number] for number in chosen]

    def best(self, word: str) -> tuple[float, str] | None:
        """(ratio, candidate) of the suggestion for `word`, or None."""
        if word in self._cache:
            return self._cache[word]
        found = None
        spent = self.budget is not None and self.budget.left <= 0
        if len(word) <= LONGEST and self.candidates and not spent:
            pool = self.candidates if self.exact else self._shortlist(word)
            found = _best_of(word, pool, self.budget)
        if len(self._cache) >= _CACHED_WORDS:
            self._cache.clear()
        self._cache[word] = found
        return found

    def closest(self, word: str) -> str | None:
        found = self.best(word)
        return found[1] if found else None


def _best_of(word: str, candidates, budget: Budget | None = None) -> tuple[float, str] | None:
    """difflib.get_close_matches(word, candidates, n=1) with its score (the ratio is at most
    real_quick_ratio, which the lengths alone give, so that check first only saves time);
    None where the budget cannot pay for every candidate."""
    size = len(word)
    pool = [c for c in candidates
            if 2.0 * min(size, len(c)) / (size + len(c)) >= CUTOFF]
    if not pool:
        return None
    if budget is not None:
        if budget.left < len(pool):
            budget.left = 0
            return None
        budget.left -= len(pool)
    matcher = difflib.SequenceMatcher()
    matcher.set_seq2(word)
    best = None
    for candidate in pool:
        matcher.set_seq1(candidate)
        score = matcher.ratio()
        if score >= CUTOFF and (best is None or (score, candidate) > best):
            best = (score, candidate)
    return best


def best_match(word: str, *groups, budget: Budget | None = None) -> str | None:
    """The closest name over several groups (Suggesters, or collections of names), as
    difflib would choose it over all of them as one list."""
    if len(word) > LONGEST:
        return None
    found = []
    for group in groups:
        if isinstance(group, Suggester):
            match = group.best(word)
        else:
            group = tuple(group)
            if not group:
                continue
            if len(group) > EXACT_CANDIDATES:
                match = suggester(group).best(word)
            else:
                match = _best_of(word, [c for c in group if len(c) <= LONGEST], budget)
        if match is not None:
            found.append(match)
    return max(found)[1] if found else None


_SUGGESTERS: OrderedDict[tuple[str, ...], Suggester] = OrderedDict()


def suggester(candidates: Iterable[str]) -> Suggester:
    """A Suggester for these candidates (no budget), kept while the same set is asked
    about: the callers list their candidates afresh at each unknown word."""
    key = tuple(candidates)
    found = _SUGGESTERS.get(key)
    if found is None:
        found = _SUGGESTERS[key] = Suggester(key)
        if len(_SUGGESTERS) > 16:
            _SUGGESTERS.popitem(last=False)
    else:
        _SUGGESTERS.move_to_end(key)
    return found


def closest(word: str, candidates: Iterable[str]) -> str | None:
    return suggester(candidates).closest(word)


def did_you_mean(word: str, candidates: Iterable[str]) -> tuple[Note, ...]:
    """A note suggesting the closest candidate, or none: spread it into a diagnostic."""
    suggestion = closest(word, candidates)
    return (Note(f"did you mean '{suggestion}'?"),) if suggestion else ()


_WIDTH = 100
SHOWN_DIAGNOSTICS = 200  # render_all prints at most this many, then says how many more

# Source text and messages are printed to a terminal: a control character in them (an
# escape sequence, a carriage return, a bidirectional override) is shown as an escape,
# \x1b, \u202e, never sent as it is. Tabs are kept; newlines too, in messages only.
_CONTROLS = r"\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069"
_CONTROL = re.compile(rf"[\n{_CONTROLS}]")
_CONTROL_KEEPING_LINES = re.compile(rf"[{_CONTROLS}]")


def _escape_one(found: re.Match) -> str:
    code = ord(found.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def escape_controls(text: str, keep_newlines: bool = False) -> str:
    """`text` with every control character but tab (and newline, if kept) escaped."""
    pattern = _CONTROL_KEEPING_LINES if keep_newlines else _CONTROL
    return pattern.sub(_escape_one, text)


def _escaped(raw: str, start: int, end: int) -> tuple[str, int, int]:
    """A line with control characters, escaped, around columns start..end (0-based), with
    those columns carried over to the escaped text (an escape is wider than its character).
    Only a window of a long line is escaped; what is cut shows as '...'."""
    start = min(start, len(raw))
    low, high = max(0, start - 2 * _WIDTH), min(len(raw), max(start, end) + 2 * _WIDTH)
    prefix, suffix = ("..." if low else ""), ("..." if high < len(raw) else "")
    where, pieces, width = [], [], len(prefix)
    for character in raw[low:high]:
        where.append(width)
        piece = escape_controls(character)
        pieces.append(piece)
        width += len(piece)
    where.append(width)
    text = prefix + "".join(pieces) + suffix
    return text, where[start - low], where[min(max(end, start), high) - low]


def _quote(span: Span) -> list[str]:
    text = span.source.line_text(span.line)
    if text is None:
        return []
    text = text.expandtabs(1)
    gutter = f"{span.line:>5} | "
    start = max(span.column - 1, 0)
    same_line = span.end_line == span.line and span.end_column > span.column
    end = min(span.end_column - 1, len(text)) if same_line else start
    if _CONTROL.search(text):
        text, start, end = _escaped(text, start, end)
    if len(text) > _WIDTH and start > _WIDTH // 2:
        # Show a window of a long line around the span.
        cut = start - _WIDTH // 4
        text, start, end = "..." + text[cut:], start - cut + 3, end - cut + 3
    if len(text) > _WIDTH:
        text = text[:_WIDTH] + "..."
    if same_line:
        width = end - start
    else:
        width = max(len(text.rstrip()) - start, 1)
    width = max(1, min(width, max(len(text) - start, 1)))
    marker = " " * start + "^" + "~" * (width - 1)
    return [gutter + text, " " * (len(gutter) - 2) + "| " + marker]


def render(diagnostic: Diagnostic) -> str:
    lines = []
    where = f"{diagnostic.span}: " if diagnostic.span else "cgc: "
    lines.append(escape_controls(f"{where}{diagnostic.severity}: {diagnostic.message}", True))
    if diagnostic.span:
        lines.extend(_quote(diagnostic.span))
    for note in diagnostic.notes:
        where = f"{note.span}: " if note.span else ""
        lines.append(escape_controls(f"{where}note: {note.message}", True))
        if note.span:
            lines.extend(_quote(note.span))
    return "\n".join(lines)


def render_all(diagnostics: Iterable[Diagnostic], limit: int | None = SHOWN_DIAGNOSTICS) -> str:
    """Every diagnostic once (a repeated one is printed once), sorted; past `limit`, a line
    saying how many more there are; then the count of errors and warnings."""
    unique: dict[tuple, Diagnostic] = {}
    for diagnostic in sorted(diagnostics, key=Diagnostic.sort_key):
        key = (diagnostic.severity, diagnostic.message, diagnostic.span, tuple(diagnostic.notes))
        unique.setdefault(key, diagnostic)
    diagnostics = list(unique.values())
    shown = diagnostics if limit is None else diagnostics[:limit]
    parts = [render(d) for d in shown]
    if len(shown) < len(diagnostics):
        more = len(diagnostics) - len(shown)
        parts.append(f"cgc: ... {more} more diagnostic{'' if more == 1 else 's'} not shown "
                     f"(only the first {len(shown)} are printed)")
    errors = sum(d.severity == "error" for d in diagnostics)
    warnings = len(diagnostics) - errors
    if diagnostics:
        parts.append(f"{errors} error{'' if errors == 1 else 's'}, "
                     f"{warnings} warning{'' if warnings == 1 else 's'}")
    return "\n".join(parts)
