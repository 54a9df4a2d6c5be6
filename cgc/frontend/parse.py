"""Source text to syntax tree, with parse errors turned into diagnostics.

Lark builds the LALR(1) table from grammar/cg.lark; a small driver here runs it. The
lexer is one regular expression made from the grammar's own terminals, in Lark's order of
precedence; tokens are tuples and each reduction builds a syntax node directly. This is
several times faster than Lark's general-purpose front end, which matters for large
generated schedules.
"""

from __future__ import annotations

import re
from functools import lru_cache

from lark import Lark
from lark.parsers.lalr_analysis import Shift

from ..core.diagnostics import Note, Reporter, did_you_mean
from ..resources import grammar_path
from .syntax import (
    Apply, Arrow, Clause, Declaration, Floating, Import, Integer, Lambda, Module, Name,
    Natural, Source, Span,
)

USAGES = ("linear", "affine", "unrestricted")
DECLARATION_KEYWORDS = (
    "import", "def", "constant", "config", "buffer", "bank", "entry", "arena", "phase", "image",
)
_DECLARATION_START = re.compile(rf"^(?:{'|'.join(DECLARATION_KEYWORDS)})\b", re.MULTILINE)

# How each terminal is named in "expected ..." messages.
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


class _SyntaxError(Exception):
    """The offending token (None for a character no terminal matches) and what was expected."""

    def __init__(self, token, expected: set[str], offset: int):
        self.token, self.expected, self.offset = token, expected, offset


class _Parser:
    def __init__(self):
        lark = Lark(grammar_path().read_text(encoding="utf-8"), parser="lalr", lexer="basic")
        # Lark's own order of precedence among terminals, so that both lexers agree.
        terminals = sorted(lark.terminals, key=lambda t: (-t.priority, -t.pattern.max_width,
                                                          -len(t.pattern.value), t.name))
        # Words such as `lambda` match NAME too; like Lark, retype them after the match.
        self.keywords = {str(t.pattern.value): str(t.name) for t in lark.terminals
                         if t.pattern.type == "str" and re.fullmatch(r"[a-z]+", t.pattern.value)}
        self.ignored = frozenset(map(str, lark.ignore_tokens)) - {"WS"}
        # Whitespace is folded into the next match: one regex match per token.
        self.regex = re.compile(r"[ \t\f\r\n]*(?:" + "|".join(
            f"(?P<{t.name}>{t.pattern.to_regexp()})"
            for t in terminals if t.name not in self.keywords.values() and t.name != "WS")
            + r"|(?P<WS>$))")
        table = lark.parser.parser.parser.parse_table
        callbacks = {id(rule): (len(rule.expansion), str(rule.origin.name), self._callback(rule))
                     for rule in lark.rules}
        # state -> terminal -> next state (a shift: an int) or (size, origin, callback)
        self.actions = {
            state: {str(kind): (target if action is Shift else callbacks[id(target)])
                    for kind, (action, target) in row.items() if kind.isupper() or kind == "$END"}
            for state, row in table.states.items()}
        self.gotos = {state: {str(kind): target for kind, (action, target) in row.items()
                              if not (kind.isupper() or kind == "$END")}
                      for state, row in table.states.items()}
        self.start_state = table.start_states["start"]
        self.end_state = table.end_states["start"]
        self.source: Source | None = None
        self.docs: list[tuple[int, str]] = []
        self.comments: list[tuple[int, int]] = []

    # ---- lexing ------------------------------------------------------------------

    def tokens(self, text: str, start: int, end: int):
        keywords, ignored, docs = self.keywords, self.ignored, self.docs
        position = start
        for found in self.regex.finditer(text, start, end):
            if found.start() != position:
                break
            kind, position = found.lastgroup, found.end()
            if kind == "WS":  # trailing whitespace
                continue
            begin = found.start(kind)
            if kind in ignored:
                self.comments.append((begin, position))
                if kind == "DOC_COMMENT":
                    docs.append((begin, text[begin:position]))
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
        self.source, self.docs = source, []
        actions, gotos, end_state = self.actions, self.gotos, self.end_state
        state_stack, value_stack = [self.start_state], []
        for token in self.tokens(source.text, start, end):
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
                size, origin, callback = action
                if size:
                    children = value_stack[-size:]
                    del state_stack[-size:]
                    del value_stack[-size:]
                else:
                    children = []
                value_stack.append(callback(children))
                state_stack.append(gotos[state_stack[-1]][origin])
                if state_stack[-1] == end_state:
                    return value_stack[-1], self.docs
        raise AssertionError("the LALR driver ended without accepting")

    # ---- building nodes ----------------------------------------------------------

    def _span(self, first, last) -> Span:
        # Tokens are tuples; syntax nodes are not.
        end = last[_END] if last.__class__ is tuple else last.span.end
        return Span(self.source, first[_START], end)

    def _name(self, token) -> Name:
        return Name(token[_TEXT], Span(self.source, token[_START], token[_END]))

    def _callback(self, rule):
        origin, alias = rule.origin.name, rule.alias
        if origin.startswith("__"):  # Lark's helper rules for `x*` and `x+`: flat lists
            def repeat(children):
                if children and children[0].__class__ is list:
                    children[0].extend(children[1:])
                    return children[0]
                return children
            return repeat
        if origin == "_item":
            return lambda children: children[0]
        if origin == "start":
            return lambda children: children[0] if children else []
        return getattr(self, f"_build_{alias or origin}")

    def _build_name(self, children):
        return self._name(children[0])

    def _build_natural(self, children):
        token = children[0]
        return Natural(int(token[_TEXT]), self._span(token, token))

    def _build_integer(self, children):
        token = children[0]
        return Integer(int(token[_TEXT]), self._span(token, token))

    def _build_floating(self, children):
        token = children[0]
        return Floating(float(token[_TEXT]), token[_TEXT], self._span(token, token))

    def _build_group(self, children):
        return children[1]

    def _build_apply(self, children):
        return Apply(children[1], tuple(children[2]), self._span(children[0], children[-1]))

    def _build_lambda_(self, children):
        _, _, usage, binder, _, binder_type, _, body, close = children
        if usage[_TEXT] not in USAGES:
            raise _UsageError(usage)
        return Lambda(usage[_TEXT], self._name(binder), binder_type, body,
                      self._span(children[0], close))

    def _build_arrow(self, children):
        parts = [children[1]] + [part for part in children[2] if part.__class__ is not tuple]
        return Arrow(tuple(parts), self._span(children[0], children[-1]))

    def _build_clause(self, children):
        arguments = tuple(children[2]) if len(children) == 4 else ()
        return Clause(self._name(children[1]), arguments, self._span(children[0], children[-1]))

    def _build_import_decl(self, children):
        keyword, path = children
        return Import(path[_TEXT][1:-1], self._span(keyword, path))

    def _build_declaration(self, children):
        flat = []
        for child in children:
            flat.extend(child) if child.__class__ is list else flat.append(child)
        keyword, name, *rest = flat
        span = self._span(keyword, rest[-1] if rest else name)
        parent = None
        if rest and rest[0].__class__ is tuple and rest[0][_TYPE] == "FROM":
            parent, rest = self._name(rest[1]), rest[2:]
        rest = [item for item in rest if item.__class__ is not tuple]  # drop ':' and '='
        terms = tuple(item for item in rest if not isinstance(item, Clause))
        clauses = tuple(item for item in rest if isinstance(item, Clause))
        return Declaration(keyword[_TEXT], self._name(name), terms, clauses, None, span, parent)

    _build_def_decl = _build_constant_decl = _build_config_decl = _build_declaration
    _build_buffer_decl = _build_bank_decl = _build_entry_decl = _build_declaration
    _build_arena_decl = _build_phase_decl = _build_image_decl = _build_declaration


@lru_cache(maxsize=1)
def _parser() -> _Parser:
    return _Parser()


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
    except _SyntaxError as error:
        _explain(error, source, start, end, report)
    return None


def parse_source(source: Source) -> Module:
    """Parses one file; raises CompileError with every broken declaration's error."""
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
    parser = _parser()
    parser.comments, parser.docs = [], []
    try:
        for _ in parser.tokens(text, 0, len(text)):
            pass
    except _SyntaxError:
        pass
    return list(parser.comments)
