"""Shared test helpers: the repository root, golden files, and hardware markers."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import cgc  # noqa: F401  first: sets NumPy's BLAS threads before any test loads NumPy

ROOT = Path(__file__).resolve().parent.parent
SCHEDULES = ROOT / "schedules"
SEED_DIR = ROOT / "tests" / "seed"  # the seed excerpt, kept in the repository (tests/seed/README.md)
# The attention forward on Hopper's own instructions (wgmma, TMA, mbarrier; sm_90a), which a
# configuration selects with this constant at 1 (off by default).
HOPPER = {"cgAttentionHopper": 1}
# The tiny model with it, at three key tiles a sequence: its producer loads a stage again only
# after the consumers freed it (two stages), which one tile (the tiny context of 64) never does.
HOPPER_THREE_TILES = {**HOPPER, "cgContext": 192, "cgBatch": 2}


def seeded_build_cache(cache_home: Path, monkeypatch) -> Path:
    """A build cache of the test's own under `cache_home` (XDG_CACHE_HOME from here on), seeded
    with the emulator's runtime object that build() links into every program at its default
    flags (compiled once, in the session's cache): a test of how build() caches its own file
    need not compile the runtime as well (4-5 s each). Returns the folder of built files."""
    from cgc.backends.cuda.emulated import _record_path, cache_folder, runtime_object
    runtime = runtime_object()
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache_home))
    folder = cache_folder()
    folder.mkdir(parents=True, exist_ok=True)
    for path in (runtime, Path(_record_path(runtime))):
        shutil.copyfile(path, folder / path.name)
    return folder


def probe_sass(probe: str, kernel: str, architecture: str | None = None, preamble: str = ""):
    """The parsed SASS of `kernel`, a kernel of `probe` compiled by nvcc after the emitted file's
    device code (the tiny step's) and its primitives, for sm_90 or `architecture`; skips the
    test where CUDA's compiler wheels are missing."""
    import sys
    sys.path.insert(0, str(ROOT / "scripts"))
    import sass_audit
    from cgc.backends.cuda.toolchain import ToolchainMissing
    try:
        sass_audit.check_versions()
        source, _ = sass_audit.emitted_file(str(SCHEDULES / "train.cg"), "tiny")
    except ToolchainMissing as missing:
        pytest.skip(str(missing))
    code = preamble + sass_audit.device_code(source) + probe
    cubin = sass_audit.build_cubin(code, architecture=architecture)
    return sass_audit.parse_sass(sass_audit.disassemble(cubin))[kernel]


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true",
                     help="rewrite golden files from the current output (review with git diff)")


def _gpu_present() -> bool:
    return shutil.which("nvidia-smi") is not None


def pytest_collection_modifyitems(config, items):
    if _gpu_present():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU; none is present")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def golden(request):
    """golden(path, text): compare text with the file, or write it under --update-golden."""
    update = request.config.getoption("--update-golden")

    def check(path: Path, text: str) -> None:
        if update:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            return
        assert path.exists(), f"no golden file {path}; run pytest --update-golden and review it"
        expected = path.read_text(encoding="utf-8")
        assert text == expected, f"output differs from {path.relative_to(ROOT)}; " \
                                 "if the change is intended, run pytest --update-golden"

    return check


def pytest_assertrepr_compare(op, left, right):
    """Two long strings or byte strings compared: where they first differ, not pytest's own
    diff, which is quadratic (two parameter banks' bytes took it many minutes in CI)."""
    if not (isinstance(left, (str, bytes)) and isinstance(right, (str, bytes))) or \
            max(len(left), len(right)) <= 10_000:
        return None
    first = next((i for i, (a, b) in enumerate(zip(left, right)) if a != b),
                 min(len(left), len(right)))
    return [f"{type(left).__name__} of {len(left)} {op} {type(right).__name__} of {len(right)}",
            f"they first differ at index {first}"]
