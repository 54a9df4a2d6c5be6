"""Source text to syntax tree (Lark, LALR), with parse errors turned into diagnostics."""

from __future__ import annotations

import re
from functools import lru_cache

from lark import Lark, Token, Transformer, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedInput, UnexpectedToken

from .diagnostics import Note, Reporter, did_you_mean
from .resources import grammar_path
from .syntax import (
    Apply, Arrow, Clause, Declaration, Floating, Import, Integer, Lambda, Module, Name,
    Natural, Span,
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


class _UsageError(Exception):
    def __init__(self, token: Token):
        self.token = token


@v_args(inline=True)
class _Build(Transformer):
    """Builds syntax nodes during the parse; `path` and `line_offset` are set per parse."""

    path = "<input>"
    line_offset = 0

    def _span(self, first: Token, last) -> Span:
        if isinstance(last, Token):
            end_line, end_column = last.end_line + self.line_offset, last.end_column
        else:  # a node: its span already carries the offset
            end_line, end_column = last.span.end_line, last.span.end_column
        return Span(self.path, first.line + self.line_offset, first.column, end_line, end_column)

    def _name(self, token: Token) -> Name:
        return Name(str(token), self._span(token, token))

    def name(self, token):
        return self._name(token)

    def natural(self, token):
        return Natural(int(token), self._span(token, token))

    def integer(self, token):
        return Integer(int(token), self._span(token, token))

    def floating(self, token):
        return Floating(float(token), str(token), self._span(token, token))

    def group(self, open_paren, term, close_paren):
        return term

    def apply(self, open_paren, function, *rest):
        return Apply(function, tuple(rest[:-1]), self._span(open_paren, rest[-1]))

    def lambda_(self, open_paren, usage, binder, binder_type, body, close_paren):
        if str(usage) not in USAGES:
            raise _UsageError(usage)
        return Lambda(str(usage), self._name(binder), binder_type, body,
                      self._span(open_paren, close_paren))

    def arrow(self, open_paren, *rest):
        return Arrow(tuple(rest[:-1]), self._span(open_paren, rest[-1]))

    def clause(self, open_paren, keyword, *rest):
        return Clause(self._name(keyword), tuple(rest[:-1]), self._span(open_paren, rest[-1]))

    def import_decl(self, keyword, path):
        return Import(str(path)[1:-1], self._span(keyword, path))

    def _declaration(self, keyword, name, *rest):
        span = self._span(keyword, rest[-1] if rest else name)
        parent = None
        if rest and isinstance(rest[0], Token):  # config NAME from PARENT
            parent, rest = self._name(rest[0]), rest[1:]
        terms = tuple(item for item in rest if not isinstance(item, Clause))
        clauses = tuple(item for item in rest if isinstance(item, Clause))
        return Declaration(str(keyword), self._name(name), terms, clauses, None, span, parent)

    def_decl = constant_decl = config_decl = buffer_decl = bank_decl = _declaration
    entry_decl = arena_decl = phase_decl = image_decl = _declaration

    def start(self, *items):
        return list(items)


class _Parser:
    """One LALR parser with its transformer, reused for every file."""

    def __init__(self):
        self.comments: list[Token] = []
        self.builder = _Build()
        self.lark = Lark(
            grammar_path().read_text(encoding="utf-8"),
            parser="lalr",
            propagate_positions=True,
            maybe_placeholders=False,
            transformer=self.builder,
            lexer_callbacks={"DOC_COMMENT": self.comments.append},
        )

    def parse(self, text: str, path: str, line_offset: int = 0):
        self.builder.path = path
        self.builder.line_offset = line_offset
        self.comments.clear()
        items = self.lark.parse(text)
        docs = [(token.line + line_offset, str(token)) for token in self.comments]
        return items, docs


@lru_cache(maxsize=1)
def _parser() -> _Parser:
    return _Parser()


def _last_character_span(text: str, path: str, line_offset: int) -> Span:
    stripped = text.rstrip()
    if not stripped:
        return Span(path, 1 + line_offset, 1, 1 + line_offset, 2)
    line = stripped.count("\n") + 1
    column = len(stripped) - (stripped.rfind("\n") + 1)
    return Span(path, line + line_offset, column, line + line_offset, column + 1)


def _open_parentheses(text: str, upto: int) -> list[tuple[int, bool]]:
    """(offset, is_lambda) of each parenthesis still open before `upto`, innermost last."""
    stack: list[tuple[int, bool]] = []
    for match in re.finditer(r"--[^\n]*|\"[^\"\n]*\"|[()]|lambda\b", text[:upto]):
        word = match.group()
        if word == "(":
            stack.append((match.start(), False))
        elif word == ")":
            if stack:
                stack.pop()
        elif word == "lambda" and stack and match.start() == _after_paren(text, stack[-1][0]):
            stack[-1] = (stack[-1][0], True)
    return stack


def _after_paren(text: str, offset: int) -> int:
    position = offset + 1
    while position < len(text) and text[position] in " \t\r\n":
        position += 1
    return position


def _offset_span(text: str, offset: int, path: str, line_offset: int, width: int = 1) -> Span:
    line = text.count("\n", 0, offset) + 1
    column = offset - (text.rfind("\n", 0, offset) + 1) + 1
    return Span(path, line + line_offset, column, line + line_offset, column + width)


def _enclosing_keyword(text: str, upto: int) -> str | None:
    matches = list(_DECLARATION_START.finditer(text, 0, upto))
    return matches[-1].group() if matches else None


def _describe_expected(expected: set[str]) -> str:
    words = sorted({_TERMINAL_WORDS.get(t, f"'{t.lower()}'") for t in expected})
    if len(words) > 6:
        return "a term or a declaration"
    return ", ".join(words[:-1]) + (" or " if len(words) > 1 else "") + words[-1]


def _explain(error: UnexpectedInput, text: str, path: str, line_offset: int, report: Reporter,
             last_piece: bool):
    """Turns one Lark error into one diagnostic, matching the common mistakes first."""
    if isinstance(error, UnexpectedCharacters):
        span = _offset_span(text, error.pos_in_stream, path, line_offset)
        report.error(f"unexpected character {text[error.pos_in_stream]!r}", span)
        return
    assert isinstance(error, UnexpectedToken)
    token = error.token
    at_end = token.type == "$END"
    offset = len(text.rstrip()) if at_end else token.start_pos
    span = (_last_character_span(text, path, line_offset) if at_end
            else _offset_span(text, offset, path, line_offset, max(len(str(token)), 1)))
    found = "end of file" if at_end else repr(str(token))
    expected = set(error.expected)
    open_parens = _open_parentheses(text, offset)
    keyword = _enclosing_keyword(text, offset)

    def opener_note(message="the parenthesis opened here"):
        where = open_parens[-1][0]
        return Note(message, _offset_span(text, where, path, line_offset))

    starts_declaration = not at_end and str(token) in DECLARATION_KEYWORDS and token.column == 1
    if open_parens and (at_end or starts_declaration):
        before = (f"the next declaration '{token}'" if not at_end
                  else "the end of the file" if last_piece else "the next declaration")
        report.error(f"unclosed parenthesis: expected ')' before {before}", span, opener_note())
    elif token.type == "RPAR" and not open_parens:
        report.error("unmatched ')': there is no '(' open here", span)
    elif token.type == "RPAR" and expected & {"NAME", "NAT", "LPAR"} and text[:offset].rstrip().endswith("("):
        report.error("empty parentheses: expected a term after '('", span)
    elif open_parens and open_parens[-1][1] and expected == {"DOT"}:
        report.error(f"lambda is missing the '.' between its binder's type and its body (found {found})",
                     span, opener_note("the lambda starts here"))
    elif open_parens and open_parens[-1][1] and token.type == "COLON" and "NAME" in expected:
        report.error("lambda needs a usage annotation before its binder: linear, affine or "
                     "unrestricted, as in (lambda unrestricted i : Nat . body)", span,
                     opener_note("the lambda starts here"))
    elif keyword == "def" and "EQUAL" in expected and not open_parens:
        report.error(f"a def needs '=' between its type and its body (found {found})", span,
                     Note("the form is: def NAME : TYPE = TERM"))
    elif keyword == "def" and expected == {"COLON"}:
        report.error(f"a def needs a type after its name (found {found})", span,
                     Note("the form is: def NAME : TYPE = TERM"))
    elif not open_parens and keyword is None or (expected >= {"DEF", "IMPORT"} and not open_parens):
        report.error(f"expected a declaration ({', '.join(DECLARATION_KEYWORDS)}), found {found}",
                     span)
    else:
        report.error(f"unexpected {found}: expected {_describe_expected(expected)}", span)


def _split_declarations(text: str) -> list[tuple[int, str]]:
    """(line offset, text) chunks, each starting at a declaration keyword in column 1."""
    starts = [m.start() for m in _DECLARATION_START.finditer(text)]
    if not starts or starts[0] != 0:
        starts.insert(0, 0)
    chunks = []
    for begin, end in zip(starts, starts[1:] + [len(text)]):
        chunks.append((text.count("\n", 0, begin), text[begin:end]))
    return chunks


def _attach_docs(items, docs: list[tuple[int, str]]):
    by_line = {line: body for line, body in docs}
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


def _parse_piece(text: str, path: str, line_offset: int, report: Reporter,
                 last_piece: bool = True):
    parser = _parser()
    try:
        return parser.parse(text, path, line_offset)
    except _UsageError as error:
        token = error.token
        span = Span(path, token.line + line_offset, token.column,
                    token.end_line + line_offset, token.end_column)
        notes = [note for note in [did_you_mean(str(token), USAGES)] if note]
        report.error(f"unknown usage annotation '{token}': expected linear, affine or "
                     "unrestricted", span, *notes)
        return None
    except UnexpectedInput as error:
        _explain(error, text, path, line_offset, report, last_piece)
        return None


def parse_text(text: str, path: str) -> Module:
    """Parses one file; raises CompileError with every declaration's parse error."""
    report = Reporter()
    result = _parse_piece(text, path, 0, report)
    if result is None:
        # Re-parse declaration by declaration so that each broken one is reported once.
        report = Reporter()
        items, docs = [], []
        chunks = _split_declarations(text)
        for index, (line_offset, chunk) in enumerate(chunks):
            piece = _parse_piece(chunk, path, line_offset, report, index == len(chunks) - 1)
            if piece is not None:
                items.extend(piece[0])
                docs.extend(piece[1])
        report.raise_if_errors()
    else:
        items, docs = result
    items = _attach_docs(items, docs)
    imports = tuple(item for item in items if isinstance(item, Import))
    declarations = tuple(item for item in items if isinstance(item, Declaration))
    return Module(path, imports, declarations)
