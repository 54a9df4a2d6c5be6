"""The LALR driver in cgc/frontend/parse.py: Lark's internals it reads, pinned one by one;
its output against Lark's own LALR parser; per-parse state; the cached tables.

A Lark upgrade that moves an internal the driver reads fails here, in the pin of that
internal, and `lark_internals` names it with the supported range.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import lark
import pytest
from lark import Lark, Token, Tree
from lark.exceptions import UnexpectedCharacters, UnexpectedToken

from cgc.core.diagnostics import CompileError
from cgc.frontend import parse as driver
from cgc.frontend.parse import (
    LarkInternals, LarkInternalsError, _parser, comment_ranges, lark_internals, parse_text,
)
from cgc.frontend.syntax import (
    Apply, Arrow, Declaration, Floating, Import, Integer, Lambda, Name, Natural,
)
from cgc.resources import grammar_path

from conftest import ROOT, SCHEDULES

SCHEDULE_FILES = sorted(SCHEDULES.glob("*.cg"))
# Every .cg file the tests hold: good ones, and ones with syntax (or later) errors.
ALL_FILES = SCHEDULE_FILES + sorted((ROOT / "tests").rglob("*.cg"))
GRAMMAR = grammar_path().read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def built() -> Lark:
    """Lark as the driver builds it."""
    return Lark(GRAMMAR, parser="lalr", lexer="basic")


@pytest.fixture(scope="module")
def reference() -> Lark:
    """Lark's own LALR parser and lexer, with positions, to compare the driver against."""
    return Lark(GRAMMAR, parser="lalr", lexer="basic", propagate_positions=True)


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


# ---- each private piece of Lark the driver reads ---------------------------------------


def pin_module_lalr_analysis(built):
    import lark.parsers.lalr_analysis as analysis
    assert analysis.Shift is not analysis.Reduce
    assert type(analysis.Shift) is type(analysis.Reduce)  # noqa: E721 (Action tags)


def pin_shift(built):
    from lark.parsers.lalr_analysis import Reduce, Shift
    table = built.parser.parser.parser.parse_table
    tags = {action for row in table.states.values() for action, _ in row.values()}
    assert tags == {Shift, Reduce}


def pin_states(built):
    from lark.parsers.lalr_analysis import Shift
    from lark.grammar import Rule
    table = built.parser.parser.parser.parse_table
    assert isinstance(table.states, dict) and table.states
    rule_ids = {id(rule) for rule in built.rules}
    for state, row in table.states.items():
        assert isinstance(state, int) and isinstance(row, dict)
        for symbol, (action, target) in row.items():
            assert isinstance(symbol, str)
            if action is Shift:
                assert isinstance(target, int) and target in table.states
            else:  # a reduction carries the very Rule object of Lark.rules
                assert isinstance(target, Rule) and id(target) in rule_ids
    # Terminals in capitals, the end marker `$END`, rules in lower case (`_`-prefixed
    # helpers included): the driver splits each row into actions and gotos by this.
    symbols = {symbol for row in table.states.values() for symbol in row}
    terminals = {t.name for t in built.terminals} | {"$END"}
    assert "$END" in symbols
    for symbol in symbols:
        assert (symbol in terminals) == driver._is_terminal(symbol), symbol


def pin_start_state(built):
    table = built.parser.parser.parser.parse_table
    assert isinstance(table.start_states, dict) and table.start_states["start"] in table.states


def pin_end_state(built):
    table = built.parser.parser.parser.parse_table
    assert isinstance(table.end_states, dict) and table.end_states["start"] in table.states
    # Accepting means reaching the end state by the goto on `start`.
    assert any(row.get("start", (None, None))[1] == table.end_states["start"]
               for row in table.states.values())


def pin_terminals(built):
    names = set()
    for t in built.terminals:
        assert isinstance(t.name, str) and isinstance(t.priority, int)
        assert t.pattern.type in ("str", "re") and isinstance(t.pattern.value, str)
        assert isinstance(t.pattern.max_width, int) and isinstance(t.pattern.to_regexp(), str)
        names.add(t.name)
    # How Lark names what the grammar does not: the string terminals the driver retypes
    # from NAME, the anonymous "->" (in the messages) and the grammar's own.
    by_value = {t.pattern.value: t.name for t in built.terminals if t.pattern.type == "str"}
    assert by_value["from"] == "FROM" and by_value["lambda"] == "LAMBDA"
    assert by_value["->"] == "__ANON_0"
    assert set(driver._TERMINAL_WORDS) - {"$END"} <= names


def pin_ignored(built):
    assert {str(name) for name in built.ignore_tokens} == {"WS", "COMMENT", "DOC_COMMENT"}


def pin_rules(built):
    origins = set()
    for rule in built.rules:
        assert isinstance(rule.origin.name, str) and isinstance(rule.expansion, list)
        assert rule.alias is None or isinstance(rule.alias, str)
        origins.add(str(rule.origin.name))
        driver._builder_name(rule)  # every rule has a builder
    # `x*` and `x+` become helper rules named `__...`; `?term`'s alternatives keep aliases.
    assert any(origin.startswith("__") and "_star_" in origin for origin in origins)
    assert any(origin.startswith("__") and "_plus_" in origin for origin in origins)
    assert {"start", "_item", "term"} <= origins
    assert {rule.alias for rule in built.rules if rule.origin.name == "term"} == {
        "name", "natural", "integer", "floating", "apply", "lambda_", "arrow", "group"}


PINS = {  # LarkInternals' field (or the module behind one) -> its pin
    "lalr_analysis": pin_module_lalr_analysis, "shift": pin_shift, "states": pin_states,
    "start_state": pin_start_state, "end_state": pin_end_state, "terminals": pin_terminals,
    "ignored": pin_ignored, "rules": pin_rules,
}


@pytest.mark.parametrize("internal", sorted(PINS))
def test_lark_internal_is_pinned(internal, built):
    PINS[internal](built)


def test_every_internal_the_driver_reads_has_a_pin():
    assert set(LarkInternals._fields) <= set(PINS)


def test_lark_internals_fetches_them(built):
    from lark.parsers.lalr_analysis import Shift
    found = lark_internals(built)
    table = built.parser.parser.parser.parse_table
    assert found.shift is Shift and found.states is table.states
    assert found.start_state == table.start_states["start"]
    assert found.end_state == table.end_states["start"]
    assert found.rules == list(built.rules) and found.terminals == list(built.terminals)
    assert set(found.ignored) == {"WS", "COMMENT", "DOC_COMMENT"}


def test_the_supported_range_is_the_one_declared():
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert f'"{driver.SUPPORTED_LARK}"' in pyproject


@pytest.mark.parametrize("break_it, named", [
    (lambda built, mp: mp.setattr(built.parser.parser.parser, "parse_table", None),
     "Lark.parser.parser.parser.parse_table"),
    (lambda built, mp: mp.delattr(built.parser.parser.parser, "parse_table"),
     "Lark.parser.parser.parser.parse_table"),
    (lambda built, mp: mp.delattr("lark.parsers.lalr_analysis.Shift"),
     "lark.parsers.lalr_analysis.Shift"),
    (lambda built, mp: mp.setattr(built, "ignore_tokens", ["NOT_A_TERMINAL"]),
     "Lark.ignore_tokens"),
    (lambda built, mp: mp.setattr(built, "rules", [types.SimpleNamespace(origin="start")]),
     "Lark.rules"),
])
def test_a_changed_internal_fails_loudly_and_names_itself(break_it, named, monkeypatch):
    built = Lark(GRAMMAR, parser="lalr", lexer="basic")  # its own, to break
    break_it(built, monkeypatch)
    with pytest.raises(LarkInternalsError) as error:
        lark_internals(built)
    message = str(error.value)
    assert message.startswith(f"this Lark version ({lark.__version__}) changed its internals: ")
    assert named in message and message.endswith("cgc supports lark>=1.2,<2")


# ---- the driver against Lark's own LALR parser -----------------------------------------


def _span(node) -> tuple[int, int]:
    return (node.span.start, node.span.end)


def driver_form(node):
    """A syntax node as plain data: kinds, values and offsets."""
    if isinstance(node, Name):
        return ("name", node.text, *_span(node))
    if isinstance(node, (Natural, Integer)):
        return (type(node).__name__.lower(), node.value, *_span(node))
    if isinstance(node, Floating):
        return ("floating", node.value, *_span(node))
    if isinstance(node, Apply):
        return ("apply", driver_form(node.function), [driver_form(a) for a in node.arguments],
                _span(node))
    if isinstance(node, Lambda):
        return ("lambda", node.usage, driver_form(node.binder), driver_form(node.binder_type),
                driver_form(node.body), _span(node))
    if isinstance(node, Arrow):
        return ("arrow", [driver_form(part) for part in node.parts], _span(node))
    if isinstance(node, Import):
        return ("import", node.path, _span(node))
    if isinstance(node, Declaration):
        return (node.kind, driver_form(node.name),
                driver_form(node.parent) if node.parent else None,
                [driver_form(term) for term in node.terms],
                [("clause", driver_form(c.keyword), [driver_form(a) for a in c.arguments],
                  _span(c)) for c in node.clauses], _span(node))
    raise AssertionError(f"unexpected node {node!r}")


def _token_form(token: Token):
    return ("name", str(token), token.start_pos, token.end_pos)


def lark_form(node):
    """Lark's tree (propagate_positions) as the same plain data, independently of the driver."""
    data = node.data
    if data in ("name", "natural", "integer", "floating"):
        token = node.children[0]
        value = {"name": str, "natural": int, "integer": int, "floating": float}[data](token)
        return (data, value, token.start_pos, token.end_pos)
    if data == "group":
        return lark_form(node.children[1])
    span = (node.meta.start_pos, node.meta.end_pos)
    trees = [child for child in node.children if isinstance(child, Tree)]
    tokens = [child for child in node.children
              if isinstance(child, Token) and child.type not in ("LPAR", "RPAR")]
    if data == "apply":
        return ("apply", lark_form(trees[0]), [lark_form(t) for t in trees[1:]], span)
    if data == "lambda_":
        usage, binder = tokens
        return ("lambda", str(usage), _token_form(binder), lark_form(trees[0]),
                lark_form(trees[1]), span)
    if data == "arrow":
        return ("arrow", [lark_form(t) for t in trees], span)
    if data == "import_decl":
        return ("import", str(tokens[1])[1:-1], span)
    if data == "clause":
        return ("clause", _token_form(tokens[0]), [lark_form(t) for t in trees], span)
    assert data.endswith("_decl"), data
    keyword, name, *parent = tokens
    terms = [lark_form(t) for t in trees if t.data != "clause"]
    clauses = [lark_form(t) for t in trees if t.data == "clause"]
    return (str(keyword), _token_form(name), _token_form(parent[0]) if parent else None,
            terms, clauses, span)


@pytest.mark.parametrize("path", SCHEDULE_FILES, ids=_name)
def test_driver_builds_the_tree_larks_parser_builds(path, reference):
    text = path.read_text(encoding="utf-8")
    module = parse_text(text, str(path))
    ours = ([driver_form(node) for node in module.imports],
            [driver_form(node) for node in module.declarations])
    items = [lark_form(item) for item in reference.parse(text).children]
    theirs = ([item for item in items if item[0] == "import"],
              [item for item in items if item[0] != "import"])
    assert ours == theirs


@pytest.mark.parametrize("path", ALL_FILES, ids=_name)
def test_driver_lexes_as_larks_lexer(path, reference):
    text = path.read_text(encoding="utf-8")
    try:
        theirs = [(t.type, str(t), t.start_pos, t.end_pos)
                  for t in reference.lex(text, dont_ignore=True)]
        failed_at = None
    except UnexpectedCharacters as error:
        theirs, failed_at = None, error.pos_in_stream
    comments = []
    try:
        ours = [token for token in _parser().tokens(text, 0, len(text), comments)][:-1]
    except driver._SyntaxError as error:
        assert error.token is None and error.offset == failed_at
        return
    assert failed_at is None
    assert ours == [t for t in theirs if t[0] not in ("WS", "COMMENT", "DOC_COMMENT")]
    assert comments == [(start, end, kind) for kind, _, start, end in theirs
                        if kind in ("COMMENT", "DOC_COMMENT")]
    assert comment_ranges(text) == [(start, end) for start, end, _ in comments]


BAD_INPUTS = [
    "def x : Nat = (f 1",                       # end of file inside parentheses
    "def x : Nat = f 1)",                       # a ')' with none open
    "def x : Nat = ()",                         # empty parentheses
    "def x Nat = 1",                            # a def without its ':'
    "def x : Nat 1",                            # ... without its '='
    "def x : Nat = (lambda i : Nat . i)",       # a lambda without its usage
    "def x : Nat = (lambda linear i : Nat i)",  # ... without its '.'
    "def x : Nat = (f -> )",                    # an arrow without its last part
    "config c from (a 1)",                      # `from` without a name
    "buffer b $ 1",                             # a character no terminal matches
    "x : Nat = 1",                              # no declaration keyword
    "  def x : Nat = 1",                        # a keyword not in the first column
    'import "a.cg" "b.cg"',
    "def x : Nat = 1\nimage i (block 1 1 1",
    "",                                         # empty: accepted
    "-- only a comment\n--- and a doc\n",       # accepted
]


def _driver_verdict(text: str):
    try:
        _parser().parse(driver.Source("bad.cg", text), 0, len(text))
    except driver._UsageError:
        return "accepted"  # the grammar accepts it; the usage is checked while building
    except driver._SyntaxError as error:
        if error.token is None:
            return ("character", error.offset)
        kind = error.token[driver._TYPE]
        return ("token", kind, None if kind == "$END" else error.offset, error.expected)
    return "accepted"


def _lark_verdict(lark_parser: Lark, text: str):
    try:
        lark_parser.parse(text)
    except UnexpectedCharacters as error:
        return ("character", error.pos_in_stream)
    except UnexpectedToken as error:
        kind = error.token.type
        return ("token", kind, None if kind == "$END" else error.token.start_pos,
                set(error.expected))
    return "accepted"


@pytest.mark.parametrize("text", BAD_INPUTS)
def test_driver_rejects_where_larks_parser_rejects(text, reference):
    assert _driver_verdict(text) == _lark_verdict(reference, text)


@pytest.mark.parametrize("path", ALL_FILES, ids=_name)
def test_driver_accepts_and_rejects_each_file_as_larks_parser(path, reference):
    text = path.read_text(encoding="utf-8")
    assert _driver_verdict(text) == _lark_verdict(reference, text)


# ---- per-parse state -------------------------------------------------------------------


def _shape(obj) -> dict:
    """Every attribute of the cached parser, with the size of each container in it."""
    def size(value) -> int:
        if isinstance(value, dict):
            return len(value) + sum(size(v) for v in value.values())
        if isinstance(value, (list, tuple, set, frozenset)):
            return len(value) + sum(size(v) for v in value)
        return 1
    return {name: size(value) for name, value in vars(obj).items()}


def test_each_parse_keeps_its_state_to_itself():
    text = (SCHEDULES / "forward.cg").read_text(encoding="utf-8")
    parser = _parser()
    before = _shape(parser)
    # _parse_module: the parser itself each time, not the cache of parsed files
    first = driver._parse_module(driver.Source("forward.cg", text))
    comments = comment_ranges(text)
    with pytest.raises(Exception):
        parse_text("def x : Nat = (f 1\n-- a comment\n", "broken.cg")  # fails mid-way
    second = driver._parse_module(driver.Source("forward.cg", text))
    assert first is not second
    assert first == second and repr(first) == repr(second)
    assert [d.doc for d in first.declarations] == [d.doc for d in second.declarations]
    assert comment_ranges(text) == comments and comments
    assert _shape(parser) == before
    assert not {"comments", "docs", "source"} & set(vars(parser))


def test_a_file_read_again_unchanged_is_not_parsed_again(monkeypatch):
    """The parsed-file cache: the same module for the same path and text; a changed text, or
    the same text under another path, parsed afresh; a file that fails reports its errors
    every time (failures are not kept); past _PARSED_FILES the oldest goes."""
    monkeypatch.setattr(driver, "_PARSED", driver.OrderedDict())
    parses = []
    parse_module = driver._parse_module

    def counted(source):
        parses.append(source.path)
        return parse_module(source)
    monkeypatch.setattr(driver, "_parse_module", counted)
    text = (SCHEDULES / "forward.cg").read_text(encoding="utf-8")
    first = parse_text(text, "forward.cg")
    assert parse_text(text, "forward.cg") is first and parses == ["forward.cg"]
    changed = parse_text(text + "\ndef extra : Nat = 1\n", "forward.cg")
    assert [d.name.text for d in changed.declarations][-1] == "extra"
    assert parse_text(text, "elsewhere/forward.cg").path == "elsewhere/forward.cg"
    assert parses == ["forward.cg", "forward.cg", "elsewhere/forward.cg"]
    for _ in range(2):
        with pytest.raises(CompileError) as error:
            parse_text("def x : Nat = (f 1\n", "broken.cg")
        assert "broken.cg:1:" in str(error.value)
    assert parses.count("broken.cg") == 2
    monkeypatch.setattr(driver, "_PARSED_FILES", 2)
    parse_text("def a : Nat = 1\n", "a.cg")
    parse_text("def b : Nat = 2\n", "b.cg")
    assert list(driver._PARSED) == [("a.cg", "def a : Nat = 1\n"), ("b.cg", "def b : Nat = 2\n")]


# ---- the cached tables -----------------------------------------------------------------


@pytest.fixture
def cache_home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path / "cgc"


def _count_builds(monkeypatch) -> list:
    builds = []
    build = driver._build_tables

    def counted(grammar):
        builds.append(1)
        return build(grammar)
    monkeypatch.setattr(driver, "_build_tables", counted)
    return builds


def test_tables_are_built_once_then_read_from_the_cache(cache_home, monkeypatch):
    builds = _count_builds(monkeypatch)
    built = driver._load()
    assert builds == [1]
    assert [f.name for f in cache_home.iterdir()] == [f"parser-{driver._cache_key(GRAMMAR)}.json"]
    cached = driver._load()
    assert builds == [1]
    assert _shape(cached) == _shape(built)
    assert cached.start_state == built.start_state and cached.actions.keys() == built.actions.keys()
    # The cached tables run the same parser.
    text = (SCHEDULES / "backward.cg").read_text(encoding="utf-8")
    source = driver.Source("backward.cg", text)
    assert repr(cached.parse(source, 0, len(text))) == \
        repr(driver._Parser(driver._build_tables(GRAMMAR)).parse(source, 0, len(text)))


def test_a_damaged_or_foreign_cache_file_is_rebuilt(cache_home, monkeypatch):
    driver._load()
    path = driver._cache_file(GRAMMAR)
    whole = path.read_bytes()
    builds = _count_builds(monkeypatch)
    # Lark numbers its states differently from one process to the next, so a rebuilt
    # file is a valid one, not necessarily the same bytes.
    damaged = [whole[:len(whole) // 2]]  # half-written
    foreign = json.loads(whole)
    foreign["key"] = "parser-" + "0" * 64
    old_format = json.loads(whole)
    old_format["format"] = driver._TABLES_FORMAT - 1
    no_actions = json.loads(whole)
    del no_actions["actions"]
    damaged += [json.dumps(data).encode() for data in (foreign, old_format, no_actions, [])]
    for count, content in enumerate(damaged, 1):
        path.write_bytes(content)
        assert driver._read_cache(path) is None
        assert driver._load().actions and len(builds) == count
        assert driver._read_cache(path) is not None


def test_the_key_follows_the_grammar_and_larks_version(tmp_path, monkeypatch):
    key = driver._cache_key(GRAMMAR)
    assert driver._cache_key(GRAMMAR) == key
    assert driver._cache_key(GRAMMAR + "// one more comment\n") != key
    lark_init = Path(driver.importlib.util.find_spec("lark").origin)
    assert f'"{lark.__version__}"' in lark_init.read_text(encoding="utf-8")
    other_lark = tmp_path / "__init__.py"
    other_lark.write_text(lark_init.read_text(encoding="utf-8").replace(
        lark.__version__, "1.9.9"), encoding="utf-8")
    monkeypatch.setattr(driver.importlib.util, "find_spec",
                        lambda name: types.SimpleNamespace(origin=str(other_lark)))
    assert driver._cache_key(GRAMMAR) != key


def test_the_cache_is_written_whole_then_renamed(cache_home, monkeypatch):
    renames = []
    replace = os.replace

    def spy(source, target):
        renames.append((Path(source), Path(target)))
        assert json.loads(Path(source).read_text())["key"] == Path(target).stem
        replace(source, target)
    monkeypatch.setattr(driver.os, "replace", spy)
    driver._load()
    (temporary, target), = renames
    assert temporary.parent == target.parent == cache_home and not temporary.exists()
    assert [f.name for f in cache_home.iterdir()] == [target.name]


def test_a_failed_write_leaves_nothing_and_raises_nothing(cache_home, monkeypatch):
    def fail(source, target):
        raise OSError("disk full")
    monkeypatch.setattr(driver.os, "replace", fail)
    assert driver._load().actions
    assert list(cache_home.iterdir()) == []


def test_an_unusable_cache_place_means_no_cache(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    assert driver._load().actions
    monkeypatch.setattr(driver, "cache_dir", lambda: None)
    assert driver._cache_file(GRAMMAR) is None and driver._load().actions


def test_the_cache_place_follows_xdg(tmp_path, monkeypatch):
    from cgc.resources import cache_dir
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "cgc"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for unset in ("", "relative/path"):
        monkeypatch.setenv("XDG_CACHE_HOME", unset)
        assert cache_dir() == tmp_path / "home" / ".cache" / "cgc"


def test_a_process_that_finds_the_cache_does_not_import_lark(tmp_path):
    script = ("import sys; from cgc.frontend.parse import _parser; _parser(); "
              "print('lark' in sys.modules)")
    environment = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    runs = [subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=environment,
                           capture_output=True, text=True, check=True).stdout.strip()
            for _ in range(2)]
    assert runs == ["True", "False"]
