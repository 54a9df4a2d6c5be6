"""Type checking of every term, with spans, and usage checking of linear and affine binders."""

from __future__ import annotations

from .builtins import ELEMENT_NAMES, GRID_NAMES, PRIMITIVES, TYPE_NAMES
from .declarations import Declarations
from ..core.roles import ROLES
from ..core.diagnostics import Note, Reporter
from .resolve import Scope
from .syntax import Apply, Arrow, Floating, Integer, Lambda, Name, Natural, Span, Term
from .types import (
    ENTRY, FLOAT, IMAGE, INT, NAT, NUMBER, PHASE, SCHEDULE, Base, Function, Storage, Type,
    Unifier, instantiate, is_polymorphic,
)

_BASE_BY_NAME = {name: Base(name) for name in
                 ("Nat", "Float", "Int", "Image", "Phase", "Slots", "Entry", "Argument", "Scalar")}
_BASE_BY_NAME["Schedule"] = SCHEDULE


def type_from_term(term: Term, report: Reporter) -> Type | None:
    """Reads a type term: Nat, (Buffer float32), (family NvidiaLaunchSchedule), (A -> B).

    Unknown names were reported by resolution; they give None here without a second error.
    """
    if isinstance(term, Name) and term.text in _BASE_BY_NAME:
        return _BASE_BY_NAME[term.text]
    if isinstance(term, Name) and term.text not in TYPE_NAMES and term.text not in ELEMENT_NAMES:
        return None
    if isinstance(term, Arrow):
        parts = [type_from_term(part, report) for part in term.parts]
        if None in parts:
            return None
        result = parts[-1]
        for argument in reversed(parts[:-1]):
            result = Function(argument, result)
        return result
    if isinstance(term, Apply) and isinstance(term.function, Name) and len(term.arguments) == 1:
        head, argument = term.function.text, term.arguments[0]
        if head == "family":
            if isinstance(argument, Name) and argument.text == "NvidiaLaunchSchedule":
                return SCHEDULE
            report.error("unknown family: the one family is NvidiaLaunchSchedule", argument.span)
            return None
        if head in ("Buffer", "Bank", "Arena"):
            if isinstance(argument, Name) and argument.text in ELEMENT_NAMES:
                return Storage(head, argument.text)
            if isinstance(argument, Name) and argument.text not in TYPE_NAMES:
                return None  # an unknown name, reported by resolution
            report.error(f"({head} ELEMENT) needs an element type: "
                         f"{', '.join(ELEMENT_NAMES)}", argument.span)
            return None
    if isinstance(term, Name) and term.text in ("Buffer", "Bank", "Arena"):
        report.error(f"'{term.text}' needs its element type, as in ({term.text} float32)",
                     term.span)
        return None
    if isinstance(term, Name) and term.text == "family":
        report.error("write the schedule type as (family NvidiaLaunchSchedule)", term.span)
        return None
    report.error("not a type: expected Nat, Float, Int, Schedule, Image, Phase, Slots, Entry, "
                 "(Buffer E), (Bank E), (Arena E), (family NvidiaLaunchSchedule) or (A -> B)",
                 term.span)
    return None


_REPEAT = "nvidiaAffineLaunchRepeat"
_POLYMORPHIC = {name for name, t in PRIMITIVES.items() if is_polymorphic(t)}


def _arity_name(term: Term) -> str:
    return f"'{term.text}'" if isinstance(term, Name) else "this function"


def _how_used(uses) -> str:
    if len(uses) == 1:
        return "used inside the body of a repeat, which runs once per iteration"
    return f"used {len(uses)} times"


class TypeChecker:
    def __init__(self, scope: Scope, declarations: Declarations, report: Reporter):
        self.scope = scope
        self.declarations = declarations
        self.report = report
        self.global_types: dict[str, Type | None] = {}
        self.global_type_spans: dict[str, Span] = {}
        for declaration in scope.order:
            self.global_types[declaration.name.text] = self._declared_type(declaration)

    def _declared_type(self, declaration) -> Type | None:
        kind, name = declaration.kind, declaration.name.text
        if kind in ("def", "constant"):
            self.global_type_spans[name] = declaration.terms[0].span
            return type_from_term(declaration.terms[0], self.report)
        if kind == "buffer":
            storage = self.declarations.storages.get(name)
            return Storage("Buffer", storage.element) if storage and storage.element else None
        if kind == "arena":
            storage = self.declarations.storages.get(name)
            return Storage("Arena", storage.element) if storage and storage.element else None
        if kind == "bank":
            return Storage("Bank", self.declarations.banks[name].element)
        return {"entry": ENTRY, "phase": PHASE, "image": IMAGE}.get(kind)

    # ---- inference ---------------------------------------------------------------

    def infer(self, term: Term, local: dict[str, Type]) -> Type | None:
        kind = term.__class__
        if kind is Name:
            return self._name_type(term, local)
        if kind is Apply:
            return self._apply_type(term, local)
        if kind is Natural:
            return NAT
        if kind is Integer:
            return INT
        if kind is Floating:
            return FLOAT
        if isinstance(term, Lambda):
            binder = type_from_term(term.binder_type, self.report)
            body = self.infer(term.body, {**local, term.binder.text: binder})
            self._check_usage(term)
            return Function(binder, body) if binder is not None and body is not None else None
        if isinstance(term, Apply):
            return self._apply_type(term, local)
        return None  # an arrow in value position, reported by resolution

    def _name_type(self, name: Name, local: dict[str, Type]) -> Type | None:
        text = name.text
        if text in local:
            return local[text]
        if text in PRIMITIVES:
            return instantiate(PRIMITIVES[text]) if text in _POLYMORPHIC else PRIMITIVES[text]
        if text in self.global_types:
            found = self.global_types[text]
            if found is None and self.scope.declarations[text].kind == "config":
                self.report.error(f"'{text}' is a config; select it with --config", name.span)
            return found
        return None  # unknown: reported by resolution

    def _apply_type(self, term: Apply, local: dict[str, Type]) -> Type | None:
        function = self.infer(term.function, local)
        if function is None:
            for argument in term.arguments:
                self.infer(argument, local)
            return None
        unifier = Unifier()
        for position, argument in enumerate(term.arguments, start=1):
            actual = self.infer(argument, local)
            function = unifier.apply(function)
            if not isinstance(function, Function):
                self.report.error(
                    f"{_arity_name(term.function)} is applied to too many arguments: it takes "
                    f"{position - 1}, and its result has type {function}", argument.span)
                return None
            if actual is None:
                function = function.result
                continue
            if not unifier.unify(function.argument, actual):
                expected = unifier.apply(function.argument)
                notes = []
                if isinstance(term.function, Name) and term.function.text in self.global_type_spans:
                    notes.append(Note(f"'{term.function.text}' is declared with this type",
                                      self.global_type_spans[term.function.text]))
                elif isinstance(term.function, Name) and term.function.text in PRIMITIVES:
                    notes.append(Note(f"built-in '{term.function.text}' has type "
                                      f"{PRIMITIVES[term.function.text]}"))
                what = "a Nat, an Int or a Float" if expected == NUMBER else str(expected)
                self.report.error(
                    f"argument {position} of {_arity_name(term.function)} has the wrong type: "
                    f"expected {what}, found {unifier.apply(actual)}", argument.span, *notes)
            function = function.result
        return unifier.apply(function)

    # ---- usage -----------------------------------------------------------------

    def _check_usage(self, term: Lambda) -> None:
        if term.usage == "unrestricted":
            return
        uses: list[tuple[Span, int]] = []
        name = term.binder.text
        stack: list[tuple[Term, int]] = [(term.body, 1)]
        while stack:
            node, weight = stack.pop()
            if isinstance(node, Name) and node.text == name:
                uses.append((node.span, weight))
            elif isinstance(node, Apply):
                # The body of a repeat runs once per iteration: a use there counts as many.
                repeated = isinstance(node.function, Name) and node.function.text == _REPEAT
                stack.append((node.function, weight))
                stack.extend((argument, 2 if repeated and position > 0 else weight)
                             for position, argument in enumerate(node.arguments))
            elif isinstance(node, Lambda) and node.binder.text != name:
                stack.append((node.body, weight))
        count = sum(weight for _, weight in uses)
        notes = [Note("used here", span) for span, _ in sorted(uses, key=lambda u: u[0].sort_key())]
        if term.usage == "linear" and count != 1:
            how = "never used" if count == 0 else _how_used(uses)
            self.report.error(f"linear binder '{name}' must be used exactly once, but it is {how}",
                              term.binder.span, *notes)
        elif term.usage == "affine" and count > 1:
            how = _how_used(uses)
            self.report.error(f"affine binder '{name}' may be used at most once, but it is {how}",
                              term.binder.span, *notes)

    # ---- declarations ------------------------------------------------------------

    def expect(self, term: Term, expected: Type, what: str, local=None) -> None:
        actual = self.infer(term, local or {})
        if actual is not None and not Unifier().unify(expected, actual):
            self.report.error(f"{what} must be {expected}, found {actual}", term.span)

    def check_all(self) -> None:
        for declaration in self.scope.order:
            name = declaration.name.text
            if declaration.kind == "def":
                declared = self.global_types.get(name)
                actual = self.infer(declaration.terms[1], {})
                if declared is not None and actual is not None \
                        and not Unifier().unify(declared, actual):
                    self.report.error(
                        f"the body of '{name}' has type {actual}, but '{name}' is declared "
                        f"as {declared}", declaration.terms[1].span,
                        Note("the declared type is here", declaration.terms[0].span))
            elif declaration.kind == "constant":
                declared = self.global_types.get(name)
                if declared not in (NAT, INT, FLOAT, None):
                    self.report.error("a constant is a Nat, an Int or a Float",
                                      declaration.terms[0].span)
                elif declared is not None and len(declaration.terms) > 1:
                    self.expect(declaration.terms[1], declared, f"the default of '{name}'")
        for storage in self.declarations.storages.values():
            self.expect(storage.count, NAT, f"the element count of '{storage.name}'")
            if storage.stack is not None:
                self.expect(storage.stack, NAT, f"the stack count of '{storage.name}'")
            if storage.init is not None:
                for argument in storage.init.arguments[1:]:
                    self.expect(argument, FLOAT, "an initialiser's standard deviation")
        for image in self.declarations.images.values():
            for term in image.block or ():
                self.expect(term, NAT, "a block dimension")
            scalars = {s.name: (FLOAT if s.type == "float32" else NAT)
                       for s in image.scalars.values()}
            extent_names = {name: NAT for name in GRID_NAMES} | scalars
            for pointer in image.pointers.values():
                if pointer.extent is not None:
                    self.expect(pointer.extent, NAT, "an extent", extent_names)
            for scalar in image.scalars.values():
                if scalar.default is not None:
                    self.expect(scalar.default, FLOAT if scalar.type == "float32" else NUMBER,
                                f"the default of scalar '{scalar.name}'")
        for requirement in self.declarations.requirements:
            for term in (requirement.left, requirement.right):
                self.expect(term, NAT, f"a ({requirement.kind} ...) requirement")
        for binding in self.declarations.roles.values():
            if ROLES[binding.role].kind == "Nat":
                self.expect(binding.value, NAT, f"role '{binding.role}'")
            elif ROLES[binding.role].kind == "Float":
                self.expect(binding.value, FLOAT, f"role '{binding.role}'")
            elif ROLES[binding.role].kind == "Schedule":
                self.expect(binding.value, SCHEDULE, f"role '{binding.role}'")
        for config in self.declarations.configs.values():
            for key, (value, _) in config.values.items():
                declared = self.global_types.get(key)
                actual = self.infer(value, {}) if key != "low" else None
                if declared is not None and actual is not None and actual != declared \
                        and not (declared == INT and actual == NAT):
                    self.report.error(f"'{key}' is a {declared}, but config '{config.name}' "
                                      f"gives it a {actual}", value.span)
