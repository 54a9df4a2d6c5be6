"""The seed excerpt is our reference sample: it parses, checks and compiles unchanged."""

from __future__ import annotations

import re

import pytest

from cgc.core.diagnostics import CompileError, render_all
from cgc.frontend.api import analyse, evaluate
from cgc.core.ir import format_program
from cgc.frontend.parse import _parser, parse_text
from cgc.frontend.syntax import Source

from conftest import SCHEDULES, SEED_DIR

PAGE_SENTENCE = re.compile(r"The compiler supplied declaration spans.*$", re.DOTALL)


def seed_files():
    files = sorted(SEED_DIR.glob("*.txt"))
    assert files, f"the seed excerpt is missing: expected it in {SEED_DIR}"
    return files


def schedule_from_excerpt(text: str) -> tuple[str, str]:
    """(documentation, declaration): line numbers and the page's closing sentence removed."""
    prose, code = [], []
    for line in text.splitlines():
        numbered = re.match(r"^(\d{4})(.*)$", line)
        if numbered:
            code.append(numbered.group(2))
        elif not code:
            prose.append(line)
        else:
            code.append(line)
    declaration = PAGE_SENTENCE.sub("", "\n".join(code)).rstrip() + "\n"
    return "\n".join(prose), declaration


def tokens(text: str) -> list[tuple[str, str]]:
    return [(kind, value) for kind, value, _, _ in _parser().tokens(text, 0, len(text))]


@pytest.fixture(params=seed_files(), ids=lambda p: p.name)
def excerpt(request):
    return schedule_from_excerpt(request.param.read_text(encoding="utf-8"))


def test_the_excerpt_parses_with_its_documentation(excerpt):
    prose, declaration = excerpt
    text = "".join(f"--- {line}\n" for line in prose.splitlines()) + declaration
    module = parse_text(text, "seed.cg")
    (backward,) = module.declarations
    assert backward.kind == "def" and backward.name.text == "cgBackward"
    assert backward.doc == prose
    assert backward.span.line == len(prose.splitlines()) + 1


def test_backward_cg_holds_the_excerpt_token_for_token(excerpt):
    prose, declaration = excerpt
    text = (SCHEDULES / "backward.cg").read_text(encoding="utf-8")
    start = text.index("def cgBackward")
    assert tokens(text[start:]) == tokens(declaration)
    module = parse_text(text, "backward.cg")
    (backward,) = [d for d in module.declarations if d.name.text == "cgBackward"]
    assert backward.doc == prose


def test_the_excerpt_checks_and_evaluates_as_backward_cg(excerpt, tmp_path):
    """Unchanged, beside the library it names, it gives the launch program of backward.cg."""
    prose, declaration = excerpt
    seed = tmp_path / "seed.cg"
    seed.write_text(f'import "{SCHEDULES / "library.cg"}"\n' + declaration, encoding="utf-8")
    reference = SCHEDULES / "backward.cg"
    for config in ("tiny", "gpt2"):
        try:
            ours = evaluate(analyse([str(seed)]), str(seed), config=config)
        except CompileError as error:
            pytest.fail(render_all(error.diagnostics))
        theirs = evaluate(analyse([str(reference)]), str(reference), config=config)
        strip = re.compile(r"  -- .*$", re.MULTILINE)  # source locations differ, nothing else
        assert strip.sub("", format_program(ours)).splitlines()[2:] == \
            strip.sub("", format_program(theirs)).splitlines()[2:]


def test_spans_point_into_the_excerpt(excerpt):
    _, declaration = excerpt
    module = parse_text(declaration, "seed.cg")
    (backward,) = module.declarations
    source = Source("seed.cg", declaration)
    name = backward.name
    assert (name.span.line, name.span.column) == (1, 5)
    assert source.text[name.span.start:name.span.end] == "cgBackward"
