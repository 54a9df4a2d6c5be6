"""The attention forward on Hopper's own instructions (cgAttentionHopper 1: wgmma products, TMA
tile loads, mbarrier stages; templates/kernels/attention_hopper.cu.j2), off by default.

Its numerics are checked with every other kernel's, against the NumPy reference with its
outputs poisoned (tests/test_emulated.py: heads of 16 and 64; tests/test_llama.py: grouped
queries, heads of 32), in the whole bfloat16 step (test_emulated.py), under ASan and UBSan
(test_sanitizers.py) and racecheck (test_racecheck.py, with a freed-too-early mutation) at three
key tiles a sequence, at GPT-2 small's full size (test_full_size.py); nvcc builds its whole
file for sm_90a (test_emit.py). Here: what selects it and what refuses it, the machine code it compiles to (a
promise the SASS audit keeps, shown to fail on the mma.sync kernel), that a mutated kernel
fails the poisoned comparison, and the CuPy backend's tensor map made through ctypes (on the
driver's twin here).
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

from cgc.backends.cuda import tensor_map as tensor_maps
from cgc.backends.cuda.emit import emit_program, launch_tensor_map
from cgc.backends.cuda.emulated import build, compiler_missing
from cgc.checking.memory import plan_memory
from cgc.resources import data_dir
from cgc.pipeline import analyse, evaluate

from conftest import HOPPER, ROOT, SCHEDULES

PATH = str(SCHEDULES / "train.cg")
needs_compiler = pytest.mark.skipif(compiler_missing() is not None,
                                    reason="needs the host C++ compiler (g++)")


def cgc(*arguments):
    return subprocess.run([sys.executable, "-m", "cgc", *arguments], capture_output=True,
                          text=True, cwd=ROOT)


def test_the_constant_selects_the_kernel_and_its_architecture():
    default = emit_program(*_planned("gpt2", None)).text
    hopper = emit_program(*_planned("gpt2", HOPPER)).text
    assert "cg_wgmma_bf16_ss<" not in default and "// Architecture:" not in default
    assert "cg_wgmma_bf16_ss<" in hopper and "cg_tma_load_2d(" in hopper
    assert "// Architecture: sm_90a" in hopper
    # the launch passes the qkv rows' map: 8 x 1024 rows of 2304, boxes of a head by a tile
    assert "cg_tensor_map_2d(" in hopper and ", 2304, (" in hopper and ") / 2304, 64, 64, 128)" \
        in hopper
    assert "--set cgAttentionHopper=1" in hopper.splitlines()[1]  # how to make it again


def _planned(config, overrides):
    program = evaluate(analyse([PATH]), PATH, config=config, overrides=overrides)
    return program, plan_memory(program)


@pytest.mark.parametrize("arguments,message", [
    (("--config", "tiny32", "--set", "cgAttentionHopper=1"),
     "multiplies bfloat16 on wgmma, and this configuration's low type is float32"),
    (("--config", "tiny", "--set", "cgAttentionHopper=1", "--set", "cgWidth=96",
      "--set", "cgHeads=2"), "heads of 16, 32 or 64), and the heads here are 48 wide"),
    (("--config", "tiny", "--set", "cgAttentionHopper=2"),
     "requires cgAttentionHopper (2) to be at most 1"),
], ids=["float32", "heads-of-48", "not-a-switch"])
def test_a_configuration_it_cannot_run_is_a_diagnostic(arguments, message):
    result = cgc("check", PATH, *arguments)
    assert result.returncode == 1 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_the_launch_tensor_map_follows_the_pointer():
    program, _ = _planned("tiny", HOPPER)
    launch = next(launch for launch, _, _ in program.launches()
                  if launch.image.name == "cgImageAttention")
    tensor_map, rows = launch_tensor_map(launch.image, dict(program.kernel_constants()),
                                         launch.arguments())
    assert (tensor_map.pointer, tensor_map.width, tensor_map.box_width, tensor_map.box_rows,
            tensor_map.swizzle, rows) == (2, 192, 16, 64, 32, 4 * 64)
    plain, _ = _planned("tiny", None)
    launch = next(launch for launch, _, _ in plain.launches()
                  if launch.image.name == "cgImageAttention")
    assert launch_tensor_map(launch.image, dict(plain.kernel_constants()),
                             launch.arguments()) is None


# ---- the CuPy backend's map, through ctypes, on the driver's twin ---------------------------

TWIN = """
#include <cuda.h>
extern "C" CUresult twin_encode(CUtensorMap* map, CUtensorMapDataType type, cuuint32_t rank, void* address,
                                const cuuint64_t* dims, const cuuint64_t* strides, const cuuint32_t* box,
                                const cuuint32_t* unit, CUtensorMapInterleave interleave,
                                CUtensorMapSwizzle swizzle, CUtensorMapL2promotion promotion,
                                CUtensorMapFloatOOBfill fill) {
  return cuTensorMapEncodeTiled(map, type, rank, address, dims, strides, box, unit, interleave, swizzle,
                                promotion, fill);
}
// The fields the twin reads back: address, rank, element bytes, swizzle, dims, row stride, box.
extern "C" int twin_fields(const void* map, unsigned long long* out) {
  cgcpu::detail::TensorMapFields f;
  if (!cgcpu::detail::unpack_tensor_map(static_cast<const CUtensorMap*>(map), f)) return 0;
  const unsigned long long values[9] = {reinterpret_cast<unsigned long long>(f.address), f.rank,
                                        f.element_bytes, f.swizzle, f.dims[0], f.dims[1], f.strides[1],
                                        f.box[0], f.box[1]};
  for (int i = 0; i < 9; ++i) out[i] = values[i];
  return 1;
}
"""


@pytest.fixture(scope="module")
def twin():
    library = ctypes.CDLL(str(build(TWIN, "tensor-map-twin")))
    library.twin_fields.argtypes = (ctypes.c_void_p, ctypes.POINTER(ctypes.c_ulonglong))
    return library


@needs_compiler
@pytest.mark.parametrize("swizzle,width", [(32, 16), (64, 32), (128, 64)])
def test_the_ctypes_map_is_the_one_asked_for(twin, swizzle, width):
    matrix = np.zeros((256, 3 * width * 4), dtype=np.uint16)
    value = tensor_maps.encode_2d(tensor_maps._typed(twin.twin_encode), matrix.ctypes.data,
                                  matrix.shape[1], matrix.shape[0], width, 64, swizzle)
    assert value.dtype.itemsize == 128
    fields = (ctypes.c_ulonglong * 9)()
    held = np.frombuffer(value.tobytes(), dtype=np.uint8).copy()
    assert twin.twin_fields(held.ctypes.data, fields) == 1
    swizzle_code = {32: 1, 64: 2, 128: 3}[swizzle]
    assert list(fields) == [matrix.ctypes.data, 2, 2, swizzle_code, matrix.shape[1],
                            matrix.shape[0], matrix.shape[1] * 2, width, 64]


@needs_compiler
def test_a_map_the_driver_refuses_is_an_error(twin):
    matrix = np.zeros((64, 256), dtype=np.uint16)
    with pytest.raises(tensor_maps.TensorMapError, match="refused a 64 x 256 map"):
        # a box row of 128 bytes under a 64-byte swizzle: wider than its span
        tensor_maps.encode_2d(tensor_maps._typed(twin.twin_encode), matrix.ctypes.data, 256, 64,
                              64, 64, 64)


# ---- its machine code ---------------------------------------------------------------------

def _instructions(config, overrides, mutate=None):
    sys.path.insert(0, str(ROOT / "scripts"))
    import sass_audit
    from cgc.backends.cuda.toolchain import ToolchainMissing
    try:
        sass_audit.check_versions()
        source, _ = sass_audit.emitted_file(PATH, config, overrides=overrides)
    except ToolchainMissing as missing:
        pytest.skip(str(missing))
    if mutate:
        source = mutate(source)
    cubin = sass_audit.build_cubin(sass_audit.device_code(source))
    kernel = sass_audit.parse_sass(sass_audit.disassemble(cubin))["cgImageAttention"]
    return Counter(i.base for i in kernel.instructions)


def on_wgmma_and_tma(counts: Counter) -> bool:
    """Products on the warpgroup's tensor cores (HGMMA), tiles by TMA (UTMALDG), stages by
    mbarrier (SYNCS); none of the mma.sync kernel's HMMA, ldmatrix or cp.async."""
    return counts["HGMMA"] > 0 and counts["UTMALDG"] > 0 and counts["SYNCS"] > 0 \
        and counts["HMMA"] == counts["LDSM"] == counts["LDGSTS"] == 0


def test_the_kernel_is_on_wgmma_tma_and_mbarrier():
    counts = _instructions("gpt2", HOPPER)
    assert on_wgmma_and_tma(counts), counts
    # S = Q K^T: 4 products of k16 over a head of 64; O += P V: 4 of 16 keys; each loop of key
    # tiles and the peeled diagonal tile has its 8
    assert counts["HGMMA"] == 16, counts
    assert not on_wgmma_and_tma(_instructions("gpt2", None))  # the promise can fail


# ---- the comparison can fail ----------------------------------------------------------------

@needs_compiler
def test_a_mutated_kernel_fails_the_poisoned_comparison(tmp_path, monkeypatch):
    """V's descriptor read K-major instead of N-major (its rows taken for its columns): the
    output is wrong, and the comparison the other tests make says so at this kernel."""
    from test_emulated import every_kernel_against_its_reference
    templates = tmp_path / "templates"
    shutil.copytree(data_dir("templates"), templates)
    path = templates / "kernels" / "attention_hopper.cu.j2"
    text = path.read_text(encoding="utf-8")
    assert "cg_wgmma_bf16_rs<D, 1>" in text
    path.write_text(text.replace("cg_wgmma_bf16_rs<D, 1>", "cg_wgmma_bf16_rs<D, 0>"),
                    encoding="utf-8")
    monkeypatch.setenv("CGC_TEMPLATES", str(templates))
    with pytest.raises(AssertionError, match=r"cgImageAttention pointer 0"):
        every_kernel_against_its_reference(PATH, "tiny", HOPPER, 2e-2)
