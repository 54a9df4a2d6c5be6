"""The backend interface: the registry, what each backend checks before it runs, and the
model's roles (a model with other names runs with no change to cgc)."""

from __future__ import annotations

import io
import re
import shutil

import numpy as np
import pytest

from cgc.backends import REGISTRY, backend, choose
from cgc.backends.base import Run
from cgc.backends.cuda.emit import emit_program, image_problems
from cgc.training.data import Batches, load_corpus
from cgc.backends.numpy.reference import KERNELS
from cgc.training.loop import train
from cgc.checking.memory import plan_memory
from cgc.cli import main
from cgc.core.diagnostics import CompileError, render_all
from cgc.frontend.builtins import PRIMITIVES
from cgc.pipeline import analyse, backend_problems, check, evaluate, open_run

from conftest import SCHEDULES


def test_every_registered_backend_implements_the_interface():
    for name in REGISTRY:
        cls = backend(name)
        assert issubclass(cls, Run) and cls.name == name
        for method in ("store", "fetch", "run_step"):
            assert method in cls.__dict__, (name, method)


def test_auto_says_why_it_chose():
    name, why = choose("auto")
    assert name in REGISTRY and why.startswith("auto: ")


def test_every_image_the_schedules_launch_has_a_kernel_on_every_backend():
    path = str(SCHEDULES / "train.cg")
    frontend = analyse([path])
    for config in ("tiny", "gpt2"):
        assert backend_problems(evaluate(frontend, path, config=config)) == []


@pytest.fixture
def schedules(tmp_path):
    for path in SCHEDULES.glob("*.cg"):
        shutil.copy(path, tmp_path / path.name)
    return tmp_path


def test_an_image_without_a_template_is_a_diagnostic_at_its_declaration(schedules, capsys):
    """Found before anything runs, by check and by compile: not a TemplateNotFound. (An
    image the step launches, renamed everywhere: the training step launches no zeroing.)"""
    images = schedules / "images.cg"
    images.write_text(images.read_text().replace("cgImageEmbedding", "cgImageEmbeddings"))
    for name in ("library.cg", "optimizer.cg", "backward.cg", "train.cg", "forward.cg"):
        path = schedules / name
        path.write_text(path.read_text().replace("cgImageEmbedding", "cgImageEmbeddings"))
    for command in (["check"], ["compile", "-o", str(schedules / "out.cu")]):
        assert main([*command, str(schedules / "train.cg")]) == 1
        err = capsys.readouterr().err
        assert re.search(r"images\.cg:\d+:\d+: error: image 'cgImageEmbeddings' has no kernel "
                         r"template: the CUDA backend looks for templates/kernels/embeddings\.cu\.j2",
                         err), err
        if command == ["check"]:  # check asks every backend; the numpy one has its own gap
            assert "image 'cgImageEmbeddings' has no reference function" in err
        assert "internal error" not in err and "Traceback" not in err


def test_a_template_constant_no_role_gives_is_a_diagnostic(schedules, capsys):
    model = schedules / "model.cg"
    model.write_text(model.read_text().replace("(attentionTile cgAttentionTile)", ""))
    assert main(["compile", str(schedules / "train.cg"), "-o", str(schedules / "out.cu")]) == 1
    err = capsys.readouterr().err
    assert "error: the kernel of image 'cgImageAttention' uses kAttentionTile, but no `roles` " \
           "declaration gives the role 'attentionTile'" in err, err
    assert "KeyError" not in err


def test_the_detector_passes_what_the_schedules_need():
    """The gap check is not trivially silent: dropping a template it needs is caught above;
    with everything present it finds nothing."""
    path = str(SCHEDULES / "train.cg")
    program = evaluate(analyse([path]), path)
    assert image_problems(program) == []
    assert set(KERNELS) >= {launch.image.name for launch, _, _ in program.launches()}


def test_an_unknown_role_and_a_mistyped_buffer_role_are_diagnostics(schedules):
    model = schedules / "model.cg"
    text = model.read_text()
    model.write_text(text.replace("(ids cgIds)", "(idz cgIds)").replace("(loss cgLoss)",
                                                                         "(loss cgCorrect)"))
    with pytest.raises(CompileError) as error:
        evaluate(analyse([str(schedules / "train.cg")]), str(schedules / "train.cg"))
    text = render_all(error.value.diagnostics)
    assert "unknown role 'idz'" in text and "did you mean 'ids'" in text
    assert "role 'loss' is the cross-entropy of each row: a buffer of float32, but " \
           "'cgCorrect' holds int32" in text


# ---- a model with every name changed ------------------------------------------------------

def renamed(source: str) -> str:
    """Every name the model declares (constants, definitions, buffers, arena slots, banks,
    entries, phases, configs' constants) gets a new one; the language's primitives and the
    images (named after their kernels) keep theirs."""
    keep = set(PRIMITIVES)
    return re.sub(r"\bcg(?!Image)([A-Z]\w*)",
                  lambda m: m.group(0) if m.group(0) in keep else f"my{m.group(1)}Renamed",
                  source)


def test_a_model_with_other_names_compiles_and_runs_unchanged(schedules, tmp_path):
    for path in list(schedules.glob("*.cg")):
        path.write_text(renamed(path.read_text()))
    text = "".join(p.read_text() for p in schedules.glob("*.cg"))
    assert "cgIds" not in text and "cgLoss" not in text and "cgWidth" not in text
    assert "myIdsRenamed" in text and "myWidthRenamed" in text

    original, other = str(SCHEDULES / "train.cg"), str(schedules / "train.cg")
    program = evaluate(analyse([other]), other, config="tiny")
    assert check(program) == []
    reference = evaluate(analyse([original]), original, config="tiny")
    assert program.roles["ids"] == "myIdsRenamed" and program.roles["width"] == 64
    # The CUDA is the same but for the names (and the file names in its comments).
    ours = emit_program(program, plan_memory(program)).text
    theirs = emit_program(reference, plan_memory(reference)).text
    strip = lambda s: re.sub(r"(\b|_)(cg|my)[A-Z]\w*|[\w/.-]+\.cg:\d+:\d+", "N", s)  # noqa: E731
    assert strip(ours) == strip(theirs)
    # And it trains to the same losses, bit for bit.
    losses = []
    for path in (original, other):
        run = open_run("numpy", analyse([path]), path, "tiny", {}, seed=2)
        batches = Batches(load_corpus(None), 4, 64, 2)
        losses.append(train(run, batches, 2, out=io.StringIO()).losses)
    assert losses[0] == losses[1] and np.isfinite(losses[0]).all()


@pytest.mark.parametrize("name", ["numpy", "emulated"])
def test_token_ids_outside_the_vocabulary_are_refused_before_the_step(name):
    """One behaviour on every backend, checked on the host: the message names the row."""
    from cgc.backends.base import DataError
    path = str(SCHEDULES / "train.cg")
    run = open_run(name, analyse([path]), path, "tiny", {}, 0)
    ids, targets = Batches(load_corpus(None), 4, 64, 0).next()
    before = run.bank_values("parameters")
    bad = ids.copy()
    bad[37] = 256
    with pytest.raises(DataError, match=r"row 37: token id 256 is outside the vocabulary 0 \.\. 255"):
        run.step(bad, targets)
    bad_targets = targets.copy()
    bad_targets[5] = -2
    with pytest.raises(DataError, match=r"row 5: target -2 is outside"):
        run.step(ids, bad_targets)
    after = run.bank_values("parameters")
    assert all((before[k] == after[k]).all() for k in before)  # nothing ran
    targets[3] = -1  # an ignored row is fine
    assert np.isfinite(run.step(ids, targets).loss)


def test_the_emulated_backend_without_a_host_compiler_says_so_in_one_sentence(monkeypatch):
    from cgc.backends import cuda
    from cgc.backends.base import Unavailable
    from cgc.backends.cuda import emulated
    monkeypatch.setattr(emulated, "COMPILER", "g++-that-is-not-installed")
    with pytest.raises(Unavailable) as error:
        choose("emulated")
    message = str(error.value)
    assert message.count(".") <= 1 and "g++-that-is-not-installed" in message
    assert "apt-get install g++" in message
    del cuda


def test_a_run_time_fault_is_a_diagnostic_at_the_launch(monkeypatch, capsys, tmp_path):
    """A schedule the checker never saw (the checker is bypassed here) faults on the
    machine: the run says where, as a diagnostic, exit 1, no traceback."""
    from cgc import pipeline
    from cgc.backends.numpy import machine as machine_module
    original = machine_module.Machine._launch

    def faulty(self, launch, phase, point):
        if launch.image.name == "cgImageLayerNorm":
            raise machine_module.Fault("bounds", "pointer 0 'output' touches elements 0 .. 9, "
                                                 "outside the 8 of its buffer")
        return original(self, launch, phase, point)

    monkeypatch.setattr(machine_module.Machine, "_launch", faulty)
    status = main(["run", str(SCHEDULES / "train.cg"), "--backend", "numpy", "--steps", "1"])
    err = capsys.readouterr().err
    assert status == 1 and "Traceback" not in err and "internal error" not in err
    assert re.search(r"library\.cg:\d+:\d+: error: the step failed on the numpy backend: "
                     r"pointer 0 'output' touches", err), err
    assert "note: required from the call here" in err
    del pipeline


def test_the_memory_check_counts_what_a_backend_allocates_beside_the_plan():
    """The emulated and CuPy runs allocate cuBLASLt's workspace, 32 MiB a compute stream,
    beside the memory plan: a limit that holds the plan but not the workspaces is refused,
    naming them (once only one workspace was counted, whatever the streams)."""
    from cgc import api
    from cgc.backends.base import memory_problem
    from cgc.backends.cuda.backend import CupyRun
    from cgc.backends.cuda.emulated import EmulatedRun
    schedule = api.load(str(SCHEDULES / "train.cg"), config="tiny")
    plan, program = schedule.plan, schedule.program
    assert EmulatedRun.beside_plan(program) == CupyRun.beside_plan(program)
    beside, _ = EmulatedRun.beside_plan(program)
    assert beside == 2 * 32 * 2 ** 20  # train.cg's products on two streams

    def limited(run_class, limit):
        return type("Limited", (run_class,), {"memory_limit": staticmethod(
            lambda: (limit, "the test's limit"))})
    room = plan.total_bytes + beside
    assert memory_problem(limited(EmulatedRun, room), plan, program) is None
    refused = memory_problem(limited(EmulatedRun, room - 1), plan, program)
    assert refused is not None and "and 67,108,864 bytes (64.00 MiB) of cuBLASLt's " \
        "workspace (32 MiB for each of 2 streams) beside it" in refused.message, refused
    assert Run.beside_plan(program) == (0, "")  # the numpy machine allocates the plan alone
