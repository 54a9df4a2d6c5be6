"""docs/tutorial.md runs as written: its files written, its commands run in order in an empty
folder, each command's output (stdout and stderr together) the page's, and its Python block
printing what the page says. Only a step's timings may differ (ms, tok/s)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT

PAGE = ROOT / "docs" / "tutorial.md"
FENCE = re.compile(r"^```(\w+)(?: file=(\S+))?\n(.*?)^```\n", re.S | re.M)
TIMING = re.compile(r"\d[\d.,]* ms  [\d,]+ tok/s")


def blocks(text: str):
    """(kind, file, body) for each fenced block of the page, in order."""
    return [(m.group(1), m.group(2), m.group(3)) for m in FENCE.finditer(text)]


def commands(body: str) -> list[tuple[str, str]]:
    """A console block's `$ command` lines, each with the output shown after it."""
    found = []
    for line in body.splitlines(keepends=True):
        if line.startswith("$ "):
            found.append([line[2:].rstrip("\n"), ""])
        else:
            found[-1][1] += line
    return [(command, output) for command, output in found]


def same(got: str, shown: str) -> bool:
    return TIMING.sub("T", got.rstrip("\n")) == TIMING.sub("T", shown.rstrip("\n"))


def _shell(tmp_path):
    """A `cgc` on PATH that runs this checkout's code."""
    bin_folder = tmp_path / "bin"
    bin_folder.mkdir()
    shim = bin_folder / "cgc"
    shim.write_text(f"#!/bin/sh\nexec {sys.executable} -m cgc \"$@\"\n")
    shim.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_folder}{os.pathsep}{os.environ['PATH']}",
            "PYTHONPATH": str(ROOT)}


@pytest.mark.slow
def test_the_tutorial_runs_as_written(tmp_path):
    folder = tmp_path / "scaled"
    folder.mkdir()
    environment = _shell(tmp_path)
    ran, python_output = [], None
    page = blocks(PAGE.read_text(encoding="utf-8"))
    for index, (kind, file, body) in enumerate(page):
        if file:
            (folder / file).parent.mkdir(parents=True, exist_ok=True)
            (folder / file).write_text(body, encoding="utf-8")
        elif kind == "console":
            for command, shown in commands(body):
                result = subprocess.run(["bash", "-c", command + " 2>&1"], cwd=folder,
                                        env=environment, capture_output=True, text=True,
                                        timeout=600)
                assert same(result.stdout, shown), (command, result.stdout)
                ran.append(command)
        elif kind == "python":
            result = subprocess.run([sys.executable, "-c", body], cwd=folder, env=environment,
                                    capture_output=True, text=True, timeout=600)
            assert result.returncode == 0, result.stderr
            assert page[index + 1][0] == "text", "the block after the Python is its output"
            python_output = result.stdout
            assert same(python_output, page[index + 1][2])
    # the page's whole story, not a part that happened to pass
    assert any(c.startswith("cgc check wrong.cg") for c in ran)
    assert any("--backend numpy" in c for c in ran) and any("--backend emulated" in c for c in ran)
    assert python_output is not None and (folder / "scaled.cu").is_file()


def test_the_tutorials_comparison_can_fail():
    """The detector works: another loss, or another error line, is not the page's."""
    shown = "step 1/5 [#] loss 5.4896  norm 1.0102  lr 3.000e-03  131.2 ms  1,952 tok/s\n"
    assert same(shown.replace("131.2 ms  1,952", "99.0 ms  2,001"), shown)
    assert not same(shown.replace("5.4896", "5.4897"), shown)
    assert not same("", shown)
    body = blocks(PAGE.read_text(encoding="utf-8"))
    assert sum(1 for kind, file, _ in body if file) == 3
    assert sum(len(commands(b)) for kind, _, b in body if kind == "console") >= 7
