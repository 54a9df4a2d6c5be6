"""Bad inputs and the exact diagnostics they give (golden files in tests/diagnostics/)."""

from __future__ import annotations

import os

import pytest

from cgc.diagnostics import CompileError, render_all
from cgc.frontend import analyse, evaluate

from conftest import ROOT

CASES = sorted(p for p in (ROOT / "tests" / "diagnostics").glob("*.cg")
               if not p.name.startswith("_"))


def diagnose(path: str) -> str:
    """Everything the front end says about a file: its errors, or its warnings."""
    try:
        frontend = analyse([path])
        evaluate(frontend, path)
    except CompileError as error:
        return render_all(error.diagnostics) + "\n"
    return "no diagnostics\n"


@pytest.mark.parametrize("case", CASES, ids=[p.stem for p in CASES])
def test_bad_input_gives_its_golden_diagnostics(case, golden, monkeypatch):
    monkeypatch.chdir(ROOT)
    text = diagnose(os.path.relpath(case, ROOT))
    assert "error" in text, "every case here is a bad input"
    assert "Traceback" not in text
    golden(case.with_suffix(".expected"), text)


def test_there_are_enough_cases():
    assert len(CASES) >= 15
