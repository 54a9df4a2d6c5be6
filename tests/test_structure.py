"""The package's shape: stages import one way, and nothing after the launch program reads
the front end."""

from __future__ import annotations

import ast

from conftest import ROOT

PACKAGE = ROOT / "cgc"
# What each stage may import from cgc: itself and the stages before it (resources and
# outputs, the one writer, are leaves every stage that reads or writes files may use).
ALLOWED = {
    "core": {"core"},
    "frontend": {"core", "frontend", "resources"},
    "checking": {"core", "checking"},
    "backends": {"core", "checking", "backends", "resources", "outputs"},
    "training": {"core", "checking", "backends", "training", "resources", "outputs"},
    "tools": {"core", "frontend", "tools", "resources", "outputs"},
}


def cgc_imports(path):
    """The cgc modules a file imports, as dotted names (relative imports resolved)."""
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[:len(package) - node.level + 1])
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names = [f"{module}.{a.name}" for a in node.names] if not node.module else [module]
            found.update(n for n in names if n.startswith("cgc"))
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("cgc"))
    return found


def test_stages_import_only_themselves_and_the_stages_before_them():
    wrong = []
    for stage, allowed in ALLOWED.items():
        for path in sorted((PACKAGE / stage).rglob("*.py")):
            for module in cgc_imports(path):
                parts = module.split(".")
                if len(parts) > 1 and parts[1] not in allowed | {"__version__"}:
                    wrong.append(f"{path.relative_to(ROOT)} imports {module}")
    assert wrong == []


def test_nothing_after_the_launch_program_reads_the_front_end():
    after = [p for stage in ("core", "checking", "backends", "training")
             for p in (PACKAGE / stage).rglob("*.py")]
    readers = [str(p.relative_to(ROOT)) for p in after
               if any(m.startswith(("cgc.frontend", "cgc.pipeline", "cgc.api", "cgc.cli")) for m in cgc_imports(p))]
    assert readers == []
    source = "".join(p.read_text(encoding="utf-8") for p in after)
    assert "evaluator" not in source and "declarations." not in source


def test_the_import_checker_sees_a_violation():
    """The detector works: a front-end module does import core, and the checker sees it."""
    assert any(m.startswith("cgc.core") for m in cgc_imports(PACKAGE / "frontend" / "evaluate.py"))
    assert "cgc.frontend.api" in cgc_imports(PACKAGE / "pipeline.py")


def test_no_module_spells_an_element_type_code_of_its_own():
    """One table of element types (cgc/core/elements.py): no literal dtype or C type codes."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "elements.py":
            continue
        text = path.read_text(encoding="utf-8")
        for literal in ('"__nv_bfloat16"', "np.uint16", "CUDA_R_16BF", "CUDA_R_32F",
                        '"bfloat16": 2', "== 14"):
            if literal in text:
                offenders.append(f"{path.relative_to(ROOT)}: {literal}")
    assert offenders == []


def test_every_package_is_installed():
    """pyproject.toml lists packages by hand (grammar/ and templates/ install under cgc/):
    a new sub-package not listed would be missing from `pip install .`."""
    import tomllib
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in PACKAGE.rglob("__init__.py")}
    assert found <= listed, sorted(found - listed)


def test_every_data_file_is_installed():
    """Each file of the folders installed as data (schedules/, templates/, grammar/) matches a
    package-data pattern: schedules/llama/ was once left out, and `cgc sample` of a Llama
    checkpoint found no sampler outside a checkout."""
    import fnmatch
    import tomllib
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    missing = []
    for package, folder in setuptools["package-dir"].items():
        if package == "cgc":
            continue  # the code's own folder: its few data files are listed by name
        patterns = setuptools["package-data"].get(package, [])
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".py":
                name = path.relative_to(ROOT / folder).as_posix()
                if not any(fnmatch.fnmatch(name, p) and name.count("/") == p.count("/")
                           for p in patterns):
                    missing.append(f"{folder}/{name}")
    assert not missing, missing


def test_every_install_hint_names_the_distribution_not_pypis_other_cgc():
    """`cgc` on PyPI is another project: a hint `pip install 'cgc[...]'` would fetch it. The
    hints come from one function (cgc/resources.py: install_hint), whose extras exist."""
    import re
    import tomllib

    from cgc.resources import DISTRIBUTION, install_hint
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == DISTRIBUTION != "cgc"
    wrong = []
    for path in [*PACKAGE.rglob("*.py"), *(ROOT / "scripts").glob("*"), *(ROOT / "docs").glob("*.md"),
                 ROOT / "README.md", ROOT / "pyproject.toml"]:
        if path.is_file() and path.suffix in (".py", ".md", ".sh", ".toml"):
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if re.search(r"\bcgc\[", line):
                    wrong.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert wrong == []
    for extra in ("cuda", "cuda-tools", "parallel", "test"):
        assert extra in project["optional-dependencies"]
        assert install_hint(extra) == (f"pip install '{DISTRIBUTION}[{extra}]' (in a checkout "
                                       f"of cgc: pip install '.[{extra}]')")


def test_the_command_is_a_thin_shell():
    """cli.py parses a command line and calls the library: no function of it is long (a run
    is assembled in cgc/training/run.py and cgc/api.py, not here)."""
    tree = ast.parse((PACKAGE / "cli.py").read_text(encoding="utf-8"))
    long = {node.name: node.end_lineno - node.lineno + 1 for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno + 1 > 55}
    assert long == {}
