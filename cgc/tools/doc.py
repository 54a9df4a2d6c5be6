"""`cgc doc`: static, offline HTML pages of schedules, every name linked to its declaration.

One page per .cg file: its declarations (kind, type, rendered documentation) and its
source, highlighted (the Pygments lexer of cgc/highlight.py), with line numbers and every
use of a declared name linked to where it is declared, in whatever file. An index lists
every declaration. No scripts and no network: types show on hover (title attributes).

Documentation comments are Markdown without raw HTML: a tag written in one is shown as
text, never copied into the page (no `<script>`, no `onerror=`), and a link or image whose
target has a scheme other than http, https or mailto (`javascript:`, `data:`, `vbscript:`)
loses its target. Everything else on a page is escaped where it is written.
"""

from __future__ import annotations

import html
import itertools
import os
import re
import urllib.parse
from dataclasses import dataclass, field

import jinja2
import markdown
from markdown.treeprocessors import Treeprocessor
from pygments import lex
from pygments.token import Token

from ..frontend.api import Frontend
from ..frontend.load import read_source
from .highlight import CgLexer
from ..outputs import check, write_file
from ..resources import data_dir
from ..frontend.syntax import Apply, Declaration, Lambda, Name

_CLASSES = [  # the longest matching token type decides the CSS class
    (Token.Literal.String.Doc, "doc"), (Token.Comment, "comment"),
    (Token.Keyword.Declaration, "declaration"), (Token.Keyword.Pseudo, "usage"),
    (Token.Keyword.Type, "type"), (Token.Keyword, "keyword"),
    (Token.Name.Builtin, "builtin"), (Token.Literal.Number, "number"),
    (Token.Literal.String, "string"), (Token.Operator, "punctuation"),
    (Token.Punctuation, "punctuation"),
]


def _css_class(kind) -> str:
    for token, name in _CLASSES:
        if kind in token:
            return name
    return ""


_SAFE_SCHEMES = {"http", "https", "mailto"}
_SCHEME = re.compile(r"([a-z][a-z0-9+.\-]*):")
_IGNORED_IN_SCHEMES = re.compile(r"[\x00-\x20\x7f]+")  # browsers skip these in a scheme


def safe_target(target: str) -> bool:
    """Whether a link target is relative or names a harmless scheme. What a browser reads
    is what is checked: entities decoded, blanks and control characters dropped, any case."""
    text = _IGNORED_IN_SCHEMES.sub("", html.unescape(target)).lower()
    found = _SCHEME.match(text)
    return found is None or found.group(1) in _SAFE_SCHEMES


class _DropUnsafeTargets(Treeprocessor):
    """Removes href and src attributes a browser would run (javascript:, data:, ...)."""

    def run(self, root):
        for element in root.iter():
            for attribute in ("href", "src"):
                target = element.get(attribute)
                if target is not None and not safe_target(target):
                    del element.attrib[attribute]
        return None


def _markdown() -> markdown.Markdown:
    """Markdown with raw HTML shown as text, and no unsafe link targets."""
    renderer = markdown.Markdown(output_format="html")
    renderer.preprocessors.deregister("html_block")
    renderer.inlinePatterns.deregister("html")
    renderer.treeprocessors.register(_DropUnsafeTargets(renderer), "cgc_unsafe_targets", 1)
    return renderer


def render_markdown(text: str) -> str:
    renderer = _markdown()
    return renderer.convert(text)


def _url(page: str) -> str:
    """A page's file name as it goes into an href: URL-quoted, then escaped for HTML."""
    return html.escape(urllib.parse.quote(page))


@dataclass
class Page:
    path: str  # the source, as loaded
    name: str  # the page's file name
    declarations: list[dict] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)


INDEX = "index.html"


def page_names(paths: list[str], common: str) -> dict[str, str]:
    """Each source's page file name: its path under `common`, folders joined by `__`, `.cg`
    made `.html`. Two sources never share a page, nor one the index: where names meet
    (`a/b.cg` and `a__b.cg`, `index.cg`, names that differ only in case, which some file
    systems take for one), the first path in sorted order keeps its name and each other
    gets the first free `NAME-2.html`, `NAME-3.html`, ... (no source's own name)."""
    def plain(path: str) -> str:
        relative = os.path.relpath(os.path.abspath(path), common)
        return relative.replace(os.sep, "__").removesuffix(".cg") + ".html"

    wanted = {path: plain(path) for path in paths}
    reserved = {name.casefold() for name in wanted.values()} | {INDEX}
    taken, names = {INDEX}, {}

    def numbered(name: str) -> str:
        for number in itertools.count(2):
            candidate = f"{name.removesuffix('.html')}-{number}.html"
            if candidate.casefold() not in taken | reserved:
                return candidate
        raise AssertionError("unreachable")

    for path in sorted(wanted):
        name = wanted[path]
        names[path] = name if name.casefold() not in taken else numbered(name)
        taken.add(names[path].casefold())
    return names


class Documenter:
    def __init__(self, frontend: Frontend):
        self.frontend = frontend
        self.scope = frontend.scope
        paths = [module.path for module in frontend.modules]
        common = os.path.commonpath([os.path.abspath(p) for p in paths]) if paths else ""
        if len(paths) == 1:
            common = os.path.dirname(os.path.abspath(paths[0]))
        self.pages = page_names(paths, common)

    def describe(self, name: str) -> str:
        """What hovering over a name shows: its kind and type."""
        declaration = self.scope.declarations[name]
        found = self.frontend.checker.global_types.get(name)
        if declaration.kind in ("def", "constant"):
            return f"{declaration.kind} {name} : {found}"
        if found is not None:
            return f"{declaration.kind} {name} : {found}"
        return f"{declaration.kind} {name}"

    def link(self, name: str) -> str:
        declaration = self.scope.declarations[name]
        return f"{_url(self.pages[declaration.span.path])}#{name}"

    def references(self, declaration: Declaration) -> dict[int, str]:
        """Offsets of the names in a declaration that refer to global declarations."""
        found: dict[int, str] = {}
        terms = list(declaration.terms) + [a for c in declaration.clauses for a in c.arguments]
        if declaration.kind == "config":
            terms += [c.keyword for c in declaration.clauses]  # a config sets constants
            if declaration.parent is not None:
                terms.append(declaration.parent)
        for term in terms:
            self._collect(term, (), found)
        return found

    def _collect(self, term, bound: tuple[str, ...], found: dict[int, str]) -> None:
        if isinstance(term, Name):
            if term.text not in bound and term.text in self.scope.declarations:
                found[term.span.start] = term.text
        elif isinstance(term, Apply):
            self._collect(term.function, bound, found)
            for argument in term.arguments:
                self._collect(argument, bound, found)
        elif isinstance(term, Lambda):
            self._collect(term.binder_type, bound, found)
            self._collect(term.body, bound + (term.binder.text,), found)
        elif hasattr(term, "parts"):
            for part in term.parts:
                self._collect(part, bound, found)

    def page(self, module) -> Page:
        source = read_source(module.path)  # as it was loaded: a regular file, UTF-8
        page = Page(module.path, self.pages[module.path])
        targets: dict[int, str] = {}
        anchors: dict[int, str] = {}
        for declaration in module.declarations:
            name = declaration.name.text
            targets.update(self.references(declaration))
            anchors[declaration.name.span.start] = name
            page.declarations.append({
                "name": name, "kind": declaration.kind, "line": declaration.span.line,
                "type": self.describe(name) if name in self.scope.declarations else "",
                "doc": render_markdown(declaration.doc or "")})
        parts, offset = [], 0
        for kind, text in lex(source, CgLexer()):
            css = _css_class(kind)
            escaped = html.escape(text)
            if offset in anchors and kind in Token.Name:
                name = anchors[offset]
                escaped = (f'<span class="declared" id="{name}" '
                           f'title="{html.escape(self.describe(name))}">{escaped}</span>')
            elif offset in targets and kind in Token.Name:
                name = targets[offset]
                escaped = (f'<a href="{self.link(name)}" '
                           f'title="{html.escape(self.describe(name))}">{escaped}</a>')
            elif css:
                escaped = f'<span class="{css}">{escaped}</span>'
            parts.append(escaped)
            offset += len(text)
        page.lines = "".join(parts).split("\n")
        if page.lines and page.lines[-1] == "":
            page.lines.pop()
        return page


def _environment() -> jinja2.Environment:
    environment = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(data_dir("templates"))),
        undefined=jinja2.StrictUndefined, autoescape=False, trim_blocks=True,
        lstrip_blocks=True)
    environment.filters["url"] = _url  # a page name in an href
    return environment


def write_documentation(frontend: Frontend, folder: str) -> list[str]:
    """Writes one page per loaded file and index.html, by cgc's one writer (cgc/outputs.py);
    returns the files written. Every page is checked first: none is written where one is
    refused (a read-only page, a page that is one of the sources)."""
    documenter = Documenter(frontend)
    environment = _environment()
    os.makedirs(folder, exist_ok=True)
    sources = [module.path for module in frontend.modules]
    index = os.path.join(folder, INDEX)
    for name in [*documenter.pages.values(), INDEX]:
        check(os.path.join(folder, name), sources)
    written, entries = [], []
    for module in frontend.modules:
        page = documenter.page(module)
        title = os.path.basename(module.path)
        text = environment.get_template("doc/page.html.j2").render(
            title=title, page=page, pages=sorted(documenter.pages.values()))
        target = os.path.join(folder, page.name)
        write_file(target, text)
        written.append(target)
        entries += [{**d, "page": page.name, "file": title} for d in page.declarations]
    entries.sort(key=lambda d: (d["kind"], d["name"].lower()))
    write_file(index, environment.get_template("doc/index.html.j2").render(
        entries=entries, pages=sorted(documenter.pages.items(), key=lambda p: p[1]),
        basename=os.path.basename))
    written.append(index)
    return written
