"""Evaluation: exact natural arithmetic, affine repeat indices, and what is refused."""

from __future__ import annotations

import pytest

from cgc.core import affine
from cgc.core.affine import Affine, LoopVariable
from cgc.core.diagnostics import CompileError
from cgc.frontend.api import analyse, evaluate
from cgc.core.ir import Repeat

PRELUDE = """\
constant cgRows : Nat = 8
config c
buffer cgItems float32 4 (stack 16)
phase p (stage forward)
image cgImageTouch (block 32 1 1) (pointer 0 data float32 readwrite gridX) (scalar 0 n int32)
def touch : ((Buffer float32) -> Nat -> Schedule) = (lambda unrestricted b : (Buffer float32) .
  (lambda unrestricted n : Nat .
    (cgLaunch cgImageTouch n 1 1 (cgPointer (cgArgument 0) b (cgSlot (cgScalar 0) n cgNoSlots)))))
"""


def run(tmp_path, body: str):
    path = tmp_path / "case.cg"
    path.write_text(PRELUDE + f"def cgStep : Schedule = (cgPhase p {body})\n")
    return evaluate(analyse([str(path)]), str(path))


def errors(tmp_path, body: str) -> list[str]:
    with pytest.raises(CompileError) as error:
        run(tmp_path, body)
    return [d.message for d in error.value.diagnostics if d.severity == "error"]


def launches(program):
    return [(launch, loops) for launch, _, loops in program.launches()]


def test_affine_forms_add_scale_and_bound():
    i = LoopVariable.fresh("i", 5)
    j = LoopVariable.fresh("j", 3)
    form = affine.add(affine.scale(Affine.of(i), -2), affine.add(Affine.of(j), 10))
    assert str(form) == "10 - 2*i + j"
    assert affine.bounds(form) == (2, 12)
    assert form.at({i: 4, j: 0}) == 2
    assert affine.add(Affine.of(i), Affine.of(i), -1) == 0


def test_index_arithmetic_inside_a_repeat_stays_affine(tmp_path):
    program = run(tmp_path, "(nvidiaAffineLaunchRepeat 8 (lambda unrestricted i : Nat . "
                            "(touch (cgItem cgItems (naturalAdd (naturalMultiply 2 i) 1)) "
                            "(naturalDivideUnchecked (naturalMultiply 4 i) 2))))")
    ((launch, loops),) = launches(program)
    (loop,) = loops
    assert loop.count == 8
    assert str(launch.grid[0]) == "2*i"
    assert launch.pointers[0].view.label == "cgItems[2*i + 1]"
    assert launch.scalars[0].value.at({loop: 3}) == 6


def test_saturating_subtract_that_never_saturates_is_affine(tmp_path):
    program = run(tmp_path, "(nvidiaAffineLaunchRepeat 16 (lambda unrestricted i : Nat . "
                            "(touch (cgItem cgItems (naturalSaturatingSubtract 15 i)) 1)))")
    ((launch, _),) = launches(program)
    assert launch.pointers[0].view.label == "cgItems[15 - i]"


def test_nested_repeats_are_nested_loops(tmp_path):
    program = run(tmp_path, "(nvidiaAffineLaunchRepeat 4 (lambda unrestricted i : Nat . "
                            "(nvidiaAffineLaunchRepeat 4 (lambda unrestricted j : Nat . "
                            "(touch (cgItem cgItems (naturalAdd (naturalMultiply 4 i) j)) 1)))))")
    (outer,) = program.body[0].body
    assert isinstance(outer, Repeat) and isinstance(outer.body[0], Repeat)
    ((launch, loops),) = launches(program)
    assert launch.pointers[0].view.label == "cgItems[4*i + j]"
    assert [v.count for v in loops] == [4, 4]


@pytest.mark.parametrize("body,expected", [
    ("(touch cgItems (naturalDivideUnchecked 4 0))", "division by zero"),
    ("(touch cgItems (naturalModulo 4 0))", "division by zero"),
    ("(touch cgItems (naturalSubtract 1 2))", "naturalSubtract underflows"),
    ("(nvidiaAffineLaunchRepeat 4 (lambda unrestricted i : Nat . "
     "(touch cgItems (naturalMultiply i i))))", "not affine"),
    ("(nvidiaAffineLaunchRepeat 4 (lambda unrestricted i : Nat . "
     "(touch cgItems (naturalDivideUnchecked i 2))))", "not affine"),
    ("(nvidiaAffineLaunchRepeat 4 (lambda unrestricted i : Nat . "
     "(touch cgItems (naturalModulo i 2))))", "not affine"),
    ("(nvidiaAffineLaunchRepeat 4 (lambda unrestricted i : Nat . "
     "(touch cgItems (naturalMaximum i 2))))", "not affine"),
    ("(nvidiaAffineLaunchRepeat 4 (lambda unrestricted i : Nat . "
     "(touch (cgItem cgItems (naturalAdd i 13)) 1)))", "out of range"),
])
def test_refused_arithmetic_is_an_error_with_a_reason(tmp_path, body, expected):
    assert any(expected in message for message in errors(tmp_path, body))


def test_every_error_is_reported_not_just_the_first(tmp_path):
    found = errors(tmp_path, "(cgThen (touch cgItems (naturalDivideUnchecked 1 0)) "
                             "(touch cgItems (naturalSubtract 0 1)))")
    assert len(found) == 2


def test_constants_can_be_overridden(tmp_path):
    path = tmp_path / "case.cg"
    path.write_text(PRELUDE + "def cgStep : Schedule = (cgPhase p (touch cgItems cgRows))\n")
    frontend = analyse([str(path)])
    ((launch, _),) = launches(evaluate(frontend, str(path), overrides={"cgRows": 5}))
    assert launch.grid[0] == 5


def test_a_zero_repeat_is_a_warning_and_no_launch(tmp_path):
    path = tmp_path / "case.cg"
    path.write_text(PRELUDE + "def cgStep : Schedule = (cgPhase p (nvidiaAffineLaunchRepeat 0 "
                              "(lambda unrestricted i : Nat . (touch cgItems 1))))\n")
    program = evaluate(analyse([str(path)]), str(path))
    assert launches(program) == []
    (warning,) = program.warnings
    assert warning.message == "this repeat runs zero times"


def test_a_definition_that_doubles_itself_is_refused_within_a_second(tmp_path):
    """60 lines of `def dK = (cgThen dK-1 dK-1)` would be 2^60 launches: evaluation stops at
    the documented limit, in bounded time and memory, with a diagnostic at the definition."""
    import subprocess
    import sys
    import time

    from conftest import ROOT
    lines = [f'import "{ROOT / "tests" / "diagnostics" / "_base.cg"}"',
             "def d0 : Schedule = (cgPhase cgPhaseWork (cgCopy cgA (cgItem cgB 0)))"]
    lines += [f"def d{k} : Schedule = (cgThen d{k - 1} d{k - 1})" for k in range(1, 61)]
    path = tmp_path / "doubling.cg"
    path.write_text("\n".join(lines) + "\n")
    # VmHWM, the process's own peak (ru_maxrss would count what the forking parent held).
    probe = ("import re, sys; from cgc.cli import main; status = main(sys.argv[1:]); "
             "print(re.search(r'VmHWM:\\s*(\\d+)', open('/proc/self/status').read()).group(1)); "
             "sys.exit(status)")
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", probe, "check", str(path)], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    elapsed = time.perf_counter() - started
    assert result.returncode == 1, result.stderr
    assert "this schedule holds 131,072 launches, more than cgc's limit of 100,000" in \
        result.stderr
    assert elapsed < 5 and int(result.stdout.split()[-1]) < 400_000  # KiB: under 400 MB


def test_a_repeat_that_would_make_too_many_launches_is_refused(tmp_path):
    from conftest import ROOT
    path = tmp_path / "long.cg"
    path.write_text(f'import "{ROOT / "tests" / "diagnostics" / "_base.cg"}"\n'
                    "def cgStep : Schedule = (cgPhase cgPhaseWork (nvidiaAffineLaunchRepeat "
                    "20000000 (lambda unrestricted i : Nat . (cgCopy cgA (cgItem cgB 0)))))\n")
    import pytest
    from cgc.core.diagnostics import CompileError
    with pytest.raises(CompileError) as error:
        evaluate(analyse([str(path)]), str(path))
    assert "makes 20,000,000 launches, more than cgc's limit of 10,000,000" in \
        error.value.diagnostics[0].message
