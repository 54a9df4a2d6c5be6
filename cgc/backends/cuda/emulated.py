"""The emulated backend: the exact file `cgc compile` emits, built for the host.

The host C++ compiler builds the emitted .cu with the project's own CUDA-on-CPU headers
(cgc/backends/cuda_cpu/include: every CUDA thread a fiber, blocks over the cores, shared
memory per block, warp collectives, WMMA, bfloat16 as the device rounds it, cuBLAS's
gemmEx and cuBLASLt's matmul on the CPU, streams whose concurrent launches run interleaved)
into a shared library, cached by content. A small driver, generated
here and compiled in the same translation unit, exports the host program's step, its
allocations, and one entry point per kernel image and cuBLAS product, so a run can go
through the emitted host program (`cg_step`) or launch by launch, as the CuPy backend does.

The shadow build (`shadow=True`, or CGC_EMULATED_SHADOW=1 for a run) records which launch read
and wrote each element of global memory while launches may run at the same time, and reports
any element two unordered launches touch where one writes: `Conflict` values, and for a run a
`ConcurrencyConflict` fault (docs/emulation.md, "Streams and the shadow").
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from ...checking.memory import storage_home
from ...core.elements import c_type, element_bytes
from ...resources import cache_dir
from ..base import Run, RunFault, initial_parameters
from ..numerics import decode, encode, storage_dtype
from .emit import (emit_program, image_problems, kernel_variant, launch_tensor_map,
                   rank_mismatch, shared_memory_bytes, workspace_beside_plan)

HEADERS = Path(__file__).resolve().parent.parent / "cuda_cpu" / "include"
COMPILER = os.environ.get("CGC_CXX", "g++")
# -O1: the emulated steps run as fast as at -O2 (two tiny steps 1.01 s against 1.06 s, one
# 256-wide step 7.3 s against 7.7 s, measured) and build in two thirds of the time. -O2's
# assumptions (strict aliasing above all) are still tried: tests/test_emulated.py builds the
# standalone program at OPTIMISED_FLAGS.
FLAGS = ("-std=c++17", "-O1", "-pthread", "-shared", "-fPIC", "-w")
STANDALONE_FLAGS = ("-std=c++17", "-O1", "-pthread", "-w")
OPTIMISED_FLAGS = ("-std=c++17", "-O2", "-pthread", "-w")
# AddressSanitizer and UndefinedBehaviorSanitizer (alignment included: a 16-byte vector
# access at an address that is not a multiple of 16 is reported), with the memory plan's
# red zones fenced (cgcpu/sanitize.h). -Og -g1 (line tables: reports name the file and line),
# not -O1 -g: the same reports, built in a third of the time (20.5 s against 58 s for the tiny
# step, measured), and run as fast.
SANITIZER_FLAGS = ("-std=c++17", "-Og", "-g1", "-pthread", "-w", "-fsanitize=address,undefined",
                   "-fno-omit-frame-pointer", "-fno-sanitize-recover=all",
                   "-include", "cgcpu/sanitize.h")
SANITIZER_ENVIRONMENT = {"ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1",
                         "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1"}
RED_ZONE = 256  # bytes after every step buffer and arena slot in the sanitizer build
# Racecheck: ThreadSanitizer, told about every fiber and about CUDA's barriers by the headers
# (cgc/backends/cuda_cpu/README.md, "Racecheck"); its reports are read back into Race values.
# -g1: line tables, all a report's stacks and the racecheck parser read.
RACECHECK_FLAGS = ("-std=c++17", "-O1", "-g1", "-pthread", "-w", "-fsanitize=thread")
RACECHECK_ENVIRONMENT = {"TSAN_OPTIONS": "halt_on_error=0:atexit_sleep_ms=0:report_signal_unsafe=0:"
                                         "exitcode=66"}
# The shadow: GCC's ThreadSanitizer instrumentation (every load, store and atomic becomes a call
# of __tsan_read4(p) and the like) WITHOUT ThreadSanitizer's runtime: compiled with these flags,
# then linked without -fsanitize=thread, so that cgcpu/shadow.h's definitions are what the
# calls reach (-U__SANITIZE_THREAD__: the headers must not take it for a racecheck build).
SHADOW_FLAGS = ("-std=c++17", "-O2", "-pthread", "-w", "-fsanitize=thread", "-U__SANITIZE_THREAD__",
                "-DCG_CPU_SHADOW=1", "--param", "tsan-instrument-func-entry-exit=0")
SHADOW_LINK = ("-pthread", "-rdynamic")  # -rdynamic: reports name __device__ variables (dladdr)
# -fno-gnu-unique: each run loads its own copy of the library, and its own copy it must be; the
# emulator's singletons (function-local statics) would otherwise be STB_GNU_UNIQUE, one for the
# whole process whatever dlopen's RTLD_LOCAL says, and a second run would find the first's
# configuration and shadow.
SHADOW_LIBRARY_FLAGS = (*SHADOW_FLAGS, "-fPIC", "-fno-gnu-unique")
SHADOW_LIBRARY_LINK = ("-shared", "-pthread")


class BuildFailed(RunFault):
    """The host compiler refused the emitted file (a bug in a template or in the CUDA-on-CPU
    headers, never the schedule's); the message holds the compiler's log."""


def compiler_missing() -> str | None:
    if shutil.which(COMPILER) is None:
        return (f"no host C++ compiler ({COMPILER}) is installed: apt-get install g++ "
                "(or set CGC_CXX)")
    return None


def header_files() -> list[Path]:
    return sorted(p for p in HEADERS.rglob("*") if p.is_file())


def _compiler_version() -> str:
    try:
        return subprocess.run([COMPILER, "--version"], capture_output=True, text=True,
                              timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def content_key(*parts: str | bytes) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode() if isinstance(part, str) else part)
        digest.update(b"\0")
    return digest.hexdigest()[:24]


# The emulator's host runtime, compiled once for each set of flags (cgcpu/linkage.h): every
# header that defines CGCPU_RUNTIME functions, reached through the shims.
RUNTIME_SOURCE = """// cgc's emulated builds: the CUDA-on-CPU runtime, one object for every program built with
// these flags (cgc/backends/cuda_cpu/include/cgcpu/linkage.h).
#include <cuda_runtime.h>
#include <cublasLt.h>
#include <nccl.h>
"""


def build(source: str, output_name: str, flags=FLAGS, extra: tuple = (),
          link: tuple | None = None) -> Path:
    """Compiles `source` (C++ that includes the emitted file) for the host, once per content:
    the result is cached under the cache folder by a hash of the source, the headers, the
    flags and the compiler's version, with its size and SHA-256 recorded beside it. A cached
    file that does not match its record (cut short, overwritten, the record lost) is built
    again, never loaded: a truncated library would fail dlopen or end in SIGBUS. The
    emulator's runtime is not compiled with it but linked in, built once for these flags
    (runtime_object). With `link`, the source is compiled to an object file with `flags`,
    then linked with `link` alone (the shadow build: instrumented, but not linked with the
    sanitizer's runtime)."""
    shared = "-shared" in flags or (link is not None and "-shared" in link)

    def compile_to(built: str, scratch: Path) -> subprocess.CompletedProcess:
        runtime = runtime_object(flags, extra)
        path = scratch / f"{output_name}.cpp"
        path.write_text(source, encoding="utf-8")
        compiled = str(scratch / f"{output_name}.o") if link is not None else built
        command = [COMPILER, *flags, *extra, "-DCGCPU_SEPARATE_RUNTIME", f"-I{HEADERS}",
                   "-x", "c++", str(path)]
        command += ["-c"] if link is not None else ["-x", "none", str(runtime)]
        result = subprocess.run([*command, "-o", compiled], capture_output=True, text=True)
        if result.returncode == 0 and link is not None:
            result = subprocess.run([COMPILER, compiled, str(runtime), *link, "-o", built],
                                    capture_output=True, text=True)
        return result

    return _cached(f"{output_name}-{_key(source, flags, extra, link)}{'.so' if shared else ''}",
                   compile_to, "the emitted file")


def runtime_object(flags=FLAGS, extra: tuple = ()) -> Path:
    """The emulator's runtime (RUNTIME_SOURCE) compiled with `flags` and `extra` into an object
    file, cached as build's products are: every program built with the same flags links it."""
    def compile_to(built: str, scratch: Path) -> subprocess.CompletedProcess:
        path = scratch / "runtime.cpp"
        path.write_text(RUNTIME_SOURCE, encoding="utf-8")
        command = [COMPILER, *flags, *extra, "-DCGCPU_RUNTIME_OBJECT", f"-I{HEADERS}",
                   "-x", "c++", str(path), "-c", "-o", built]
        return subprocess.run(command, capture_output=True, text=True)

    return _cached(f"runtime-{_key(RUNTIME_SOURCE, flags, extra, None)}.o", compile_to,
                   "the CUDA-on-CPU runtime")


def _key(source: str, flags, extra, link) -> str:
    headers = b"".join(p.read_bytes() for p in header_files())
    return content_key(source, headers, " ".join((*flags, *extra)), _compiler_version(),
                       " ".join(link) if link is not None else "")


def cache_folder() -> Path:
    """Where built programs are kept: cgc's cache folder's `emulated`, else (no cache folder to
    be had) the temporary folder's `cgc-emulated`."""
    base = cache_dir()
    return (base / "emulated") if base is not None else Path(tempfile.gettempdir()) / "cgc-emulated"


def _cached(name: str, compile_to, what: str) -> Path:
    """The cache folder's file `name` (`what` it is built from, for a failure's message), made
    by compile_to(path, scratch folder) if the cache
    does not hold it whole: built under a temporary name, then renamed into place, by one
    builder at a time (another process or thread that wants it waits, then finds it built)."""
    folder = cache_folder()
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / name
    if _intact(target):
        return target
    with _one_builder(folder / f".{name}.lock"):
        if _intact(target):  # built while this one waited
            return target
        # Built under a temporary name in the cache folder itself, so that the rename that
        # installs it never crosses file systems (TMPDIR on another one: EXDEV).
        # (A name only: the compiler makes the file, with an executable's mode.)
        built = str(folder / f".{target.name}.{os.getpid()}-{secrets.token_hex(6)}.cgc-tmp")
        try:
            with tempfile.TemporaryDirectory(prefix="cgc-build-") as scratch:
                result = compile_to(built, Path(scratch))
            if result.returncode != 0:
                raise BuildFailed(f"{COMPILER} could not build {what} for the host:\n"
                                  + result.stderr[-20000:])
            record = _record(built)
            os.replace(built, target)  # atomic: a half-written library is never found
        finally:
            if os.path.exists(built):
                os.unlink(built)
        # The record second: a reader that finds the file without it (or with another build's)
        # builds again rather than trust it.
        from ...outputs import write_file
        write_file(_record_path(target), record)
    return target


# How long a builder waits for another that builds the same file before it builds its own
# copy: the other may be stopped (Ctrl-Z) or stuck. The largest builds take about a minute.
LOCK_PATIENCE_SECONDS = 600.0


@contextmanager
def _one_builder(lock: Path, patience: float = LOCK_PATIENCE_SECONDS):
    """Held while one file of the cache is built: an exclusive flock on `lock` (created empty;
    never followed if it is a link), waited for `patience` seconds at most. Where the file
    system refuses the lock, or the wait runs out, the build goes on without it: two builders
    then make the same file twice, and the rename keeps one."""
    try:
        handle = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError:
        yield
        return
    try:
        deadline, pause = time.monotonic() + patience, 0.01
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:  # another builder holds it
                if time.monotonic() >= deadline:
                    break
                time.sleep(pause)
                pause = min(pause * 2, 0.5)
            except OSError:  # no locks on this file system
                break
        yield
    finally:
        os.close(handle)  # and with it the lock


_RECORD_BYTES = 128  # "SIZE SHA256\n": a record longer than this is not one


def _record_path(target: Path) -> str:
    return f"{target}.sha256"


def _record(path: str | Path) -> str:
    """The size and SHA-256 of a built file, as its record holds them."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
            size += len(chunk)
    return f"{size} {digest.hexdigest()}\n"


def _intact(target: Path) -> bool:
    """Whether the cache holds `target` whole: a regular file of the size and SHA-256 its
    record says (the record read only if it is a small regular file)."""
    import stat
    try:
        found = os.lstat(target)
        recorded = os.lstat(_record_path(target))
        if not (stat.S_ISREG(found.st_mode) and stat.S_ISREG(recorded.st_mode)) or \
                recorded.st_size > _RECORD_BYTES:
            return False
        with open(_record_path(target), encoding="ascii", errors="replace") as handle:
            record = handle.read(_RECORD_BYTES)
        size = int(record.split()[0]) if record.split() else -1
        return size == found.st_size and _record(target) == record
    except (OSError, ValueError):
        return False


def entry_points(program, prefix: str, grid_for_libraries: bool) -> list[str]:
    """C functions PREFIX<image>(gx, gy, gz, void** a), one per image the program launches,
    each launching its kernel over the grid given (a library call takes `void** a` only,
    unless grid_for_libraries) with the arguments unpacked from `a` in slot order (pointers,
    then scalars), returning cudaGetLastError()."""
    constants = dict(program.kernel_constants())
    used = sorted({launch.image.name: launch.image
                   for launch, _, _ in program.launches()}.items())
    lines = []
    for name, image in used:
        arguments = []
        for position, index in enumerate(sorted(image.pointers)):
            ctype = c_type(image.pointers[index].element, program.low)
            arguments.append(f"reinterpret_cast<{ctype}*>(*static_cast<void**>(a[{position}]))")
        for position, index in enumerate(sorted(image.scalars), len(image.pointers)):
            ctype = c_type(image.scalars[index].type, program.low)
            arguments.append(f"*static_cast<{ctype}*>(a[{position}])")
        if image.library is not None:
            grid = "unsigned, unsigned, unsigned, " if grid_for_libraries else ""
            lines.append(f"int {prefix}{name}({grid}void** a) {{")
            lines.append(f'  {name}(cudaStream_t{{}}, "{name}", {", ".join(arguments)});')
        else:
            variant = kernel_variant(name, constants)
            if variant is not None and variant.tensor_map is not None:
                # its tensor map, made here from its pointer and its rows (the next slot)
                tensor_map = variant.tensor_map(constants)
                position = sorted(image.pointers).index(tensor_map.pointer)
                rows = len(image.pointers) + len(image.scalars)
                arguments.append(
                    f"cg_tensor_map_2d({arguments[position]}, {tensor_map.width}, "
                    f"*static_cast<unsigned long long*>(a[{rows}]), {tensor_map.box_width}, "
                    f"{tensor_map.box_rows}, {tensor_map.swizzle})")
            block = ", ".join(map(str, image.block))
            shared = shared_memory_bytes(image, constants, program.low)
            lines.append(f"int {prefix}{name}(unsigned gx, unsigned gy, unsigned gz, void** a) {{")
            lines.append(f"  CG_LAUNCH({name}, dim3(gx, gy, gz), dim3({block}), {shared}, "
                         f"cudaStream_t{{}})({', '.join(arguments)});")
        lines += ["  return static_cast<int>(cudaGetLastError());", "}", ""]
    return lines


def has_collectives(program) -> bool:
    return any(launch.image.collective for launch, _, _ in program.launches())


# The transport NCCL's CPU twin calls for a collective over several ranks (cgcpu/nccl.h: the
# whole buffer and its count, the NCCL data type, the NCCL reduction operator (-1 for the
# all-gather), the collective; 0 for success), and the run's communicator's method for each
# (collective, operator): each works in place on the whole buffer, the shards this rank's.
NCCL_TRANSPORT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                  ctypes.c_int, ctypes.c_int)
NCCL_FLOAT32 = 7  # ncclFloat32
NCCL_ALL_REDUCE, NCCL_REDUCE_SCATTER, NCCL_ALL_GATHER = 0, 1, 2  # cgcpu::NcclCollective
NCCL_COLLECTIVES = {(NCCL_ALL_REDUCE, 0): "all_reduce_sum",  # ncclSum
                    (NCCL_ALL_REDUCE, 4): "all_reduce_average",  # ncclAvg
                    (NCCL_REDUCE_SCATTER, 4): "reduce_scatter_average",
                    (NCCL_ALL_GATHER, -1): "all_gather"}


def driver_source(program, plan, emitted_text: str) -> str:
    """The emitted file, then C entry points for the backend (ctypes)."""
    lines = ["// Generated by cgc's emulated backend: the emitted file and its C entry points.",
             "#define main cg_standalone_main  // the dump replayer: not this library's",
             emitted_text, "#undef main", "", 'extern "C" {', ""]
    names = [f"cg_bank_{bank}" for bank in plan.banks] + ["cg_buffers", "cg_arena"]
    lines.append("void* cg_emulated_allocation(int i) {")
    for index, name in enumerate(names):
        lines.append(f"  if (i == {index}) return {name};")
    lines += ["  return nullptr;", "}", "",
              # The step runs on a stream of its own, as the standalone program's does: its
              # launches are queued and run when the stream is waited for, the concurrent ones
              # interleaved (on the legacy stream each would run as it is issued).
              "static cudaStream_t cg_emulated_stream = nullptr;",
              "int cg_emulated_prepare() { cg_allocate(); cg_prepare(); "
              "cudaStreamCreate(&cg_emulated_stream); "
              "return static_cast<int>(cudaGetLastError()); }",
              "int cg_emulated_step() { cg_step(cg_emulated_stream); "
              "cudaStreamSynchronize(cg_emulated_stream); "
              "return static_cast<int>(cudaGetLastError()); }",
              "const char* cg_emulated_error_string(int e) { "
              "return cudaGetErrorString(static_cast<cudaError_t>(e)); }",
              # Emulator extensions: the fibers' order at barriers, block sampling.
              "void cg_emulated_set_schedule_seed(unsigned long long seed) { "
              "cgcpu::set_schedule_seed(seed); }",
              "void cg_emulated_set_blocks(const long long* blocks, int count) { "
              "cgcpu::set_block_sample(blocks, count < 0 ? 0 : static_cast<std::size_t>(count)); }",
              "void cg_emulated_set_interleave_seed(unsigned long long seed) { "
              "cgcpu::set_interleave_seed(seed); }",
              # The shadow's reports since the last call (empty outside the shadow build).
              "const char* cg_emulated_shadow_reports() { "
              "static std::string taken; taken = cgcpu::shadow_take_reports(); "
              "return taken.c_str(); }",
              "void cg_emulated_shadow_print(int print) { cgcpu::shadow_print_reports(print != 0); }",
              "int cg_emulated_shadow_active() { return cgcpu::shadow_active() ? 1 : 0; }",
              ""]
    if has_collectives(program):  # NCCL's CPU twin carries its collectives through this
        lines += ["void cg_emulated_set_nccl_transport(cgcpu::nccl_transport transport) { "
                  "cgcpu::set_nccl_transport(transport); }", ""]
    lines += entry_points(program, "cg_emulated_", grid_for_libraries=False)
    lines.append("}  // extern \"C\"")
    return "\n".join(lines) + "\n"


def standalone(program, sanitize: bool = False, racecheck: bool = False,
               shadow: bool = False) -> Path:
    """The emitted file's own program (its main replays a `cgc run --dump` folder), built
    for the host; with `sanitize`, under ASan and UBSan, with red zones between buffers; with
    `racecheck`, under ThreadSanitizer, with its barriers numbered (number_barriers) so that
    CG_CPU_DISABLE_BARRIER can skip one of them; with `shadow`, the shadow build."""
    from ...checking.memory import plan_memory
    plan = plan_memory(program, red_zone=RED_ZONE if sanitize else 0)
    text = emit_program(program, plan).text
    if shadow:
        return build(text, f"standalone-shadow-{program.config}", flags=SHADOW_FLAGS,
                     link=SHADOW_LINK)
    if racecheck:
        return build(number_barriers(text)[0], f"standalone-racecheck-{program.config}",
                     flags=RACECHECK_FLAGS)
    if sanitize:
        return build(text, f"standalone-sanitized-{program.config}", flags=SANITIZER_FLAGS)
    return build(text, f"standalone-{program.config}", flags=STANDALONE_FLAGS)


def replay(binary: Path, dump: str, steps: int, timeout: float = 600):
    """Runs a standalone build on a dump: (exit status, stdout, stderr)."""
    environment = {**os.environ, **SANITIZER_ENVIRONMENT}
    result = subprocess.run([str(binary), dump, str(steps)], capture_output=True, text=True,
                            env=environment, timeout=timeout)
    return result.returncode, result.stdout, result.stderr


# ---- racecheck -------------------------------------------------------------------------

_BARRIER = re.compile(r"\b(__syncthreads|__syncwarp)\(\);")
_FUNCTION = re.compile(r"^(?:extern \"C\" )?(?:__global__|__device__)\b")


@dataclass(frozen=True)
class BarrierSite:
    """A `__syncthreads();` or `__syncwarp();` call in the emitted file: its number (the
    value of CG_CPU_DISABLE_BARRIER that skips it), the function it is in (a kernel, or a
    device function of common.cuh), and its line."""

    number: int
    kind: str
    function: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"#{self.number} {self.kind} in {self.function} (line {self.line}: {self.text})"


def number_barriers(text: str) -> tuple[str, list[BarrierSite]]:
    """The emitted file with each barrier call `B();` rewritten as
    `if (!::cgcpu::barrier_disabled(N)) B();` (on the same line), and the sites in order."""
    sites: list[BarrierSite] = []
    function = "?"
    lines = text.split("\n")
    for index, line in enumerate(lines):
        if _FUNCTION.match(line):
            names = [n for n in re.findall(r"(\w+)\(", line) if n != "__launch_bounds__"]
            function = names[0] if names else function
        if "__syncthreads();" not in line and "__syncwarp();" not in line:
            continue

        def replace(match: re.Match) -> str:
            number = len(sites)
            sites.append(BarrierSite(number, match.group(1), function, index + 1, line.strip()))
            return f"if (!::cgcpu::barrier_disabled({number})) {match.group(1)}();"

        lines[index] = _BARRIER.sub(replace, line)
    return "\n".join(lines), sites


@dataclass(frozen=True)
class RaceAccess:
    """One side of a race: the CUDA thread (or OS thread) and what it did."""

    thread: str          # TSan's name for it: "cgImageLayerNorm block (3,0,0) thread 37"
    access: str          # "read" or "write"
    size: int
    lines: tuple = ()    # its stack's lines in the emitted file, innermost first

    @property
    def line(self) -> int | None:
        return self.lines[0] if self.lines else None

    @property
    def kernel(self) -> str | None:
        found = re.match(r"(\S+) block \(", self.thread)
        return found.group(1) if found else None

    @property
    def block(self) -> tuple | None:
        found = re.search(r" block \((\d+),(\d+),(\d+)\)", self.thread)
        return tuple(int(x) for x in found.groups()) if found else None

    @property
    def index(self) -> int | tuple | None:
        """threadIdx: an int for a one-dimensional block, else (x, y, z)."""
        found = re.search(r" thread (\(?[\d,]+\)?)$", self.thread)
        if not found:
            return None
        text = found.group(1)
        return tuple(int(x) for x in text.strip("()").split(",")) if "(" in text else int(text)


@dataclass(frozen=True)
class Race:
    """A racecheck report: `access` and an earlier `previous` access by another thread to the
    same bytes, with no barrier between them. `memory` is "dynamic shared" (offset from the
    block's dynamic shared memory), "static shared" (`variable`, the __shared__ variable, and
    the offset in it), "global" (offset in a cudaMalloc allocation of `variable` bytes) or
    "other"; "report" for a TSan report that is not a data race (`variable` says which)."""

    memory: str
    variable: str | None
    offset: int | None
    access: RaceAccess | None
    previous: RaceAccess | None
    text: str = field(repr=False, default="")

    @property
    def kernel(self) -> str | None:
        return self.access.kernel if self.access is not None else None

    @property
    def block(self) -> tuple | None:
        return self.access.block if self.access is not None else None

    @property
    def threads(self) -> tuple:
        return (self.access.index if self.access else None,
                self.previous.index if self.previous else None)

    @property
    def lines(self) -> tuple:
        return (self.access.line if self.access else None,
                self.previous.line if self.previous else None)

    def __str__(self) -> str:
        if self.memory == "report":
            return f"ThreadSanitizer: {self.variable}"
        where = {"dynamic shared": "dynamic shared memory",
                 "static shared": f"__shared__ {self.variable}",
                 "global": f"global memory (an allocation of {self.variable} bytes)",
                 }.get(self.memory, "memory")
        a, b = self.access, self.previous
        return (f"race in {a.kernel or a.thread}, block {a.block}: {a.access} of {a.size} bytes by "
                f"thread {a.index} (line {a.line}) and earlier {b.access} of {b.size} bytes by "
                f"{'thread ' + str(b.index) if b.kernel == a.kernel else b.thread} (line {b.line}),"
                f" at {where} offset {self.offset}")


@dataclass
class RacecheckResult:
    races: list
    status: int
    stdout: str
    stderr: str

    @property
    def faults(self) -> list[str]:
        """The emulator's own fault reports (deadlocks, misused collectives)."""
        return [line for line in self.stderr.splitlines()
                if line.startswith("cuda_cpu: kernel ")]


@lru_cache(maxsize=8)
def _tls_symbols(binary: str, stamp: float) -> tuple[int | None, list]:
    """The anchor's offset and every TLS symbol (offset, size, name) of a racecheck build."""
    listing = subprocess.run(["readelf", "-sW", binary], capture_output=True, text=True).stdout
    anchor, symbols = None, []
    for line in listing.splitlines():
        parts = line.split()
        if len(parts) < 8 or parts[3] != "TLS":
            continue
        value, size, name = int(parts[1], 16), int(parts[2], 0), parts[7]
        if name == "_ZN5cgcpu6detail20tls_racecheck_anchorE":
            anchor = value
        symbols.append((value, size, name))
    return anchor, symbols


def _demangle(name: str) -> str:
    try:
        done = subprocess.run(["c++filt", name], capture_output=True, text=True)
        return done.stdout.strip() or name
    except OSError:
        return name


def _static_shared(binary: Path, delta: int) -> tuple[str | None, int | None]:
    """The thread-local symbol (mangled) at `delta` bytes from the anchor, and the offset."""
    anchor, symbols = _tls_symbols(str(binary), binary.stat().st_mtime)
    if anchor is None:
        return None, None
    at = anchor + delta
    for value, size, name in symbols:
        if value <= at < value + max(size, 1):
            return name, at - value
    return None, None


_HOOK = re.compile(r"cuda_cpu racecheck: (\w+)(?:\+(\d+))? (\S+) (read|write) (\d+) "
                   r"(read|write|\?) (\d+) \[(.*)\] \[(.*)\]$")
_ACCESS = re.compile(r"^  (?:Previous )?(?:[Aa]tomic )?([Rr]ead|[Ww]rite) of size \d+ at ")
_FRAME = re.compile(r"^    #\d+ .* (\S+):(\d+)(?::\d+)? \(")


def _emitted_lines(report: list[str], emitted_name: str) -> list[tuple]:
    """The lines in the emitted file of each access's stack (innermost first), in order."""
    found: list[list] = []
    inside = False
    for line in report:
        if _ACCESS.match(line):
            found.append([])
            inside = True
            continue
        if not inside:
            continue
        if not line.startswith("    #"):
            inside = False
            continue
        frame = _FRAME.match(line)
        if frame and Path(frame.group(1)).name == emitted_name:
            found[-1].append(int(frame.group(2)))
    return [tuple(lines) for lines in found]


def parse_racecheck(stderr: str, binary: Path | None = None,
                    emitted_name: str | None = None) -> list[Race]:
    """The races of a racecheck run's standard error: ThreadSanitizer's reports, each followed
    by the line the headers' report hook adds (cgcpu/racecheck.h). `binary` (its symbol table)
    names static __shared__ variables; `emitted_name`, the file name the build compiled, picks
    each access's lines in it. Races on the initialisation guard of a __shared__ variable of
    class type are an artefact of the emulation, and left out."""
    races: list[Race] = []
    report: list[str] = []
    for line in stderr.splitlines():
        if not line.startswith("cuda_cpu racecheck: "):
            report.append(line)
            continue
        text = "\n".join(report)
        start = text.rfind("WARNING: ThreadSanitizer:")
        text = text[start:] if start >= 0 else text
        report = []
        if line.startswith("cuda_cpu racecheck: other ") and "[" not in line:
            races.append(Race("report", line.split(" other ", 1)[1], None, None, None, text))
            continue
        hook = _HOOK.match(line)
        if hook is None:
            continue
        kind, size, where, first, first_size, second, second_size, name, previous = hook.groups()
        lines = _emitted_lines(text.splitlines(), emitted_name) if emitted_name else []
        lines += [(), ()]
        variable, offset = None, None
        if kind == "dynamic":
            memory, offset = "dynamic shared", int(where)
        elif kind == "global":
            memory, variable, offset = "global", size, int(where)
        elif kind == "tls":
            variable, offset = _static_shared(binary, int(where)) if binary else (None, None)
            if variable is not None and variable.startswith("_ZGV"):
                # The guard of a __shared__ variable's dynamic initialisation (a class type):
                # __shared__ is a function-local thread_local here, initialised once per
                # worker by whichever CUDA thread comes first; a GPU initialises nothing.
                continue
            memory = "static shared" if variable else "other"
            variable = _demangle(variable) if variable else None
        else:
            memory = "other"
        races.append(Race(memory, variable, offset,
                          RaceAccess(name, first, int(first_size), lines[0]),
                          RaceAccess(previous, second, int(second_size), lines[1]), text))
    return races


def racecheck_run(program, dump: str, steps: int = 1, disabled_barrier: int | None = None,
                  seed: int | None = None, blocks: str | None = None, threads: int | None = None,
                  unsampled: tuple[str, ...] = (), timeout: float = 600) -> RacecheckResult:
    """The emitted program replaying `steps` steps of a dump under ThreadSanitizer (the
    racecheck build of standalone), with barrier site `disabled_barrier` skipped, the fibers
    in the order of schedule `seed`, only the linear `blocks` of each launch (CG_CPU_BLOCKS,
    e.g. "0,1,-1") but every block of the kernels named `unsampled` (CG_CPU_UNSAMPLED), and
    `threads` workers; its races, exit status and output."""
    binary = standalone(program, racecheck=True)
    environment = {**os.environ, **RACECHECK_ENVIRONMENT}
    for name, value in (("CG_CPU_DISABLE_BARRIER", disabled_barrier),
                        ("CG_CPU_SCHEDULE_SEED", seed), ("CG_CPU_BLOCKS", blocks),
                        ("CG_CPU_THREADS", threads),
                        ("CG_CPU_UNSAMPLED", ",".join(unsampled) or None)):
        environment.pop(name, None)
        if value is not None:
            environment[name] = str(value)
    result = subprocess.run([str(binary), dump, str(steps)], capture_output=True, text=True,
                            env=environment, timeout=timeout)
    emitted_name = f"standalone-racecheck-{program.config}.cpp"
    return RacecheckResult(parse_racecheck(result.stderr, binary, emitted_name),
                           result.returncode, result.stdout, result.stderr)


def racecheck(program, dump: str, steps: int = 1, disabled_barrier: int | None = None,
              **options) -> list[Race]:
    """CUDA's racecheck on the CPU: the races ThreadSanitizer finds between the CUDA threads
    of a block (and between blocks) while the emitted program replays `steps` steps of a
    `cgc run --dump` folder; with `disabled_barrier`, barrier site N (number_barriers) is
    skipped. Options as racecheck_run's."""
    return racecheck_run(program, dump, steps, disabled_barrier, **options).races


# ---- the shadow: launches that may run at the same time ----------------------------------

@dataclass(frozen=True)
class ConflictAccess:
    """One side of a conflict: the op (a kernel, cublasLtMatmul, ncclAllReduce, a copy ...),
    the CG_LAUNCHED string of its launch site (None where none was given) and what it did:
    "read", "write" or "atomic"."""

    kernel: str
    site: str | None
    access: str

    def __str__(self) -> str:
        return f"{self.access} by {self.kernel}" + (f" ({self.site})" if self.site else "")


@dataclass(frozen=True)
class Conflict:
    """A shadow report: two ops that CUDA does not order (different streams, no event or host
    wait between them) touched the same bytes, one of them writing. `memory` is "global" (an
    allocation: `base` its address, `size` its bytes) or "symbol" (a program variable:
    `symbol`); `offset` is the first byte both touched, from the allocation's start, and
    `bytes` the extent from there to the last; `first` was issued before `second`. `buffers`,
    where the run knows its memory plan, names the storages those bytes belong to."""

    memory: str
    base: int | None
    symbol: str | None
    size: int
    offset: int
    bytes: int
    first: ConflictAccess
    second: ConflictAccess
    buffers: tuple = ()

    @property
    def kernels(self) -> tuple:
        return self.first.kernel, self.second.kernel

    @property
    def sites(self) -> tuple:
        return self.first.site, self.second.site

    def __str__(self) -> str:
        if self.memory == "symbol":
            where = f"the variable {self.symbol}"
        else:
            where = f"an allocation of {self.size} bytes"
        named = f" ({', '.join(self.buffers)})" if self.buffers else ""
        return (f"{self.first} and {self.second} may run at the same time: {where}, bytes "
                f"{self.offset} to {self.offset + self.bytes}{named}")


_SHADOW = re.compile(r"^cuda_cpu shadow: (global|symbol) (\S+) (\d+) (\d+) (\d+) (read|write|atomic) "
                     r"\[([^\]]*)\] \[([^\]]*)\] (read|write|atomic) \[([^\]]*)\] \[([^\]]*)\]$")


def parse_shadow(text: str) -> list[Conflict]:
    """The conflicts in a shadow build's report lines (cgcpu/shadow.h), in order."""
    found = []
    for line in text.splitlines():
        match = _SHADOW.match(line)
        if match is None:
            continue
        memory, where, size, offset, extent, kind1, name1, site1, kind2, name2, site2 = match.groups()
        found.append(Conflict(
            memory, int(where, 16) if memory == "global" else None,
            where if memory == "symbol" else None, int(size), int(offset), int(extent),
            ConflictAccess(name1, None if site1 == "?" else site1, kind1),
            ConflictAccess(name2, None if site2 == "?" else site2, kind2)))
    return found


class ConcurrencyConflict(RunFault):
    """The shadow found ops that may run at the same time touching the same memory, one of
    them writing (`conflicts`)."""

    def __init__(self, conflicts: list):
        self.conflicts = list(conflicts)
        super().__init__("launches that may run at the same time touch the same memory, one "
                         "of them writing:\n" + "\n".join(f"  {c}" for c in self.conflicts))


def _storages_at(program, plan, home: str, offset: int, extent: int) -> tuple:
    """The storages of memory home `home` that [offset, offset + extent) overlaps."""
    names = []
    for label, storage in program.storages.items():
        try:
            where, start = storage_home(program, plan, storage)
        except (KeyError, ValueError):
            continue
        size = storage.count * element_bytes(storage.element, program.low)
        if where == home and start < offset + max(extent, 1) and offset < start + size:
            names.append(label)
    return tuple(sorted(names))


@dataclass
class ShadowResult:
    conflicts: list
    status: int
    stdout: str
    stderr: str


def shadow_run(program, dump: str, steps: int = 1, seed: int | None = None,
               threads: int | None = None, timeout: float = 600) -> ShadowResult:
    """The emitted program replaying `steps` steps of a `cgc run --dump` folder in the shadow
    build, its concurrent launches interleaved in the order of `seed` (CG_CPU_INTERLEAVE_SEED)
    on `threads` workers: the conflicts (each named with the storages it touched, where the
    allocation's size says which memory home it is), the exit status and the output."""
    from ...checking.memory import plan_memory
    binary = standalone(program, shadow=True)
    environment = dict(os.environ)
    for name, value in (("CG_CPU_INTERLEAVE_SEED", seed), ("CG_CPU_THREADS", threads)):
        environment.pop(name, None)
        if value is not None:
            environment[name] = str(value)
    result = subprocess.run([str(binary), dump, str(steps)], capture_output=True, text=True,
                            env=environment, timeout=timeout)
    # The program's allocations by size (the banks', the step buffers', the arena's): the
    # report's allocation is the memory home of that size, where only one has it.
    plan = plan_memory(program)
    by_size: dict[int, list] = {}
    for bank, (_, _, size, _) in plan.banks.items():
        by_size.setdefault(size, []).append(bank)
    by_size.setdefault(max(plan.buffers_bytes, 256), []).append("buffers")
    by_size.setdefault(max(plan.arena_bytes, 256), []).append("arena")
    conflicts = []
    for conflict in parse_shadow(result.stderr):
        candidates = by_size.get(conflict.size, [])
        if conflict.memory == "global" and len(candidates) == 1:
            conflict = Conflict(**{**conflict.__dict__, "buffers": _storages_at(
                program, plan, candidates[0], conflict.offset, conflict.bytes)})
        conflicts.append(conflict)
    return ShadowResult(conflicts, result.returncode, result.stdout, result.stderr)


class EmulatedRun(Run):
    name = "emulated"
    beside_plan = staticmethod(workspace_beside_plan)  # the emitted program's, in host memory

    def __init__(self, program, plan, seed: int, shadow: bool | None = None):
        super().__init__(program, plan, seed)
        self.low = program.low
        self.kernel_constants = dict(program.kernel_constants())
        self.emitted = emit_program(program, plan)
        # The shadow build, asked for here or by the environment (CGC_EMULATED_SHADOW=1): every
        # step's conflicts between launches that may run at the same time are a fault.
        if shadow is None:
            shadow = os.environ.get("CGC_EMULATED_SHADOW", "") not in ("", "0")
        self.shadow = shadow
        self.conflicts: list[Conflict] = []
        started = time.perf_counter()
        source = driver_source(program, plan, self.emitted.text)
        if shadow:
            self.library_path = build(source, "step-shadow", flags=SHADOW_LIBRARY_FLAGS,
                                      link=SHADOW_LIBRARY_LINK)
        else:
            self.library_path = build(source, "step")
        self.build_seconds = time.perf_counter() - started
        # The host program keeps its allocations in globals: each run loads its own copy of
        # the library (dlopen shares one loaded path between every handle to it).
        self._private = tempfile.TemporaryDirectory(prefix="cgc-emulated-run-")
        private = Path(self._private.name) / self.library_path.name
        shutil.copyfile(self.library_path, private)
        library = self.library = ctypes.CDLL(str(private))
        library.cg_emulated_allocation.restype = ctypes.c_void_p
        library.cg_emulated_error_string.restype = ctypes.c_char_p
        library.cg_emulated_shadow_reports.restype = ctypes.c_char_p
        library.cg_emulated_shadow_print(ctypes.c_int(0))  # read back here, not printed
        self._check(library.cg_emulated_prepare(), "preparing")
        self.memory = {}
        homes = [*plan.banks, "buffers", "arena"]
        sizes = [size for _, _, size, _ in plan.banks.values()]
        sizes += [max(plan.buffers_bytes, 256), max(plan.arena_bytes, 256)]
        for index, (home, size) in enumerate(zip(homes, sizes)):
            address = library.cg_emulated_allocation(index)
            self.memory[home] = np.ctypeslib.as_array(
                (ctypes.c_uint8 * size).from_address(address))
        self.load_parameters(initial_parameters(program, seed))
        self.calls = [self._prepare(launch, point) for launch, _, point in program.unrolled()]
        self.through_host_program = True  # run_step calls the emitted cg_step
        self.joined = not has_collectives(program)  # the NCCL communicator is made
        if not self.joined:
            self._transport = NCCL_TRANSPORT(self._carry)  # kept alive as long as the run
            library.cg_emulated_set_nccl_transport(self._transport)

    # ---- collectives: NCCL's CPU twin, carried by the run's communicator (MPI) ---------

    def _join(self) -> None:
        """The emitted program's NCCL communicator: rank 0 draws the id, the communicator
        broadcasts it, every rank joins (llm.c's split of MPI and NCCL). A program that shards
        joins only as the rank it was compiled for (its host functions check it again)."""
        mismatch = rank_mismatch(self.program, self.communicator.rank, self.communicator.size)
        if mismatch is not None:
            raise RunFault(mismatch)
        identifier = ctypes.create_string_buffer(128)  # NCCL_UNIQUE_ID_BYTES
        if self.communicator.lead:
            self._check_nccl(self.library.cg_nccl_unique_id(identifier), "drawing the NCCL id")
        raw = self.communicator.broadcast_object(identifier.raw)
        identifier = ctypes.create_string_buffer(raw, 128)
        self._check_nccl(self.library.cg_nccl_join(ctypes.c_int(self.communicator.rank),
                                                   ctypes.c_int(self.communicator.size),
                                                   identifier), "joining the NCCL communicator")
        self.joined = True

    @staticmethod
    def _check_nccl(status: int, where: str) -> None:
        if status != 0:
            raise RunFault(f"{where}: NCCL error {status}")

    def _carry(self, data, count, kind, operator, collective) -> int:
        """Called by the emitted program's NCCL calls (through the CPU twin) with the whole
        buffer of the collective, to carry in place over the ranks (a reduce-scatter or an
        all-gather: this rank's shard of it, as the run's communicator takes it); 0 when done.
        Errors are told here: the emitted program only learns that the collective failed,
        and exits."""
        try:
            method = NCCL_COLLECTIVES.get((collective, operator))
            if kind != NCCL_FLOAT32 or method is None:
                raise RunFault(f"the CPU twin of NCCL carries float32 all-reduce sums and "
                               f"averages, reduce-scatter averages and all-gathers, not NCCL "
                               f"type {kind} with operator {operator} in collective "
                               f"{collective}")
            values = np.ctypeslib.as_array((ctypes.c_float * count).from_address(data))
            getattr(self.communicator, method)(values)
            return 0
        except BaseException as error:  # noqa: BLE001 - nothing may unwind through C
            print(f"cgc: error: rank {self.communicator.rank}: {error}", file=sys.stderr,
                  flush=True)
            return 1

    @staticmethod
    def unavailable() -> str | None:
        return compiler_missing()

    @staticmethod
    def problems(program):
        return image_problems(program)

    # ---- emulator controls ----------------------------------------------------------

    def set_schedule_seed(self, seed: int) -> None:
        """The order in which a block's ready CUDA threads run (0: thread order; else a
        pseudo-random order drawn from the seed, the launch and the block), for every later
        launch of this run (CG_CPU_SCHEDULE_SEED)."""
        self.library.cg_emulated_set_schedule_seed(ctypes.c_ulonglong(seed))

    def set_interleave_seed(self, seed: int) -> None:
        """The order in which the blocks of launches that may run at the same time are handed
        out (0: round robin; else pseudo-random picks drawn from the seed), for every later
        step of this run (CG_CPU_INTERLEAVE_SEED)."""
        self.library.cg_emulated_set_interleave_seed(ctypes.c_ulonglong(seed))

    @property
    def shadow_active(self) -> bool:
        """Whether this run's library records accesses (the shadow build, its memory reserved)."""
        return bool(self.library.cg_emulated_shadow_active())

    def take_conflicts(self) -> list[Conflict]:
        """The shadow's conflicts since the last call (none outside the shadow build), each
        named with the storages it touched."""
        text = self.library.cg_emulated_shadow_reports().decode(errors="replace")
        homes = {self.memory[home].ctypes.data: home for home in self.memory}
        found = []
        for conflict in parse_shadow(text):
            home = homes.get(conflict.base)
            if home is not None:
                conflict = Conflict(**{**conflict.__dict__, "buffers": _storages_at(
                    self.program, self.plan, home, conflict.offset, conflict.bytes)})
            found.append(conflict)
        self.conflicts += found
        return found

    def set_blocks(self, blocks=None) -> None:
        """Block sampling: every later launch runs only these linear block indices (negative:
        from the end of its grid; those outside the grid are skipped); None runs every block
        again (CG_CPU_BLOCKS)."""
        values = [int(b) for b in blocks] if blocks is not None else []
        array = (ctypes.c_longlong * max(len(values), 1))(*values)
        self.library.cg_emulated_set_blocks(array, ctypes.c_int(len(values)))

    def _check(self, status: int, where: str) -> None:
        if status != 0:
            text = self.library.cg_emulated_error_string(status).decode(errors="replace")
            raise RunFault(f"{where}: CUDA error {status}: {text}")

    # ---- memory ------------------------------------------------------------------

    def address(self, storage, offset: int = 0) -> int:
        home, start = storage_home(self.program, self.plan, storage)
        base = self.memory[home].ctypes.data
        return base + start + offset * element_bytes(storage.element, self.low)

    def array(self, label: str) -> np.ndarray:
        storage = self.program.storages[label]
        dtype = storage_dtype(storage.element, self.low)
        home, start = storage_home(self.program, self.plan, storage)
        return self.memory[home][start:start + storage.count * dtype.itemsize].view(dtype)

    def store(self, label: str, values) -> None:
        storage = self.program.storages[label]
        self.array(label)[:] = encode(np.asarray(values).reshape(-1), storage.element, self.low)

    def fetch(self, label: str) -> np.ndarray:
        storage = self.program.storages[label]
        return decode(self.array(label), storage.element, self.low)

    def view(self, label: str) -> np.ndarray:
        return self.array(label)

    # ---- launches ----------------------------------------------------------------

    def _prepare(self, launch, point):
        """One launch at one repeat index, as a call of its entry point."""
        image = launch.image
        bound = launch.arguments(point)
        values = [ctypes.c_void_p(self.address(p.view.storage, p.offset)) for p in bound.pointers]
        for scalar in bound.scalars:
            values.append(ctypes.c_float(scalar.value) if scalar.parameter.type == "float32"
                          else ctypes.c_int(int(scalar.value)))
        tensor_map = launch_tensor_map(image, self.kernel_constants, bound)
        if tensor_map is not None:  # the rows of its tensor map (entry_points)
            values.append(ctypes.c_ulonglong(tensor_map[1]))
        pointers = (ctypes.c_void_p * len(values))(
            *[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
        function = getattr(self.library, f"cg_emulated_{image.name}")
        grid = tuple(int(g) for g in bound.grid)
        where = f"{image.name} ({launch.span})"

        if image.collective is not None:
            def call():
                if not self.joined:  # launch by launch: the communicator, before the first
                    self._join()
                self._check(function(pointers), where)
        elif image.library is not None:
            def call():
                self._check(function(pointers), where)
        else:
            def call():
                self._check(function(*grid, pointers), where)
        call.keep = (values, pointers)  # the arguments live as long as the call
        call.image = image.name
        return call

    def run_step(self, trace: list | None) -> float:
        if not self.joined:
            self._join()
        started = time.perf_counter()
        if trace is None and self.through_host_program:
            self._check(self.library.cg_emulated_step(), "the step")
        else:
            for (launch, phase, _), call in zip(self.program.unrolled(), self.calls):
                before = time.perf_counter()
                call()
                if trace is not None:
                    trace.append((launch.image.name, phase, before, time.perf_counter()))
        seconds = time.perf_counter() - started
        if self.shadow:
            conflicts = self.take_conflicts()
            if conflicts:
                raise ConcurrencyConflict(conflicts)
        return seconds


Backend = EmulatedRun
