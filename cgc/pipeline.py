"""The stages in order, for the commands: front end, launch program, checker, memory plan.

This is the one module that calls both the front end and the stages after it; they never
call back (cgc/frontend produces a Program, and cgc/checking and cgc/backends read only it).
"""

from __future__ import annotations

from dataclasses import dataclass

from .checking.check import check_program
from .checking.memory import MemoryPlan, plan_memory
from .core.diagnostics import CompileError, Reporter
from .core.ir import Program
from .frontend.api import Frontend, analyse, evaluate, paused_gc, parse_override

__all__ = ["Checked", "Frontend", "analyse", "backend_problems", "check", "checked", "evaluate",
           "open_run", "parse_override"]


def check(program: Program) -> list:
    """Runs the static checker; raises CompileError on errors, returns the warnings."""
    report = Reporter()
    with paused_gc():
        check_program(program, report)
    report.raise_if_errors()
    return [d for d in report.diagnostics if d.severity == "warning"]


@dataclass
class Checked:
    """A launch program that passed the checker, its memory plan, and every warning."""

    program: Program
    plan: MemoryPlan
    warnings: list


def checked(frontend: Frontend, path: str, entry: str | None = None, config: str | None = None,
            overrides: dict | None = None) -> Checked:
    program = evaluate(frontend, path, entry, config, overrides)
    warnings = program.warnings + check(program)
    return Checked(program, plan_memory(program), warnings)


def backend_problems(program: Program, names=None) -> list:
    """What the backends (all of them, or those named) lack to run the program."""
    from .backends import REGISTRY, backend
    found = []
    for name in names or REGISTRY:
        found += [d for d in backend(name).problems(program) if d not in found]
    return found


def open_run(backend_name: str, frontend: Frontend, path: str, config: str | None = None,
             overrides: dict | None = None, seed: int = 0, entry: str | None = None):
    """FILE's entry, checked and set up on a backend with its first parameters."""
    from .backends import backend
    from .backends.base import memory_problem
    result = checked(frontend, path, entry, config, overrides)
    problems = backend_problems(result.program, [backend_name])
    if problems:
        raise CompileError(problems)
    run_class = backend(backend_name)
    too_big = memory_problem(run_class, result.plan)  # before any allocation
    if too_big is not None:
        raise CompileError([too_big])
    run = run_class(result.program, result.plan, seed)
    run.warnings = result.warnings
    return run
