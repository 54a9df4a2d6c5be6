"""The Python API (cgc/api.py, docs/api.md): its page runs as written, and what a training run
does (steps, resume, identity, data, validation, the tensors) holds through the library as it
does through the command (tests/test_checkpoint.py, tests/test_run_refusals.py)."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import cgc
from cgc.training.checkpoint import CheckpointError
from conftest import ROOT

TRAIN = str(ROOT / "schedules" / "train.cg")


def _python_blocks(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "docs" / page).read_text(), re.S)


def test_the_api_page_runs_as_written():
    """Every python block of docs/api.md, in order, in one fresh interpreter at the root (as
    a reader would paste them), printing what the page says it prints."""
    script = "\n".join(_python_blocks("api.md"))
    assert script.count("cgc.open_training") >= 2
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                            text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "cgTrainStep tiny 45 launches"
    assert "error: unknown name 'cgForwardd'" in result.stdout
    assert "note: did you mean the def 'cgForward'?" in result.stdout
    assert "[2, 3, 4, 5, 6] -> " in result.stdout
    assert "float32 (24576,) True" in result.stdout
    assert "tokens from step 6" in result.stdout


def test_the_public_names_are_exported_with_docstrings_and_hints():
    for name in cgc.__all__:
        value = getattr(cgc, name)
        if name == "__version__":
            continue
        assert value.__doc__, name
        if callable(value) and not isinstance(value, type):
            assert value.__annotations__.get("return") is not None, name
    for method in ("step", "train", "save", "parameters", "gradients", "sample"):
        function = getattr(cgc.TrainingRun, method)
        assert function.__doc__ and "return" in function.__annotations__, method
    with pytest.raises(AttributeError):
        cgc.no_such_name  # noqa: B018


def test_import_cgc_loads_no_numpy():
    probe = "import sys, cgc; cgc.load; print('numpy' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert result.stdout.strip() == "False", result.stderr


def test_a_compile_error_carries_the_diagnostics_as_the_command_prints_them(tmp_path, capsys):
    wrong = tmp_path / "wrong.cg"
    wrong.write_text(f'import "{TRAIN}"\n\ndef cgAgain : (family NvidiaLaunchSchedule) =\n'
                     "  (cgTrainStepp)\n")
    with pytest.raises(cgc.CompileError) as raised:
        cgc.load(wrong)
    from cgc.cli import main
    assert main(["check", str(wrong)]) == 1
    assert capsys.readouterr().err.strip() == str(raised.value).strip()
    assert "unknown name 'cgTrainStepp'" in raised.value.diagnostics[0].message
    with pytest.raises(cgc.OptionError, match="unknown config 'huge'"):
        cgc.load(TRAIN, config="huge")
    with pytest.raises(cgc.OptionError, match="cgLayerz"):
        cgc.load(TRAIN, overrides=["cgLayerz=2"])


def test_overrides_as_a_mapping_or_as_texts_are_the_same_program():
    a = cgc.load(TRAIN, config="tiny32", overrides={"cgLayers": 1})
    b = cgc.load(TRAIN, config="tiny32", overrides=["cgLayers=1"])
    assert a.launch_program() == b.launch_program()
    assert a.launch_program() != cgc.load(TRAIN, config="tiny32").launch_program()
    assert a.cuda() == b.cuda() and "__global__" in a.cuda()
    assert "arena" in a.memory_report()


def test_stepping_one_at_a_time_is_the_loop():
    """step() and train() are one step: stepping twice then training to 4 gives the losses
    (bit for bit) and the parameters of training to 4 at once."""
    schedule = cgc.load(TRAIN, config="tiny32")
    one = cgc.open_training(schedule, "numpy", steps=4, seed=3)
    records = [one.step(), one.step()]
    seen = []
    one.train(on_step=lambda record: seen.append(record.step))
    other = cgc.open_training(schedule, "numpy", steps=4, seed=3)
    out = io.StringIO()
    result = other.train(out=out)
    assert [r.loss for r in records] + one.losses[2:] == result.losses == one.losses
    assert seen == [3, 4] and out.getvalue().count("\n") == 4
    for name, value in one.parameters().items():
        assert np.array_equal(value, other.parameters()[name]), name
    with pytest.raises(cgc.OptionError, match="at step 4"):
        one.train(3)


def test_a_part_of_a_step_is_refused_by_the_library_too():
    with pytest.raises(cgc.CompileError, match="is not a whole training step"):
        cgc.open_training(str(ROOT / "schedules" / "backward.cg"), "numpy")


def test_save_and_resume_through_the_library_continue_bit_for_bit(tmp_path):
    whole = cgc.open_training(TRAIN, "numpy", steps=4, seed=2, config="tiny32")
    whole.train()
    half = cgc.open_training(TRAIN, "numpy", steps=2, seed=2, config="tiny32")
    half.train()
    saved = half.save(str(tmp_path / "ckpt"))
    resumed = cgc.open_training(TRAIN, "numpy", steps=4, resume=str(tmp_path / "ckpt"))
    assert resumed.resumed.path == saved and resumed.step_number == 2
    assert resumed.options.seed == 2 and resumed.options.config == "tiny32"
    resumed.train()
    assert resumed.losses == whole.losses
    for name, value in whole.parameters().items():
        assert np.array_equal(value, resumed.parameters()[name]), name


def test_resume_refuses_another_seed_data_or_split_through_the_library(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for index in range(12):
        (data / f"doc{index:02d}.txt").write_text(f"document {index} " * 40)
    run = cgc.open_training(TRAIN, "numpy", steps=1, data=[str(data)], val_every=1,
                            config="tiny32")
    result = run.train()
    assert [step for step, _ in result.validation] == [1]
    assert run.identity["data"]["held_out"].startswith("1 in 10 documents")
    run.save(str(tmp_path / "ckpt"))
    other = tmp_path / "other"
    other.mkdir()
    for index in range(12):
        (other / f"doc{index:02d}.txt").write_text(f"another {index} " * 40)
    changes = {"seed": dict(seed=9), "held_out": dict(val_every=0),
               "sha256": dict(data=[str(other)])}
    for field, settings in changes.items():
        with pytest.raises(CheckpointError, match=field):
            cgc.open_training(TRAIN, "numpy", steps=3, resume=str(tmp_path / "ckpt"),
                              **{"data": [str(data)], "val_every": 1, **settings})
    with pytest.raises(cgc.RunError, match="cannot use the training data"):
        cgc.open_training(TRAIN, "numpy", data=[str(data / "doc00.txt")], val_every=1)


def test_parameters_are_the_backends_memory_not_a_copy():
    run = cgc.open_training(TRAIN, "numpy", steps=2, config="tiny32")
    weights = run.parameters()["cgQkvWeight"]
    weights[:] = 0.0  # the model's own memory: the bank reads zeros now
    assert not run.run.fetch("cgBankP.cgQkvWeight").any()
    run.step()
    gradient = run.gradients()["cgQkvWeight"]
    assert gradient.any() and np.array_equal(gradient, run.run.fetch("cgBankG.cgQkvWeight"))


@pytest.mark.parametrize("backend", ["numpy", "cupy"])
def test_torch_takes_the_tensors_without_a_copy(backend, monkeypatch):
    """torch.from_dlpack shares the backend's memory: a write through torch is the model's.
    (cupy: through tests/fake_cupy.py, whose arrays are host memory; on a GPU,
    tests/test_gpu.py does the same with CuPy's.)"""
    torch = pytest.importorskip("torch")
    from cgc.pipeline import analyse, open_run
    from cgc.training.run import TrainingOptions, TrainingRun
    frontend = analyse([TRAIN])
    if backend == "cupy":
        import fake_cupy
        reference = open_run("numpy", frontend, TRAIN, "tiny32", {}, 0)
        fake_cupy.install(monkeypatch, reference.program.images, reference.program.low,
                          reference.machine.constants)
    run = TrainingRun(open_run(backend, frontend, TRAIN, "tiny32", {}, 0), {},
                      TrainingOptions(steps=1))
    array = run.parameters()["cgQkvWeight"]
    tensor = torch.from_dlpack(array)
    assert tensor.data_ptr() == array.__array_interface__["data"][0]
    tensor.fill_(0.25)
    assert (run.run.fetch("cgBankP.cgQkvWeight") == 0.25).all()


def test_one_str_is_one_item_never_its_characters(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("hello world, " * 100)
    run = cgc.open_training(TRAIN, "numpy", steps=1, data=str(text), config="tiny32")
    assert run.identity["data"]["tokens"] == 1300
    assert cgc.load(TRAIN, config="tiny32", overrides="cgLayers=1").program.constants[
        "cgLayers"] == 1
    with pytest.raises(cgc.PathError, match="cannot read the kernels folder nowhere"):
        cgc.load(TRAIN, kernels="nowhere")


def test_bad_settings_are_option_errors_not_type_errors():
    for settings in (dict(steps="5"), dict(steps=2.5), dict(seed=1.5), dict(warmup=1.5),
                     dict(lr="0.1"), dict(steps=None)):
        with pytest.raises(cgc.OptionError):
            cgc.open_training(TRAIN, "numpy", **settings)
    with pytest.raises(cgc.OptionError, match="unknown backend 'bogus'"):
        cgc.open_training(TRAIN, "bogus")
    with pytest.raises(TypeError, match="unknown setting 'stepz'"):
        cgc.open_training(TRAIN, "numpy", stepz=3)


def test_sampling_refuses_what_the_command_refuses():
    run = cgc.open_training(TRAIN, "numpy", steps=1, config="tiny32")
    for arguments in (dict(prompt="", tokens=4), dict(prompt="a", tokens=0),
                      dict(prompt="a", tokens=4, temperature=-1),
                      dict(prompt="a", tokens=4, top_k=0), dict(prompt="a", tokens=4, top_k=999)):
        with pytest.raises(cgc.OptionError):
            run.sample(**arguments)
    assert len(run.sample("a", 3).encode("utf-8", "surrogateescape")) >= 1


def test_a_schedules_overrides_stay_and_settings_add_to_them():
    schedule = cgc.load(TRAIN, config="tiny32", overrides={"cgLayers": 1})
    run = cgc.open_training(schedule, "numpy", overrides={"cgHeads": 2})
    assert run.program.constants["cgLayers"] == 1 and run.program.constants["cgHeads"] == 2


def test_load_asks_the_backends_as_check_does(tmp_path):
    """A schedule whose image has no template or reference function is refused by load,
    as `cgc check` refuses it (not accepted, to fail later)."""
    from test_tutorial import PAGE, blocks
    (tmp_path / "cgc-schedules").symlink_to(ROOT / "schedules")
    for _, file, body in blocks(PAGE.read_text(encoding="utf-8")):
        if file:
            (tmp_path / file).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / file).write_text(body, encoding="utf-8")
    with pytest.raises(cgc.CompileError, match="has no reference function"):
        cgc.load(tmp_path / "scaled.cg", config="tiny")
    assert cgc.load(tmp_path / "scaled.cg", config="tiny", kernels=tmp_path / "kernels")


def test_a_checkpoint_folder_that_is_a_file_is_refused_before_any_step(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(cgc.PathError, match="cannot write checkpoints into .*: not a folder"):
        cgc.open_training(TRAIN, "numpy", steps=2, checkpoint_dir=str(afile))
