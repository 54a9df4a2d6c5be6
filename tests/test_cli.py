"""The `cgc` command as users run it: exit codes, help, and the installed entry point."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from cgc.cli import main

from conftest import ROOT, SCHEDULES


def test_check_passes_every_schedule_in_every_config(capsys):
    files = sorted(str(p) for p in SCHEDULES.glob("*.cg"))
    assert main(["check", *files]) == 0
    out = capsys.readouterr().out
    for name in ("train.cg", "backward.cg", "forward.cg", "optimizer.cg"):
        assert f"{name}: ok" in out
    assert "gpt2 (" in out and "tiny32 (" in out


def test_diagnostics_exit_1_and_go_to_stderr(capsys):
    bad = ROOT / "tests" / "diagnostics" / "unknown_name.cg"
    assert main(["check", str(bad)]) == 1
    captured = capsys.readouterr()
    assert "error: unknown name 'cgPhaseWrok'" in captured.err
    assert "did you mean 'cgPhaseWork'?" in captured.err
    assert captured.out == ""


@pytest.mark.parametrize("argv", [
    [],
    ["bogus"],
    ["ir"],
    ["ir", str(SCHEDULES / "train.cg"), "--config", "nope"],
    ["ir", str(SCHEDULES / "train.cg"), "--set", "cgLayers=many"],
    ["ir", str(SCHEDULES / "train.cg"), "--set", "cgNotAConstant=3"],
])
def test_usage_errors_exit_2(argv, capsys):
    assert main(argv) == 2
    assert "usage:" in capsys.readouterr().err


@pytest.mark.parametrize("command", [[], ["check"], ["ir"]])
def test_every_command_has_help(command, capsys):
    assert main([*command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: cgc")
    assert "--help" in out


def test_ir_writes_a_file(tmp_path):
    out = tmp_path / "train.ir"
    assert main(["ir", str(SCHEDULES / "train.cg"), "--config", "tiny", "-o", str(out)]) == 0
    assert out.read_text().startswith("-- cgc launch program")


def test_a_missing_file_is_a_diagnostic(capsys, tmp_path):
    assert main(["check", str(tmp_path / "absent.cg")]) == 1
    assert "cannot read" in capsys.readouterr().err


def test_the_module_runs_as_a_program():
    result = subprocess.run([sys.executable, "-m", "cgc", "--version"], capture_output=True,
                            text=True, check=True)
    assert result.stdout.startswith("cgc ")


def test_the_installed_command_works_from_any_directory(tmp_path):
    """`pip install .` puts `cgc` on PATH with its grammar inside the package."""
    command = shutil.which("cgc")
    assert command, "the cgc command is not installed: run the README's install step"
    result = subprocess.run([command, "check", str(SCHEDULES / "train.cg")], cwd=tmp_path,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "train.cg: ok" in result.stdout


def test_run_trains_on_the_numpy_backend_and_dumps(tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("hello, cgc. " * 200)
    dump = tmp_path / "dump"
    assert main(["run", str(SCHEDULES / "train.cg"), "--steps", "2", "--data", str(text),
                 "--dump", str(dump)]) == 0
    out = capsys.readouterr().out
    assert "step 2/2" in out and "loss" in out
    assert (dump / "run.json").exists() and (dump / "gradients" / "cgQkvWeight.npy").exists()


def test_run_without_a_gpu_names_the_numpy_alternative(capsys):
    assert main(["run", str(SCHEDULES / "train.cg"), "--backend", "cupy"]) == 1
    assert "--backend numpy" in capsys.readouterr().err


def test_run_with_unreadable_data_is_an_error_not_a_traceback(tmp_path, capsys):
    assert main(["run", str(SCHEDULES / "train.cg"), "--data", str(tmp_path / "none.txt")]) == 1
    assert "cannot read the training data" in capsys.readouterr().err
