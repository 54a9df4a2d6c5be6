"""The CuPy backend's plumbing on the CPU, through tests/fake_cupy.py: every address, offset,
argument, scalar type, cuBLASLt operand and the graph capture, checked by running a step
with the reference kernels behind a fake CuPy and comparing with the NumPy backend. (What
the CUDA kernels compute is for tests/test_gpu.py, on a GPU.)"""

from __future__ import annotations

import numpy as np
import pytest

import fake_cupy
from cgc.training.data import Batches, load_corpus
from cgc.backends.numpy import portable
from cgc.core.elements import concrete
from cgc.frontend.api import analyse
from cgc.pipeline import open_run


from conftest import SCHEDULES
from cgc.backends.cuda.cublaslt import load as REAL_LOAD  # before any test installs the fake

PATH = str(SCHEDULES / "train.cg")


# Both sides' products are exactly rounded (portable.matmul, in the fake cuBLAS too: the
# same bits with any BLAS or thread count; with np.matmul this test failed on one
# machine's OpenBLAS), but the steps around them round in different places (cuBLAS's alpha
# and beta in float32 before the output's rounding, the reference machine's own order), so
# float32 results differ in their last bits; in the bfloat16 configuration a value that
# lands near a rounding boundary can take the neighbouring bfloat16 (2^-8 relative), and
# that grows over the steps. Measured after three steps: 4.5e-6 (tiny32), 4.8e-3 (tiny).
TOLERANCES = {"tiny32": (1e-5, 1e-4), "tiny": (2e-4, 2e-2)}


@pytest.mark.parametrize("config", ["tiny32", "tiny"])
def test_a_graph_replayed_step_matches_the_numpy_backend(config, monkeypatch):
    loss_tolerance, bank_tolerance = TOLERANCES[config]
    frontend = analyse([PATH])
    reference = open_run("numpy", frontend, PATH, config, {}, seed=5)
    fake_cupy.install(monkeypatch, reference.program.images, reference.program.low,
                      reference.machine.constants)
    run = open_run("cupy", frontend, PATH, config, {}, seed=5)
    constants = reference.program.constants
    batches = Batches(load_corpus(None), constants["cgBatch"], constants["cgContext"], 5)
    for step in range(3):
        ids, targets = batches.next()
        expected = reference.step(ids, targets).loss
        loss = run.step(ids, targets).loss  # eager, then captured: the next ones replay it
        assert (run.graph is not None) and run.steps_run == step + 1
        assert abs(loss - expected) <= loss_tolerance * expected, step
    for role in ("parameters", "gradients", "state"):
        ours, theirs = run.bank_values(role), reference.bank_values(role)
        for name, values in theirs.items():
            scale = max(float(np.linalg.norm(values)), 1e-30)
            error = float(np.linalg.norm(ours[name] - values)) / scale
            assert error <= bank_tolerance, (role, name, error)
    copy, expected = run.fetch("cgBankHalf.cgQkvWeight"), reference.machine.array(
        "cgBankHalf.cgQkvWeight")
    assert float(np.linalg.norm(copy - expected)) <= bank_tolerance * float(np.linalg.norm(expected))


U = 2.0 ** -24  # float32's unit roundoff
GELU_SLOPE = 1.13  # the largest |GELU'(x)| (tanh form), at x near 1.5


def _allowance(image: str, name: str, total: np.ndarray, depth: int, expected: np.ndarray,
               pre: np.ndarray | None, low: bool) -> np.ndarray:
    """The most one element of a product's output may differ between the fake cuBLASLt and
    the reference, from T = sum |a||b| of its K = depth terms (Higham, Accuracy and
    Stability, 3.1; the bounds hold for any order of addition):

    - the fake's float32 sum in BLAS's order: within gamma_K T of the exact sum p
      (gamma_K = K u / (1 - K u), u = 2^-24), times alpha: u T more; the reference's: the
      float32 nearest p (portable.matmul), within u T. So the two sums differ by at most
      delta = (gamma_K + 2u) T.
    - residual: both add the same residual r in float32, each sum rounded once (u |r + p|,
      and |r| + |p| <= |D| + 2T): delta + 2u (|D| + 2T).
    - GELU: |GELU'| <= 1.13, and each side's float32 GELU (NumPy's tanh on one, portable's on
      the other, each within 4 ulp; three roundings of 0.5 x (1 + t)) is within 16u |x| of
      GELU(x), |x| <= T + delta: 1.13 delta + 32u (T + delta).
    - DGELU: the sum times GELU'(pre), pre as stored (the same on both): 1.13 delta, and
      |p| <= T times the two float32 GELU' evaluations' difference, which a tanh 4 ulp off
      (8u) moves by at most 8u (0.5 + 0.8 |x| (1 + 0.134 x^2)) plus their roundings: within
      32u (1 + |x| (1 + 0.134 x^2)).
    - the output's own rounding: float32, u of each side's value; bfloat16, one bfloat16 ulp
      (2^-7 relative) where the two float32 values straddle a rounding boundary."""
    gamma = depth * U / (1 - depth * U)
    delta = (gamma + 2 * U) * total
    size = np.abs(expected)
    if image == "cgImageProductResidual":
        difference = delta + 2 * U * (size + 2 * total)
    elif image == "cgImageProductGelu" and name == "output":
        difference = GELU_SLOPE * delta + 32 * U * (total + delta)
    elif image == "cgImageProductTransposedGeluBackward":
        x = np.abs(pre)
        difference = GELU_SLOPE * delta + total * 32 * U * (1 + x * (1 + 0.134 * x * x))
    else:
        difference = delta
    if low:
        return difference + 2.0 ** -7 * (size + difference) + 1e-38
    return difference + 2 * U * (size + difference)


@pytest.mark.parametrize("config", ["tiny32", "tiny"])
def test_every_product_through_cublaslt_equals_its_reference(config, monkeypatch):
    """Launch by launch, from the same memory: each cuBLASLt product as the CuPy backend calls
    it (the fake computes cublasLtMatmul from cuBLASLt's column-major definition, epilogues
    included) against the reference product kernel, every output it writes (the GELU
    product's pre-activation too), element by element within _allowance, and equal outside
    what the product writes."""
    frontend = analyse([PATH])
    reference = open_run("numpy", frontend, PATH, config, {}, seed=1)
    fake_cupy.install(monkeypatch, reference.program.images, reference.program.low,
                      reference.machine.constants)
    run = open_run("cupy", frontend, PATH, config, {}, seed=1)
    machine = reference.machine
    constants = reference.program.constants
    ids, targets = Batches(load_corpus(None), constants["cgBatch"], constants["cgContext"],
                           1).next()
    reference.store("cgIds", ids)
    reference.store("cgTargets", targets)
    sums = []  # each reference product's T = |a| @ |b| and K
    product = portable.matmul

    def recorded(a, b):
        sums.append((np.matmul(np.abs(a).astype(np.float64), np.abs(b).astype(np.float64)),
                     a.shape[-1]))
        return product(a, b)

    monkeypatch.setattr(portable, "matmul", recorded)
    checked, worst = set(), 0.0
    launch_calls = [call for step, call in zip(run.steps, run.calls) if step.kind == "launch"]
    for (launch, phase, point), call in zip(reference.program.unrolled(), launch_calls):
        if launch.image.library is not None:
            for name, memory in machine.memory.items():
                size = min(memory.size, run.memory[name].size)
                run.memory[name][:size] = memory[:size]
            call()
        sums.clear()
        machine.launch(launch, phase, point)
        if launch.image.library is None:
            continue
        [(total, depth)] = sums
        bound = {b.parameter.name: b for b in launch.arguments(point).pointers}
        pre = None
        if "pre" in bound and bound["pre"].parameter.access == "read":
            start = bound["pre"].offset
            pre = machine.array(bound["pre"].view.storage.label)[start:start + total.size]
        for name, binding in bound.items():
            if binding.parameter.access == "read":
                continue
            label, start = binding.view.storage.label, binding.offset
            ours, expected = run.fetch(label), machine.array(label)
            stop = start + total.size
            low = concrete(binding.view.storage.element, reference.program.low).name == \
                "bfloat16"
            allowed = _allowance(launch.image.name, name, total.reshape(-1), depth,
                                 expected[start:stop], pre, low)
            difference = np.abs(ours - expected)
            assert np.array_equal(ours[:start], expected[:start]) and \
                np.array_equal(ours[stop:], expected[stop:]), (launch.image.name, label)
            assert (difference[start:stop] <= allowed).all(), (
                launch.image.name, label, float((difference[start:stop] / allowed).max()))
            worst = max(worst, float((difference[start:stop] / allowed).max()))
        checked.add(launch.image.name)
    # The step's products; cgImageProductWeight (beta = 1) only the seed's backward launches.
    assert checked == {"cgImageProductData", "cgImageProductTransposed", "cgImageProductResidual",
                       "cgImageProductWeightSet", "cgImageProductDataLow", "cgImageProductGelu",
                       "cgImageProductTransposedLow", "cgImageProductTransposedGeluBackward"}
    # Every residual product read its residual as C, distinct from D: no copy made first.
    assert ("DEFAULT", False) in fake_cupy.cublaslt.matmuls
    print(f"{config}: the largest difference, as a fraction of its allowance: {worst:.3g}")


def test_the_training_loop_dumps_and_traces_a_cupy_run_as_it_does_a_numpy_one(
        monkeypatch, tmp_path):
    """One loop serves every backend: --dump and --trace work on cupy too."""
    import io
    import json

    from cgc.training.loop import train
    frontend = analyse([PATH])
    reference = open_run("numpy", frontend, PATH, "tiny32", {}, seed=4)
    fake_cupy.install(monkeypatch, reference.program.images, reference.program.low,
                      reference.machine.constants)
    run = open_run("cupy", frontend, PATH, "tiny32", {}, seed=4)
    results = {}
    for name, backend in (("numpy", reference), ("cupy", run)):
        timings = []
        batches = Batches(load_corpus(None), 4, 64, 4)
        out = io.StringIO()
        results[name] = train(backend, batches, 2, out=out, dump=str(tmp_path / name),
                              trace=timings)
        assert len(timings) == sum(1 for _ in backend.program.unrolled())
        assert out.getvalue().count("\n") == 2
    manifest = json.loads((tmp_path / "cupy" / "run.json").read_text())
    assert manifest["backend"] == "cupy" and manifest["steps"] == 2
    assert manifest["roles"]["ids"] == "cgIds"
    for part in ("before", "gradients", "after", "final"):
        for entry in run.entries():
            ours = np.load(tmp_path / "cupy" / part / f"{entry}.npy")
            theirs = np.load(tmp_path / "numpy" / part / f"{entry}.npy")
            scale = max(float(np.linalg.norm(theirs)), 1e-30)
            assert float(np.linalg.norm(ours - theirs)) / scale <= 1e-4, (part, entry)
    for ours, theirs in zip(results["cupy"].losses, results["numpy"].losses):
        assert abs(ours - theirs) <= 1e-5 * theirs



def _algorithm_run(monkeypatch, capsys, unlabelled: bool):
    """Two tiny steps on the fake CuPy, its algorithms timed 3, 2 and 1 ms a run (the split-K
    one fastest): the losses, and the choices reported."""
    import re
    frontend = analyse([PATH])
    reference = open_run("numpy", frontend, PATH, "tiny", {}, seed=6)
    fake_cupy.install(monkeypatch, reference.program.images, reference.program.low,
                      reference.machine.constants)
    fake_cupy.algorithm_milliseconds = {0: 3.0, 1: 2.0, 2: 1.0}
    fake_cupy.cublaslt.split_k_unlabelled = unlabelled
    monkeypatch.setenv("CG_ALGORITHM_REPORT", "1")
    run = open_run("cupy", frontend, PATH, "tiny", {}, seed=6)
    batches = Batches(load_corpus(None), 4, 64, 6)
    capsys.readouterr()
    losses = [run.step(*batches.next()).loss for _ in range(2)]
    reports = re.findall(r"(\d+) algorithms in one pass over k, (\d+) give the first's bits, "
                         r"chose algorithm (\d+)", capsys.readouterr().err)
    steps_algorithms = {plan["algo"].algo[1] for plan in run.matmul_plans.values()}
    return losses, [tuple(int(x) for x in r) for r in reports], steps_algorithms


def test_the_cupy_run_times_only_one_pass_algorithms_and_keeps_the_fastest(monkeypatch, capsys):
    losses, reports, kept = _algorithm_run(monkeypatch, capsys, unlabelled=False)
    assert len(reports) >= 8 and all(r == (2, 2, 1) for r in reports), reports
    assert kept == {1}  # the faster of the two in one pass; the split-K one never


def test_the_cupy_run_never_keeps_an_algorithm_whose_bits_differ(monkeypatch, capsys):
    """The split-K algorithm labelled one pass: the comparison of bits alone keeps it out
    where its rounding differs, and it is kept (the fastest) only where it gave the same."""
    _, reports, _ = _algorithm_run(monkeypatch, capsys, unlabelled=True)
    assert all(r[0] == 3 for r in reports), reports
    differed = [r for r in reports if r[1] == 2]
    assert differed and all(r[2] == 1 for r in differed), reports
    assert all(r[2] == 2 for r in reports if r[1] == 3), reports


def test_a_missing_cublaslt_is_said_not_raised(monkeypatch):
    """Without libcublasLt the CuPy backend is unavailable, with a message saying how to get
    it (no traceback: the run reports it as it reports a missing CuPy)."""
    from cgc.backends.cuda import backend, cublaslt
    frontend = analyse([PATH])
    reference = open_run("numpy", frontend, PATH, "tiny", {}, seed=1)
    fake_cupy.install(monkeypatch, reference.program.images, reference.program.low,
                      reference.machine.constants)
    assert backend.unavailable_reason() is None  # the fake's cuBLASLt
    monkeypatch.setattr(cublaslt, "load", REAL_LOAD)  # the real loader, finding nothing
    monkeypatch.setattr(cublaslt, "_library_paths", lambda: ["/nowhere/libcublasLt.so.13"])
    reason = backend.unavailable_reason()
    assert reason is not None and "pip install 'cgc-compiler[cuda]'" in reason \
        and "/nowhere/libcublasLt.so.13" in reason
