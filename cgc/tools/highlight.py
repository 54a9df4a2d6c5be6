"""A Pygments lexer for .cg schedules (`pygmentize -l cg FILE`), used by `cgc doc`."""

from __future__ import annotations

from pygments.lexer import RegexLexer, words
from pygments.token import (
    Comment, Keyword, Name, Number, Operator, Punctuation, String, Text, Whitespace,
)

from ..frontend.builtins import ELEMENT_NAMES, PRIMITIVES, TYPE_NAMES
from ..frontend.parse import DECLARATION_KEYWORDS, USAGES


class CgLexer(RegexLexer):
    """The cgc schedule language."""

    name = "cg"
    aliases = ["cg", "cgc"]
    filenames = ["*.cg"]
    mimetypes = ["text/x-cg"]

    tokens = {
        "root": [
            (r"---[^\n]*", String.Doc),
            (r"--[^\n]*", Comment.Single),
            (r"\s+", Whitespace),
            (r'"[^"\n]*"', String),
            (words(DECLARATION_KEYWORDS, prefix=r"(?m)^", suffix=r"\b"), Keyword.Declaration),
            (words(("lambda", "from"), suffix=r"\b"), Keyword),
            (words(USAGES, suffix=r"\b"), Keyword.Pseudo),
            (words(TYPE_NAMES + ELEMENT_NAMES, suffix=r"\b"), Keyword.Type),
            (words(tuple(PRIMITIVES), suffix=r"\b"), Name.Builtin),
            (r"[+-]?[0-9]+\.[0-9]+([eE][+-]?[0-9]+)?|[+-]?[0-9]+[eE][+-]?[0-9]+", Number.Float),
            (r"[+-][0-9]+|[0-9]+", Number.Integer),
            (r"->", Operator),
            (r"[():=.]", Punctuation),
            (r"[A-Za-z_][A-Za-z0-9_']*", Name),
            (r".", Text),
        ],
    }
