#!/usr/bin/env python3
"""The second ground truth: the emitted kernels on the CPU, under AddressSanitizer and
UndefinedBehaviorSanitizer, with poisoned outputs.

Building the emitted file per variant takes seconds, so the kernels are built ONCE per
distinct set of kernel constants (the low type, the model's shape as the kernels see it:
kWidth, kRows, ..., and the images' blocks), from the unmutated whole step, which launches
every image: a sanitized shared library (emulated.build with SANITIZER_FLAGS) holding the
emitted file (its kernels, and the host functions of its cuBLAS products, which call the
emulated cublasGemmEx) and C entry points of our own: one per image taking its grid and a
`void**` of its arguments, as cgc/backends/cuda/emulated.py's `driver_source` does, and
helpers to allocate, poison, unpoison, fill and count NaNs.

A variant is then a JOB (`make_job`): its memory laid out by its own memory plan
(plan_memory with 256-byte red zones after every step buffer and arena slot), its ids,
targets, learning rate and first parameters filled; in a whole step every other step buffer and arena
slot starts as NaN (0xFF bytes), but for what the step only reads-and-writes (the
optimizer's counter, which the runtime's zeroed memory starts at 0). Its launches run in
order through the entry points (`Launch.arguments(point)` for each iteration of
`program.unrolled()`). Before each launch every allocation is poisoned and only the views
the launch binds are unpoisoned, so that any access outside a pointer's own buffer (past a
step buffer, into another item of a stack, into the next entry of a bank, into an arena
slot that shares its bytes) is reported by AddressSanitizer, as the NumPy machine reports
it; and what the pointers it only writes reach (their extents at that iteration: the rest of
a view keeps its value, as the checker and the memory plan say) is filled with NaN, unless
another pointer of the launch reads the same bytes. Jobs run in a WORKER process started with g++'s libasan
preloaded: a sanitizer report kills the worker (it is restarted), an emulator fault
(deadlock, misused collective) fails the launch (the worker resets the device). The verdict:

- `faulted`: a sanitizer report, a kernel fault, a failed launch or cuBLAS call;
- `refused`: no C program exists for it (an argument unbound or bound twice, a pointer of
  another element type: the emitted call does not compile);
- `poisoned`: it ran clean, but NaN reached the results (the loss, the bank entries), and
  does not when the poisoned memory is zeroed instead: a value no launch wrote got there;
- `nan`: NaN reaches the results however memory starts (arithmetic on the wrong values);
- `clean`;
- `timeout`: the worker took longer than the budget (killed; not a verdict).

`python3 scripts/ground_truth_emulated.py` runs the unmutated step, and a grid one block too
large, and prints what happened.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import select
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

POISON_BYTE = 0xFF  # NaN in float32 and bfloat16; -1 in int32
RED_ZONE = 256
ALIGNMENT = 256
WRITE_ONLY = "write"

# What the worker's C helpers and entry points are called (cg_gt_*).
DRIVER_HELPERS = r"""
extern "C" {
void* cg_gt_malloc(unsigned long bytes) {
  void* p = nullptr;
  if (cudaMalloc(&p, bytes) != cudaSuccess) return nullptr;
  std::memset(p, 0, bytes);
  return p;
}
void cg_gt_poison(void* p, unsigned long bytes) {
#if defined(__SANITIZE_ADDRESS__)
  ASAN_POISON_MEMORY_REGION(p, bytes);
#endif
}
void cg_gt_unpoison(void* p, unsigned long bytes) {
#if defined(__SANITIZE_ADDRESS__)
  ASAN_UNPOISON_MEMORY_REGION(p, bytes);
#endif
}
void cg_gt_fill(void* p, int byte, unsigned long bytes) { std::memset(p, byte, bytes); }
void cg_gt_copy(void* to, const void* from, unsigned long bytes) { std::memcpy(to, from, bytes); }
// NaNs among `count` values: kind 4 float32, 2 bfloat16 (other kinds: 0).
long cg_gt_nans(const void* p, unsigned long count, int kind) {
  long found = 0;
  if (kind == 4) {
    const unsigned* v = static_cast<const unsigned*>(p);
    for (unsigned long i = 0; i < count; ++i) found += (v[i] & 0x7fffffffu) > 0x7f800000u;
  } else if (kind == 2) {
    const unsigned short* v = static_cast<const unsigned short*>(p);
    for (unsigned long i = 0; i < count; ++i) found += (v[i] & 0x7fffu) > 0x7f80u;
  }
  return found;
}
int cg_gt_error() { return static_cast<int>(cudaGetLastError()); }
const char* cg_gt_error_string(int e) { return cudaGetErrorString(static_cast<cudaError_t>(e)); }
// Frees every allocation, clears a sticky error (after a kernel fault), then sets the
// kernels' attributes again.
int cg_gt_reset() {
  cudaDeviceReset();
  cg_gt_attributes();
  return static_cast<int>(cudaGetLastError());
}
int cg_gt_prepare() {
  cg_check(cublasLtCreate(&cg_lt), "creating the cuBLASLt handle");
  cg_gt_attributes();
  return static_cast<int>(cudaGetLastError());
}
"""


def library_source(program, plan, emitted_text: str) -> str:
    """The emitted file and the worker's C entry points (compiled into one library)."""
    from cgc.backends.cuda.emit import shared_memory_bytes
    from cgc.backends.cuda.emulated import entry_points, has_collectives
    lines = ["// Generated by scripts/ground_truth_emulated.py: the emitted file, entry points.",
             "#define main cg_standalone_main  // the dump replayer: not this library's",
             emitted_text, "#undef main", "#include <cstring>",
             "#if defined(__SANITIZE_ADDRESS__)", "#include <sanitizer/asan_interface.h>",
             "#endif", ""]
    constants = dict(program.kernel_constants())
    images = sorted({launch.image.name: launch.image
                     for launch, _, _ in program.launches()}.items())
    lines.append("static void cg_gt_attributes() {")
    for name, image in images:
        shared = shared_memory_bytes(image, constants, program.low)
        if image.library is None and shared > 48 * 1024:
            lines.append(f"  cudaFuncSetAttribute({name}, "
                         f"cudaFuncAttributeMaxDynamicSharedMemorySize, {shared});")
    lines += ["}", DRIVER_HELPERS]
    if has_collectives(program):  # a variant's collective runs on one rank: itself
        lines += ["int cg_gt_one_rank() {", "  ncclUniqueId id;",
                  "  if (cg_nccl_unique_id(&id) != 0) return 1;",
                  "  return cg_nccl_join(0, 1, &id);", "}"]
    lines += entry_points(program, "cg_gt_", grid_for_libraries=True)
    lines.append("}  // extern \"C\"")
    return "\n".join(lines) + "\n"


def library_key(program) -> tuple:
    """What the kernels are compiled from: the low type, the kernel constants, the blocks."""
    blocks = tuple(sorted((name, image.block) for name, image in program.images.items()))
    return (program.low, tuple(program.kernel_constants()), blocks)


def build_library(base_program) -> str:
    """The sanitized library of every kernel of `base_program` (which must launch every image
    a job may use: the unmutated whole step), cached by content (emulated.build)."""
    from cgc.backends.cuda.emit import emit_program
    from cgc.backends.cuda.emulated import SANITIZER_FLAGS, build
    from cgc.checking.memory import plan_memory
    plan = plan_memory(base_program, red_zone=RED_ZONE)
    text = emit_program(base_program, plan).text
    flags = tuple(f for f in SANITIZER_FLAGS) + ("-shared", "-fPIC")
    return str(build(library_source(base_program, plan, text), "ground-truth", flags=flags))


# ---- jobs: a variant's memory and launches, as plain data -----------------------------------


@dataclass
class Job:
    """Everything a worker needs to run one variant, in plain Python data."""

    allocations: list = field(default_factory=list)   # bytes of each
    fills: list = field(default_factory=list)         # (allocation, offset, bytes, byte)
    data: list = field(default_factory=list)          # (allocation, offset, raw bytes)
    # (image, where, grid, pointers as (allocation, offset), scalars as ("f" | "i", value),
    #  the byte ranges to fill with NaN first, the byte ranges it may touch)
    calls: list = field(default_factory=list)
    results: list = field(default_factory=list)      # (label, allocation, offset, count, kind)
    refused: str | None = None                        # why no C program exists


class Layout:
    """A variant's memory by its memory plan (with red zones after every step buffer and
    arena slot); addresses as (allocation, byte offset)."""

    def __init__(self, program, plan):
        from cgc.core.elements import element_bytes
        self.program, self.plan, self.low = program, plan, program.low
        self.size = lambda element: element_bytes(element, program.low)
        self.job = Job()
        self.index = {}
        for bank, (_, element, size, entries) in plan.banks.items():
            self._allocate(bank, max(size, ALIGNMENT))
        self._allocate("buffers", max(plan.buffers_bytes, ALIGNMENT))
        self._allocate("arena", max(plan.arena_bytes, ALIGNMENT))

    def _allocate(self, home: str, size: int) -> int:
        self.index[home] = len(self.job.allocations)
        self.job.allocations.append(size)
        return self.index[home]

    def start(self, storage) -> tuple[int, int]:
        """(allocation, byte offset) of a storage's first element."""
        from cgc.checking.memory import storage_home
        home, offset = storage_home(self.program, self.plan, storage)
        return self.index[home], offset

    def view(self, view, offset: int) -> tuple[int, int, int]:
        """(allocation, first byte, bytes) of a view whose first element is `offset`."""
        index, start = self.start(view.storage)
        item = self.size(view.storage.element)
        return index, start + offset * item, view.count * item

    def kind(self, element: str) -> int:
        from cgc.core.elements import concrete
        chosen = concrete(element, self.low)
        return {"float32": 4, "bfloat16": 2}.get(chosen.name, 0)


def make_job(program, plan, parameters=None, tokens=None, whole_step: bool | None = None) -> Job:
    """A variant as a job. `parameters`: each entry's first values (loaded into the
    parameter and copy banks); `tokens`: (ids, targets) as int lists. In a whole step (the
    program's entry is its `step` role), every step buffer and arena slot starts as NaN but
    for what the runtime writes before each step (the ids, the targets, the learning rate:
    the roles that flow in) and what the step only reads-and-writes (state kept across
    steps, as the runtime's zeroed memory gives it); elsewhere memory starts zeroed."""
    from cgc.checking.flow import reach
    from cgc.core.elements import concrete
    from cgc.core.ir import BindingError
    layout = Layout(program, plan)
    job = layout.job
    roles = program.roles
    if whole_step is None:
        whole_step = roles.get("step") == program.entry
    if whole_step:
        first_access = {}
        for launch, _, _ in program.launches():
            for binding in launch.pointers:
                parameter = launch.image.pointers.get(binding.index)
                storage = binding.view.storage
                if parameter is not None and storage.kind in ("buffer", "arena"):
                    first_access.setdefault(storage.name, parameter.access)
        from cgc.core.roles import flowing
        inputs = {program.storages[roles[r]].name for r in flowing("in") if r in roles}
        for name, storage in program.storages.items():
            if storage.kind not in ("buffer", "arena") or name in inputs:
                continue
            if name not in plan.offsets or first_access.get(name) in ("readwrite", "accumulate"):
                continue
            index, offset = layout.start(storage)
            job.fills.append((index, offset, storage.count * layout.size(storage.element),
                              POISON_BYTE))
    if "learningRate" in roles and roles["learningRate"] in program.storages:
        # the runtime writes the step's rate before each step: the schedule's peak
        storage = program.storages[roles["learningRate"]]
        index, offset = layout.start(storage)
        rate = float(roles.get("peakLearningRate", 1e-3))
        job.data.append((index, offset, struct.pack(f"<{storage.count}f",
                                                    *[rate] * storage.count)))
    if tokens is not None:
        for role, values in zip(("ids", "targets"), tokens):
            if role in roles and roles[role] in program.storages:
                storage = program.storages[roles[role]]
                index, offset = layout.start(storage)
                raw = struct.pack(f"<{storage.count}i", *list(values)[:storage.count])
                job.data.append((index, offset, raw))
    if parameters is not None:
        import numpy as np
        from cgc.backends.numerics import encode
        for bank, declaration in program.banks.items():
            if declaration.role not in ("parameters", "copies"):
                continue
            for name, values in parameters.items():
                label = f"{bank}.{name}"
                if label in program.storages:
                    storage = program.storages[label]
                    raw = encode(np.asarray(values).reshape(-1)[:storage.count],
                                 storage.element, program.low).tobytes()
                    index, offset = layout.start(storage)
                    job.data.append((index, offset, raw))
    for position, (launch, phase, point) in enumerate(program.unrolled()):
        image = launch.image
        where = f"launch {position} of '{image.name}' ({launch.span})"
        try:
            bound = launch.arguments(point)
        except BindingError as error:
            job.refused = f"{where}: {error}: the emitted call would not compile"
            return job
        pointers, views = [], []
        for pointer in bound.pointers:
            if pointer.view.storage.element != pointer.parameter.element and \
                    concrete(pointer.view.storage.element, program.low) != \
                    concrete(pointer.parameter.element, program.low):
                job.refused = (f"{where}: pointer {pointer.parameter.index} takes "
                               f"{pointer.parameter.element}, bound to "
                               f"{pointer.view.storage.element}: the emitted call would not "
                               "compile")
                return job
            index, first, size = layout.view(pointer.view, int(pointer.offset))
            pointers.append((index, first))
            # what a write reaches at this iteration: the rest of its view keeps its value
            low, high = reach(launch, pointer.parameter, pointer.view, point)
            written = max(high - low, 0) * layout.size(pointer.view.storage.element)
            views.append((index, first, size, pointer.parameter.access, written))
        scalars = []
        for scalar in bound.scalars:
            value = scalar.value
            if scalar.parameter.type == "float32":
                scalars.append(("f", float(value)))
            else:
                number = int(value)
                number = (number + 2 ** 31) % 2 ** 32 - 2 ** 31  # as C converts to int
                scalars.append(("i", number))
        poison = []
        for index, first, size, access, written in views:
            if access != WRITE_ONLY:
                continue
            overlaps = any(other[0] == index and other[1] < first + written
                           and first < other[1] + other[2] and other[3] != WRITE_ONLY
                           for other in views)
            if not overlaps and written:
                poison.append((index, first, written))
        grid = tuple(int(g) for g in bound.grid)
        fence = [(index, first, size) for index, first, size, _, _ in views]
        job.calls.append((image.name, where, grid, pointers, scalars, poison, fence))
    for label, storage in program.storages.items():
        if storage.kind == "bank" and storage.entry is not None or \
                roles.get("loss") == label:
            kind = layout.kind(storage.element)
            if kind:
                index, offset = layout.start(storage)
                job.results.append((label, index, offset, storage.count, kind))
    return job


# ---- the worker -------------------------------------------------------------------------


def _send(stream, value) -> None:
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _receive(stream):
    head = stream.read(8)
    if len(head) < 8:
        return None
    (size,) = struct.unpack("<Q", head)
    data = stream.read(size)
    return pickle.loads(data)


class _Runner:
    """The worker's side: the library, and one job run on it."""

    def __init__(self, library_path: str):
        library = self.library = ctypes.CDLL(library_path)
        library.cg_gt_malloc.restype = ctypes.c_void_p
        library.cg_gt_malloc.argtypes = [ctypes.c_ulong]
        for name in ("cg_gt_poison", "cg_gt_unpoison"):
            getattr(library, name).argtypes = [ctypes.c_void_p, ctypes.c_ulong]
        library.cg_gt_fill.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_ulong]
        library.cg_gt_copy.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_ulong]
        library.cg_gt_nans.restype = ctypes.c_long
        library.cg_gt_nans.argtypes = [ctypes.c_void_p, ctypes.c_ulong, ctypes.c_int]
        library.cg_gt_error_string.restype = ctypes.c_char_p
        library.cg_gt_prepare()
        if hasattr(library, "cg_gt_one_rank") and library.cg_gt_one_rank() != 0:
            raise RuntimeError("the one-rank NCCL communicator of the CPU twin failed")
        self.functions = {}

    def function(self, name: str):
        function = self.functions.get(name)
        if function is None:
            function = self.functions[name] = getattr(self.library, f"cg_gt_{name}")
            function.argtypes = [ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p]
        return function

    def run(self, job: Job, fill: int = POISON_BYTE, keep: dict | None = None) -> tuple[str, str]:
        """(verdict, why) of one run, the poisoned memory filled with `fill` bytes; `keep`
        receives each result's bytes."""
        library, log = self.library, sys.stderr
        base = []
        try:
            for size in job.allocations:
                address = library.cg_gt_malloc(size)
                if not address:
                    return "faulted", f"cannot allocate {size} bytes"
                base.append(address)
            for index, offset, raw in job.data:
                library.cg_gt_copy(base[index] + offset, raw, len(raw))
            for index, offset, size, _ in job.fills:
                library.cg_gt_fill(base[index] + offset, fill, size)
            outcome = ("clean", "")
            for name, where, grid, pointers, scalars, poison, fence in job.calls:
                try:
                    function = self.function(name)
                except AttributeError:
                    return "refused", f"{where}: the library has no kernel '{name}'"
                # Only what this launch binds is addressable while it runs.
                for index, size in enumerate(job.allocations):
                    library.cg_gt_poison(base[index], size)
                for index, offset, size in fence:
                    library.cg_gt_unpoison(base[index] + offset, size)
                for index, offset, size in poison:
                    library.cg_gt_fill(base[index] + offset, fill, size)
                values = [ctypes.c_void_p(base[index] + offset) for index, offset in pointers]
                for kind, value in scalars:
                    values.append(ctypes.c_float(value) if kind == "f" else ctypes.c_int(value))
                arguments = (ctypes.c_void_p * len(values))(
                    *[ctypes.addressof(v) for v in values])
                log.write(f"cg_gt: {where}\n")
                log.flush()
                # A grid dimension past what dim3 holds is refused by the launch, as on a GPU.
                gx, gy, gz = (min(g, 2 ** 32 - 1) for g in grid)
                status = function(gx, gy, gz, arguments)
                if status != 0:
                    text = library.cg_gt_error_string(status).decode(errors="replace")
                    outcome = ("faulted", f"{where}: CUDA error {status}: {text}")
                    break
            for index, size in enumerate(job.allocations):
                library.cg_gt_unpoison(base[index], size)
            if outcome[0] == "clean":
                found = []
                for label, index, offset, count, kind in job.results:
                    if keep is not None:
                        keep[label] = ctypes.string_at(base[index] + offset, count * kind)
                    nans = library.cg_gt_nans(base[index] + offset, count, kind)
                    if nans:
                        found.append(f"{label} ({nans} NaN of {count})")
                if found:
                    outcome = ("poisoned", "NaN in " + ", ".join(found[:4])
                               + (f" and {len(found) - 4} more" if len(found) > 4 else ""))
            return outcome
        finally:
            library.cg_gt_reset()  # frees every allocation, clears a kernel fault

    def judge(self, job: Job) -> tuple[str, str]:
        """A run with poisoned memory; where NaN reaches the results, a second run with the
        same memory zeroed tells a poisoned value that got there (`poisoned`) from a NaN the
        arithmetic makes whatever memory holds (`nan`)."""
        verdict, why = self.run(job)
        if verdict != "poisoned":
            return verdict, why
        again, second = self.run(job, 0)
        if again == "clean":
            return "poisoned", why
        if again == "poisoned":
            return "nan", why + " (also with memory zeroed)"
        return again, second + " (with memory zeroed; with it poisoned: " + why + ")"


def worker_main(library_path: str) -> int:
    """Runs jobs from stdin, one at a time; answers each on stdout. Each launch is announced
    on stderr first, so that a sanitizer report that kills the process can be placed."""
    runner = _Runner(library_path)
    source, sink = sys.stdin.buffer, sys.stdout.buffer
    while True:
        received = _receive(source)
        if received is None:
            return 0
        started = time.perf_counter()
        verdict, why = runner.judge(Job(**received))
        _send(sink, (verdict, why, time.perf_counter() - started))


# ---- the parent's side ------------------------------------------------------------------


def asan_runtime() -> str:
    """g++'s libasan, to preload into the worker (the sanitized library needs it first)."""
    from cgc.backends.cuda.emulated import COMPILER
    path = subprocess.run([COMPILER, "-print-file-name=libasan.so"], capture_output=True,
                          text=True).stdout.strip()
    return os.path.realpath(path)


def summarise_report(text: str) -> str:
    """One line of a worker's last words: the sanitizer's report (and the kernel it names),
    or the emulator's fault, and the launch it happened in."""
    import re
    launch = None
    for line in text.splitlines():
        if line.startswith("cg_gt: "):
            launch = line[len("cg_gt: "):]
    reasons = []
    report = re.search(r"ERROR: AddressSanitizer: ([\w-]+)", text)
    if report:
        reasons.append(f"AddressSanitizer: {report.group(1)}")
        stack = text[report.end():].split("\n\n")[0]
        kernel = re.search(r"#\d+ 0x[0-9a-f]+ in (cgImage\w+)", stack)
        frame = re.search(r"ground-truth\.cpp:(\d+)", stack)
        if kernel or frame:
            reasons.append(f"in {kernel.group(1) if kernel else 'the emitted file'}"
                           + (f" (line {frame.group(1)})" if frame else ""))
    ubsan = re.search(r"runtime error: ([^\n]*)", text)
    if ubsan:
        reasons.append(f"UBSan: {ubsan.group(1)[:120]}")
        frame = re.search(r"ground-truth\.cpp:(\d+):\d+: runtime error", text)
        if frame:
            reasons.append(f"(line {frame.group(1)})")
    for line in text.splitlines():
        if line.startswith("cuda_cpu: "):
            reasons.append(line[:200])
            break
    if not reasons:
        lines = [line for line in text.splitlines() if line and not line.startswith("cg_gt: ")]
        reasons.append(lines[-1][:200] if lines else "the worker died without a word")
    return (f"{launch}: " if launch else "") + " ".join(reasons)


class Worker:
    """One worker process on one library; restarted after a crash or a timeout."""

    def __init__(self, library: str, threads: int = 1, budget: float = 60.0):
        self.library, self.threads, self.budget = library, threads, budget
        self.process = None
        self.log = None
        self.restarts = 0

    def _start(self) -> None:
        environment = dict(os.environ)
        environment.update({
            "LD_PRELOAD": asan_runtime(),
            "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1:abort_on_error=0:"
                            "allocator_may_return_null=1",
            "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
            "CG_CPU_THREADS": str(self.threads),
            "PYTHONPATH": ROOT,
        })
        self.log = tempfile.TemporaryFile(prefix="cgc-ground-truth-")
        self.process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", self.library],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env=environment)

    def stop(self) -> None:
        if self.process is not None:
            try:
                self.process.stdin.close()
            except OSError:
                pass
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.process = None
        if self.log is not None:
            self.log.close()
            self.log = None

    def _last_words(self, since: int) -> str:
        self.log.flush()
        self.log.seek(since)
        return self.log.read().decode(errors="replace")

    def run(self, job: Job) -> tuple[str, str, float]:
        """(verdict, why, seconds) of one job."""
        if job.refused is not None:
            return "refused", job.refused, 0.0
        if self.process is None or self.process.poll() is not None:
            if self.process is not None:
                self.stop()
                self.restarts += 1
            self._start()
        since = self.log.seek(0, os.SEEK_END)
        started = time.perf_counter()
        try:
            _send(self.process.stdin, dict(job.__dict__))  # plain data: no class to import
        except (BrokenPipeError, OSError):
            pass
        stdout = self.process.stdout
        ready, _, _ = select.select([stdout], [], [], self.budget)
        if not ready:
            self.process.kill()
            self.process.wait()
            words = self._last_words(since)
            self.stop()
            self.restarts += 1
            return "timeout", summarise_report(words) + f" (over {self.budget:.0f} s)", \
                time.perf_counter() - started
        answer = _receive(stdout)
        if answer is None:  # the worker died: a sanitizer report, or an exit
            self.process.wait()
            words = self._last_words(since)
            self.stop()
            self.restarts += 1
            return "faulted", summarise_report(words), time.perf_counter() - started
        verdict, why, _ = answer
        if verdict == "faulted":  # the emulator's own word on a kernel fault, if it said one
            said = [line for line in self._last_words(since).splitlines()
                    if line.startswith("cuda_cpu: ")]
            if said:
                why = f"{why} ({said[0][:200]})"
        return verdict, why, time.perf_counter() - started


class Workers:
    """A worker per library, at most `keep` alive at once."""

    def __init__(self, threads: int = 1, budget: float = 60.0, keep: int = 2):
        self.threads, self.budget, self.keep = threads, budget, keep
        self.workers: dict[str, Worker] = {}

    def run(self, library: str, job: Job):
        worker = self.workers.pop(library, None)
        if worker is None:
            worker = Worker(library, self.threads, self.budget)
        self.workers[library] = worker  # most recently used last
        while len(self.workers) > self.keep:
            oldest = next(iter(self.workers))
            self.workers.pop(oldest).stop()
        return worker.run(job)

    @property
    def restarts(self) -> int:
        return sum(w.restarts for w in self.workers.values())

    def stop(self) -> None:
        for worker in self.workers.values():
            worker.stop()
        self.workers.clear()


def _demo() -> int:
    import numpy as np
    from cgc.backends.base import initial_parameters
    from cgc.checking.memory import plan_memory
    from cgc.pipeline import analyse, evaluate
    path = os.path.join(ROOT, "schedules", "train.cg")
    program = evaluate(analyse([path]), path, config="tiny", overrides={"cgBatch": 1})
    started = time.perf_counter()
    library = build_library(program)
    print(f"library {os.path.basename(library)}: {time.perf_counter() - started:.1f} s")
    plan = plan_memory(program, red_zone=RED_ZONE)
    generator = np.random.default_rng(1)
    rows = program.storages[program.roles["ids"]].count
    vocab = program.roles["vocab"]
    tokens = (generator.integers(0, vocab, rows).tolist(),
              generator.integers(0, vocab, rows).tolist())
    job = make_job(program, plan, initial_parameters(program, 0), tokens)
    workers = Workers(threads=int(os.environ.get("CG_CPU_THREADS", "2")))
    for attempt in range(3):
        verdict, why, seconds = workers.run(library, job)
        print(f"unmutated step: {verdict} {why} {seconds:.2f} s")
    # A grid one block too large on the first layer norm.
    calls = list(job.calls)
    for i, call in enumerate(calls):
        if call[0] == "cgImageLayerNorm":
            name, where, grid, pointers, scalars, poison, fence = call
            calls[i] = (name, where, (grid[0] + 1, *grid[1:]), pointers, scalars, poison, fence)
            break
    bad = Job(**{**job.__dict__, "calls": calls})
    verdict, why, seconds = workers.run(library, bad)
    print(f"layer norm grid + 1: {verdict} {why} {seconds:.2f} s")
    workers.stop()
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        sys.exit(worker_main(sys.argv[2]))
    sys.exit(_demo())
