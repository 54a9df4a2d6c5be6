"""The emulated backend's build cache (cgc/backends/cuda/emulated.py, build): a library is
built beside the cache, so a temporary folder on another file system works, and a cached
file that does not match the size and SHA-256 recorded beside it is built again, never
loaded (a truncated library fails dlopen, or ends in SIGBUS once mapped)."""

from __future__ import annotations

import ctypes
import os
import tempfile

import pytest

from cgc.backends.cuda.emulated import build, compiler_missing

from conftest import seeded_build_cache

pytestmark = pytest.mark.skipif(compiler_missing() is not None, reason=str(compiler_missing()))

SOURCE = 'extern "C" int answer() { return 42; }\n'


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = seeded_build_cache(tmp_path / "cache", monkeypatch)
    assert folder == tmp_path / "cache" / "cgc" / "emulated"
    return folder


def _answer(path) -> int:
    """Loads a private copy (dlopen shares one handle between loads of one path)."""
    copy = tempfile.NamedTemporaryFile(suffix=".so", delete=False)
    try:
        copy.write(path.read_bytes())
        copy.close()
        return ctypes.CDLL(copy.name).answer()
    finally:
        os.unlink(copy.name)


def test_a_temporary_folder_on_another_file_system_builds(cache, monkeypatch):
    """TMPDIR=/dev/shm (tmpfs) with the cache under /tmp: os.replace from one to the other
    failed with EXDEV."""
    if not os.path.isdir("/dev/shm") or \
            os.stat("/dev/shm").st_dev == os.stat(cache.parent.parent.parent).st_dev:
        pytest.skip("no /dev/shm on a file system other than the cache's")
    monkeypatch.setattr(tempfile, "tempdir", "/dev/shm")
    built = build(SOURCE, "probe")
    assert built.parent == cache and _answer(built) == 42
    assert not [name for name in os.listdir(cache) if name.endswith(".cgc-tmp")]


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "no record"])
def test_a_damaged_cached_library_is_built_again(cache, damage):
    built = build(SOURCE, "probe")
    whole = built.read_bytes()
    if damage == "truncated":
        built.write_bytes(whole[:len(whole) // 3])
    elif damage == "garbage":
        built.write_bytes((bytes(range(256)) * (len(whole) // 256 + 1))[:len(whole)])  # its size
    elif damage == "empty":
        built.write_bytes(b"")
    else:  # a library put there by hand (or an older cgc): not trusted without its record
        os.unlink(f"{built}.sha256")
        built.write_bytes(whole[:100])
    damaged = built.read_bytes()
    again = build(SOURCE, "probe")
    assert again == built and again.read_bytes() != damaged
    assert _answer(again) == 42
