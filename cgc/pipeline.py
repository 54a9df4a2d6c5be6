"""The stages in order, for the commands: front end, launch program, checker, memory plan.

This is the one module that calls both the front end and the stages after it; they never
call back (cgc/frontend produces a Program, and cgc/checking and cgc/backends read only it).
"""

from __future__ import annotations

from dataclasses import dataclass

from .checking.check import check_program
from .checking.memory import MemoryPlan, plan_memory
import os

from .core.diagnostics import CompileError, Diagnostic, Note, Reporter
from .resources import read_regular
from .core.ir import Program
from .frontend.api import Frontend, analyse, paused_gc, parse_override
from .frontend.api import evaluate as evaluate_schedule

__all__ = ["Checked", "Frontend", "analyse", "backend_problems", "check", "checked", "evaluate",
           "collective_problems", "kernel_folders", "open_run", "parse_override",
           "whole_step_problems"]


def kernel_folders(paths) -> tuple[str, ...]:
    """The folders of the user's own kernels (`--kernels DIR`), absolute and each once;
    PathError for one that is no readable folder."""
    from .core.diagnostics import PathError
    found = []
    if isinstance(paths, (str, os.PathLike)):  # one folder, not its name's characters
        paths = [paths]
    for path in paths or ():
        path = os.fspath(path)
        if not os.path.isdir(path) or not os.access(path, os.R_OK | os.X_OK):
            raise PathError(f"cannot read the kernels folder {path}: "
                            + ("not a folder" if os.path.exists(path) else
                               "No such file or directory"))
        folder = os.path.abspath(path)
        if folder not in found:
            found.append(folder)
    return tuple(found)


def evaluate(frontend: Frontend, path: str, entry: str | None = None, config: str | None = None,
             overrides: dict | None = None, kernels=(), ranks: tuple[int, int] = (0, 1)) -> Program:
    """The launch program of `entry` (default: the file's last schedule) in `config`, with
    the folders of the user's own kernels it may launch (`kernels`), for rank `ranks[0]` of
    `ranks[1]` (what cgRank and cgRanks give)."""
    program = evaluate_schedule(frontend, path, entry, config, overrides, ranks)
    program.kernel_folders = kernel_folders(kernels)
    return program


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
            overrides: dict | None = None, kernels=(), ranks: tuple[int, int] = (0, 1)) -> Checked:
    program = evaluate(frontend, path, entry, config, overrides, kernels, ranks)
    warnings = program.warnings + check(program)
    return Checked(program, plan_memory(program), warnings)


def backend_problems(program: Program, names=None) -> list:
    """What the backends (all of them, or those named) lack to run the program."""
    from .backends import REGISTRY, backend
    found = []
    for name in names or REGISTRY:
        found += [d for d in backend(name).problems(program) if d not in found]
    return found


def _step_bindings(frontend: Frontend) -> list:
    """The `step` role's bindings in the loaded files: the whole steps they declare."""
    roles = frontend.declarations
    return [b for b in (roles.roles.get("step"), *roles.more_roles)
            if b is not None and b.role == "step"]


def whole_steps_using(path: str) -> list:
    """The whole steps (their `step` role bindings) declared by the `.cg` files beside `path`
    that load it: where a user who ran a part of a step finds the step it is part of."""
    key = os.path.realpath(path)
    folder = os.path.dirname(path)
    found = []
    try:
        names = sorted(n for n in os.listdir(folder or ".") if n.endswith(".cg"))
    except OSError:
        return found
    for name in names:
        candidate = os.path.join(folder, name)
        if os.path.realpath(candidate) == key:
            continue
        try:
            # a regular file only (a FIFO named *.cg would hang the open), and one that
            # names a step somewhere: the others need no front end
            text = read_regular(candidate, 1 << 20)
            if text is None or b"step" not in text:
                continue
            frontend = analyse([candidate])
        except (OSError, CompileError):
            continue
        if key in {os.path.realpath(m.path) for m in frontend.modules}:
            found += [b for b in _step_bindings(frontend)
                      if os.path.realpath(b.span.path) == os.path.realpath(candidate)]
    return found


def whole_step_problems(frontend: Frontend, program: Program, path: str) -> list:
    """Why `program` is not a whole training step (none where it is): `cgc run` trains only
    a schedule given the `step` role, whose checker proves it writes what it reads and the
    loss the runtime takes after it; a part of a step (a forward alone, a backward) would
    "train" on whatever its buffers held."""
    if program.roles.get("step") == program.entry:
        return []
    declaration = frontend.scope.declarations.get(program.entry)
    span = declaration.name.span if declaration is not None else None
    here = _step_bindings(frontend)
    if here:
        default = frontend.default_entry(path)
        notes = [Note(f"'{b.value.text}' is the whole step (its `step` role here): run it "
                      + ("without --entry" if b.value.text == default
                         else f"with --entry {b.value.text}"), b.span) for b in here]
    else:
        notes = [Note(f"'{b.value.text}' is a whole step that uses it: cgc run {b.span.path}",
                      b.span)
                 for b in whole_steps_using(path)]
        notes = notes or [Note("a whole step is a schedule named by a `roles` declaration's "
                               "(step NAME) clause (schedules/train.cg has one)")]
    return [Diagnostic("error", f"'{program.entry}' is not a whole training step: no `roles` "
                                "declaration gives it the `step` role, so nothing proves it "
                                "writes what it reads and the loss; `cgc run` trains only a "
                                "whole step (`cgc check` accepts parts of one)", span,
                       tuple(notes))]


def collective_problems(frontend: Frontend, program: Program, ranks: int) -> list:
    """Why `program` cannot train on `ranks` ranks (none where it can): without a collective
    each rank would train alone on its share of the batch."""
    if ranks <= 1 or any(launch.image.collective for launch, _, _ in program.launches()):
        return []
    declaration = frontend.scope.declarations.get(program.entry)
    return [Diagnostic("error", f"{ranks} ranks would run '{program.entry}', which has no "
                                "collective: each rank would train alone on its share of the "
                                "batch; run a data-parallel step (schedules/train_parallel.cg "
                                "all-reduces the gradients)",
                       declaration.name.span if declaration is not None else None)]


def open_run(backend_name: str, frontend: Frontend, path: str, config: str | None = None,
             overrides: dict | None = None, seed: int = 0, entry: str | None = None,
             whole_step: bool = False, kernels=(), ranks: tuple[int, int] = (0, 1)):
    """FILE's entry, checked and set up on a backend with its first parameters, for rank
    `ranks[0]` of `ranks[1]`; with `whole_step`, only a whole training step
    (whole_step_problems)."""
    from .backends import backend
    from .backends.base import memory_problem
    result = checked(frontend, path, entry, config, overrides, kernels, ranks)
    if whole_step:
        problems = whole_step_problems(frontend, result.program, path)
        if problems:
            raise CompileError(problems)
    problems = backend_problems(result.program, [backend_name])
    if problems:
        raise CompileError(problems)
    run_class = backend(backend_name)
    too_big = memory_problem(run_class, result.plan, result.program)  # before any allocation
    if too_big is not None:
        raise CompileError([too_big])
    run = run_class(result.program, result.plan, seed)
    run.warnings = result.warnings
    return run
