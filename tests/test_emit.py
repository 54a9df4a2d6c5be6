"""The CUDA backend without a GPU: golden files, determinism, and every emitted file
compiled for sm_90 (NVRTC with no warnings; nvcc for the whole file, linked with cuBLAS;
no kernel spills registers)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest

from cgc.backends.cuda.compile import compiler_diagnostics
from cgc.core.diagnostics import render_all
from cgc.backends.cuda.emit import emit_program, template_name
from cgc.pipeline import analyse, check, evaluate
from cgc.checking.memory import plan_memory
from cgc.resources import data_dir
from cgc.backends.cuda.toolchain import nvcc_build, nvrtc_compile, ptxas_report

from conftest import HOPPER, ROOT, SCHEDULES

GOLDEN = ROOT / "tests" / "golden" / "cuda"
CASES = [(stem, config) for stem in ("backward", "train", "train_recompute") for config in ("tiny", "tiny32", "gpt2")]
# Configurations with constants set (`--set`), by the name the tests give them: GPT-2 small
# with the attention forward on wgmma, TMA and mbarrier (sm_90a).
SET = {"gpt2-hopper": ("gpt2", HOPPER)}
CASES.append(("train", "gpt2-hopper"))
IDS = [f"{s}-{c}" for s, c in CASES]


def emitted(stem: str, config: str):
    path = str(SCHEDULES / f"{stem}.cg")
    frontend = analyse([path])
    config, overrides = SET.get(config, (config, None))
    program = evaluate(frontend, path, config=config, overrides=overrides)
    check(program)
    return emit_program(program, plan_memory(program))


@pytest.mark.parametrize("stem,config", CASES, ids=IDS)
def test_cuda_matches_golden(stem, config, golden):
    golden(GOLDEN / f"{stem}.{config}.cu", emitted(stem, config).text)


def test_same_input_same_bytes_in_another_process(tmp_path):
    out = tmp_path / "train.cu"
    subprocess.run([sys.executable, "-m", "cgc", "compile", str(SCHEDULES / "train.cg"),
                    "--config", "gpt2", "-o", str(out)], check=True, capture_output=True)
    assert out.read_text() == emitted("train", "gpt2").text


@pytest.mark.parametrize("stem,config", CASES, ids=IDS)
def test_nvrtc_compiles_every_file_for_sm90_without_warnings(stem, config):
    ok, log, _ = nvrtc_compile(emitted(stem, config).text, f"{stem}.{config}.cu")
    assert ok, log
    assert log.strip() == ""


@pytest.mark.parametrize("config", ["tiny32", "gpt2", "gpt2-hopper"])
def test_nvcc_builds_the_whole_file_with_its_host_program(config, tmp_path):
    source = tmp_path / f"train.{config}.cu"
    source.write_text(emitted("train", config).text)
    ok, log = nvcc_build(str(source), str(tmp_path / "train"))
    assert ok, log
    assert "warning" not in log
    assert (tmp_path / "train").exists()


@pytest.mark.parametrize("config", ["tiny32", "gpt2", "gpt2-hopper"])
def test_no_kernel_spills_registers(config):
    result = emitted("train", config)
    ok, log, reports = ptxas_report(result.text)
    assert ok, log
    assert {r.name for r in reports} == {k.image for k in result.kernels}
    for report in reports:
        assert report.spill_stores == 0 and report.spill_loads == 0, report
        assert report.registers <= 255


def test_every_launch_is_checked_and_names_its_source_line():
    text = emitted("train", "tiny").text
    launches = re.findall(r"^\s*CG_LAUNCH\((cgImage\w+),", text, re.MULTILINE)
    checks = re.findall(r'^\s*CG_LAUNCHED\("(\S+\.cg:\d+:\d+)', text, re.MULTILINE)
    assert launches and len(launches) == len(checks)
    source = (SCHEDULES / "launches.cg").read_text().splitlines()
    # the training step's scatter (the seed's cgBackward, in backward.cg, has its own)
    line = next(i for i, t in enumerate(source, 1) if "(cgLaunch cgImageScatterSorted" in t)
    column = source[line - 1].index("(cgLaunch") + 1
    assert f'CG_LAUNCHED("launches.cg:{line}:{column} cgImageScatterSorted");' in text
    # the saving backward's turned loop: every layer's turn but the bottom one's
    assert "for (int fromTop = 0; fromTop < 1; ++fromTop) {" in text


def test_every_kernel_image_has_its_template():
    frontend = analyse([str(SCHEDULES / "images.cg")])
    for image in frontend.declarations.images.values():
        if image.library is None and image.collective is None:  # a kernel, not a host call
            assert (data_dir("templates") / "kernels" / f"{template_name(image.name)}.cu.j2").exists()


def test_a_template_error_is_reported_at_the_template_line(tmp_path, monkeypatch):
    templates = tmp_path / "templates"
    shutil.copytree(data_dir("templates"), templates)
    # a kernel the training step launches (its GELU is now a product's epilogue, its cast
    # down the layer-norm backward's second output)
    broken = templates / "kernels" / "attention_delta.cu.j2"
    lines = broken.read_text().splitlines()
    lines[4] = lines[4] + " undefined_identifier += 1;"
    broken.write_text("\n".join(lines) + "\n")
    monkeypatch.setenv("CGC_TEMPLATES", str(templates))
    result = emitted("train", "tiny")
    ok, log, _ = nvrtc_compile(result.text, "train.tiny.cu")
    assert not ok
    text = render_all(compiler_diagnostics(result, log, "train.tiny.cu"))
    assert f"{broken}:5:1: error: identifier \"undefined_identifier\" is undefined " \
           "(in the kernel of image 'cgImageAttentionDelta')" in text
    assert "note: emitted as line" in text


def _copies_and_gelu_passes(text: str) -> list[str]:
    """What the cuBLASLt products were built to remove: a device copy in a product's host
    function or in the step (before a residual product), and a separate GELU pass."""
    found = []
    functions = re.findall(r"^static void (cgImageProduct\w+)\(.*?^}", text, re.MULTILINE | re.DOTALL)
    bodies = re.findall(r"^static void cgImageProduct\w+\(.*?^}", text, re.MULTILINE | re.DOTALL)
    for name, body in zip(functions, bodies):
        if "cudaMemcpy" in body:
            found.append(f"{name} copies")
    step = text[text.index("// the schedule: one function per phase"):text.index("void cg_step(")]
    if "cudaMemcpy" in step:
        found.append("the step copies")
    found += re.findall(r"CG_LAUNCH\((cgImageGelu(?:Backward)?),", text)
    return found


@pytest.mark.parametrize("config", ["tiny", "gpt2"])
def test_no_copy_before_residual_products_and_gelu_fused_into_products(config):
    text = emitted("train", config).text
    assert _copies_and_gelu_passes(text) == []
    # the residual is cuBLASLt's C and the output its D, beta 1
    residual = re.search(r"^static void cgImageProductResidual\(.*?^}", text,
                         re.MULTILINE | re.DOTALL).group(0)
    assert ", residual, output, CUDA_R_32F, 1.0f, CUBLASLT_EPILOGUE_DEFAULT, nullptr);" in residual
    assert "CUBLASLT_EPILOGUE_GELU_AUX, pre);" in text and "CUBLASLT_EPILOGUE_DGELU, pre);" in text
    # the detector fails on what the emitter used to write: a copy first, GELU its own pass
    copied = text.replace(residual, residual.replace(
        "{\n", "{\n  cg_check(cudaMemcpyAsync(output, residual, 4, cudaMemcpyDeviceToDevice, stream), where);\n", 1))
    assert _copies_and_gelu_passes(copied) == ["cgImageProductResidual copies"]
    assert _copies_and_gelu_passes(text + "CG_LAUNCH(cgImageGelu, dim3(1), dim3(256), 0, stream)") \
        == ["cgImageGelu"]


def test_an_epilogue_product_with_an_aux_ld_cublaslt_refuses_is_an_error():
    """n is the aux matrix's leading dimension: cuBLASLt wants it divisible by 8."""
    from cgc.backends.cuda.emit import image_problems
    path = str(SCHEDULES / "train.cg")
    program = evaluate(analyse([path]), path, config="tiny")
    assert image_problems(program) == []
    launch = next(launch for launch, _, _ in program.launches()
                  if launch.image.name == "cgImageProductGelu")
    import dataclasses
    scalars = tuple(dataclasses.replace(s, value=1020) if launch.image.scalars[s.index].name == "n"
                    else s for s in launch.scalars)
    broken = dataclasses.replace(launch, scalars=scalars)
    monkey = dataclasses.replace(program, body=(broken,))
    problems = image_problems(monkey)
    assert [p.message for p in problems] == [
        "image 'cgImageProductGelu' is launched with n = 1020, but cuBLASLt's GELU_AUX epilogue "
        "needs the leading dimension of its aux matrix (pre, n) divisible by 8"]


def test_a_kernel_past_the_shared_memory_a_block_may_have_is_a_diagnostic(capsys):
    """The classifier holds its row on chip: at a vocabulary of 128,256 (Llama 3's) in
    bfloat16 that is 256,512 bytes, past sm_90's 227 KiB a block. cgc compile says so at
    the image's declaration, exit 1, before any CUDA is written; at GPT-2's 50,304 it
    compiles."""
    from cgc.cli import main
    status = main(["compile", str(SCHEDULES / "train.cg"), "--config", "gpt2",
                   "--set", "cgVocab=128256", "-o", "-"])
    err = capsys.readouterr().err
    assert status == 1 and "Traceback" not in err
    assert re.search(r"images\.cg:\d+:1: error: the kernel of image 'cgImageClassifier' needs "
                     r"256,512 bytes of dynamic shared memory a block", err), err
    assert "note: the classifier holds its whole row of 128256 logits on chip" in err
