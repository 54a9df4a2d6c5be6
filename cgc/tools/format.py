"""`cgc fmt`: one canonical layout for schedules.

Declarations start in column 1; what does not fit in WIDTH columns breaks after the head
of an application, each further argument on its own line two columns in; a lambda breaks
after its dot. Comments and documentation comments between declarations are kept as they
are, runs of blank lines become one, and a declaration with a comment inside it is kept as
written. Only layout changes: the tokens, and so the program, stay the same.
"""

from __future__ import annotations

from ..frontend.parse import comment_ranges, parse_text
from ..outputs import write_file
from ..frontend.syntax import (
    Apply, Arrow, Clause, Floating, Import, Integer, Lambda, Name, Natural,
)

WIDTH = 100
INDENT = 2


def flat(term) -> str:
    """A term on one line."""
    if isinstance(term, Name):
        return term.text
    if isinstance(term, Natural):
        return str(term.value)
    if isinstance(term, Integer):
        return f"{term.value:+d}"
    if isinstance(term, Floating):
        return term.text
    if isinstance(term, Apply):
        return "(" + " ".join(flat(t) for t in (term.function, *term.arguments)) + ")"
    if isinstance(term, Lambda):
        return (f"(lambda {term.usage} {term.binder.text} : {flat(term.binder_type)} . "
                f"{flat(term.body)})")
    if isinstance(term, Arrow):
        return "(" + " -> ".join(flat(p) for p in term.parts) + ")"
    if isinstance(term, Clause):
        return "(" + " ".join([term.keyword.text, *(flat(a) for a in term.arguments)]) + ")"
    raise TypeError(term)


def _atomic(term) -> bool:
    return isinstance(term, (Name, Natural, Integer, Floating))


def layout(term, column: int, trailing: int = 0) -> str:
    """The term starting at `column`, broken over lines where it does not fit; `trailing`
    characters (closing parentheses of the terms around it) follow it on its last line."""
    text = flat(term)
    if column + len(text) + trailing <= WIDTH or _atomic(term):
        return text
    inner = column + INDENT
    pad = " " * inner
    if isinstance(term, Arrow):  # parts filled onto lines, each further line led by ->
        parts = [flat(p) for p in term.parts]
        lines, current = [], "(" + parts[0]
        for part in parts[1:]:
            if len(current) + column + 4 + len(part) + trailing + 1 <= WIDTH:
                current += " -> " + part
            else:
                lines.append(current)
                current = pad + "-> " + part
        return "\n".join(lines + [current]) + ")"
    if isinstance(term, Lambda):
        head = f"(lambda {term.usage} {term.binder.text} : {flat(term.binder_type)} ."
        return f"{head}\n{pad}{layout(term.body, inner, trailing + 1)})"
    if isinstance(term, Clause):
        head, arguments = term.keyword.text, list(term.arguments)
    else:
        head, arguments = layout(term.function, column + 1), list(term.arguments)
    first = "(" + head
    # Arguments stay on the head's line while they fit, all but the last: the last, most
    # often the rest of a chain, starts a line of its own.
    while len(arguments) > 1 and "\n" not in first and \
            column + len(first) + 1 + len(flat(arguments[0])) <= WIDTH:
        first += " " + flat(arguments.pop(0))
    lines = [first] + [pad + layout(argument, inner, trailing + 1 if last else 0)
                       for last, argument in ((i == len(arguments) - 1, a)
                                              for i, a in enumerate(arguments))]
    return "\n".join(lines) + ")"


def _continued(head: str, pieces: list) -> str:
    """A declaration's head, then its pieces, filled onto lines two columns in."""
    text = head + "".join(" " + flat(p) for p in pieces)
    if len(text) <= WIDTH:
        return text
    lines, current = [], head
    for piece in pieces:
        word = flat(piece)
        if len(current) + 1 + len(word) <= WIDTH:
            current += " " + word
        else:
            lines.append(current)
            current = " " * INDENT + layout(piece, INDENT) if len(word) + INDENT > WIDTH \
                else " " * INDENT + word
    lines.append(current)
    return "\n".join(lines)


def declaration_text(item) -> str:
    if isinstance(item, Import):
        return f'import "{item.path}"'
    name = item.name.text
    if item.kind == "def":
        type_text, body = flat(item.terms[0]), item.terms[1]
        head = f"def {name} : {type_text} ="
        one_line = f"{head} {flat(body)}"
        if len(one_line) <= WIDTH:
            return one_line
        if len(head) > WIDTH:  # a long type gets a line (or more) of its own
            head = f"def {name} :\n{' ' * INDENT}{layout(item.terms[0], INDENT, 2)} ="
        return f"{head}\n{' ' * INDENT}{layout(body, INDENT)}"
    if item.kind == "constant":
        text = f"constant {name} : {flat(item.terms[0])}"
        return text + (f" = {flat(item.terms[1])}" if len(item.terms) > 1 else "")
    if item.kind == "image":
        clauses = list(item.clauses)
        head = f"image {name}"
        if clauses and clauses[0].keyword.text in ("block", "library", "collective"):
            head += " " + flat(clauses.pop(0))
        return "\n".join([head] + [" " * INDENT + layout(c, INDENT) for c in clauses])
    head = f"{item.kind} {name}" + (f" from {item.parent.text}" if item.parent else "")
    return _continued(head, [*item.terms, *item.clauses])


def format_text(text: str, path: str = "<input>") -> str:
    """The canonical layout of a file; raises CompileError if it does not parse."""
    module = parse_text(text, path)
    items = sorted([*module.imports, *module.declarations], key=lambda item: item.span.start)
    comments = comment_ranges(text)
    out: list[str] = []
    previous_end = 0

    def trivia(start: int, end: int) -> None:
        """The comments and blank lines between two items (`end` starts a line), kept."""
        pieces = text[start:end].split("\n")
        # The first piece ends the previous item's line (unless the file starts here); the
        # last begins the next item's.
        if start == 0:
            lines = pieces[:-1]
        else:
            lines = pieces[1:-1]
            if pieces[0].strip():  # a comment after an item, on its line
                out[-1] += " " + pieces[0].strip()
        blank = False
        for line in lines:
            stripped = line.strip()
            if not stripped:
                blank = True
                continue
            if blank and out:
                out.append("")
            blank = False
            out.append(stripped)
        if blank and out:
            out.append("")

    for item in items:
        start = item.span.start
        # A declaration's documentation lines belong to the trivia before it.
        line_start = text.rfind("\n", 0, start) + 1
        trivia(previous_end, line_start)
        inside = any(item.span.start <= c < item.span.end for c, _ in comments)
        out.append(text[line_start:item.span.end] if inside else declaration_text(item))
        previous_end = item.span.end
    trivia(previous_end, len(text))
    while out and out[-1] == "":
        out.pop()
    return "\n".join(out) + "\n"


def replace_file(path: str, text: str) -> None:
    """Replaces a file's content with `text` by cgc's one writer (cgc/outputs.py): a
    temporary file beside it, flushed, given the file's mode and owner, renamed onto it; the
    file is always the old bytes or the new, whole, even if cgc is killed. A symbolic link
    is followed (its target rewritten, the link kept); a read-only file is refused."""
    write_file(path, text)
