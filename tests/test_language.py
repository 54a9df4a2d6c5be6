"""The surface language: every form the grammar accepts, its nodes and their spans."""

from __future__ import annotations

import pytest

from cgc.core.diagnostics import CompileError
from cgc.frontend.api import analyse, evaluate
from cgc.frontend.parse import parse_text
from cgc.frontend.syntax import Apply, Arrow, Floating, Integer, Lambda, Name, Natural, walk

SAMPLE = """\
-- an ordinary comment
--- First line of the documentation,
--- and its second line.
def cgThree : Nat = (naturalAdd 1 2)
def cgNegative : Int = -12
def cgScale : Float = 2.5e-3
def cgIncrement : (Nat -> Nat) = (lambda affine n : Nat . (naturalAdd n 1))
config tiny from base (cgRows 4) (low float32)
buffer cgLogits float32 (naturalMultiply cgRows 8) (stack 3)
image cgImageCopy (block 32 1 1)
  (pointer 0 output float32 write gridX)
  (scalar 0 scale float32 1.0)
"""


def declarations(text=SAMPLE):
    return {d.name.text: d for d in parse_text(text, "sample.cg").declarations}


def test_literals_of_each_kind():
    found = declarations()
    assert found["cgNegative"].terms[1] == Integer(-12, found["cgNegative"].terms[1].span)
    scale = found["cgScale"].terms[1]
    assert isinstance(scale, Floating) and scale.value == 2.5e-3 and scale.text == "2.5e-3"
    three = found["cgThree"].terms[1]
    assert isinstance(three, Apply) and [a.value for a in three.arguments] == [1, 2]


def test_documentation_comments_attach_to_the_next_declaration_only():
    found = declarations()
    assert found["cgThree"].doc == "First line of the documentation,\nand its second line."
    assert found["cgNegative"].doc is None


def test_function_types_and_usage_annotations():
    increment = declarations()["cgIncrement"]
    assert isinstance(increment.terms[0], Arrow) and len(increment.terms[0].parts) == 2
    body = increment.terms[1]
    assert isinstance(body, Lambda) and body.usage == "affine" and body.binder.text == "n"


def test_declaration_forms_keep_their_parts():
    found = declarations()
    config = found["tiny"]
    assert config.kind == "config" and config.parent.text == "base"
    assert [c.keyword.text for c in config.clauses] == ["cgRows", "low"]
    buffer = found["cgLogits"]
    assert buffer.kind == "buffer" and buffer.terms[0].text == "float32"
    assert buffer.clauses[0].keyword.text == "stack"
    image = found["cgImageCopy"]
    assert [c.keyword.text for c in image.clauses] == ["block", "pointer", "scalar"]


def test_every_node_has_a_span_that_covers_its_text():
    source = SAMPLE
    for declaration in parse_text(source, "sample.cg").declarations:
        for term in declaration.terms:
            for node in walk(term):
                text = source[node.span.start:node.span.end]
                if isinstance(node, Name):
                    assert text == node.text
                elif isinstance(node, Natural):
                    assert int(text) == node.value
                elif isinstance(node, (Apply, Lambda, Arrow)):
                    assert text.startswith("(") and text.endswith(")")


def test_spans_give_lines_and_columns():
    increment = declarations()["cgIncrement"]
    binder = increment.terms[1].binder
    assert (binder.span.line, binder.span.column, binder.span.end_column) == (7, 49, 50)
    assert str(binder.span) == "sample.cg:7:49"


def test_declaration_keywords_are_names_inside_terms():
    text = "def cgUse : (Entry -> Entry) = (lambda unrestricted entry : Entry . entry)\n"
    (use,) = parse_text(text, "names.cg").declarations
    assert use.terms[1].binder.text == "entry"


def test_imports_share_one_namespace(tmp_path):
    (tmp_path / "a.cg").write_text("constant cgRows : Nat = 3\nconfig only\n")
    (tmp_path / "b.cg").write_text('import "a.cg"\ndef cgSix : Nat = (naturalMultiply cgRows 2)\n'
                                   'phase p (stage forward)\n'
                                   'def cgStep : Schedule = (cgPhase p cgNothing)\n')
    path = str(tmp_path / "b.cg")
    frontend = analyse([path])
    assert {"cgRows", "cgSix", "cgStep"} <= set(frontend.scope.declarations)
    assert evaluate(frontend, path).entry == "cgStep"


def test_an_import_cycle_loads_each_file_once(tmp_path):
    (tmp_path / "a.cg").write_text('import "b.cg"\nconstant cgA : Nat = 1\nconfig c\n')
    (tmp_path / "b.cg").write_text('import "a.cg"\ndef cgB : Nat = cgA\n')
    frontend = analyse([str(tmp_path / "a.cg")])
    assert len(frontend.modules) == 2


@pytest.mark.parametrize("body,message", [
    ("(lambda linear b : (Buffer float32) . cgNothing)", "never used"),
    ("(lambda affine b : (Buffer float32) . (cgThen (f b) (f b)))", "used 2 times"),
])
def test_usage_annotations_are_checked(body, message, tmp_path):
    text = ("phase p (stage forward)\nconfig c\n"
            "def f : ((Buffer float32) -> Schedule) = (lambda unrestricted b : (Buffer float32) . "
            "cgNothing)\n"
            f"def g : ((Buffer float32) -> Schedule) = {body}\n")
    path = tmp_path / "usage.cg"
    path.write_text(text)
    with pytest.raises(CompileError) as error:
        analyse([str(path)])
    assert any(message in d.message for d in error.value.diagnostics)


def test_affine_binder_used_once_and_linear_used_once_are_accepted(tmp_path):
    path = tmp_path / "ok.cg"
    path.write_text("config c\ndef twice : (Nat -> Nat -> Nat) = (lambda linear a : Nat . "
                    "(lambda affine b : Nat . (naturalAdd a b)))\n"
                    "def none : (Nat -> Nat) = (lambda affine a : Nat . 0)\n")
    analyse([str(path)])


def test_the_language_reference_lists_every_built_in_with_its_type():
    from cgc.frontend.builtins import PRIMITIVES
    from conftest import ROOT
    reference = (ROOT / "docs" / "language.md").read_text(encoding="utf-8")
    for name, signature in PRIMITIVES.items():
        assert f"| `{name}` | `{signature}` |" in reference, name
