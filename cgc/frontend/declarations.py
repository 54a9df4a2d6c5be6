"""Elaborates the non-def declarations into records the type checker and evaluator read.

The image record is the single source of truth for a kernel's signature: block shape,
pointer arguments (element type, access, extent formula), scalar arguments (type,
default) and the pointer pairs that may alias. The checker and the emitter both read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core.diagnostics import Note, Reporter, did_you_mean
from ..core.elements import ELEMENT_NAMES, LOW_CHOICES, SCALAR_TYPES
from ..core.roles import ROLES
from .resolve import Scope
from .syntax import Clause, Declaration, Floating, Integer, Name, Natural, Span, Term

ACCESSES = ("read", "write", "readwrite", "accumulate")
BANK_ROLES = ("parameters", "gradients", "state", "copies")
STAGES = ("data", "forward", "backward", "optimizer")
INITIALISERS = ("normal", "ones", "zeros")
# The collectives an image may stand for, and the reductions each takes (none for the
# all-gather, which copies): the mean over the ranks (the gradients), the sum (partial sums
# of a norm), and the shard forms of ZeRO-1 (docs/language.md, "Collectives"). A collective
# image runs on the host program's communicator (NCCL on GPUs, MPI on CPU ranks), not as a
# kernel.
COLLECTIVE_REDUCTIONS = {"allReduce": ("average", "sum"), "reduceScatter": ("average",),
                         "allGather": ()}
COLLECTIVES = tuple(COLLECTIVE_REDUCTIONS)
# The element types a collective carries (what every communicator can reduce).
COLLECTIVE_ELEMENTS = ("float32",)


@dataclass(frozen=True)
class PointerParameter:
    index: int
    name: str
    element: str
    access: str
    extent: Term | None
    span: Span


@dataclass(frozen=True)
class ScalarParameter:
    index: int
    name: str
    type: str
    default: Term | None
    span: Span


@dataclass
class ImageDeclaration:
    name: str
    block: tuple[Term, Term, Term] | None
    library: str | None
    pointers: dict[int, PointerParameter]
    scalars: dict[int, ScalarParameter]
    aliases: set[frozenset[int]]
    span: Span
    doc: str | None
    alignments: dict[int, tuple[int, Span]] = field(default_factory=dict)  # pointer -> bytes
    covers: dict[int, Span] = field(default_factory=dict)  # pointers a launch must cover
    collective: tuple[str, str] | None = None  # (operation, reduction) of a collective image
    device_state: Span | None = None  # (deviceState): the kernel keeps state of its own


@dataclass
class StorageDeclaration:
    """A buffer, an arena slot or a bank entry: element count, optional stack of items."""

    kind: str  # buffer | arena | entry
    name: str
    element: str | None  # None for entries: the bank decides
    count: Term
    stack: Term | None
    span: Span
    matrix: bool = False
    init: Clause | None = None
    sharded: bool = False  # a buffer: one rank's shard of a whole (docs/language.md)


@dataclass
class BankDeclaration:
    name: str
    element: str
    role: str
    span: Span


@dataclass
class PhaseDeclaration:
    name: str
    stage: str | None
    writes: tuple[Name, ...]
    span: Span


@dataclass
class ConstantDeclaration:
    name: str
    type_term: Term
    default: Term | None
    span: Span


@dataclass
class ConfigDeclaration:
    name: str
    parent: Name | None
    values: dict[str, tuple[Term, Span]]
    span: Span


@dataclass
class RoleBinding:
    role: str
    value: Term
    span: Span  # the clause
    declaration: str  # the roles declaration it is in


@dataclass
class Requirement:
    """(multiple A B): A is a multiple of B; (equal A B): A equals B; (atMost A B): A is at
    most B. Naturals, checked in
    every configuration: what the kernels and the runtime assume of the model's shape."""

    kind: str  # a key of REQUIREMENTS
    left: Term
    right: Term
    span: Span  # the clause
    doc: str | None


# Each requirement: how it reads in the language's help, the test, and how a failure reads.
REQUIREMENTS = {
    "multiple": ("is a multiple of", lambda a, b: b > 0 and a % b == 0, "a multiple of"),
    "equal": ("equals", lambda a, b: a == b, "equal to"),
    "atMost": ("is at most", lambda a, b: a <= b, "at most"),
}


@dataclass
class Declarations:
    images: dict[str, ImageDeclaration] = field(default_factory=dict)
    storages: dict[str, StorageDeclaration] = field(default_factory=dict)
    banks: dict[str, BankDeclaration] = field(default_factory=dict)
    phases: dict[str, PhaseDeclaration] = field(default_factory=dict)
    constants: dict[str, ConstantDeclaration] = field(default_factory=dict)
    configs: dict[str, ConfigDeclaration] = field(default_factory=dict)
    roles: dict[str, RoleBinding] = field(default_factory=dict)
    requirements: list[Requirement] = field(default_factory=list)
    # A schedule role given again for another schedule (several whole steps: train.cg's,
    # train_recompute.cg's, train_parallel.cg's): the program whose entry it names takes it
    # (evaluate.py).
    more_roles: list[RoleBinding] = field(default_factory=list)


def _natural(term: Term, report: Reporter, what: str) -> int | None:
    if isinstance(term, Natural):
        return term.value
    report.error(f"{what} must be a natural number literal", term.span)
    return None


def _keyword(term: Term, allowed, report: Reporter, what: str) -> str | None:
    if isinstance(term, Name) and term.text in allowed:
        return term.text
    if isinstance(term, Name):
        notes = did_you_mean(term.text, allowed)
        report.error(f"unknown {what} '{term.text}': expected {', '.join(allowed)}", term.span,
                     *notes)
    else:
        report.error(f"expected {what} ({', '.join(allowed)})", term.span)
    return None


def _arity(clause: Clause, low: int, high: int, form: str, report: Reporter) -> bool:
    if low <= len(clause.arguments) <= high:
        return True
    report.error(f"malformed ({clause.keyword.text} ...) clause: expected {form}", clause.span)
    return False


class _Elaborator:
    def __init__(self, scope: Scope, report: Reporter):
        self.scope = scope
        self.report = report
        self.result = Declarations()

    def term(self, term: Term, owner: str, grid: bool = False, bound=()) -> Term:
        self.scope.resolve_term(term, owner, bound=bound, grid=grid)
        return term

    def element(self, term: Term) -> str | None:
        return _keyword(term, ELEMENT_NAMES, self.report, "element type")

    def clauses(self, declaration: Declaration, allowed: dict[str, tuple[int, int, str]],
                once=()):
        """Validates clause keywords and arities; yields (keyword, clause) for good ones.
        The clauses in `once` say one thing of the declaration (its stack, its role, its
        block): each is given at most once."""
        seen: dict[str, Clause] = {}
        for clause in declaration.clauses:
            keyword = clause.keyword.text
            if keyword in once:
                if keyword in seen:
                    self.report.error(f"the clause '({keyword} ...)' is given twice in "
                                      f"'{declaration.name.text}': give it once",
                                      clause.span, Note("it is first given here",
                                                        seen[keyword].span))
                    continue
                seen[keyword] = clause
            if keyword not in allowed:
                notes = did_you_mean(keyword, allowed)
                self.report.error(
                    f"unknown clause '({keyword} ...)' in "
                    f"{'an' if declaration.kind[0] in 'aeiou' else 'a'} {declaration.kind} "
                    "declaration; "
                    f"expected one of: {', '.join(allowed) or 'none'}",
                    clause.keyword.span, *notes)
                continue
            low, high, form = allowed[keyword]
            if _arity(clause, low, high, form, self.report):
                yield keyword, clause

    def storage(self, declaration: Declaration) -> None:
        name = declaration.name.text
        if declaration.kind == "entry":
            element, (count,) = None, declaration.terms
        else:
            element_term, count = declaration.terms
            element = self.element(element_term)
        allowed = {"stack": (1, 1, "(stack COUNT)")}
        if declaration.kind == "buffer":
            allowed |= {"sharded": (0, 0, "(sharded)")}
        if declaration.kind == "entry":
            allowed |= {"matrix": (0, 0, "(matrix)"),
                        "init": (1, 2, "(init normal STD), (init ones) or (init zeros)")}
        record = StorageDeclaration(declaration.kind, name, element, self.term(count, name), None,
                                    declaration.span)
        for keyword, clause in self.clauses(declaration, allowed, once=allowed):
            if keyword == "stack":
                record.stack = self.term(clause.arguments[0], name)
            elif keyword == "matrix":
                record.matrix = True
            elif keyword == "sharded":
                record.sharded = True
            elif keyword == "init":
                kind = _keyword(clause.arguments[0], INITIALISERS, self.report, "initialiser")
                if kind == "normal" and len(clause.arguments) != 2:
                    self.report.error("(init normal STD) needs the standard deviation", clause.span)
                for argument in clause.arguments[1:]:
                    self.term(argument, name)
                record.init = clause
        self.result.storages[name] = record

    def bank(self, declaration: Declaration) -> None:
        (element_term,) = declaration.terms
        role = None
        for _, clause in self.clauses(declaration, {"role": (1, 1, "(role ROLE)")},
                                      once=("role",)):
            role = _keyword(clause.arguments[0], BANK_ROLES, self.report, "bank role")
        if role is None and not any(c.keyword.text == "role" for c in declaration.clauses):
            self.report.error(f"bank '{declaration.name.text}' needs a role: "
                              f"(role {' | '.join(BANK_ROLES)})", declaration.name.span)
        element = self.element(element_term)
        self.result.banks[declaration.name.text] = BankDeclaration(
            declaration.name.text, element or "float32", role or "parameters", declaration.span)

    def phase(self, declaration: Declaration) -> None:
        stage, writes = None, []
        allowed = {"stage": (1, 1, "(stage STAGE)"), "writes": (1, 64, "(writes BANK ...)")}
        for keyword, clause in self.clauses(declaration, allowed, once=("stage",)):
            if keyword == "stage":
                stage = _keyword(clause.arguments[0], STAGES, self.report, "stage")
            else:
                for argument in clause.arguments:
                    if isinstance(argument, Name) and argument.text in self.scope.declarations \
                            and self.scope.declarations[argument.text].kind == "bank":
                        writes.append(argument)
                    elif isinstance(argument, Name):
                        banks = [d.name.text for d in self.scope.of_kind("bank")]
                        notes = did_you_mean(argument.text, banks)
                        self.report.error(f"'{argument.text}' is not a bank", argument.span,
                                          *notes)
                    else:
                        self.report.error("(writes ...) lists bank names", argument.span)
        self.result.phases[declaration.name.text] = PhaseDeclaration(
            declaration.name.text, stage, tuple(writes), declaration.span)

    def image(self, declaration: Declaration) -> None:
        name = declaration.name.text
        record = ImageDeclaration(name, None, None, {}, {}, set(), declaration.span,
                                  declaration.doc)
        allowed = {
            "block": (3, 3, "(block X Y Z)"),
            "library": (1, 1, "(library cublas)"),
            "pointer": (4, 5, "(pointer INDEX NAME ELEMENT ACCESS [EXTENT])"),
            "scalar": (3, 4, "(scalar INDEX NAME TYPE [DEFAULT])"),
            "alias": (2, 2, "(alias POINTER POINTER)"),
            "aligned": (2, 64, "(aligned BYTES POINTER ...)"),
            "covers": (1, 64, "(covers POINTER ...)"),
            "collective": (1, 2, "(collective OPERATION [REDUCTION])"),
            "deviceState": (0, 0, "(deviceState)"),
        }
        clauses = list(self.clauses(declaration, allowed,
                                    once=("block", "library", "collective", "deviceState")))
        scalar_names = [c.arguments[1].text for k, c in clauses
                        if k == "scalar" and isinstance(c.arguments[1], Name)]
        for keyword, clause in clauses:
            arguments = clause.arguments
            if keyword == "block":
                record.block = tuple(self.term(a, name) for a in arguments)
            elif keyword == "library":
                record.library = _keyword(arguments[0], ("cublas",), self.report, "library")
            elif keyword == "collective":
                record.collective = self.collective_form(arguments, clause)
            elif keyword in ("pointer", "scalar"):
                index = _natural(arguments[0], self.report, f"a {keyword} index")
                if not isinstance(arguments[1], Name):
                    self.report.error(f"a {keyword} argument needs a name", arguments[1].span)
                    continue
                table = record.pointers if keyword == "pointer" else record.scalars
                if index is not None and index in table:
                    self.report.error(f"{keyword} {index} of image '{name}' is declared twice",
                                      clause.span,
                                      Note("the first declaration is here", table[index].span))
                    continue
                if keyword == "pointer":
                    element = self.element(arguments[2])
                    access = _keyword(arguments[3], ACCESSES, self.report, "access")
                    extent = (self.term(arguments[4], name, grid=True, bound=scalar_names)
                              if len(arguments) == 5 else None)
                    if index is not None and element and access:
                        table[index] = PointerParameter(index, arguments[1].text, element, access,
                                                        extent, clause.span)
                else:
                    scalar_type = _keyword(arguments[2], SCALAR_TYPES, self.report, "scalar type")
                    default = self.term(arguments[3], name) if len(arguments) == 4 else None
                    if index is not None and scalar_type:
                        table[index] = ScalarParameter(index, arguments[1].text, scalar_type,
                                                       default, clause.span)
            elif keyword == "deviceState":
                record.device_state = clause.span
            elif keyword == "alias":
                pair = [_natural(a, self.report, "an aliased pointer index") for a in arguments]
                if None not in pair:
                    record.aliases.add(frozenset(pair))
            elif keyword == "covers":
                for argument in arguments:
                    index = _natural(argument, self.report, "a covered pointer index")
                    if index is not None:
                        record.covers[index] = clause.span
            elif keyword == "aligned":
                size = _natural(arguments[0], self.report, "an alignment in bytes")
                if size is not None and (size == 0 or size & (size - 1) or size > 256):
                    self.report.error(f"an alignment is a power of two up to 256 bytes, not "
                                      f"{size}", arguments[0].span)
                    size = None
                for argument in arguments[1:]:
                    index = _natural(argument, self.report, "an aligned pointer index")
                    if size is not None and index is not None:
                        record.alignments[index] = (size, clause.span)
        kinds = [c for k, c in clauses if k in ("block", "library", "collective")]
        if not kinds:  # (a bad one has its own error)
            self.report.error(f"image '{name}' needs a block shape (block X Y Z), a "
                              "(library cublas) clause or a (collective ...) clause",
                              declaration.name.span)
        elif record.collective is not None and len({c.keyword.text for c in kinds}) > 1:
            self.report.error(f"image '{name}' is a kernel (block ...), a library call "
                              "(library ...) or a collective (collective ...): only one",
                              kinds[1].span)
        if record.collective is not None:
            self.collective_signature(record, declaration)
        for pair in record.aliases:
            for index in pair:
                if index not in record.pointers:
                    self.report.error(f"(alias ...) names pointer {index}, which image '{name}' "
                                      "does not declare", declaration.span)
        for index, (_, span) in record.alignments.items():
            if index not in record.pointers:
                self.report.error(f"(aligned ...) names pointer {index}, which image '{name}' "
                                  "does not declare", span)
        for index, span in record.covers.items():
            pointer = record.pointers.get(index)
            if pointer is None:
                self.report.error(f"(covers ...) names pointer {index}, which image '{name}' "
                                  "does not declare", span)
            elif pointer.extent is None:  # (a read may be covered too: a sum over all of it)
                self.report.error(f"(covers ...) names pointer {index} '{pointer.name}', which "
                                  "has no declared extent", span)
        self.result.images[name] = record

    def collective_form(self, arguments, clause) -> tuple[str, str | None] | None:
        """(OPERATION, REDUCTION) of a (collective ...) clause: a reduction where the operation
        reduces, none where it copies; None (reported) otherwise."""
        operation = _keyword(arguments[0], COLLECTIVES, self.report, "collective")
        if operation is None:
            return None
        reductions = COLLECTIVE_REDUCTIONS[operation]
        if not reductions:
            if len(arguments) > 1:
                self.report.error(f"the collective {operation} copies, it reduces nothing: "
                                  f"write (collective {operation})", arguments[1].span)
                return None
            return (operation, None)
        if len(arguments) < 2:
            self.report.error(f"the collective {operation} needs its reduction: "
                              f"(collective {operation} {reductions[0]}); it takes "
                              f"{' or '.join(reductions)}", clause.span)
            return None
        reduction = _keyword(arguments[1], reductions, self.report, "reduction")
        return (operation, reduction) if reduction else None

    def collective_signature(self, record: ImageDeclaration, declaration: Declaration) -> None:
        """A collective reduces one buffer in place across the ranks: exactly one pointer,
        readwrite, of an element type every communicator carries, covered whole by the
        extent its count scalar gives (a partial reduction would leave ranks apart)."""
        name = record.name
        pointers = list(record.pointers.values())
        if len(pointers) != 1:
            self.report.error(f"collective image '{name}' takes exactly one pointer (the buffer "
                              f"it reduces in place), not {len(pointers)}", declaration.name.span)
            return
        (pointer,) = pointers
        if pointer.access != "readwrite":
            self.report.error(f"the pointer '{pointer.name}' of collective image '{name}' is "
                              f"{pointer.access}: a collective reads and writes its buffer in "
                              "place (readwrite)", pointer.span)
        if pointer.element not in COLLECTIVE_ELEMENTS:
            self.report.error(f"collective image '{name}' reduces {pointer.element}; "
                              f"collectives carry {', '.join(COLLECTIVE_ELEMENTS)}",
                              pointer.span)
        if pointer.extent is None or pointer.index not in record.covers:
            self.report.error(f"collective image '{name}' must declare the extent of "
                              f"'{pointer.name}' and (covers {pointer.index}): every rank "
                              "reduces the whole buffer it is given", pointer.span)

    def constant(self, declaration: Declaration) -> None:
        type_term = declaration.terms[0]
        self.scope.resolve_type(type_term)
        default = declaration.terms[1] if len(declaration.terms) > 1 else None
        if default is not None:
            self.term(default, declaration.name.text)
        self.result.constants[declaration.name.text] = ConstantDeclaration(
            declaration.name.text, type_term, default, declaration.span)

    def config(self, declaration: Declaration) -> None:
        values: dict[str, tuple[Term, Span]] = {}
        constants = [d.name.text for d in self.scope.of_kind("constant")]
        for clause in declaration.clauses:
            key = clause.keyword.text
            if key != "low" and key not in constants:
                notes = did_you_mean(key, constants + ["low"])
                self.report.error(f"config '{declaration.name.text}' sets '{key}', which is not a "
                                  "declared constant", clause.keyword.span,
                                  *notes)
                continue
            if key in values:
                self.report.error(f"config '{declaration.name.text}' sets '{key}' twice",
                                  clause.keyword.span, Note("first set here", values[key][1]))
                continue
            if len(clause.arguments) != 1:
                self.report.error(f"({key} VALUE) takes exactly one value", clause.span)
                continue
            value = clause.arguments[0]
            if key == "low":
                _keyword(value, LOW_CHOICES, self.report, "low-precision type")
            elif not isinstance(value, (Natural, Integer, Floating)):
                self.report.error("a config value must be a literal", value.span)
                continue
            values[key] = (value, clause.keyword.span)
        if declaration.parent is not None:
            parent = self.scope.declarations.get(declaration.parent.text)
            if parent is None or parent.kind != "config":
                configs = [d.name.text for d in self.scope.of_kind("config")]
                notes = did_you_mean(declaration.parent.text, configs)
                self.report.error(f"unknown config '{declaration.parent.text}'",
                                  declaration.parent.span, *notes)
        self.result.configs[declaration.name.text] = ConfigDeclaration(
            declaration.name.text, declaration.parent, values, declaration.span)

    def roles(self, declaration: Declaration) -> None:
        """(ROLE NAME) clauses: which buffer or constant plays each role of the model."""
        for clause in declaration.clauses:
            role = clause.keyword.text
            if role not in ROLES:
                notes = did_you_mean(role, ROLES)
                self.report.error(f"unknown role '{role}'; the roles are: {', '.join(ROLES)}",
                                  clause.keyword.span, *notes)
                continue
            if len(clause.arguments) != 1:
                self.report.error(f"({role} NAME) names exactly one "
                                  f"{ {'buffer': 'buffer', 'Nat': 'constant', 'Float': 'constant'}.get(ROLES[role].kind, 'schedule')}",
                                  clause.span)
                continue
            value = clause.arguments[0]
            again = role in self.result.roles
            if again and (ROLES[role].kind != "Schedule" or not isinstance(value, Name) or
                          any(b.value.text == value.text for b in self.schedule_roles(role))):
                first = self.result.roles[role]
                self.report.error(f"role '{role}' is given twice", clause.keyword.span,
                                  Note("first given here", first.span))
                continue
            self.term(value, declaration.name.text)
            if ROLES[role].kind == "Schedule":
                target = self.scope.declarations.get(value.text) if isinstance(value, Name) \
                    else None
                if target is None or target.kind != "def":
                    self.report.error(f"role '{role}' names a schedule definition "
                                      f"({ROLES[role].meaning})", value.span)
                    continue
            if ROLES[role].kind == "buffer":
                target = self.scope.declarations.get(value.text) if isinstance(value, Name) \
                    else None
                if target is None or target.kind != "buffer":
                    self.report.error(f"role '{role}' names a step buffer ({ROLES[role].meaning})",
                                      value.span)
                    continue
                element = target.terms[0]
                wanted = ROLES[role].element
                allowed = wanted if isinstance(wanted, tuple) else (wanted,)
                if isinstance(element, Name) and element.text not in allowed:
                    self.report.error(f"role '{role}' is {ROLES[role].meaning}: a buffer of "
                                      f"{' or '.join(allowed)}, but '{value.text}' holds "
                                      f"{element.text}",
                                      value.span, Note(f"'{value.text}' is declared here",
                                                       target.span))
                    continue
            binding = RoleBinding(role, value, clause.span, declaration.name.text)
            if again:  # another schedule in the same role: each program takes its entry's
                self.result.more_roles.append(binding)
            else:
                self.result.roles[role] = binding

    def schedule_roles(self, role: str) -> list[RoleBinding]:
        return [b for b in (self.result.roles.get(role), *self.result.more_roles)
                if b is not None and b.role == role]

    def require(self, declaration: Declaration) -> None:
        allowed = {kind: (2, 2, f"({kind} A B): A {words} B")
                   for kind, (words, _, _) in REQUIREMENTS.items()}
        for keyword, clause in self.clauses(declaration, allowed):
            left, right = (self.term(a, declaration.name.text) for a in clause.arguments)
            self.result.requirements.append(
                Requirement(keyword, left, right, clause.span, declaration.doc))

    def definition(self, declaration: Declaration) -> None:
        type_term, body = declaration.terms
        self.scope.resolve_type(type_term)
        self.term(body, declaration.name.text)


def elaborate(scope: Scope, report: Reporter) -> Declarations:
    elaborator = _Elaborator(scope, report)
    handlers = {
        "def": elaborator.definition, "constant": elaborator.constant,
        "config": elaborator.config, "buffer": elaborator.storage, "arena": elaborator.storage,
        "entry": elaborator.storage, "bank": elaborator.bank, "phase": elaborator.phase,
        "image": elaborator.image, "roles": elaborator.roles, "require": elaborator.require,
    }
    for declaration in scope.order:
        handlers[declaration.kind](declaration)
    scope.report_cycles()
    return elaborator.result
