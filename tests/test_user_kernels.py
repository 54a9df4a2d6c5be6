"""Kernels of the user's own (`--kernels DIR`, docs/tutorial.md): found only where named,
their faults told as diagnostics, their reference functions as bounds-checked as cgc's, and
their files part of a run's identity."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT
from test_tutorial import PAGE, blocks


@pytest.fixture
def folder(tmp_path):
    """The tutorial's files (the scaled step, its template and reference function)."""
    (tmp_path / "cgc-schedules").symlink_to(ROOT / "schedules")
    for _, file, body in blocks(PAGE.read_text(encoding="utf-8")):
        if file:
            (tmp_path / file).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / file).write_text(body, encoding="utf-8")
    return tmp_path


def cgc(folder, *arguments):
    return subprocess.run([sys.executable, "-m", "cgc", *arguments], cwd=folder, text=True,
                          capture_output=True, timeout=300, env={"PYTHONPATH": str(ROOT),
                                                                  "PATH": "/usr/bin:/bin"})


def test_a_kernels_folder_that_is_not_one_is_a_usage_error(folder):
    result = cgc(folder, "check", "scaled.cg", "--kernels", "nowhere")
    assert result.returncode == 2
    assert result.stderr.strip() == ("cgc: error: cannot read the kernels folder nowhere: "
                                     "No such file or directory")
    result = cgc(folder, "check", "scaled.cg", "--kernels", "scaled.cg")
    assert result.returncode == 2 and "not a folder" in result.stderr


def test_a_reference_file_that_fails_to_load_is_a_diagnostic(folder):
    (folder / "kernels" / "reference.py").write_text("def scale(k:\n")
    result = cgc(folder, "check", "scaled.cg", "--kernels", "kernels", "--config", "tiny")
    assert result.returncode == 1, result.stderr
    assert "error: cannot load the reference functions in " in result.stderr
    assert "SyntaxError" in result.stderr and "Traceback" not in result.stderr
    (folder / "kernels" / "reference.py").write_text("KERNELS = 3\n")
    result = cgc(folder, "check", "scaled.cg", "--kernels", "kernels", "--config", "tiny")
    assert result.returncode == 1 and "KERNELS is not a dict" in result.stderr


def test_a_reference_function_outside_its_extent_fails_the_step_at_the_launch(folder):
    reference = folder / "kernels" / "reference.py"
    reference.write_text(reference.read_text().replace("values.read(0, n)",
                                                       "values.read(0, n + 1)[:n]"))
    result = cgc(folder, "run", "scaled.cg", "--kernels", "kernels", "--backend", "numpy",
                 "--steps", "1")
    assert result.returncode == 1, result.stderr
    assert "error: the step failed on the numpy backend" in result.stderr
    assert "scaled.cg:" in result.stderr and "Traceback" not in result.stderr


def test_the_kernels_files_are_part_of_the_runs_identity(folder):
    assert cgc(folder, "run", "scaled.cg", "--kernels", "kernels", "--backend", "numpy",
               "--steps", "1", "--checkpoint-dir", "run").returncode == 0
    template = folder / "kernels" / "scale.cu.j2"
    template.write_text(template.read_text() + "// changed\n")
    result = cgc(folder, "run", "scaled.cg", "--kernels", "kernels", "--backend", "numpy",
                 "--steps", "2", "--resume", "run")
    assert result.returncode == 1
    assert "this run differs from the checkpoint's" in result.stderr
    assert "kernels/scale.cu.j2" in result.stderr


def test_a_template_that_does_not_render_is_a_diagnostic_at_its_line(folder):
    template = folder / "kernels" / "scale.cu.j2"
    original = template.read_text()
    template.write_text(original + "{% if %}\n")
    result = cgc(folder, "compile", "scaled.cg", "--kernels", "kernels", "-o", "x.cu")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "scale.cu.j2:7:1: error: the kernel template of image 'cgImageScale' does not " \
           "render: Expected an expression" in result.stderr
    assert not (folder / "x.cu").exists()
    template.write_text(original + "{{ nothing }}\n")
    result = cgc(folder, "check", "scaled.cg", "--kernels", "kernels", "--config", "tiny")
    assert result.returncode == 1 and "'nothing' is undefined" in result.stderr
    template.write_bytes(b"\xff\xfe")
    result = cgc(folder, "check", "scaled.cg", "--kernels", "kernels", "--config", "tiny")
    assert result.returncode == 1 and "cannot read the kernel template" in result.stderr


def test_a_reference_function_that_raises_fails_the_step_at_its_launch(folder):
    reference = folder / "kernels" / "reference.py"
    reference.write_text(reference.read_text().replace("    n = min", "    1 / 0\n    n = min"))
    result = cgc(folder, "run", "scaled.cg", "--kernels", "kernels", "--backend", "numpy",
                 "--steps", "1")
    assert result.returncode == 1, result.stderr
    assert "its reference function scale raised ZeroDivisionError" in result.stderr
    assert "scaled.cg:17:5: error: the step failed" in result.stderr
    assert "internal error" not in result.stderr


@pytest.mark.parametrize("text, told", [
    ('KERNELS = {"cgImageScale": 3}\n', "KERNELS is not a dict of image names (str) to functions"),
    ('KERNELS = {1: print}\n', "KERNELS is not a dict of image names (str) to functions"),
    ("import sys\nsys.exit(3)\n", "SystemExit: 3"),
])
def test_a_kernels_table_that_is_not_one_is_a_diagnostic(folder, text, told):
    (folder / "kernels" / "reference.py").write_text(text)
    result = cgc(folder, "check", "scaled.cg", "--kernels", "kernels", "--config", "tiny")
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "cannot load the reference functions in " in result.stderr and told in result.stderr
