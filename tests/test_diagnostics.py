"""Bad inputs and the exact diagnostics they give.

tests/diagnostics/ holds front-end mistakes (syntax, names, types, evaluation) and
tests/checker/ the launches the static checker refuses; each NAME.cg sits beside
NAME.expected, what cgc prints for it.
"""

from __future__ import annotations

import os
import re

import pytest

from cgc.core.diagnostics import CompileError, render_all
from cgc.pipeline import analyse, check, evaluate

from conftest import ROOT

FRONT_END = sorted(p for p in (ROOT / "tests" / "diagnostics").glob("*.cg")
                   if not p.name.startswith("_"))
CHECKER = sorted(p for p in (ROOT / "tests" / "checker").glob("*.cg")
                 if not p.name.startswith("_"))
CASES = FRONT_END + CHECKER


# A case checked as one rank of a data-parallel run says so on a line of its own.
RANKS = re.compile(r"^-- checked as rank (\d+) of (\d+)$", re.MULTILINE)


def diagnose(path: str) -> str:
    """Everything the front end says about a file: its errors, or its warnings."""
    found = RANKS.search(open(path, encoding="utf-8").read())
    ranks = (int(found[1]), int(found[2])) if found else (0, 1)
    try:
        frontend = analyse([path])
        warnings = check(evaluate(frontend, path, ranks=ranks))
    except CompileError as error:
        return render_all(error.diagnostics) + "\n"
    return render_all(warnings) + "\n" if warnings else "no diagnostics\n"


@pytest.mark.parametrize("case", CASES, ids=[f"{p.parent.name}/{p.stem}" for p in CASES])
def test_bad_input_gives_its_golden_diagnostics(case, golden, monkeypatch):
    monkeypatch.chdir(ROOT)
    text = diagnose(os.path.relpath(case, ROOT))
    assert "error:" in text or "warning:" in text, "every case here is a bad input"
    assert "Traceback" not in text
    golden(case.with_suffix(".expected"), text)


def test_there_are_enough_cases():
    assert len(FRONT_END) >= 15
    assert len(CHECKER) >= 25
