"""Random token-level mutations of every schedule never crash the compiler.

Each mutated file either passes or gives diagnostics: no Python traceback, whatever the
input. The other schedule files sit beside the mutated one, so imports still resolve.
"""

from __future__ import annotations

import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cgc.core.diagnostics import CompileError, render_all
from cgc.frontend.api import analyse, evaluate
from cgc.frontend.parse import _parser

from conftest import SCHEDULES

FILES = sorted(SCHEDULES.glob("*.cg"))
# Tokens worth splicing in: brackets, literals, keywords, and names the schedules use.
EXTRA = ["(", ")", "0", "1", "-1", "2.5", "lambda", "linear", "affine", ".", ":", "=", "->",
         "\ndef", "\nimage", "naturalMultiply", "cgItem", "nvidiaAffineLaunchRepeat", '"x.cg"',
         "Nat", "(Buffer low)", "$", "--- doc\n"]


def pieces(text: str) -> list[str]:
    """The file as tokens and the text between them, so that joining gives it back."""
    parts, last = [], 0
    for _, _, start, end in _parser().tokens(text, 0, len(text)):
        parts.append(text[last:start])
        parts.append(text[start:end])
        last = end
    parts.append(text[last:])
    return parts


def mutate(parts: list[str], data) -> str:
    parts = list(parts)
    for _ in range(data.draw(st.integers(1, 3))):
        index = data.draw(st.integers(1, len(parts) - 2))
        action = data.draw(st.sampled_from(["delete", "duplicate", "replace", "swap"]))
        if action == "delete":
            parts[index] = ""
        elif action == "duplicate":
            parts[index] = parts[index] + " " + parts[index]
        elif action == "replace":
            vocabulary = data.draw(st.sampled_from(["extra", "file"]))
            choice = (st.sampled_from(EXTRA) if vocabulary == "extra"
                      else st.sampled_from(parts[1::2] or ["x"]))
            parts[index] = data.draw(choice)
        else:
            other = data.draw(st.integers(1, len(parts) - 2))
            parts[index], parts[other] = parts[other], parts[index]
    return "".join(parts)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    folder = tmp_path_factory.mktemp("schedules")
    for path in FILES:
        shutil.copy(path, folder / path.name)
    return folder


@pytest.mark.parametrize("name", [p.name for p in FILES])
@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_mutations_give_diagnostics_never_a_traceback(name, workspace, data):
    original = (SCHEDULES / name).read_text(encoding="utf-8")
    target = workspace / name
    target.write_text(mutate(pieces(original), data), encoding="utf-8")
    entry_file = str(workspace / "train.cg")
    try:
        frontend = analyse([str(target), entry_file])
        for config in frontend.configs or [None]:
            for path in (str(target), entry_file):
                if frontend.default_entry(path):
                    evaluate(frontend, path, config=config)
    except CompileError as error:
        text = render_all(error.diagnostics)
        assert error.diagnostics and "error" in text
    finally:
        target.write_text(original, encoding="utf-8")
