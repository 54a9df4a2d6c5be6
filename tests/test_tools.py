"""The tools around the language: cgc fmt, cgc doc (checked in a real headless browser),
and the Pygments lexer."""

from __future__ import annotations

import random
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
from pygments.lexers import get_lexer_by_name

from cgc.cli import main
from cgc.backends.cuda.emit import emit_program
from cgc.tools.format import format_text
from cgc.frontend.api import analyse, evaluate
from cgc.core.ir import format_program
from cgc.checking.memory import plan_memory
from cgc.frontend.parse import _parser, comment_ranges

from conftest import SCHEDULES
from pngcheck import png_colours

FILES = sorted(SCHEDULES.glob("*.cg"))
LOCATION_IR = re.compile(r"  -- .*$", re.MULTILINE)
LOCATION_CUDA = re.compile(r"\S+\.cg:\d+:\d+( \(from \S+\.cg:\d+:\d+\))?")


# ---- cgc fmt -----------------------------------------------------------------------------


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_schedules_are_kept_formatted(path):
    text = path.read_text()
    assert format_text(text, str(path)) == text, f"run: cgc fmt {path.relative_to(SCHEDULES.parent)}"


def scramble(text: str, seed: int) -> str:
    """The same tokens and comments with other whitespace inside each declaration."""
    generator = random.Random(seed)
    out, last = [], 0
    comments = comment_ranges(text)
    for _, value, start, end in _parser().tokens(text, 0, len(text)):
        between = text[last:start]
        if any(last <= c < start for c, _ in comments) or value in ("def", "image", "config",
                                                                    "constant", "buffer", "bank",
                                                                    "entry", "arena", "phase",
                                                                    "import", "roles",
                                                                    "require") and start and text[start - 1] == "\n":
            out.append(between)  # keep comments and the line starts of declarations
        elif between:
            # never a bare newline: a token in column 1 could start a declaration
            out.append(generator.choice([" ", "  ", "\n    ", " \n  "]))
        out.append(value)
        last = end
    out.append(text[last:])
    return "".join(out)


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_fmt_is_canonical_whatever_the_whitespace(path):
    canonical = path.read_text()
    for seed in range(3):
        messy = scramble(canonical, seed)
        assert messy != canonical or seed
        assert format_text(messy, str(path)) == canonical


def test_fmt_keeps_comments_and_a_commented_declaration_as_written():
    text = ("-- heading\n\n\n--- the doc\ndef a : Nat =\n  (naturalAdd 1   -- one\n 2)\n"
            "def b : Nat = (naturalAdd   1 2)  -- trailing\n")
    formatted = format_text(text)
    assert formatted == ("-- heading\n\n--- the doc\ndef a : Nat =\n  (naturalAdd 1   -- one\n 2)\n"
                         "def b : Nat = (naturalAdd 1 2) -- trailing\n")
    assert format_text(formatted) == formatted


def test_formatting_changes_neither_the_program_nor_the_cuda(tmp_path):
    for path in FILES:
        (tmp_path / path.name).write_text(scramble(path.read_text(), 7))
    assert main(["fmt", str(tmp_path)]) == 0
    for config in ("tiny", "gpt2"):
        found = []
        for folder in (SCHEDULES, tmp_path):
            source = str(folder / "train.cg")
            frontend = analyse([source])
            program = evaluate(frontend, source, config=config)
            cuda = emit_program(program,
                                plan_memory(program)).text
            found.append((LOCATION_IR.sub("", format_program(program)),
                          LOCATION_CUDA.sub("", cuda)))
        assert found[0] == found[1]


def test_fmt_check_lists_what_would_change_and_exits_1(tmp_path, capsys):
    target = tmp_path / "messy.cg"
    target.write_text("def a : Nat =    (naturalAdd 1 2)\n")
    assert main(["fmt", "--check", str(tmp_path)]) == 1
    assert f"would reformat {target}" in capsys.readouterr().out
    assert target.read_text() == "def a : Nat =    (naturalAdd 1 2)\n"
    assert main(["fmt", str(target)]) == 0
    assert main(["fmt", "--check", str(target)]) == 0


# ---- cgc doc -----------------------------------------------------------------------------


class _Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids, self.hrefs, self.titles, self.external = set(), [], 0, []

    def handle_starttag(self, tag, attributes):
        attributes = dict(attributes)
        if "id" in attributes:
            self.ids.add(attributes["id"])
        if tag == "a" and "href" in attributes:
            self.hrefs.append(attributes["href"])
            self.titles += "title" in attributes
        for name in ("src", "href"):
            if re.match(r"(https?:)?//", attributes.get(name) or ""):
                self.external.append(attributes[name])


@pytest.fixture(scope="module")
def documentation(tmp_path_factory):
    folder = tmp_path_factory.mktemp("doc")
    assert main(["doc", str(SCHEDULES), "-o", str(folder)]) == 0
    return folder


def test_doc_writes_a_page_per_file_and_an_index(documentation):
    pages = {p.name for p in documentation.glob("*.html")}
    assert pages == {p.stem + ".html" for p in FILES} | {"index.html"}


def test_every_link_of_every_page_reaches_an_anchor(documentation):
    parsed = {}
    for page in documentation.glob("*.html"):
        parser = _Links()
        parser.feed(page.read_text())
        parsed[page.name] = parser
    checked = 0
    for name, parser in parsed.items():
        assert parser.external == [], f"{name} reaches the network"
        for href in parser.hrefs:
            target, _, anchor = href.partition("#")
            target = target or name
            assert target in parsed, (name, href)
            if anchor:
                assert anchor in parsed[target].ids, (name, href)
                checked += 1
    assert checked > 500


def test_every_declaration_is_anchored_typed_and_indexed(documentation):
    frontend = analyse([str(p) for p in FILES])
    index = (documentation / "index.html").read_text()
    for declaration in frontend.scope.order:
        page = (documentation / (Path(declaration.span.path).stem + ".html")).read_text()
        assert f'id="{declaration.name.text}"' in page
        assert f'href="{Path(declaration.span.path).stem}.html#{declaration.name.text}"' in index
    backward = (documentation / "backward.html").read_text()
    assert "def cgBackward : Schedule" in backward  # the type, beside the name
    assert "<code>current</code>" in backward  # the documentation comment, as Markdown
    assert 'href="library.html#cgLayerBackward" title="def cgLayerBackward : (Nat -&gt; ' in backward


def test_a_page_renders_in_a_headless_browser(documentation, tmp_path):
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    assert browser, "Chromium is not installed: run scripts/install-test-tools.sh"
    shot = tmp_path / "library.png"
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--window-size=1200,900", f"--screenshot={shot}",
                    (documentation / "library.html").as_uri()],
                   check=True, capture_output=True, timeout=120)
    assert shot.exists() and shot.stat().st_size > 10_000
    assert png_colours(shot) > 20  # highlighted text on a page, not a blank


# ---- the Pygments lexer ---------------------------------------------------------------


def test_the_lexer_is_registered_and_highlights():
    lexer = get_lexer_by_name("cg")
    kinds = {str(kind) for kind, _ in lexer.get_tokens((SCHEDULES / "backward.cg").read_text())}
    assert {"Token.Keyword.Declaration", "Token.Name.Builtin", "Token.Literal.String.Doc",
            "Token.Keyword.Type", "Token.Literal.Number.Integer"} <= kinds


def test_pygmentize_knows_cg_after_install():
    command = shutil.which("pygmentize")
    assert command, "pygmentize is not installed"
    result = subprocess.run([command, "-l", "cg", "-f", "html", str(SCHEDULES / "forward.cg")],
                            capture_output=True, text=True, check=True)
    assert 'class="kd">def</span>' in result.stdout  # a declaration keyword
    assert 'class="nb">cgThen</span>' in result.stdout  # a built-in
