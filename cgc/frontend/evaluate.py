"""Evaluation of a checked schedule to a launch program, for one configuration.

Call by value over closures; no recursion exists, so evaluation always ends. Inside
`nvidiaAffineLaunchRepeat` the index is symbolic: every natural computed from it is an
affine function of it (or the evaluator says why not), which keeps the loop a loop.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from ..core import affine
from ..core.affine import Affine, Int, LoopVariable, Nat, bounds, format_nat
from .builtins import GRID_NAMES, PRIMITIVES
from .declarations import REQUIREMENTS, Declarations, StorageDeclaration
from ..core.diagnostics import Note, Reporter
from ..core.elements import DEFAULT_LOW
from ..core.ir import (
    Bank, Concurrent, Entry, Extent, Image, Launch, Phase, PhaseRegion, PointerBinding, PointerParameter,
    Program, Repeat, ScalarBinding, ScalarParameter, StorageRef, View,
)
from ..core.roles import ROLES
from .resolve import Scope
from .syntax import Apply, Floating, Integer, Lambda, Name, Natural, Span, Term
from .types import Function

LOG2_E = 1.4426950408889634
# Entries start on multiples of 64 elements in their bank (256 bytes of float32), so that
# every entry can be read with 16-byte vector loads; the padding stays zero.
BANK_ALIGNMENT = 64
# Beyond this many iterations a non-affine extent is not enumerated (the checker says so).
ENUMERATION_LIMIT = 100_000
# The most launches a program may hold (a repeat's body counted once) and make (unrolled):
# GPT-2 small's step holds 57 and makes 409; these bound evaluation's memory and time.
LAUNCH_LIMIT = 100_000
UNROLLED_LIMIT = 10_000_000


class _Poison:
    """The value of a term whose evaluation failed; it silences errors that would follow."""

    def __repr__(self):
        return "<poison>"


POISON = _Poison()


class Schedule(tuple):
    """A schedule's nodes, and how many launches it holds and makes (see Evaluator.schedule)."""

    launches = 0
    unrolled = 0


@dataclass(frozen=True)
class Closure:
    function: Lambda
    env: dict


@dataclass(frozen=True)
class Partial:
    name: str
    arity: int
    arguments: tuple  # (value, span) pairs


@dataclass(frozen=True)
class Ref:
    kind: str  # bank | arena | entry | phase | image
    name: str


@dataclass(frozen=True)
class ArgumentIndex:
    index: int


@dataclass(frozen=True)
class ScalarIndex:
    index: int


@dataclass(frozen=True)
class Slots:
    bindings: tuple  # PointerBinding | ScalarBinding, in source order


def _arity(t) -> int:
    count = 0
    while isinstance(t, Function):
        count += 1
        t = t.result
    return count


_ARITIES = {name: _arity(t) for name, t in PRIMITIVES.items()}


def _text(term: Term) -> str:
    """A requirement's operand as written: a name, a number, or (f ...)."""
    if isinstance(term, Name):
        return term.text
    if isinstance(term, (Natural, Integer)):
        return str(term.value)
    return term.span.source.text[term.span.start:term.span.end]


def _shown(term: Term, value: int) -> str:
    """`cgHeadWidth (15)`, or just `16` for a literal."""
    return str(value) if isinstance(term, Natural) else f"{_text(term)} ({value})"


def chain_notes(trace: tuple, repeats=()) -> list[Note]:
    """"required from here" notes for the calls that led to a failing expression: the
    innermost call first, the outermost (the one the user wrote) last. A repeat applies its
    body like a call; `repeats` (their spans) are left out: they are no call of the user's."""
    return [Note("required from the call here", span) for span in reversed(trace)
            if span not in repeats]


class EvaluationError(Exception):
    def __init__(self, message: str, span: Span | None, *notes: Note):
        self.message, self.span, self.notes = message, span, notes


def resolve_config(declarations: Declarations, name: str, overrides: dict[str, object],
                   report: Reporter) -> tuple[dict[str, object], str]:
    """The value of every constant in config `name`, and its low-precision type."""
    chain, seen = [], set()
    current = declarations.configs.get(name)
    if current is None:
        known = ", ".join(declarations.configs) or "none declared"
        report.error(f"unknown config '{name}' (known: {known})", None)
        return {}, DEFAULT_LOW
    while current is not None and current.name not in seen:
        seen.add(current.name)
        chain.append(current)
        current = declarations.configs.get(current.parent.text) if current.parent else None
    values: dict[str, object] = {}
    for config in reversed(chain):
        for key, (term, _) in config.values.items():
            values[key] = term
    low = values.pop("low", None)
    low_name = low.text if isinstance(low, Name) else DEFAULT_LOW
    constants = {}
    for constant in declarations.constants.values():
        if constant.name in overrides:
            constants[constant.name] = overrides[constant.name]
        elif constant.name in values:
            constants[constant.name] = values[constant.name]
        elif constant.default is not None:
            constants[constant.name] = constant.default
        else:
            report.error(f"config '{name}' does not set constant '{constant.name}', which has "
                         "no default", declarations.configs[name].span,
                         Note(f"'{constant.name}' is declared here", constant.span))
    return constants, low_name


class Evaluator:
    def __init__(self, scope: Scope, declarations: Declarations, config: str,
                 overrides: dict[str, object], report: Reporter, ranks: tuple[int, int] = (0, 1)):
        self.scope = scope
        self.rank, self.ranks = ranks
        self.declarations = declarations
        self.config = config
        self.report = report
        self.constant_terms, self.low = resolve_config(declarations, config, overrides, report)
        self.overrides = overrides
        self.cache: dict[str, object] = {}
        self.in_progress: set[str] = set()
        self.storages: dict[str, StorageRef] = {}
        self.loop_spans: dict[LoopVariable, Span] = {}
        self.repeat_spans: set[Span] = set()
        self.layouts: dict[str, tuple[dict[str, int], int]] = {}
        self.images: dict[str, Image] = {}
        self.failed_storages: set[str] = set()

    # ---- globals -----------------------------------------------------------------

    def global_value(self, name: str, span: Span):
        if name in self.cache:
            return self.cache[name]
        if name in self.in_progress:
            raise EvaluationError(f"'{name}' depends on its own value", span)
        declaration = self.scope.declarations[name]
        self.in_progress.add(name)
        try:
            kind = declaration.kind
            if kind == "def":
                value = self.eval(declaration.terms[1], {}, ())
            elif kind == "constant":
                value = self.constant(name, span)
            elif kind == "buffer":
                storage = self.storage_of(self.declarations.storages[name], None)
                value = View(storage, 0, storage.count) if storage else POISON
            elif kind in ("arena", "entry", "bank", "phase", "image"):
                value = Ref(kind, name)
            else:
                raise EvaluationError(f"'{name}' is a {kind}, not a value", span)
        finally:
            self.in_progress.discard(name)
        self.cache[name] = value
        return value

    def constant(self, name: str, span: Span):
        term = self.constant_terms.get(name)
        if term is None:
            return POISON
        if not isinstance(term, (Natural, Integer, Floating, Apply, Name)):
            return term  # an override given on the command line, already a value
        return self.eval(term, {}, ())

    def natural_constant(self, term: Term, what: str, least: int = 1) -> int | None:
        value = self.eval(term, {}, ())
        if value is POISON:
            return None
        if not isinstance(value, int) or value < least:
            kind = "a positive natural" if least == 1 else f"a natural of at least {least}"
            self.report.error(f"{what} must be {kind}, found {value}", term.span,
                              self.configuration_note())
            return None
        return value

    def storage_of(self, declaration: StorageDeclaration, bank: str | None) -> StorageRef | None:
        key = f"{bank}.{declaration.name}" if bank else declaration.name
        if key in self.storages:
            return self.storages[key]
        if declaration.name in self.failed_storages:
            return None  # its error is reported once, at its declaration
        count = self.natural_constant(declaration.count, f"the element count of '{declaration.name}'")
        stack = (self.natural_constant(declaration.stack, f"the stack of '{declaration.name}'")
                 if declaration.stack is not None else None)
        if count is None or (declaration.stack is not None and stack is None):
            self.failed_storages.add(declaration.name)
            return None
        if bank is not None:
            bank_declaration = self.declarations.banks[bank]
            storage = StorageRef("bank", bank, declaration.name, bank_declaration.element, count,
                                 stack)
        else:
            storage = StorageRef(declaration.kind, declaration.name, None, declaration.element, count,
                                 stack)
        self.storages[key] = storage
        return storage

    def entry(self, declaration: StorageDeclaration) -> Entry:
        """A bank entry as the runtimes see it: size, matrix, how it is initialised."""
        bank = next((b.name for b in self.declarations.banks.values() if b.role != "copies"),
                    None)
        storage = self.storage_of(declaration, bank) if bank else None
        count, stack = (storage.item_count, storage.stack) if storage else (0, None)
        init, std = "zeros", None
        if declaration.init is not None:
            init = declaration.init.arguments[0].text
            if init == "normal" and len(declaration.init.arguments) == 2:
                value = self.eval(declaration.init.arguments[1], {}, ())
                std = None if value is POISON else float(value)
        return Entry(declaration.name, count * (stack or 1), stack, declaration.matrix,
                     init, std, declaration.span)

    def roles(self) -> tuple[dict[str, object], dict[str, Span]]:
        """What each declared role names: a buffer's label, or a Nat's value."""
        values, spans = {}, {}
        for role, binding in self.declarations.roles.items():
            spans[role] = binding.span
            if ROLES[role].kind == "Schedule":
                values[role] = binding.value.text  # a definition's name: not evaluated here
            elif ROLES[role].kind == "buffer":
                storage = self.storage_of(self.declarations.storages[binding.value.text], None)
                if storage is None:
                    continue
                values[role] = storage.label  # its element type is checked in elaboration
            elif ROLES[role].kind == "Float":
                value = self.eval(binding.value, {}, ())
                if value is not POISON:
                    values[role] = float(value)
            else:
                value = self.natural_constant(binding.value, f"role '{role}'",
                                              ROLES[role].least)
                if value is not None:
                    values[role] = value
        return values, spans

    def configuration_note(self) -> Note:
        """Where the values came from: the configuration, and what --set changed."""
        changed = ", ".join(f"{name}={value}" for name, value in self.overrides.items())
        return Note(f"in config '{self.config}'" + (f" with --set {changed}" if changed else ""))

    def check_requirements(self, roles: dict) -> None:
        """The model's declared requirements (`require`), and what the roles themselves
        imply: rows = batch x context, the ids, targets and loss buffers one value a row,
        width = heads x head width."""
        from ..core.roles import ROLES
        for requirement in self.declarations.requirements:
            # naturals, 0 included (a switch at most 1); `multiple` holds for no divisor 0
            left = self.natural_constant(requirement.left, "a requirement's value", 0)
            right = self.natural_constant(requirement.right, "a requirement's value", 0)
            if left is None or right is None:
                continue
            _, holds, words = REQUIREMENTS[requirement.kind]
            if not holds(left, right):
                why = [Note(requirement.doc.replace("\n", " "))] if requirement.doc else []
                self.report.error(
                    f"the model requires {_shown(requirement.left, left)} to be {words} "
                    f"{_shown(requirement.right, right)}", requirement.span, *why,
                    self.configuration_note())
        relations = [("rows", ("batch", "context"), "batch x context")]
        relations += [(buffer, ("rows",), "one value a row") for buffer in ("ids", "targets",
                                                                            "loss")]
        relations.append(("width", ("heads", "headWidth"), "heads x headWidth"))
        for role, parts, meaning in relations:
            if role not in roles or not all(p in roles for p in parts):
                continue
            value = roles[role]
            actual = self.storages[value].count if ROLES[role].kind == "buffer" else value
            expected = 1
            for part in parts:
                expected *= roles[part]
            if actual != expected:
                self.report.error(
                    f"role '{role}' is {actual}, but the other roles make it {expected} "
                    f"({meaning})", self.declarations.roles[role].span,
                    self.configuration_note())

    def bank_entries(self, bank: str) -> list[StorageDeclaration]:
        copies = self.declarations.banks[bank].role == "copies"
        return [s for s in self.declarations.storages.values()
                if s.kind == "entry" and (s.matrix or not copies)]

    # ---- terms -------------------------------------------------------------------

    def eval(self, term: Term, env: dict, trace: tuple):
        kind = term.__class__
        if kind is Name:
            text = term.text
            if text in env:
                return env[text]
            arity = _ARITIES.get(text)
            if arity is not None:
                return self.call(text, [], [], term.span, trace) if arity == 0 \
                    else Partial(text, arity, ())
            try:
                return self.global_value(text, term.span)
            except EvaluationError as error:
                self.report.error(error.message, error.span, *error.notes)
                return POISON
        if kind is Apply:
            function = self.eval(term.function, env, trace)
            arguments = term.arguments
            if function.__class__ is Partial and not function.arguments \
                    and function.arity == len(arguments):
                # The common case: a built-in given all its arguments at once.
                values = [self.eval(argument, env, trace) for argument in arguments]
                for value in values:
                    if value is POISON:
                        return POISON
                return self.call(function.name, values, [a.span for a in arguments],
                                 term.span, trace)
            for argument in arguments:
                value = self.eval(argument, env, trace)
                function = self.apply(function, value, argument.span, term.span, trace)
            return function
        if kind is Natural:
            return term.value
        if kind is Integer:
            return Int(term.value)
        if kind is Floating:
            return term.value
        if kind is Lambda:
            return Closure(term, env)
        return POISON

    def apply(self, function, value, argument_span: Span, span: Span, trace: tuple):
        if function is POISON:
            return POISON
        if function.__class__ is Closure:
            lam = function.function
            inner = trace if trace and trace[-1] is span else trace + (span,)
            return self.eval(lam.body, {**function.env, lam.binder.text: value}, inner)
        arguments = function.arguments + ((value, argument_span),)
        if len(arguments) < function.arity:
            return Partial(function.name, function.arity, arguments)
        if any(v is POISON for v, _ in arguments):
            return POISON
        return self.call(function.name, [v for v, _ in arguments], [s for _, s in arguments],
                         span, trace)

    def call(self, name: str, values: list, spans: list, span: Span, trace: tuple):
        """A built-in with all its arguments; its errors become diagnostics and POISON, with
        the chain of calls that led there, innermost first, back to the user's own line."""
        try:
            return getattr(self, "_" + name)(values, spans, span, trace)
        except EvaluationError as error:
            self.report.error(error.message, error.span, *error.notes,
                              *chain_notes(trace, self.repeat_spans))
            return POISON

    # ---- primitives --------------------------------------------------------------

    def _not_affine(self, why: str, span: Span, value: Nat) -> EvaluationError:
        variables = [v for v, _ in value.terms] if isinstance(value, Affine) else []
        notes = [Note(f"the repeat of '{v.name}' is here", self.loop_spans[v])
                 for v in variables if v in self.loop_spans]
        return EvaluationError(f"not affine in the repeat index: {why}", span, *notes)

    def _constant_float(self, value, span: Span) -> float:
        if isinstance(value, Affine):
            raise self._not_affine("a Float cannot depend on a repeat index", span, value)
        return float(value)

    def _cgThen(self, values, spans, span, trace):
        first, second = values
        return self.schedule(first + second, first.launches + second.launches,
                             first.unrolled + second.unrolled, span)

    def _cgConcurrently(self, values, spans, span, trace):
        """Branches that may run at the same time; a branch that is itself concurrent
        branches is spliced in (the term is associative), an empty one dropped."""
        branches = []
        for value in values:
            if len(value) == 1 and isinstance(value[0], Concurrent):
                branches.extend(value[0].branches)
            elif value:
                branches.append(tuple(value))
        nodes = (Concurrent(tuple(branches), span),) if len(branches) > 1 else \
            tuple(node for branch in branches for node in branch)
        return self.schedule(nodes, sum(v.launches for v in values),
                             sum(v.unrolled for v in values), span)

    def _cgNothing(self, values, spans, span, trace):
        return Schedule(())

    def _cgPhase(self, values, spans, span, trace):
        body = values[1]
        return self.schedule((PhaseRegion(values[0].name, body, span),), body.launches,
                             body.unrolled, span)

    def _cgLaunch(self, values, spans, span, trace):
        image, gx, gy, gz, slots = values
        pointers = tuple(b for b in slots.bindings if isinstance(b, PointerBinding))
        scalars = tuple(b for b in slots.bindings if isinstance(b, ScalarBinding))
        record = self.image(image.name)
        extents = self.extents(record, (gx, gy, gz), scalars)
        return self.schedule((Launch(record, (gx, gy, gz), pointers, scalars, span, trace,
                                     extents),), 1, 1, span)

    # ---- images and extents ------------------------------------------------------

    def image(self, name: str) -> Image:
        """The image's signature in this configuration: block and scalar defaults evaluated."""
        if name in self.images:
            return self.images[name]
        declaration = self.declarations.images[name]
        block = None
        if declaration.block is not None:
            dims = [self.natural_constant(t, "a block dimension") for t in declaration.block]
            block = tuple(dims) if None not in dims else None
        pointers = {index: PointerParameter(index, p.name, p.element, p.access,
                                            p.extent is not None, p.span)
                    for index, p in declaration.pointers.items()}
        scalars = {}
        for index, s in declaration.scalars.items():
            default = None
            if s.default is not None:
                default = self.eval(s.default, {}, ())
                default = None if default is POISON else default
            scalars[index] = ScalarParameter(index, s.name, s.type, default, s.span)
        # A collective is a host call of the communicator's library (NCCL on a GPU).
        library = "nccl" if declaration.collective is not None else declaration.library
        record = Image(name, block, library, pointers, scalars,
                       frozenset(declaration.aliases), declaration.span, declaration.doc,
                       dict(declaration.alignments), dict(declaration.covers),
                       declaration.collective, declaration.device_state)
        self.images[name] = record
        return record

    def extents(self, image: Image, grid, scalars) -> dict:
        """The extent of each pointer that declares one, at this launch. Computed only when
        every scalar is given once with a value of its type; the checker reports the rest."""
        environment = dict(zip(GRID_NAMES[:3], grid))
        environment |= dict(zip(GRID_NAMES[3:], image.block or (1, 1, 1)))
        for index, parameter in image.scalars.items():
            bound = [b for b in scalars if b.index == index]
            if len(bound) > 1:
                return {}
            if bound:
                value, is_float = bound[0].value, bound[0].kind == "Float"
            elif parameter.default is not None:
                value, is_float = parameter.default, isinstance(parameter.default, float)
            else:
                return {}
            if is_float != (parameter.type == "float32"):
                return {}
            environment[parameter.name] = value
        declaration = self.declarations.images[image.name]
        return {index: self.extent(p.extent, environment)
                for index, p in declaration.pointers.items() if p.extent is not None}

    def quietly(self, term: Term, environment: dict):
        """A formula's value, or the first error it raises: its errors are not the user's
        unless the checker says so."""
        report, self.report = self.report, Reporter()
        try:
            value = self.eval(term, environment, ())
            if self.report.diagnostics or value is POISON:
                first = next((d for d in self.report.diagnostics), None)
                raise EvaluationError(first.message if first else "cannot be evaluated",
                                      first.span if first else term.span)
            return int(value) if isinstance(value, Int) else value
        finally:
            self.report = report

    def extent(self, term: Term, environment: dict) -> Extent:
        try:
            return Extent(value=self.quietly(term, environment))
        except EvaluationError:
            pass
        # Not affine (a minimum that changes sides, say): try every iteration, if few.
        variables = sorted({v for value in environment.values() if isinstance(value, Affine)
                            for v, _ in value.terms}, key=lambda v: v.number)
        total = 1
        for variable in variables:
            total *= variable.count
        if total > ENUMERATION_LIMIT:
            return Extent(variables=tuple(variables), problem=(
                f"not affine in the repeat indices, and {total} iterations are too many to "
                "try one by one"))
        table = {}
        for point in itertools.product(*(range(v.count) for v in variables)):
            values = dict(zip(variables, point))
            concrete = {name: (value.at(values) if isinstance(value, Affine) else value)
                        for name, value in environment.items()}
            try:
                table[point] = self.quietly(term, concrete)
            except EvaluationError as error:
                where = ", ".join(f"{v.name} = {i}" for v, i in values.items())
                return Extent(variables=tuple(variables), problem=(
                    f"cannot be evaluated{' at ' + where if where else ''}: {error.message}"))
        return Extent(variables=tuple(variables), table=table)

    def _nvidiaAffineLaunchRepeat(self, values, spans, span, trace):
        count, body = values
        if isinstance(count, Affine):
            raise EvaluationError("the repeat count must not depend on an enclosing repeat index",
                                  spans[0])
        name = body.function.binder.text if isinstance(body, Closure) else "i"
        variable = LoopVariable.fresh(name, count)
        self.loop_spans[variable] = span
        self.repeat_spans.add(span)
        if count == 0:
            self.report.warning("this repeat runs zero times", spans[0])
            return Schedule(())
        result = self.apply(body, Affine.of(variable), spans[1], span, trace)
        if result is POISON:
            return POISON
        return self.schedule((Repeat(variable, result, span),), result.launches,
                             result.unrolled * count, span)

    def schedule(self, nodes: tuple, launches: int, unrolled: int, span: Span) -> "Schedule":
        """A schedule value, with its size: the launches it holds (a repeat's body once)
        and the launches it makes (unrolled). Either past its limit is an error here, long
        before the program would fill memory (a definition that doubles itself 60 times)."""
        if launches > LAUNCH_LIMIT or unrolled > UNROLLED_LIMIT:
            what, limit, count = (("holds", LAUNCH_LIMIT, launches) if launches > LAUNCH_LIMIT
                                  else ("makes", UNROLLED_LIMIT, unrolled))
            raise EvaluationError(
                f"this schedule {what} {count:,} launches, more than cgc's limit of "
                f"{limit:,} (a definition that repeats itself? a repeat too long?)", span)
        result = Schedule(nodes)
        result.launches, result.unrolled = launches, unrolled
        return result

    def _cgPointer(self, values, spans, span, trace):
        index, view, rest = values
        return Slots((PointerBinding(index.index, view, span),) + rest.bindings)

    def _cgSlot(self, values, spans, span, trace):
        index, value, rest = values
        kind = "Float" if isinstance(value, float) else "Int" if isinstance(value, Int) else "Nat"
        return Slots((ScalarBinding(index.index, value, kind, span),) + rest.bindings)

    def _cgNoSlots(self, values, spans, span, trace):
        return Slots(())

    def _index(self, value, span, what):
        if isinstance(value, Affine):
            raise self._not_affine(f"{what} must be a constant", span, value)
        return value

    def _cgArgument(self, values, spans, span, trace):
        return ArgumentIndex(self._index(values[0], spans[0], "a pointer index"))

    def _cgScalar(self, values, spans, span, trace):
        return ScalarIndex(self._index(values[0], spans[0], "a scalar index"))

    def _cgParameter(self, values, spans, span, trace):
        bank, entry = values
        declaration = self.declarations.storages[entry.name]
        bank_declaration = self.declarations.banks[bank.name]
        if bank_declaration.role == "copies" and not declaration.matrix:
            raise EvaluationError(
                f"entry '{entry.name}' has no copy in bank '{bank.name}', which holds the "
                "16-bit copies of matrices only", spans[1],
                Note("declare the entry with (matrix) to give it a copy", declaration.span))
        storage = self.storage_of(declaration, bank.name)
        return View(storage, 0, storage.count) if storage else POISON

    def bank_layout(self, bank: str) -> tuple[dict[str, int], int] | None:
        """Each entry's offset in the bank, in elements, and the bank's padded size."""
        if bank not in self.layouts:
            offsets, offset = {}, 0
            for declaration in self.bank_entries(bank):
                storage = self.storage_of(declaration, bank)
                if storage is None:
                    return None
                offsets[declaration.name] = offset
                offset += -(-storage.count // BANK_ALIGNMENT) * BANK_ALIGNMENT
            self.layouts[bank] = (offsets, offset)
        return self.layouts[bank]

    def whole_bank(self, bank: str) -> StorageRef | None:
        key = f"{bank}.*"
        if key not in self.storages:
            layout = self.bank_layout(bank)
            if layout is None:
                return None
            self.storages[key] = StorageRef("bank", bank, None,
                                            self.declarations.banks[bank].element, layout[1], None)
        return self.storages[key]

    def _cgBankAll(self, values, spans, span, trace):
        storage = self.whole_bank(values[0].name)
        return View(storage, 0, storage.count) if storage else POISON

    def _cgEntries(self, values, spans, span, trace):
        """The entries of a bank from the first named through the last, in declaration
        order, as one buffer, each with the padding that follows it in the bank."""
        bank, first, last = values
        storage = self.whole_bank(bank.name)
        if storage is None:
            return POISON
        offsets = self.layouts[bank.name][0]
        for entry, entry_span in ((first, spans[1]), (last, spans[2])):
            if entry.name not in offsets:
                raise EvaluationError(
                    f"entry '{entry.name}' has no copy in bank '{bank.name}', which holds the "
                    "16-bit copies of matrices only", entry_span,
                    Note("declare the entry with (matrix) to give it a copy",
                         self.declarations.storages[entry.name].span))
        if offsets[last.name] < offsets[first.name]:
            raise EvaluationError(
                f"entry '{last.name}' comes before '{first.name}' in bank '{bank.name}': "
                "(cgEntries BANK FIRST LAST) takes the entries in their declaration order",
                spans[2], Note(f"'{last.name}' is declared here",
                               self.declarations.storages[last.name].span))
        end = self.storage_of(self.declarations.storages[last.name], bank.name)
        if end is None:
            return POISON
        start = offsets[first.name]
        padded = -(-end.count // BANK_ALIGNMENT) * BANK_ALIGNMENT
        return View(storage, start, offsets[last.name] + padded - start)

    def _cgCount(self, values, spans, span, trace):
        return values[0].count

    def _cgElements(self, values, spans, span, trace):
        """COUNT elements of a buffer from its element START: a shard of a bank, say."""
        view, start, count = values
        count = self._index(count, spans[2], "the count of (cgElements BUFFER START COUNT)")
        high = bounds(start)[1] + count
        if high > view.count:
            start_text = "" if isinstance(start, int) else \
                f" (START {format_nat(start)} reaches {bounds(start)[1]})"
            named = view.storage.item_count if view.item is not None else view.storage.count
            whole = "" if view.count == named else "a view of "  # narrower than its name
            raise EvaluationError(
                f"(cgElements BUFFER START COUNT) reaches element {high - 1} of {whole}"
                f"'{view.label}'{start_text}, which has {view.count} (0 .. {view.count - 1})",
                span)
        return View(view.storage, affine.add(view.offset, start), count, view.item)

    def _cgRank(self, values, spans, span, trace):
        return self.rank

    def _cgRanks(self, values, spans, span, trace):
        return self.ranks

    def _cgArena(self, values, spans, span, trace):
        storage = self.storage_of(self.declarations.storages[values[0].name], None)
        return View(storage, 0, storage.count) if storage else POISON

    def _cgItem(self, values, spans, span, trace):
        view, item = values
        storage = view.storage
        if storage.stack is None or view.item is not None:
            raise EvaluationError(
                f"cgItem takes a stacked buffer (declared with (stack N)); '{view.label}' "
                "is not one", spans[0])
        low, high = bounds(item)
        if high >= storage.stack:
            raise EvaluationError(
                f"item {format_nat(item)} is out of range: '{storage.label}' has "
                f"{storage.stack} items (0 .. {storage.stack - 1}), and the index reaches {high}",
                spans[1])
        return View(storage, affine.scale(item, storage.item_count), storage.item_count, item)

    # natural arithmetic

    def _naturalAdd(self, values, spans, span, trace):
        return affine.add(values[0], values[1])

    def _naturalMultiply(self, values, spans, span, trace):
        left, right = values
        if isinstance(left, Affine) and isinstance(right, Affine):
            raise self._not_affine("naturalMultiply of two values that both depend on it",
                                   span, left)
        if isinstance(left, Affine):
            return affine.scale(left, right)
        return affine.scale(right, left)

    def _divisor(self, value, span):
        if isinstance(value, Affine):
            raise self._not_affine("the divisor depends on it", span, value)
        if value == 0:
            raise EvaluationError("division by zero", span)
        return value

    def _naturalDivideUnchecked(self, values, spans, span, trace):
        dividend, divisor = values[0], self._divisor(values[1], spans[1])
        if isinstance(dividend, int):
            return dividend // divisor
        if any(k % divisor for _, k in dividend.terms):
            raise self._not_affine(f"({format_nat(dividend)}) / {divisor} is not affine: a "
                                   "coefficient is not a multiple of the divisor", span, dividend)
        return affine.normal(dividend.constant // divisor,
                             {v: k // divisor for v, k in dividend.terms})

    def _naturalDivideCeiling(self, values, spans, span, trace):
        divisor = self._divisor(values[1], spans[1])
        return self._naturalDivideUnchecked([affine.add(values[0], divisor - 1), divisor],
                                            spans, span, trace)

    def _naturalModulo(self, values, spans, span, trace):
        dividend, divisor = values[0], self._divisor(values[1], spans[1])
        if isinstance(dividend, Affine):
            raise self._not_affine("naturalModulo of a value that depends on it", span, dividend)
        return dividend % divisor

    def _naturalSubtract(self, values, spans, span, trace):
        result = affine.add(values[0], values[1], -1)
        low, _ = bounds(result)
        if low < 0:
            raise EvaluationError(
                f"naturalSubtract underflows: {format_nat(values[0])} - {format_nat(values[1])} "
                f"reaches {low}; use naturalSaturatingSubtract to stop at zero", span)
        return result

    def _naturalSaturatingSubtract(self, values, spans, span, trace):
        result = affine.add(values[0], values[1], -1)
        low, high = bounds(result)
        if low >= 0:
            return result
        if high <= 0:
            return 0
        raise self._not_affine(
            f"{format_nat(values[0])} - {format_nat(values[1])} saturates at zero for some "
            "iterations only", span, result)

    def _extreme(self, values, span, pick):
        left, right = values
        if isinstance(left, int) and isinstance(right, int):
            return pick(left, right)
        difference = affine.add(left, right, -1)
        low, high = bounds(difference)
        if low >= 0:
            return left if pick is max else right
        if high <= 0:
            return right if pick is max else left
        raise self._not_affine("the larger of the two changes within the repeat", span,
                               difference)

    def _naturalMinimum(self, values, spans, span, trace):
        return self._extreme(values, span, min)

    def _naturalMaximum(self, values, spans, span, trace):
        return self._extreme(values, span, max)

    # integers and floats

    def _integerOfNatural(self, values, spans, span, trace):
        return Int(self._index(values[0], spans[0], "an Int"))

    def _integerNegate(self, values, spans, span, trace):
        return Int(-values[0])

    def _floatOfNatural(self, values, spans, span, trace):
        return self._constant_float(values[0], spans[0])

    def _floatAdd(self, values, spans, span, trace):
        return values[0] + values[1]

    def _floatSubtract(self, values, spans, span, trace):
        return values[0] - values[1]

    def _floatMultiply(self, values, spans, span, trace):
        return values[0] * values[1]

    def _floatDivide(self, values, spans, span, trace):
        if values[1] == 0.0:
            raise EvaluationError("division by zero", spans[1])
        return values[0] / values[1]

    def _floatSquareRoot(self, values, spans, span, trace):
        if values[0] < 0:
            raise EvaluationError(f"square root of a negative number ({values[0]})", spans[0])
        return values[0] ** 0.5

    def _float32Log2E(self, values, spans, span, trace):
        return LOG2_E


def evaluate_program(scope: Scope, declarations: Declarations, source: str, entry: str,
                     config: str, overrides: dict[str, object], report: Reporter,
                     ranks: tuple[int, int] = (0, 1)) -> Program:
    """The launch program of `entry`, for rank `ranks[0]` of `ranks[1]` (cgRank, cgRanks)."""
    evaluator = Evaluator(scope, declarations, config, overrides, report, ranks)
    report.raise_if_errors()
    # What the kernels assume of the shape first: a configuration that breaks it would only
    # produce the consequences (a division by zero, a bad extent) further on.
    roles, role_spans = evaluator.roles()
    for binding in declarations.more_roles:  # a schedule role given for several schedules
        if binding.value.text == entry:
            roles[binding.role], role_spans[binding.role] = entry, binding.span
    report.raise_if_errors()
    evaluator.check_requirements(roles)
    report.raise_if_errors()
    declaration = scope.declarations[entry]
    body = evaluator.global_value(entry, declaration.name.span)
    if report.has_errors or body is POISON:
        report.raise_if_errors()
    images = {name: evaluator.image(name) for name in declarations.images}
    for storage in declarations.storages.values():
        if storage.kind != "entry":
            evaluator.storage_of(storage, None)
    for bank in declarations.banks:
        evaluator.bank_layout(bank)
    entries = tuple(evaluator.entry(s) for s in declarations.storages.values()
                    if s.kind == "entry")
    constants = {name: evaluator.constant(name, declarations.constants[name].span)
                 for name in declarations.constants}
    warnings = [d for d in report.diagnostics if d.severity == "warning"]
    banks = {name: Bank(name, b.element, b.role, b.span) for name, b in declarations.banks.items()}
    phases = {name: Phase(name, p.stage, tuple(n.text for n in p.writes),
                          tuple(n.span for n in p.writes), p.span)
              for name, p in declarations.phases.items()}
    program = Program(source, entry, config, evaluator.low, body, constants,
                      dict(evaluator.storages), images, warnings, dict(evaluator.layouts), banks,
                      phases, entries, roles, role_spans, rank=ranks[0], ranks=ranks[1])
    _without_unused_banks(program)
    program.sharded = tuple(name for name, storage in declarations.storages.items()
                            if storage.sharded and name in program.storages)
    program.overrides = tuple(overrides.items())
    return program


def _without_unused_banks(program: Program) -> None:
    """A bank no launch of the program touches is not laid out, so never allocated (a
    sharded step keeps the moments in shards, a sampler needs no gradients): its entries
    leave the program's storages; and so does a step buffer no launch touches and no role
    names (one another schedule of the loaded files declares, such as ZeRO-1's shards)."""
    touched = {binding.view.storage.name for launch, _, _ in program.launches()
               for binding in launch.pointers}
    for bank in set(program.bank_layouts) - touched:
        del program.bank_layouts[bank]
        for label in [label for label, storage in program.storages.items()
                      if storage.kind == "bank" and storage.name == bank]:
            del program.storages[label]
    named = {value for value in program.roles.values() if isinstance(value, str)}
    for label in [label for label, storage in program.storages.items()
                  if storage.kind == "buffer" and label not in touched | named]:
        del program.storages[label]
