"""The front end as one call: load, resolve, elaborate, type-check; then evaluate per config.

Its product is the launch program (cgc/core/ir.py); the stages after it read only that."""

from __future__ import annotations

import gc
import os
from contextlib import contextmanager
from dataclasses import dataclass

from .declarations import Declarations, elaborate
from ..core.diagnostics import CompileError, Diagnostic, Reporter
from .evaluate import evaluate_program
from ..core.affine import Int
from ..core.ir import Program
from .load import load
from .resolve import Scope
from .syntax import Module
from .typecheck import TypeChecker
from .types import FLOAT, INT, NAT, SCHEDULE


@contextmanager
def paused_gc():
    """The front end makes many small objects and no garbage cycles worth collecting: the
    cyclic collector would only rescan them (about a third of the time on large inputs)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@dataclass
class Frontend:
    paths: list[str]
    modules: list[Module]
    scope: Scope
    declarations: Declarations
    checker: TypeChecker
    warnings: list

    @property
    def configs(self) -> list[str]:
        return list(self.declarations.configs)

    def schedules_in(self, path: str) -> list[str]:
        """The schedule-typed definitions declared in one file, in source order."""
        key = os.path.realpath(path)
        return [d.name.text for d in self.scope.order
                if d.kind == "def" and os.path.realpath(d.span.path) == key
                and self.checker.global_types.get(d.name.text) == SCHEDULE]

    def default_entry(self, path: str) -> str | None:
        schedules = self.schedules_in(path)
        return schedules[-1] if schedules else None


def analyse(paths: list[str]) -> Frontend:
    """Everything that does not depend on a configuration; raises CompileError on errors."""
    with paused_gc():
        try:
            return _analyse(paths)
        except RecursionError:
            raise _too_deep() from None


def _too_deep() -> CompileError:
    return CompileError([Diagnostic(
        "error", "a term is nested too deeply for this process's stack; split it into "
        "smaller definitions (the cgc command allows far deeper nesting than the library "
        "default)", None)])


def _analyse(paths: list[str]) -> Frontend:
    report = Reporter()
    modules = load(paths, report)
    report.raise_if_errors()  # names from a file that did not parse would all look unknown
    scope = Scope(modules, report)
    declarations = elaborate(scope, report)
    checker = TypeChecker(scope, declarations, report)
    checker.check_all()
    report.raise_if_errors()
    return Frontend(paths, modules, scope, declarations, checker,
                    [d for d in report.diagnostics if d.severity == "warning"])


def parse_override(frontend: Frontend, text: str) -> tuple[str, object]:
    """`NAME=VALUE` from the command line, typed by the constant's declaration."""
    name, _, value = text.partition("=")
    if name not in frontend.declarations.constants or not value:
        known = ", ".join(frontend.declarations.constants)
        if name and name not in frontend.declarations.constants:
            import difflib
            close = difflib.get_close_matches(name, list(frontend.declarations.constants), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ValueError(f"--set {text}: '{name}' is not a declared constant ({known})"
                             f"{hint}")
        raise ValueError(f"--set expects CONSTANT=VALUE with a declared constant ({known})")
    declared = frontend.checker.global_types.get(name)
    try:
        if declared == FLOAT:
            return name, float(value)
        number = int(value)
    except ValueError:
        raise ValueError(f"--set {name}: '{value}' is not a {declared}") from None
    if declared == NAT and number < 0:
        raise ValueError(f"--set {name}: a Nat cannot be negative")
    if declared == INT:
        return name, Int(number)
    return name, number


def evaluate(frontend: Frontend, path: str, entry: str | None = None, config: str | None = None,
             overrides: dict[str, object] | None = None,
             ranks: tuple[int, int] = (0, 1)) -> Program:
    """The launch program of `entry` (default: the file's last schedule) in `config`, for
    rank `ranks[0]` of `ranks[1]` of a data-parallel run."""
    report = Reporter()
    entry = entry or frontend.default_entry(path)
    if entry is None:
        report.error(f"'{path}' declares no schedule (a def of type "
                     "(family NvidiaLaunchSchedule)) to use as the entry", None)
        report.raise_if_errors()
    if entry not in frontend.scope.declarations or \
            frontend.checker.global_types.get(entry) != SCHEDULE:
        report.error(f"'{entry}' is not a schedule declared in the loaded files", None)
        report.raise_if_errors()
    config = config or (frontend.configs[0] if frontend.configs else None)
    if config is None:
        report.error(f"'{path}' has a schedule but declares no configuration, nor does any file "
                     "it imports: its model constants take their values from one (`config NAME "
                     "(CONSTANT VALUE) ...`, docs/language.md); a file of library definitions "
                     "is checked through a schedule that imports a model", None)
        report.raise_if_errors()
    with paused_gc():  # an unknown config is told by resolve_config, before any evaluation
        try:
            return evaluate_program(frontend.scope, frontend.declarations, path, entry, config,
                                    overrides or {}, report, ranks)
        except RecursionError:
            raise _too_deep() from None
