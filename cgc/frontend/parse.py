"""Source text to syntax tree, with parse errors turned into diagnostics.

Lark builds the LALR(1) table from grammar/cg.lark; a small driver here runs it. The
lexer is one regular expression made from the grammar's own terminals, in Lark's order of
precedence; tokens are tuples and each reduction builds a syntax node directly. This is
several times faster than Lark's own LALR parser (scripts/bench_frontend.py measures both),
which matters for large generated schedules.

The driver needs a few of Lark's internals to read the table: they are all fetched in
`lark_internals`, which says which one a new Lark version changed (tests/test_parse_driver.py
pins each). What the driver keeps from them is plain data, cached as JSON in the user's
cache folder (`cgc.resources.cache_dir`) under a key made of the grammar, this file, Lark's
version and Python's: a process that finds it neither imports Lark nor builds the table.
The cached `_Parser` holds only that data; everything a parse collects is local to it.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import re
import sys
import threading
from collections import OrderedDict
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, NamedTuple

from ..core.diagnostics import Note, Reporter, did_you_mean
from ..resources import cache_dir, grammar_path, read_regular
from .syntax import (
    Apply, Arrow, Clause, Declaration, Floating, Import, Integer, Lambda, Module, Name,
    Natural, Source, Span,
)

USAGES = ("linear", "affine", "unrestricted")
DECLARATION_KEYWORDS = (
    "import", "def", "constant", "config", "buffer", "bank", "entry", "arena", "phase", "image",
    "roles", "require",
)
_DECLARATION_START = re.compile(rf"^(?:{'|'.join(DECLARATION_KEYWORDS)})\b", re.MULTILINE)

# How each terminal is named in "expected ..." messages. `__ANON_0` is Lark's name for the
# anonymous "->" (pinned by tests/test_parse_driver.py).
_TERMINAL_WORDS = {
    "LPAR": "'('", "RPAR": "')'", "COLON": "':'", "EQUAL": "'='", "DOT": "'.'",
    "__ANON_0": "'->'", "NAME": "a name", "NAT": "a natural number", "INT": "a signed integer",
    "FLOAT": "a float", "STRING": "a quoted path", "$END": "end of file",
}

# A token is a plain tuple, for speed: (type, text, start offset, end offset).
_TYPE, _TEXT, _START, _END = range(4)


class _UsageError(Exception):
    def __init__(self, token):
        self.token = token


# An integer literal has at most this many digits (10^30 is far past any size a schedule
# names; Python itself refuses to read an int of more than 4,300 digits). A longer one is an
# error at the literal.
MAX_LITERAL_DIGITS = 30


class _LiteralError(Exception):
    def __init__(self, token):
        self.token = token


class _SyntaxError(Exception):
    """The offending token (None for a character no terminal matches) and what was expected."""

    def __init__(self, token, expected: set[str], offset: int):
        self.token, self.expected, self.offset = token, expected, offset


# ---- Lark's internals, in one place --------------------------------------------------

SUPPORTED_LARK = "lark>=1.2,<2"


class LarkInternalsError(RuntimeError):
    """The installed Lark no longer has an internal piece the driver reads."""


class LarkInternals(NamedTuple):
    """What the driver reads from a built `Lark(..., parser="lalr")`; only this is private."""

    shift: Any                 # lark.parsers.lalr_analysis.Shift: the action tag of a shift
    states: dict               # state -> symbol -> (Shift, state) | (Reduce, Rule)
    start_state: int           # parse_table.start_states["start"]
    end_state: int             # parse_table.end_states["start"]
    terminals: list            # Lark.terminals: TerminalDef(name, pattern, priority)
    ignored: list              # Lark.ignore_tokens: names of the %ignore'd terminals
    rules: list                # Lark.rules: Rule(origin.name, expansion, alias)


def _lark_version() -> str:
    try:
        import lark
        return str(lark.__version__)
    except Exception:  # noqa: BLE001 (only for the message)
        return "unknown"


def _internal(what: str, fetch: Callable[[], Any], shaped: Callable[[Any], bool]) -> Any:
    """One internal piece of Lark, or an error naming it."""
    try:
        value = fetch()
        ok = shaped(value)
    except (AttributeError, ImportError, KeyError, IndexError, TypeError, ValueError):
        ok = False
    if not ok:
        raise LarkInternalsError(f"this Lark version ({_lark_version()}) changed its internals: "
                                 f"{what}; cgc supports {SUPPORTED_LARK}")
    return value


def _is_terminal(symbol: str) -> bool:
    """Lark names terminals in capitals (its own end marker is `$END`), rules in lower case."""
    return symbol.isupper() or symbol == "$END"


def lark_internals(lark) -> LarkInternals:
    """Every private attribute or module of Lark the driver uses, fetched and shape-checked.

    tests/test_parse_driver.py pins each of them, so that a Lark upgrade that moves one fails
    there, and here with a message naming it, rather than somewhere inside the driver.
    """
    analysis = _internal("module lark.parsers.lalr_analysis",
                         lambda: importlib.import_module("lark.parsers.lalr_analysis"),
                         lambda module: True)
    shift = _internal("lark.parsers.lalr_analysis.Shift", lambda: analysis.Shift,
                      lambda value: value is not analysis.Reduce)
    table = _internal("Lark.parser.parser.parser.parse_table (the LALR table)",
                      lambda: lark.parser.parser.parser.parse_table,
                      lambda value: hasattr(value, "states"))
    rules = _internal("Lark.rules (Rule with .origin.name, .expansion and .alias)",
                      lambda: list(lark.rules),
                      lambda found: found and all(
                          isinstance(rule.origin.name, str) and isinstance(rule.expansion, list)
                          and (rule.alias is None or isinstance(rule.alias, str))
                          for rule in found))
    rule_ids = {id(rule) for rule in rules}

    def action_shaped(entry) -> bool:
        action, target = entry
        if action is shift:
            return isinstance(target, int)
        return action is analysis.Reduce and id(target) in rule_ids

    states = _internal("parse_table.states (int state -> symbol -> (Shift, int) or "
                       "(Reduce, one of Lark.rules))",
                       lambda: table.states,
                       lambda found: isinstance(found, dict) and found and all(
                           isinstance(state, int) and isinstance(row, dict)
                           and all(isinstance(symbol, str) and action_shaped(entry)
                                   for symbol, entry in row.items())
                           for state, row in found.items()))
    start_state = _internal("parse_table.start_states['start']",
                            lambda: table.start_states["start"], lambda value: value in states)
    end_state = _internal("parse_table.end_states['start']",
                          lambda: table.end_states["start"], lambda value: value in states)
    terminals = _internal("Lark.terminals (TerminalDef with .name, .priority and .pattern "
                          "with .type, .value, .max_width and .to_regexp())",
                          lambda: list(lark.terminals),
                          lambda found: found and all(
                              isinstance(t.name, str) and isinstance(t.priority, int)
                              and t.pattern.type in ("str", "re")
                              and isinstance(t.pattern.value, str)
                              and isinstance(t.pattern.max_width, int)
                              and isinstance(t.pattern.to_regexp(), str)
                              for t in found))
    ignored = _internal("Lark.ignore_tokens (names of the %ignore'd terminals)",
                        lambda: [str(name) for name in lark.ignore_tokens],
                        lambda found: set(found) <= {t.name for t in terminals})
    return LarkInternals(shift, states, start_state, end_state, terminals, ignored, rules)


# ---- the tables ----------------------------------------------------------------------

# Bumped when the layout of the tables below changes (the cache key also hashes this file).
_TABLES_FORMAT = 1


def _build_tables(grammar: str) -> dict:
    """The driver's tables, as plain data (JSON-able), from Lark's LALR(1) analysis."""
    from lark import Lark

    internals = lark_internals(Lark(grammar, parser="lalr", lexer="basic"))
    # Lark's own order of precedence among terminals (its basic lexer sorts them so), so
    # that both lexers agree.
    terminals = sorted(internals.terminals, key=lambda t: (-t.priority, -t.pattern.max_width,
                                                       -len(t.pattern.value), t.name))
    # Words such as `lambda` match NAME too; like Lark, retype them after the match.
    keywords = {str(t.pattern.value): str(t.name) for t in terminals
                if t.pattern.type == "str" and re.fullmatch(r"[a-z]+", t.pattern.value)}
    # Whitespace is folded into the next match: one regex match per token.
    regex = r"[ \t\f\r\n]*(?:" + "|".join(
        f"(?P<{t.name}>{t.pattern.to_regexp()})"
        for t in terminals if t.name not in keywords.values() and t.name != "WS") + r"|(?P<WS>$))"
    reductions = {id(rule): [len(rule.expansion), str(rule.origin.name), _builder_name(rule)]
                  for rule in internals.rules}
    # state -> terminal -> next state (a shift: an int) or [size, origin, builder]
    actions = [[state, {str(symbol): target if action is internals.shift else reductions[id(target)]
                        for symbol, (action, target) in row.items() if _is_terminal(symbol)}]
               for state, row in internals.states.items()]
    gotos = [[state, {str(symbol): target for symbol, (action, target) in row.items()
                      if not _is_terminal(symbol)}]
             for state, row in internals.states.items()]
    return {"format": _TABLES_FORMAT, "regex": regex, "keywords": keywords,
            "ignored": sorted(set(internals.ignored) - {"WS"}), "actions": actions, "gotos": gotos,
            "start": internals.start_state, "end": internals.end_state}


def _cache_key(grammar: str) -> str:
    """Hashes everything the tables depend on: the grammar, this file (the driver and how it
    reads the table), Lark (its __init__.py, which carries __version__) and Python's version."""
    digest = hashlib.sha256()
    spec = importlib.util.find_spec("lark")
    parts = (grammar.encode("utf-8"), Path(__file__).read_bytes(),
             Path(spec.origin).read_bytes(), repr(sys.version_info[:2]).encode(),
             str(_TABLES_FORMAT).encode())
    for part in parts:
        digest.update(len(part).to_bytes(8, "little") + part)
    return digest.hexdigest()


def _cache_file(grammar: str) -> Path | None:
    """Where the tables of this grammar are cached, or None where no cache can be used."""
    try:
        folder = cache_dir()
        return None if folder is None else folder / f"parser-{_cache_key(grammar)}.json"
    except Exception:  # noqa: BLE001 (no cache is never an error)
        return None


# The cached tables take 30 KB; a file past this bound is no cache cgc wrote (and is not read).
_CACHE_LIMIT = 16 * 1024 * 1024


def _read_cache(path: Path) -> _Parser | None:
    """The parser made from the cached tables, or None (missing, unreadable, damaged, not a
    regular file, or past _CACHE_LIMIT: a FIFO or /dev/zero there is never waited on or read
    whole)."""
    import json

    try:
        data = read_regular(path, _CACHE_LIMIT)
        if data is None:
            return None
        tables = json.loads(data)
        if tables.pop("key") != path.stem or tables["format"] != _TABLES_FORMAT:
            return None
        return _Parser(tables)
    except Exception:  # noqa: BLE001 (whatever is wrong with it: rebuild)
        return None


def _write_cache(path: Path, tables: dict) -> None:
    """Writes the whole file under a temporary name, then renames it: a reader sees the old
    file, no file, or the new one, never half of it. Any failure leaves no cache behind."""
    import json
    import tempfile

    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=".parser-", suffix=".tmp")
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            json.dump({**tables, "key": path.stem}, out, separators=(",", ":"))
        os.replace(temporary, path)
    except Exception:  # noqa: BLE001 (an unwritable cache is no error)
        if temporary is not None:
            try:
                os.unlink(temporary)
            except OSError:
                pass


def _load() -> _Parser:
    """The parser from the cache where a current one is there; else built, and cached."""
    grammar = grammar_path().read_text(encoding="utf-8")  # once: the key is the tables'
    path = _cache_file(grammar)
    parser = _read_cache(path) if path is not None else None
    if parser is None:
        tables = _build_tables(grammar)
        parser = _Parser(tables)
        if path is not None:
            _write_cache(path, tables)
    return parser


# ---- the driver ----------------------------------------------------------------------


class _Parser:
    """The tables, ready to run; read-only once made, so that one serves every parse."""

    def __init__(self, tables: dict):
        self.regex = re.compile(tables["regex"])
        self.keywords: dict[str, str] = dict(tables["keywords"])
        self.ignored = frozenset(tables["ignored"])
        # state -> terminal -> next state (a shift: an int) or (size, origin, builder)
        self.actions = {
            state: {kind: action if action.__class__ is int
                    else (action[0], action[1], _BUILDERS[action[2]])
                    for kind, action in row.items()}
            for state, row in tables["actions"]}
        self.gotos = {state: dict(row) for state, row in tables["gotos"]}
        self.start_state: int = tables["start"]
        self.end_state: int = tables["end"]

    # ---- lexing ------------------------------------------------------------------

    def tokens(self, text: str, start: int, end: int, comments: list | None = None):
        """The tokens of text[start:end], then `$END`; each comment skipped is appended to
        `comments`, if given, as (start, end, terminal name)."""
        keywords, ignored = self.keywords, self.ignored
        position = start
        for found in self.regex.finditer(text, start, end):
            if found.start() != position:
                break
            kind, position = found.lastgroup, found.end()
            if kind == "WS":  # trailing whitespace
                continue
            begin = found.start(kind)
            if kind in ignored:
                if comments is not None:
                    comments.append((begin, position, kind))
                continue
            value = text[begin:position]
            if kind == "NAME" and value in keywords:
                kind = keywords[value]
            yield (kind, value, begin, position)
        if position != end:
            while text[position] in " \t\f\r\n":
                position += 1
            raise _SyntaxError(None, set(), position)
        yield ("$END", "", end, end)

    # ---- parsing -----------------------------------------------------------------

    def parse(self, source: Source, start: int, end: int):
        """(items, documentation comments as (offset, text)) of source.text[start:end]."""
        actions, gotos, end_state = self.actions, self.gotos, self.end_state
        state_stack, value_stack, comments = [self.start_state], [], []
        for token in self.tokens(source.text, start, end, comments):
            kind = token[0]
            while True:
                action = actions[state_stack[-1]].get(kind)
                if action is None:
                    expected = set(actions[state_stack[-1]])
                    raise _SyntaxError(token, expected, token[_START])
                if action.__class__ is int:
                    state_stack.append(action)
                    value_stack.append(token)
                    break
                size, origin, build = action
                if size:
                    children = value_stack[-size:]
                    del state_stack[-size:]
                    del value_stack[-size:]
                else:
                    children = []
                value_stack.append(build(source, children))
                state_stack.append(gotos[state_stack[-1]][origin])
                if state_stack[-1] == end_state:
                    text = source.text
                    docs = [(begin, text[begin:stop]) for begin, stop, kind in comments
                            if kind == "DOC_COMMENT"]
                    return value_stack[-1], docs
        raise AssertionError("the LALR driver ended without accepting")


@lru_cache(maxsize=1)
def _parser() -> _Parser:
    return _load()


# ---- building nodes ------------------------------------------------------------------
# One builder per grammar rule, called at each reduction with the source and the rule's
# children: tokens (tuples) and nodes already built.


def _span(source: Source, first, last) -> Span:
    # Tokens are tuples; syntax nodes are not.
    end = last[_END] if last.__class__ is tuple else last.span.end
    return Span(source, first[_START], end)


def _name(source: Source, token) -> Name:
    return Name(token[_TEXT], Span(source, token[_START], token[_END]))


def _build_repeat(source, children):
    """Lark's helper rules for `x*` and `x+` (named `__...`): flat lists."""
    if children and children[0].__class__ is list:
        children[0].extend(children[1:])
        return children[0]
    return children


def _build_first(source, children):
    return children[0]


def _build_start(source, children):
    return children[0] if children else []


def _build_name(source, children):
    return _name(source, children[0])


def _literal_value(token) -> int:
    if len(token[_TEXT].lstrip("+-")) > MAX_LITERAL_DIGITS:
        raise _LiteralError(token)
    return int(token[_TEXT])


def _build_natural(source, children):
    token = children[0]
    return Natural(_literal_value(token), _span(source, token, token))


def _build_integer(source, children):
    token = children[0]
    return Integer(_literal_value(token), _span(source, token, token))


def _build_floating(source, children):
    token = children[0]
    return Floating(float(token[_TEXT]), token[_TEXT], _span(source, token, token))


def _build_group(source, children):
    return children[1]


def _build_apply(source, children):
    return Apply(children[1], tuple(children[2]), _span(source, children[0], children[-1]))


def _build_lambda(source, children):
    _, _, usage, binder, _, binder_type, _, body, close = children
    if usage[_TEXT] not in USAGES:
        raise _UsageError(usage)
    return Lambda(usage[_TEXT], _name(source, binder), binder_type, body,
                  _span(source, children[0], close))


def _build_arrow(source, children):
    parts = [children[1]] + [part for part in children[2] if part.__class__ is not tuple]
    return Arrow(tuple(parts), _span(source, children[0], children[-1]))


def _build_clause(source, children):
    arguments = tuple(children[2]) if len(children) == 4 else ()
    return Clause(_name(source, children[1]), arguments,
                  _span(source, children[0], children[-1]))


def _build_import(source, children):
    keyword, path = children
    return Import(path[_TEXT][1:-1], _span(source, keyword, path))


def _build_declaration(source, children):
    flat = []
    for child in children:
        flat.extend(child) if child.__class__ is list else flat.append(child)
    keyword, name, *rest = flat
    span = _span(source, keyword, rest[-1] if rest else name)
    parent = None
    if rest and rest[0].__class__ is tuple and rest[0][_TYPE] == "FROM":
        parent, rest = _name(source, rest[1]), rest[2:]
    rest = [item for item in rest if item.__class__ is not tuple]  # drop ':' and '='
    terms = tuple(item for item in rest if not isinstance(item, Clause))
    clauses = tuple(item for item in rest if isinstance(item, Clause))
    return Declaration(keyword[_TEXT], _name(source, name), terms, clauses, None, span, parent)


# Builder of each rule, by the rule's alias or name; the cached tables name them.
_BUILDERS: dict[str, Callable] = {
    "repeat": _build_repeat, "first": _build_first, "start": _build_start,
    "name": _build_name, "natural": _build_natural, "integer": _build_integer,
    "floating": _build_floating, "group": _build_group, "apply": _build_apply,
    "lambda_": _build_lambda, "arrow": _build_arrow, "clause": _build_clause,
    "import_decl": _build_import,
    **{f"{keyword}_decl": _build_declaration for keyword in DECLARATION_KEYWORDS
       if keyword != "import"},
}


def _builder_name(rule) -> str:
    origin = str(rule.origin.name)
    if origin.startswith("__"):  # Lark's helper rules for `x*` and `x+`
        return "repeat"
    if origin == "_item":
        return "first"
    name = str(rule.alias or origin)
    if name not in _BUILDERS:
        raise LookupError(f"grammar rule {name!r} has no builder in cgc/frontend/parse.py")
    return name


# ---- explaining errors -------------------------------------------------------------


def _open_parentheses(text: str, start: int, upto: int) -> list[tuple[int, bool]]:
    """(offset, is_lambda) of each parenthesis still open before `upto`, innermost last."""
    stack: list[tuple[int, bool]] = []
    for match in re.finditer(r"--[^\n]*|\"[^\"\n]*\"|[()]|lambda\b", text[:upto]):
        if match.start() < start:
            continue
        word = match.group()
        if word == "(":
            stack.append((match.start(), False))
        elif word == ")":
            if stack:
                stack.pop()
        elif word == "lambda" and stack and \
                text[stack[-1][0] + 1:match.start()].strip() == "":
            stack[-1] = (stack[-1][0], True)
    return stack


def _enclosing_keyword(text: str, start: int, upto: int) -> str | None:
    matches = list(_DECLARATION_START.finditer(text, start, upto))
    return matches[-1].group() if matches else None


def _describe_expected(expected: set[str]) -> str:
    words = sorted({_TERMINAL_WORDS.get(t, f"'{t.lower()}'") for t in expected})
    if len(words) > 6:
        return "a term or a declaration"
    return ", ".join(words[:-1]) + (" or " if len(words) > 1 else "") + words[-1]


def _explain(error: _SyntaxError, source: Source, start: int, end: int, report: Reporter):
    """Turns one syntax error into one diagnostic, matching the common mistakes first."""
    text = source.text
    token = error.token
    if token is None:
        report.error(f"unexpected character {text[error.offset]!r}",
                     Span(source, error.offset, error.offset + 1))
        return
    kind, value = token[_TYPE], token[_TEXT]
    at_end = kind == "$END"
    if at_end:  # point at the last character, not past the end
        offset = max(len(text[:end].rstrip()) - 1, start)
        span = Span(source, offset, offset + 1)
        offset += 1
    else:
        offset = error.offset
        span = Span(source, offset, token[_END])
    found = "end of file" if at_end else repr(value)
    expected = error.expected
    open_parens = _open_parentheses(text, start, offset)
    keyword = _enclosing_keyword(text, start, offset)

    def opener_note(message="the parenthesis opened here"):
        where = open_parens[-1][0]
        return Note(message, Span(source, where, where + 1))

    starts_declaration = value in DECLARATION_KEYWORDS and kind.isupper() and kind != "NAME"
    if open_parens and (at_end or starts_declaration):
        before = (f"the next declaration '{value}'" if not at_end
                  else "the end of the file" if end == len(text) else "the next declaration")
        report.error(f"unclosed parenthesis: expected ')' before {before}", span, opener_note())
    elif kind == "RPAR" and not open_parens:
        report.error("unmatched ')': there is no '(' open here", span)
    elif kind == "RPAR" and expected & {"NAME", "NAT", "LPAR"} \
            and text[:offset].rstrip().endswith("("):
        report.error("empty parentheses: expected a term after '('", span)
    elif open_parens and open_parens[-1][1] and expected == {"DOT"}:
        report.error(f"lambda is missing the '.' between its binder's type and its body "
                     f"(found {found})", span, opener_note("the lambda starts here"))
    elif open_parens and open_parens[-1][1] and kind == "COLON" and "NAME" in expected:
        report.error("lambda needs a usage annotation before its binder: linear, affine or "
                     "unrestricted, as in (lambda unrestricted i : Nat . body)", span,
                     opener_note("the lambda starts here"))
    elif keyword == "def" and "EQUAL" in expected and not open_parens:
        report.error(f"a def needs '=' between its type and its body (found {found})", span,
                     Note("the form is: def NAME : TYPE = TERM"))
    elif keyword == "def" and expected == {"COLON"}:
        report.error(f"a def needs a type after its name (found {found})", span,
                     Note("the form is: def NAME : TYPE = TERM"))
    elif (keyword is None or expected >= {"DEF", "IMPORT"}) and not open_parens:
        report.error(f"expected a declaration ({', '.join(DECLARATION_KEYWORDS)}), found {found}",
                     span)
    else:
        report.error(f"unexpected {found}: expected {_describe_expected(expected)}", span)


# ---- files -------------------------------------------------------------------------


def _declaration_ranges(text: str) -> list[tuple[int, int]]:
    """(start, end) offsets of pieces that each begin at a declaration keyword in column 1."""
    starts = [m.start() for m in _DECLARATION_START.finditer(text)]
    if not starts or starts[0] != 0:
        starts.insert(0, 0)
    return list(zip(starts, starts[1:] + [len(text)]))


def _attach_docs(items, docs: list[tuple[int, str]], source: Source):
    """A run of `---` lines directly above a declaration is its documentation."""
    by_line = {source.position(offset)[0]: body for offset, body in docs}
    attached = []
    for item in items:
        if isinstance(item, Declaration):
            lines = []
            line = item.span.line - 1
            while line in by_line:
                lines.append(re.sub(r"^--- ?", "", by_line[line]).rstrip())
                line -= 1
            if lines:
                item = Declaration(item.kind, item.name, item.terms, item.clauses,
                                   "\n".join(reversed(lines)), item.span, item.parent)
        attached.append(item)
    return attached


def _parse_range(source: Source, start: int, end: int, report: Reporter):
    try:
        return _parser().parse(source, start, end)
    except _UsageError as error:
        token = error.token
        notes = did_you_mean(token[_TEXT], USAGES)
        report.error(f"unknown usage annotation '{token[_TEXT]}': expected linear, affine or "
                     "unrestricted", Span(source, token[_START], token[_END]), *notes)
    except _LiteralError as error:
        token = error.token
        digits = len(token[_TEXT].lstrip("+-"))
        report.error(f"this integer literal has {digits:,} digits; a literal may have at most "
                     f"{MAX_LITERAL_DIGITS}", Span(source, token[_START], token[_END]))
    except _SyntaxError as error:
        _explain(error, source, start, end, report)
    return None


# Files parsed before, by (path, text): a module is immutable (tuples all through, its spans
# on the first Source of that text), so a file read again unchanged (each test, each API call,
# analyses the same library files again) is not parsed again. A file that does not parse is
# not kept: each call reports its errors afresh.
_PARSED: OrderedDict[tuple[str, str], Module] = OrderedDict()
_PARSED_FILES = 64
_PARSED_TEXT_CHARS = 1024 * 1024  # longer texts (generated schedules) are parsed every time
_PARSED_LOCK = threading.Lock()


def parse_source(source: Source) -> Module:
    """Parses one file; raises CompileError with every broken declaration's error."""
    key = (source.path, source.text)
    with _PARSED_LOCK:
        module = _PARSED.get(key)
        if module is not None:
            _PARSED.move_to_end(key)
            return module
    module = _parse_module(source)
    if len(source.text) <= _PARSED_TEXT_CHARS:
        with _PARSED_LOCK:
            _PARSED[key] = module
            while len(_PARSED) > _PARSED_FILES:
                _PARSED.popitem(last=False)
    return module


def _parse_module(source: Source) -> Module:
    report = Reporter()
    result = _parse_range(source, 0, len(source.text), report)
    if result is None:
        # Parse again declaration by declaration, so that each broken one is reported once.
        report = Reporter()
        items, docs = [], []
        for start, end in _declaration_ranges(source.text):
            piece = _parse_range(source, start, end, report)
            if piece is not None:
                items.extend(piece[0])
                docs.extend(piece[1])
        report.raise_if_errors()
    else:
        items, docs = result
    items = _attach_docs(items, docs, source)
    imports = tuple(item for item in items if isinstance(item, Import))
    declarations = tuple(item for item in items if isinstance(item, Declaration))
    return Module(source.path, imports, declarations)


def parse_text(text: str, path: str) -> Module:
    return parse_source(Source(path, text))


def comment_ranges(text: str) -> list[tuple[int, int]]:
    """(start, end) of every comment and documentation comment, in order."""
    comments: list[tuple[int, int, str]] = []
    try:
        for _ in _parser().tokens(text, 0, len(text), comments):
            pass
    except _SyntaxError:
        pass
    return [(start, end) for start, end, _ in comments]
