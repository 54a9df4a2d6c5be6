"""A fresh clone collects every test: nothing the tests read lies outside the repository.

The clone is made from the committed tree (uncommitted work is not in it), into an empty
temporary folder with nothing beside it, as CI does.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

from conftest import ROOT

MINIMUM_TESTS = 150


def tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


def test_a_fresh_clone_collects_every_test(tmp_path):
    git = shutil.which("git")
    assert git is not None, "git is not installed: this test clones the repository with it"
    clone = tmp_path / "clone"
    made = subprocess.run([git, "clone", "--quiet", "--no-hardlinks", str(ROOT), str(clone)],
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, f"git clone failed:\n{tail(made.stdout + made.stderr)}"
    env = {**os.environ, "PYTHONPATH": str(clone), "PYTHONDONTWRITEBYTECODE": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                          "-p", "no:cacheprovider"],
                         cwd=clone, env=env, capture_output=True, text=True, timeout=120)
    output = run.stdout + run.stderr
    assert run.returncode == 0, \
        f"pytest --collect-only in a fresh clone exited {run.returncode}:\n{tail(output)}"
    assert not re.search(r"\berrors?\b", output.splitlines()[-1] if output.strip() else ""), \
        f"collection errors in a fresh clone:\n{tail(output)}"
    assert "ERROR collecting" not in output, f"collection errors in a fresh clone:\n{tail(output)}"
    collected = re.search(r"(\d+) tests? collected", output)
    assert collected, f"no count of collected tests in the output:\n{tail(output)}"
    assert int(collected.group(1)) >= MINIMUM_TESTS, \
        f"only {collected.group(1)} tests collected in a fresh clone " \
        f"(expected at least {MINIMUM_TESTS}):\n{tail(output)}"
