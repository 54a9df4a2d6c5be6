"""Name resolution: one global namespace over all loaded files, lexical lambda scopes."""

from __future__ import annotations

from .builtins import ELEMENT_NAMES, GRID_NAMES, PRIMITIVES, RESERVED, TYPE_NAMES
from ..core.diagnostics import Budget, Note, Reporter, Suggester, best_match
from .syntax import Apply, Arrow, Declaration, Lambda, Module, Name, Term


class Scope:
    """Every global declaration by name, with the names each one refers to."""

    def __init__(self, modules: list[Module], report: Reporter):
        self.report = report
        self.declarations: dict[str, Declaration] = {}
        self.order: list[Declaration] = []
        for module in modules:
            for declaration in module.declarations:
                self._declare(declaration)
        # name -> names of global declarations it refers to (for cycles and evaluation order)
        self.references: dict[str, set[str]] = {}
        # Did-you-mean: the declarations indexed at the first unknown name, not listed again
        # for each; one budget for every suggestion of this compilation.
        self._budget = Budget()
        self._globals: Suggester | None = None
        self._types = Suggester([*TYPE_NAMES, *ELEMENT_NAMES], self._budget)

    def _suggest(self, text: str, local_names, grid: bool) -> str | None:
        """The closest declaration, built-in, binder in scope (or grid name), as difflib
        would choose it over all of them."""
        if self._globals is None:
            self._globals = Suggester([*self.declarations, *PRIMITIVES], self._budget)
        return best_match(text, self._globals, local_names, GRID_NAMES if grid else (),
                          budget=self._budget)

    def _declare(self, declaration: Declaration) -> None:
        name = declaration.name.text
        if name in RESERVED:
            self.report.error(f"'{name}' is a built-in name and cannot be declared again",
                              declaration.name.span)
            return
        first = self.declarations.get(name)
        if first is not None:
            self.report.error(f"'{name}' is declared twice", declaration.name.span,
                              Note(f"the first declaration of '{name}' is here", first.name.span))
            return
        self.declarations[name] = declaration
        self.order.append(declaration)

    def of_kind(self, kind: str) -> list[Declaration]:
        return [d for d in self.order if d.kind == kind]

    def _unknown(self, name: Name, local_names, what: str, suggestion: str | None) -> None:
        notes = ()
        if suggestion in local_names:
            notes = (Note(f"did you mean the binder '{suggestion}'?"),)
        elif suggestion in self.declarations:
            declaration = self.declarations[suggestion]
            notes = (Note(f"did you mean the {declaration.kind} '{suggestion}'?",
                          declaration.name.span),)
        elif suggestion in PRIMITIVES:
            notes = (Note(f"did you mean the built-in '{suggestion}'?"),)
        elif suggestion:
            notes = (Note(f"did you mean '{suggestion}'?"),)
        self.report.error(f"unknown {what} '{name.text}'", name.span, *notes)

    def resolve_term(self, term: Term, owner: str, bound=(), grid: bool = False) -> None:
        """Reports every unknown name in a value term; records `owner`'s references."""
        references = self.references.setdefault(owner, set())
        stack: list[tuple[Term, tuple[str, ...]]] = [(term, tuple(bound))]
        while stack:
            node, local = stack.pop()
            if isinstance(node, Name):
                text = node.text
                if text in local or text in PRIMITIVES or (grid and text in GRID_NAMES):
                    continue
                if text in self.declarations:
                    references.add(text)
                    continue
                if text in TYPE_NAMES or text in ELEMENT_NAMES:
                    self.report.error(f"'{text}' is a type, not a value", node.span)
                    continue
                self._unknown(node, local, "name", self._suggest(text, local, grid))
            elif isinstance(node, Apply):
                stack.append((node.function, local))
                stack.extend((argument, local) for argument in node.arguments)
            elif isinstance(node, Lambda):
                self.resolve_type(node.binder_type)
                stack.append((node.body, local + (node.binder.text,)))
            elif isinstance(node, Arrow):
                self.report.error("a function type cannot stand where a value is expected",
                                  node.span)

    def resolve_type(self, term: Term) -> None:
        """Type terms name built-in types and element types only."""
        stack = [term]
        while stack:
            node = stack.pop()
            if isinstance(node, Name):
                if node.text not in TYPE_NAMES and node.text not in ELEMENT_NAMES:
                    self._unknown(node, (), "type", self._types.closest(node.text))
            elif isinstance(node, Apply):
                stack.append(node.function)
                stack.extend(node.arguments)
            elif isinstance(node, Arrow):
                stack.extend(node.parts)
            elif isinstance(node, Lambda):
                self.report.error("a lambda cannot stand where a type is expected", node.span)
            else:
                self.report.error("a literal cannot stand where a type is expected", node.span)

    def report_cycles(self) -> None:
        """Definitions may not refer to themselves, directly or through others."""
        state: dict[str, int] = {}  # 1 = on the path, 2 = done
        for start in self.references:
            if state.get(start):
                continue
            path: list[str] = []
            stack = [(start, iter(sorted(self.references.get(start, ()))))]
            state[start] = 1
            path.append(start)
            while stack:
                node, children = stack[-1]
                child = next(children, None)
                if child is None:
                    stack.pop()
                    path.pop()
                    state[node] = 2
                    continue
                if state.get(child) == 1:
                    cycle = path[path.index(child):] + [child]
                    declaration = self.declarations[child]
                    self.report.error(
                        f"'{child}' refers to itself: {' -> '.join(cycle)} "
                        "(the language has no recursion; repeat with nvidiaAffineLaunchRepeat)",
                        declaration.name.span)
                    state[child] = 2
                elif not state.get(child):
                    state[child] = 1
                    path.append(child)
                    stack.append((child, iter(sorted(self.references.get(child, ())))))
