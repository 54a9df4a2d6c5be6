"""Hopper's twins against the hardware. Builds cgc/backends/cuda_cpu/tests/wgmma.cu with nvcc for
sm_90a, the emitted file's own inline-PTX primitives (templates/common.cuh.j2) in place of the
CPU twins (cgcpu/wgmma.h, cgcpu/tensor_map.h), and runs on the GPU what a GPU can answer: the
N = 64 product cases of tests/test_wgmma_twins.py (every canonical layout and swizzle, A from
registers; each thread's accumulators against NumPy, exactly), two commit groups on one
accumulator, every swizzle through a tensor copy and back through descriptors, the NaN fill,
the attention-shaped ring, and the driver's own refusals of tensor maps (so that the twin's
cuTensorMapEncodeTiled refuses what the driver refuses). The twins' faults have no GPU
counterpart and are not run. Prints a line a check and exits 1 if any failed.

    python3 scripts/hopper_twins_on_gpu.py [--build-only] [--folder DIR] [--binary PROGRAM]

--build-only compiles and links without running; --binary runs the checks on a program built
otherwise (the rehearsal on a machine with no GPU: the test program built by g++ on the twins).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import sass_audit  # noqa: E402

SOURCE = ROOT / "cgc" / "backends" / "cuda_cpu" / "tests" / "wgmma.cu"
MODES = ("groups", "swizzles", "nan-fill", "pipeline", "bad-map")


def build(folder: Path) -> Path:
    """The test program for sm_90a, the tiny step's device code (its primitives) before it."""
    emitted, _ = sass_audit.emitted_file(str(ROOT / "schedules" / "train.cg"), "tiny")
    code = folder / "wgmma_gpu.cu"
    code.write_text("#include <cuda.h>\n" + sass_audit.device_code(emitted) + SOURCE.read_text(),
                    encoding="utf-8")
    binary = folder / "wgmma_gpu"
    subprocess.run([str(sass_audit.nvcc()), "-gencode", "arch=compute_90a,code=sm_90a", "-std=c++17",
                    "-O2", *sass_audit.include_flags(), f"-I{SOURCE.parent}", str(code), "-o",
                    str(binary)], check=True, capture_output=True, text=True)
    return binary


def products(binary: Path, folder: Path) -> list[tuple[str, bool, str]]:
    import test_wgmma_twins as cases
    results = []
    for case in cases.CASES:
        if case[0] != 64:  # the GPU versions are written for N = 64
            continue
        data, _, want = cases.make_case(case)
        (folder / "case.bin").write_bytes(data)
        done = subprocess.run([str(binary), "product", str(folder / "case.bin"), str(folder / "out.bin")],
                              capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            results.append((cases._name(case), False, (done.stdout + done.stderr).strip()[-300:]))
            continue
        out = np.fromfile(folder / "out.bin", np.float32).reshape(2, 128, 32)[0]
        wrong = np.argwhere(out != want)
        said = "exact" if wrong.size == 0 else \
            f"{len(wrong)} registers differ, first (thread, register) {wrong[0].tolist()}"
        results.append((cases._name(case), wrong.size == 0, said))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build-only", action="store_true", help="compile and link, run nothing")
    parser.add_argument("--folder", type=Path, help="where to build (default: a temporary folder)")
    parser.add_argument("--binary", type=Path, help="run the checks on this program instead of building one")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as temporary:
        folder = args.folder or Path(temporary)
        folder.mkdir(parents=True, exist_ok=True)
        if args.binary:
            binary = args.binary.resolve()
        else:
            try:
                binary = build(folder)
            except subprocess.CalledProcessError as failed:
                print(f"nvcc failed:\n{failed.stdout}{failed.stderr}")
                return 1
            print(f"built {binary.name} for sm_90a")
        if args.build_only:
            return 0
        results = products(binary, folder)
        for mode in MODES:
            done = subprocess.run([str(binary), mode], capture_output=True, text=True, timeout=120)
            last = (done.stdout + done.stderr).strip().splitlines()[-1:]
            results.append((mode, done.returncode == 0 and f"{mode}: ok" in done.stdout, " ".join(last)))
        for name, ok, said in results:
            print(f"{'ok  ' if ok else 'FAIL'} {name}: {said}")
        failed = sum(not ok for _, ok, _ in results)
        print(f"{len(results) - failed} passed, {failed} failed")
        return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
