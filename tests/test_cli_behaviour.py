"""The command behaves like a well-made CLI: a command list, suggestions for typos, folders,
one-line errors for missing files (exit 2), named missing CUDA headers, a plot with readable
axes, right plurals, and Ctrl-C that stops `cgc run` cleanly."""

from __future__ import annotations

import json
import os
import re
import signal
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

from cgc.backends.cuda import toolchain
from cgc.cli import build_parser, main
from cgc.tools import plot

from conftest import ROOT, SCHEDULES

COMMANDS = ("check", "ir", "compile", "fmt", "doc", "run")


# ---- 1. `cgc` alone lists the commands ----------------------------------------------------


def test_cgc_alone_lists_every_command_with_its_help_and_exits_2(capsys):
    assert main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("usage: cgc COMMAND")
    [commands] = [a for a in build_parser()._actions if hasattr(a, "_choices_actions")]
    for choice in commands._choices_actions:
        assert re.search(rf"^  {choice.dest} +{re.escape(choice.help)}$", captured.err, re.M), \
            choice.dest
    assert "required" not in captured.err


def test_cgc_help_still_exits_0(capsys):
    assert main(["--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: cgc")


# ---- 2. a mistyped command gets a suggestion -----------------------------------------------


@pytest.mark.parametrize("typed, meant", [("chek", "check"), ("complie", "compile"),
                                          ("rnu", "run"), ("fmat", "fmt")])
def test_a_mistyped_command_suggests_the_right_one(typed, meant, capsys):
    assert main([typed, "x.cg"]) == 2
    assert capsys.readouterr().err == \
        f"cgc: error: unknown command '{typed}'; did you mean '{meant}'?\n"


def test_an_unknown_command_with_nothing_close_lists_the_commands(capsys):
    assert main(["xyzzy", "x.cg"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cgc: error: unknown command 'xyzzy'\n")
    assert "did you mean" not in err
    assert all(re.search(rf"^  {name} ", err, re.M) for name in COMMANDS)


def test_the_typo_check_lets_options_and_help_through(capsys):
    assert main(["--version"]) == 0
    assert main(["check", "--help"]) == 0
    assert "unknown command" not in capsys.readouterr().err


# ---- 3. `cgc check DIR` --------------------------------------------------------------------


def test_check_takes_a_folder_and_checks_every_cg_file_in_it_sorted(capsys):
    """Every .cg file under the folder, sorted; each folder's files together (one model's:
    schedules/ and schedules/llama/ declare the same names, and each passes)."""
    assert main(["check", str(SCHEDULES), "--config", "tiny"]) == 0
    lines = capsys.readouterr().out.splitlines()
    expected = sorted(str(p) for p in SCHEDULES.glob("*.cg")) + \
        sorted(str(p) for p in (SCHEDULES / "llama").glob("*.cg"))
    assert [line.split(": ok")[0] for line in lines] == expected
    assert f"{SCHEDULES / 'model.cg'}: ok: declarations only (no schedule to evaluate)" in lines


def test_check_walks_nested_folders(tmp_path, capsys):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "two.cg").write_text("def two : Nat = (naturalAdd 1 1)\n")
    (tmp_path / "a.cg").write_text("def one : Nat = 1\n")
    (tmp_path / "notes.txt").write_text("not a schedule\n")
    assert main(["check", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.index(str(tmp_path / "a.cg")) < out.index(str(tmp_path / "b" / "two.cg"))
    assert "notes.txt" not in out


def test_check_of_a_folder_without_schedules_is_a_usage_error(tmp_path, capsys):
    assert main(["check", str(tmp_path)]) == 2
    assert "no .cg files found" in capsys.readouterr().err


# ---- 4. a missing FILE is a usage error, in one line, for every command ----------------------


@pytest.mark.parametrize("command", [
    ["check", "{missing}"],
    ["check", str(SCHEDULES / "train.cg"), "{missing}"],
    ["ir", "{missing}"],
    ["compile", "{missing}"],
    ["run", "{missing}"],
    ["fmt", "{missing}"],
    ["fmt", "--check", "{missing}"],
    ["doc", "{missing}", "-o", "{out}"],
    ["run", str(SCHEDULES / "train.cg"), "--data", "{missing}"],
])
def test_a_missing_file_is_one_line_and_exit_2(command, tmp_path, capsys):
    missing = tmp_path / "absent.cg"
    argv = [a.format(missing=missing, out=tmp_path / "out") for a in command]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err == f"cgc: error: cannot read {missing}: No such file or directory\n"
    assert captured.out == ""


def test_a_folder_where_a_file_is_needed_is_a_usage_error(capsys):
    assert main(["ir", str(SCHEDULES)]) == 2
    assert capsys.readouterr().err == f"cgc: error: cannot read {SCHEDULES}: Is a directory\n"


def test_an_output_into_a_missing_folder_is_a_usage_error(tmp_path, capsys):
    out = tmp_path / "no" / "train.ir"
    assert main(["ir", str(SCHEDULES / "train.cg"), "-o", str(out)]) == 2
    assert capsys.readouterr().err == \
        f"cgc: error: cannot write {out}: No such file or directory\n"


def test_a_missing_import_stays_a_diagnostic_at_the_import(tmp_path, capsys):
    source = tmp_path / "main.cg"
    source.write_text("-- imports a file that is not there\nimport \"gone.cg\"\n")
    assert main(["check", str(source)]) == 1
    err = capsys.readouterr().err
    assert f"{source}:2:1: error: cannot read '{tmp_path / 'gone.cg'}': No such file or " \
           "directory" in err


# ---- 5. --report without cuBLAS's headers names the header and the extra ---------------------


def _include_folder_without_cublas(root: Path) -> Path:
    folder = root / "include"
    for header in ("cuda_runtime.h", "cuda_bf16.h", "mma.h", "cuda/std/type_traits"):
        (folder / header).parent.mkdir(parents=True, exist_ok=True)
        (folder / header).write_text("")
    return folder


def test_report_names_a_missing_cuda_header_and_the_extra(tmp_path, monkeypatch, capsys):
    folder = _include_folder_without_cublas(tmp_path)
    monkeypatch.setattr(toolchain, "nvcc", lambda: Path("/opt/cuda/bin/nvcc"))
    monkeypatch.setattr(toolchain, "include_dirs", lambda compiler: [folder])
    out = tmp_path / "library.cu"
    assert main(["compile", str(SCHEDULES / "library.cg"), "-o", str(out), "--report"]) == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("cgc: error:")]
    # the first header the emitted file includes that the folder lacks (cuBLASLt's)
    assert errors == ["cgc: error: nvcc (/opt/cuda/bin/nvcc) does not find CUDA's header "
                      "cublasLt.h: pip install 'cgc-compiler[cuda-tools]' (in a checkout of "
                      "cgc: pip install '.[cuda-tools]') installs it, with an nvcc that "
                      "finds it"]
    assert "#include" not in err and "fatal error" not in err
    assert "cgc-compiler[cuda-tools]" in Path(ROOT / "pyproject.toml").read_text()  # it exists


def test_a_compiler_that_cannot_open_a_header_is_told_the_same_way(tmp_path, monkeypatch):
    """What the check before compiling misses, the compiler's own words still name."""
    fake = tmp_path / "nvcc"
    fake.write_text("#!/bin/sh\necho 'program.cu:820:10: fatal error: cublas_v2.h: No such "
                    "file or directory' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(toolchain, "nvcc", lambda: fake)
    monkeypatch.setattr(toolchain, "include_dirs", lambda compiler: [])
    with pytest.raises(toolchain.ToolchainMissing, match=r"cublas_v2\.h: pip install "
                                                         r"'cgc-compiler\[cuda-tools\]'"):
        toolchain.ptxas_report("int x;\n")
    assert toolchain.missing_header('x.cu(3): catastrophic error: cannot open source file '
                                    '"cuda_bf16.h"') == "cuda_bf16.h"
    assert toolchain.missing_header("x.cu(3): error: identifier undefined") is None


def _system_nvcc_without_cublas() -> str | None:
    import shutil
    found = shutil.which("nvcc")
    if not found:
        return None
    return None if any((d / "cublas_v2.h").exists()
                       for d in toolchain.include_dirs(Path(found))) else found


def test_report_with_a_system_nvcc_that_lacks_cublas(tmp_path, monkeypatch, capsys):
    """The real case: no CUDA wheels, and a system CUDA installed without cuBLAS."""
    def no_wheels():
        raise toolchain.ToolchainMissing("no wheels")
    monkeypatch.setattr(toolchain, "cuda_root", no_wheels)
    found = _system_nvcc_without_cublas()
    if found is None:
        pytest.skip("needs a system nvcc whose include path lacks cublas_v2.h")
    out = tmp_path / "library.cu"
    assert main(["compile", str(SCHEDULES / "library.cg"), "-o", str(out), "--report"]) == 1
    err = capsys.readouterr().err
    assert f"cgc: error: nvcc ({found}) does not find CUDA's header cublasLt.h: " \
           "pip install 'cgc-compiler[cuda-tools]'" in err
    assert "fatal error" not in err and "compilation terminated" not in err


# ---- 6. the loss plot has numbered axes, labels and a title ----------------------------------


def _decode_png(path: Path) -> np.ndarray:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    position, body, size = 8, b"", None
    while position < len(data):
        length, kind = struct.unpack(">I4s", data[position:position + 8])
        chunk = data[position + 8:position + 8 + length]
        crc = struct.unpack(">I", data[position + 8 + length:position + 12 + length])[0]
        assert crc == zlib.crc32(kind + chunk) & 0xFFFFFFFF
        if kind == b"IHDR":
            size = struct.unpack(">II", chunk[:8])
        elif kind == b"IDAT":
            body += chunk
        position += 12 + length
    width, height = size
    rows = np.frombuffer(zlib.decompress(body), dtype=np.uint8).reshape(height, 1 + width * 3)
    assert (rows[:, 0] == 0).all()  # filter type 0 on every row
    return rows[:, 1:].reshape(height, width, 3)


def _dark(region: np.ndarray) -> int:
    return int((region.astype(int).sum(axis=2) < 300).sum())


def test_the_loss_plot_has_tick_labels_axis_labels_and_a_title(tmp_path):
    from pngcheck import png_colours
    losses = [5.6 * 0.97 ** i + 0.05 * (i % 3) for i in range(37)]
    path = tmp_path / "loss.png"
    plot.write_loss_plot(str(path), losses)
    image = _decode_png(path)
    assert (image == plot.loss_image(losses)).all()
    assert png_colours(path) >= 3
    _, x_ticks, (y_low, y_high), y_ticks, _ = plot.layout(losses)
    assert len(x_ticks) >= 3 and len(y_ticks) >= 3
    bottom, right = plot.HEIGHT - plot.BOTTOM, plot.WIDTH - plot.RIGHT
    for tick in y_ticks:  # a number left of the y axis at every tick
        row = round(plot.TOP + (y_high - tick) / (y_high - y_low) * (bottom - plot.TOP))
        assert _dark(image[row - 6:row + 7, plot.LEFT - 60:plot.LEFT - 8]) > 20, tick
    for tick in x_ticks:  # and under the x axis
        column = round(plot.LEFT + (tick - 1) / (len(losses) - 1) * (right - plot.LEFT))
        assert _dark(image[bottom + 8:bottom + 24, column - 14:column + 15]) > 10, tick
    between = (y_ticks[0] + y_ticks[1]) / 2  # nothing drawn between two labels
    row = round(plot.TOP + (y_high - between) / (y_high - y_low) * (bottom - plot.TOP))
    assert _dark(image[row - 2:row + 3, plot.LEFT - 60:plot.LEFT - 8]) == 0
    assert _dark(image[bottom + 26:, plot.LEFT:right]) > 20  # "step"
    assert _dark(image[plot.TOP:bottom, :30]) > 20  # "loss", upwards
    assert _dark(image[:plot.TOP - 4, plot.LEFT:right]) > 50  # the title


def test_the_title_and_the_labels_are_the_font_s_glyphs():
    losses = [3.0, 2.5, 2.25]
    image = plot.loss_image(losses)
    title = plot.text_mask("training loss, 3 steps")
    title_rows = (plot.TOP - 7 * plot.SCALE) // 2 + title.shape[0]  # above the top tick label
    rows, columns = np.nonzero(image[:title_rows].astype(int).sum(axis=2) < 300)
    found = (image[rows.min():rows.max() + 1, columns.min():columns.max() + 1]
             .astype(int).sum(axis=2) < 300)
    rows, columns = np.nonzero(title)
    trimmed = title[rows.min():rows.max() + 1, columns.min():columns.max() + 1]
    assert found.shape == trimmed.shape and (found == trimmed).all()
    assert plot.text_mask("1 step").shape[1] < plot.text_mask("2 steps").shape[1]


@pytest.mark.parametrize("losses", [[5.5], [2.0] * 4, [11.0, 0.004], [0.0012, 0.0009, 0.001],
                                    [float("nan"), 3.0, 2.0], list(range(2000, 0, -1))])
def test_every_label_the_plot_writes_is_in_the_font(losses):
    _, x_ticks, _, y_ticks, step = plot.layout(losses)
    labels = [plot.tick_label(t, step) for t in y_ticks] + [str(int(t)) for t in x_ticks]
    labels += ["step", "loss", f"training loss, {len(losses)} steps"]
    assert all(char in plot.FONT for label in labels for char in label), labels
    assert len(set(labels[:len(y_ticks)])) == len(y_ticks)  # no two ticks read the same
    plot.loss_image(losses)  # and it draws
    assert all(glyph.shape == (9, 5) for glyph in plot.FONT.values())


# ---- 7. plurals ------------------------------------------------------------------------------


def test_counts_of_one_are_singular(tmp_path, capsys):
    assert main(["check", str(SCHEDULES / "library.cg"), "--config", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "tiny (1 launch)" in out
    out_cu = tmp_path / "library.cu"
    assert main(["compile", str(SCHEDULES / "library.cg"), "--config", "tiny",
                 "-o", str(out_cu)]) == 0
    assert re.search(r"wrote .*library\.cu: 1 kernel, \d+ lines", capsys.readouterr().err)
    messy = tmp_path / "messy.cg"
    messy.write_text("def a : Nat =    (naturalAdd 1 2)\n")
    assert main(["fmt", "--check", str(messy)]) == 1
    assert "1 file would be reformatted, 0 files unchanged" in capsys.readouterr().err


def test_counts_of_several_are_plural(tmp_path, capsys):
    assert main(["check", str(SCHEDULES / "forward.cg"), "--config", "tiny"]) == 0
    assert re.search(r"tiny \(\d+ launches\)", capsys.readouterr().out)
    assert main(["doc", str(SCHEDULES / "library.cg"), "-o", str(tmp_path / "doc")]) == 0
    assert re.search(r"wrote [2-9] pages", capsys.readouterr().out)
    from cgc.cli import _count
    assert [_count(n, "page") for n in (0, 1, 2)] == ["0 pages", "1 page", "2 pages"]
    assert _count(1, "launch", "launches") == "1 launch"


def test_no_count_in_cli_output_has_a_fixed_plural():
    """Every '{count} things' in cli.py goes through _count (or is the run's own summary)."""
    source = (ROOT / "cgc" / "cli.py").read_text()
    fixed = re.findall(r"\{(?:len\([^{}]*\)|[a-z_]*count[a-z_]*)\}\s*[a-z]+s\b", source)
    assert fixed == []


# ---- Ctrl-C during `cgc run` ---------------------------------------------------------------


def _sigint_as_a_terminal_gives_it():
    """A suite started in the background (`&`, nohup) inherits SIGINT ignored, and a process
    started so keeps ignoring it (POSIX; Python installs its Ctrl-C handler only where SIGINT
    is not ignored): the run this test interrupts gets SIGINT's default, as from a terminal."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_stops_a_run_after_the_step_under_way(tmp_path):
    plot_path, trace = tmp_path / "loss.png", tmp_path / "trace.json"
    process = subprocess.Popen(
        [sys.executable, "-m", "cgc", "run", "schedules/train.cg", "--backend", "numpy",
         "--steps", "500", "--plot", str(plot_path), "--trace", str(trace)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)}, preexec_fn=_sigint_as_a_terminal_gives_it)
    lines, deadline = [], time.monotonic() + 60
    try:
        while sum(line.startswith("step ") for line in lines) < 2:
            line = process.stdout.readline()
            assert line and time.monotonic() < deadline, "the run printed no steps"
            lines.append(line)
        process.send_signal(signal.SIGINT)
        # the rest through the same reader: communicate reads the pipe itself, past what
        # readline read ahead
        out = process.stdout.read()
        err = process.stderr.read()
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    lines += out.splitlines(keepends=True)
    assert process.returncode == 130, err
    assert "Traceback" not in err
    assert "stopping after the step under way" in err
    last = lines[-1].rstrip("\n")
    match = re.fullmatch(r"loss \d+\.\d{4} -> \d+\.\d{4} after (\d+) steps? \(stopped early\)",
                         last)
    assert match, last
    steps = int(match.group(1))
    assert 2 <= steps < 500
    assert sum(line.startswith("step ") for line in lines) == steps
    assert plot_path.exists() and trace.exists()
    _decode_png(plot_path)


# ---- options and outputs a sceptical review tried (each once exit 3) -------------------------

@pytest.mark.parametrize("options,exit_code,message", [
    (["--seed", "-1"], 2, "--seed must be a finite number, not negative"),
    (["--lr", "nan"], 2, "--lr must be a finite number, not negative"),
    (["--lr", "1e300"], 2, "--lr 1e+300 is past float32's range"),
    (["--lr", "0.01", "--lr-min", "0.1"], 2, "--lr-min 0.1 is above the peak rate 0.01"),
    (["--plot", "{folder}"], 2, "Is a directory"),  # before any step, not after them all
    (["--plot", "/dev/full"], 1, "No space left on device"),  # a failed write, as --log
    (["--log", "/dev/full"], 1, "No space left on device"),
])
def test_bad_option_values_and_unwritable_outputs_are_errors_not_internal_ones(
        options, exit_code, message, tmp_path, capsys):
    options = [o.format(folder=tmp_path) for o in options]
    code = main(["run", str(SCHEDULES / "train.cg"), "--backend", "numpy", "--steps", "1",
                 *options])
    assert code == exit_code
    assert message in capsys.readouterr().err


def test_a_dump_of_another_run_is_refused_unless_replace_dump(tmp_path, capsys):
    folder = str(tmp_path / "dump")
    base = ["run", str(SCHEDULES / "train.cg"), "--backend", "numpy", "--steps", "1",
            "--dump", folder]
    assert main(base) == 0
    assert main(base) == 0  # the same run again: replaced
    assert main([*base, "--seed", "5"]) == 1
    assert "holds the dump of another run (its seed differs)" in capsys.readouterr().err
    assert main([*base, "--seed", "5", "--replace-dump"]) == 0
    with open(os.path.join(folder, "run.json"), encoding="utf-8") as handle:
        assert '"seed": 5' in handle.read()


def test_an_output_that_cannot_be_written_whole_leaves_the_old_file(tmp_path, monkeypatch,
                                                                      capsys):
    """`cgc compile -o` on a full disk once cut the old file at 4096 bytes: now the text goes
    through a temporary file renamed into place, and a failed write leaves the old one."""
    output = tmp_path / "step.cu"
    output.write_text("the old file\n")

    def full(descriptor):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "fsync", full)
    assert main(["compile", str(SCHEDULES / "train.cg"), "--config", "tiny",
                 "-o", str(output)]) == 1  # a write the disk refused (cgc/outputs.py)
    assert "No space left on device" in capsys.readouterr().err
    assert output.read_text() == "the old file\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step.cu"]  # no temporary left


# ---- a reader that leaves, a standard output that refuses -----------------------------------
# Each both ways: Python's standard output buffered (as on most machines) and not
# (PYTHONUNBUFFERED set, as on this one): a buffered write fails only when flushed, an
# unbuffered one at the print.

BUFFERING = {"buffered": {}, "unbuffered": {"PYTHONUNBUFFERED": "1"}}


def _environment(buffering: str) -> dict:
    """This checkout's cgc (from any folder), its output buffered or not."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    path = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return {**env, "PYTHONPATH": path, **BUFFERING[buffering]}


def _closed_stdout(command, buffering: str, cwd=ROOT) -> subprocess.CompletedProcess:
    """`command` with its standard output a pipe whose reader left before it wrote (`| head`
    that has its lines): every write to it fails with EPIPE."""
    process = subprocess.Popen([sys.executable, *command], cwd=cwd, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=_environment(buffering))
    process.stdout.close()
    error = process.stderr.read()
    return subprocess.CompletedProcess(command, process.wait(), "", error)


@pytest.mark.parametrize("buffering", BUFFERING)
@pytest.mark.parametrize("command,status", [
    (("-m", "cgc", "run", "schedules/train.cg", "--config", "tiny", "--backend", "numpy",
      "--steps", "2"), 0),
    (("-m", "cgc", "ir", "schedules/train.cg"), 0),
    (("-m", "cgc", "check", "schedules/train.cg"), 0),
    (("-m", "cgc", "fmt", "--check", "{unformatted}"), 1),  # its own status, not 0
    (("scripts/cost_model.py", "--floor"), 0),  # the scripts, through script_status
], ids=["cgc run", "cgc ir", "cgc check", "cgc fmt --check", "cost_model.py"])
def test_a_reader_that_left_is_no_error(command, status, buffering, tmp_path):
    """`cgc run` once said 'cannot write the dump None: Broken pipe' (exit 1), the scripts
    printed a traceback, and `fmt --check` said 0 for a file it would reformat: now each
    ends with its own status and nothing on stderr but its own lines."""
    unformatted = tmp_path / "x.cg"
    unformatted.write_text("def cgX : Nat =    1\n")
    result = _closed_stdout([c.format(unformatted=unformatted) for c in command], buffering)
    assert result.returncode == status, result.stderr
    assert "Traceback" not in result.stderr and "error" not in result.stderr \
        and "Exception" not in result.stderr, result.stderr


@pytest.mark.parametrize("buffering", BUFFERING)
def test_a_run_whose_reader_left_stops_as_on_ctrl_c_and_resumes_exactly(buffering, tmp_path):
    """The run stops after the step under way, writes its checkpoint and dump and says so
    on stderr, exit 0; its log has that step and no later one, so the resumed run logs each
    step once (it once stopped between the log and the checkpoint: steps 1, 2, 2, 3)."""
    run = ["-m", "cgc", "run", str(SCHEDULES / "train.cg"), "--config", "tiny", "--backend",
           "numpy", "--checkpoint-dir", "ck", "--log", "log.jsonl"]
    result = _closed_stdout([*run, "--steps", "5", "--checkpoint-every", "1", "--dump", "d"],
                            buffering, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "wrote the checkpoint ck/step-00000001.safetensors" in result.stderr
    assert "dumped the run to d" in result.stderr
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step-00000001.safetensors"]
    assert len(json.loads((tmp_path / "d" / "run.json").read_text())["losses"]) == 1
    resumed = subprocess.run([sys.executable, *run, "--steps", "3", "--resume", "ck"],
                             cwd=tmp_path, capture_output=True, text=True,
                             env=_environment(buffering))
    assert resumed.returncode == 0, resumed.stderr
    steps = [json.loads(line)["step"] for line in (tmp_path / "log.jsonl").read_text()
             .splitlines()]
    assert steps == [1, 2, 3]


@pytest.mark.parametrize("buffering", BUFFERING)
@pytest.mark.parametrize("command", [
    ("-m", "cgc", "run", "schedules/train.cg", "--config", "tiny", "--backend", "numpy",
     "--steps", "2"),
    ("-m", "cgc", "check", "schedules/train.cg"),
    ("-m", "cgc", "check", "--memory", "schedules/train.cg"),
    ("-m", "cgc", "ir", "schedules/train.cg"),
    ("scripts/cost_model.py", "--floor"),
], ids=["run", "check", "check --memory", "ir", "cost_model.py"])
def test_a_standard_output_that_refuses_is_one_line_exit_1(command, buffering):
    """A full device as the standard output (`> /dev/full`): once an internal error (check,
    ir), 'cannot write the dump None' (run) or a traceback (the scripts); now said as the
    standard output's, exit 1, and nothing after it (what is left unwritten is not tried
    again at the interpreter's exit, which said 'Exception ignored', exit 120)."""
    with open("/dev/full", "w") as full:
        result = subprocess.run([sys.executable, *command], cwd=ROOT, stdout=full,
                                stderr=subprocess.PIPE, text=True,
                                env=_environment(buffering))
    assert result.returncode == 1, result.stderr
    program = "cost_model.py" if command[0].endswith(".py") else "cgc"
    assert result.stderr.splitlines()[-1] == \
        f"{program}: error: cannot write the standard output: No space left on device"
    assert "Traceback" not in result.stderr and "Exception" not in result.stderr


def test_a_closed_standard_output_is_no_output_not_an_error():
    """Started with no standard output at all (`>&-`: Python's sys.stdout is None)."""
    for command in ("check", "ir"):
        result = subprocess.run(f"{sys.executable} -m cgc {command} schedules/train.cg >&-",
                                shell=True, cwd=ROOT, capture_output=True, text=True)
        assert result.returncode == 0 and result.stderr == "", (command, result.stderr)


@pytest.mark.parametrize("ending,status,said", [
    ("raise RuntimeError('boom')", 1, "RuntimeError: boom"),
    ("sys.exit(5)", 5, None), ("return 4", 4, None), ("raise KeyboardInterrupt", 130, None)])
def test_a_scripts_own_ending_stands_when_its_reader_left(ending, status, said, tmp_path):
    """script_status keeps what the script itself does: its exceptions (with their
    traceback), its exits and its statuses, stdout's reader gone or not."""
    script = tmp_path / "script.py"
    script.write_text("import sys\n"
                      f"sys.path.insert(0, {str(ROOT)!r})\n"
                      "from cgc.outputs import script_status\n"
                      "def main():\n"
                      "    print('x' * 100)\n"
                      f"    {ending}\n"
                      "sys.exit(script_status(main))\n")
    for buffering in BUFFERING:
        result = _closed_stdout([str(script)], buffering)
        code = result.returncode if result.returncode >= 0 else 128 - result.returncode
        assert code == status, (buffering, result.returncode, result.stderr)
        if said:
            assert said in result.stderr, result.stderr


def test_a_dump_that_fills_the_disk_partway_says_why_and_leaves_nothing(tmp_path):
    """A dump larger than the disk allows (here a file-size limit: EFBIG, as a full disk's
    ENOSPC): said with its reason, where numpy's writer said only '8192 requested and 5088
    written'; exit 1, and no half-written dump or staging folder left."""
    import resource

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
    result = subprocess.run(
        [sys.executable, "-m", "cgc", "run", str(SCHEDULES / "train.cg"), "--config", "tiny",
         "--backend", "numpy", "--steps", "1", "--dump", "d"], cwd=tmp_path,
        capture_output=True, text=True, env=_environment("buffered"), preexec_fn=small_files)
    assert result.returncode == 1, result.stderr
    assert result.stderr.splitlines()[-1] == "cgc: error: cannot write the dump d: File too large"
    assert os.listdir(tmp_path) == []


def test_a_dump_the_disk_refuses_is_said_as_the_dumps(tmp_path, monkeypatch, capsys):
    from cgc.training import loop

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(loop, "write_dump", full)
    folder = tmp_path / "dump"
    assert main(["run", str(SCHEDULES / "train.cg"), "--backend", "numpy", "--steps", "1",
                 "--dump", str(folder)]) == 1
    assert f"cgc: error: cannot write the dump {folder}: No space left on device" in \
        capsys.readouterr().err


@pytest.mark.parametrize("buffering", BUFFERING)
@pytest.mark.parametrize("shell,status", [
    ("-m cgc --version > /dev/full", 1),  # argparse's own text, refused: one line
    ("scripts/cost_model.py --help > /dev/full", 1),
    ("-m cgc check /nonexistent.cg 2> /dev/full", 2),  # its message lost, its status kept
    ("-m cgc check tests/diagnostics/unknown_name.cg 2> /dev/full", 1),
    ("-m cgc check tests/diagnostics/unknown_name.cg 2>&- > {tmp}/out", 1),
    ("-m cgc check schedules/train.cg > /dev/full 2> /dev/full", 1),
], ids=["--version full", "script --help full", "usage, stderr full", "diagnostics, stderr full",
        "diagnostics, stderr closed", "both full"])
def test_standard_streams_that_fail_leave_the_status_alone(shell, status, buffering, tmp_path):
    """Whatever becomes of stdout and stderr (full, closed, their reader gone), the status is
    the command's; stdout, where it can be written, gets nothing meant for stderr (a closed
    stderr once sent the diagnostics there)."""
    (tmp_path / "x.cg").write_text("def cgX : Nat =    1\n")
    command = shell.format(tmp=tmp_path)
    result = subprocess.run(f"set -o pipefail; {sys.executable} {command}", shell=True, cwd=ROOT,
                            capture_output=True, text=True, env=_environment(buffering),
                            executable="/bin/bash")
    assert result.returncode == status, (command, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr and "Exception" not in result.stderr
    if "> {tmp}/out" in shell:
        assert (tmp_path / "out").read_text() == ""


@pytest.mark.parametrize("buffering", BUFFERING)
@pytest.mark.parametrize("command,status", [
    (("fmt", "--check", "{tmp}/x.cg"), 1), (("check", "/nonexistent.cg"), 2),
    (("check", "tests/diagnostics/unknown_name.cg"), 1),
], ids=["fmt --check", "usage", "diagnostics"])
def test_one_reader_of_both_streams_that_left_leaves_the_status_alone(command, status,
                                                                      buffering, tmp_path):
    """`cgc ... 2>&1 | head` whose reader left before cgc wrote: stderr's writes fail too,
    and the status is still the command's (fmt --check once said 0)."""
    (tmp_path / "x.cg").write_text("def cgX : Nat =    1\n")
    process = subprocess.Popen([sys.executable, "-m", "cgc",
                                *(c.format(tmp=tmp_path) for c in command)],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               env=_environment(buffering))
    process.stdout.close()
    assert process.wait() == status


@pytest.mark.parametrize("buffering", BUFFERING)
def test_a_standard_output_that_fills_up_stops_the_run_with_its_checkpoint(buffering, tmp_path):
    """The standard output refuses a progress line partway (a file at its size limit: EFBIG,
    as a disk filling up): the run stops after that step, checkpointed, so its log holds no
    step its checkpoints lack; then one line, exit 1 (it once stopped with the step logged
    and not checkpointed: a resume logged it twice)."""
    out = tmp_path / "out.txt"
    out.write_bytes(b"\0" * (4096 * 1024 - 300))  # 300 bytes under the limit below
    command = (f"ulimit -f 4096; {sys.executable} -m cgc run {SCHEDULES / 'train.cg'} "
               "--config tiny --backend numpy --steps 30 --checkpoint-dir ck "
               f"--checkpoint-every 1 --log log.jsonl >> {out}")
    result = subprocess.run(command, shell=True, cwd=tmp_path, capture_output=True, text=True,
                            env=_environment(buffering), executable="/bin/bash")
    assert result.returncode == 1, result.stderr
    assert result.stderr.splitlines()[-1] == \
        "cgc: error: cannot write the standard output: File too large"
    steps = [json.loads(line)["step"] for line in (tmp_path / "log.jsonl").read_text()
             .splitlines()]
    last = sorted(p.name for p in (tmp_path / "ck").iterdir())[-1]
    assert 1 < len(steps) < 30 and last == f"step-{steps[-1]:08d}.safetensors", (steps, last)
