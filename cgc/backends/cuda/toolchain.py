"""CUDA's compilers, from CUDA's own Python wheels: NVRTC (through CuPy) and nvcc.

Neither needs a GPU: both compile for sm_90 (Hopper), which is how CI proves every emitted
file builds. Compiler messages about the emitted file are mapped back to the template and
the image that produced the offending line.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from ...resources import install_hint

ARCHITECTURE = "sm_90"
LANGUAGE = "c++17"


class ToolchainMissing(Exception):
    """A CUDA wheel is not installed; the message says which extra installs it."""


def cuda_root() -> Path:
    """The folder the nvidia-* CUDA 13 wheels install into (bin, include, lib)."""
    spec = importlib.util.find_spec("nvidia")
    for location in (spec.submodule_search_locations or []) if spec else []:
        root = Path(location) / "cu13"
        if (root / "include" / "cuda_runtime.h").exists():
            return root
    raise ToolchainMissing(f"CUDA's headers are not installed: {install_hint('cuda')}")


def include_flags() -> list[str]:
    """The wheels' headers; none where CUDA is installed the ordinary way (its compilers
    then find their own)."""
    try:
        root = cuda_root()
    except ToolchainMissing:
        return []
    return [f"-I{root / 'include'}", f"-I{root / 'include' / 'cccl'}"]


# What a missing CUDA header means: the extra that installs it with an nvcc that finds it.
_TOOLS_EXTRA = install_hint("cuda-tools")
_CUDA_INCLUDE = re.compile(r"^\s*#\s*include\s*<((?:cu|mma\.h|cooperative_groups)[^>]*)>",
                           re.MULTILINE)
_HOST_INCLUDE_DIRS = ("/usr/local/include", "/usr/include")


def include_dirs(compiler: Path) -> list[Path]:
    """Where `compiler` (an nvcc) looks for CUDA's headers: the wheels' folders we pass it,
    the ones its own nvcc.profile adds (as `nvcc --dryrun` reports them), CPATH's, and the
    host compiler's usual ones."""
    found = [Path(flag[2:]) for flag in include_flags()]
    try:
        dry = subprocess.run([str(compiler), "--dryrun", "-x", "cu", "-cubin", os.devnull],
                             capture_output=True, text=True, timeout=60)
        for line in (dry.stdout + dry.stderr).splitlines():
            if line.startswith(("#$ INCLUDES=", "#$ SYSTEM_INCLUDES=")):
                for quoted, bare in re.findall(r'"-(?:I|isystem"\s+")([^"]+)"|-I(\S+)', line):
                    found.append(Path(quoted or bare))
    except (OSError, subprocess.SubprocessError):
        pass
    for variable in ("CPATH", "CPLUS_INCLUDE_PATH"):
        found += [Path(p) for p in os.environ.get(variable, "").split(os.pathsep) if p]
    found += [Path(p) for p in _HOST_INCLUDE_DIRS]
    found += sorted(Path("/usr/include").glob("*-linux-gnu"))
    return [d for i, d in enumerate(found) if d not in found[:i]]


def missing_header(log: str) -> str | None:
    """The header a compiler log says it could not open (gcc's and EDG's words), if any."""
    m = re.search(r"fatal error: ([^\s:]+): No such file or directory", log) or \
        re.search(r'cannot open source file "([^"]+)"', log)
    return m.group(1) if m else None


def _missing(header: str, compiler: Path) -> ToolchainMissing:
    return ToolchainMissing(f"nvcc ({compiler}) does not find CUDA's header {header}: "
                            f"{_TOOLS_EXTRA} installs it, with an nvcc that finds it")


def require_headers(source: str, compiler: Path) -> None:
    """Raises ToolchainMissing, naming the first CUDA header `source` includes that is on
    none of `compiler`'s include folders, before the compiler runs."""
    folders = include_dirs(compiler)
    for header in dict.fromkeys(_CUDA_INCLUDE.findall(source)):
        if not any((folder / header).is_file() for folder in folders):
            raise _missing(header, compiler)


@dataclass
class Message:
    line: int
    severity: str  # error | warning
    text: str


_MESSAGE = re.compile(r"^(?P<file>[^\s(]+)\((?P<line>\d+)\): (?P<severity>error|warning)"
                      r"[^:]*: (?P<text>.*)$", re.MULTILINE)


def messages(log: str) -> list[Message]:
    return [Message(int(m["line"]), m["severity"], m["text"]) for m in _MESSAGE.finditer(log)]


_ARCHITECTURE_LINE = re.compile(r"^// Architecture: (sm_\w+)", re.MULTILINE)


def architecture_of(source: str) -> str:
    """What an emitted file's kernels compile for: the architecture its header names
    (emit.architecture writes it where a kernel needs Hopper's own instructions: sm_90a),
    else sm_90."""
    found = _ARCHITECTURE_LINE.search(source)
    return found.group(1) if found else ARCHITECTURE


def nvrtc_compile(source: str, name: str = "program.cu",
                  cubin: bool = False) -> tuple[bool, str, bytes | None]:
    """Compiles the device part with NVRTC for its architecture (architecture_of): (success,
    log, the cubin where asked and made)."""
    try:
        from cupy.cuda import nvrtc
    except ImportError as error:
        raise ToolchainMissing(f"CuPy is not installed ({error}): {install_hint('cuda')}") \
            from None
    program = nvrtc.createProgram(source, name, [], [])
    try:
        nvrtc.compileProgram(program, [f"--gpu-architecture={architecture_of(source)}",
                                       f"-std={LANGUAGE}", *include_flags()])
        return True, nvrtc.getProgramLog(program), nvrtc.getCUBIN(program) if cubin else None
    except nvrtc.NVRTCError:
        return False, nvrtc.getProgramLog(program), None
    finally:
        nvrtc.destroyProgram(program)


def nvcc() -> Path:
    """The wheel's nvcc, or else the one on PATH."""
    try:
        path = cuda_root() / "bin" / "nvcc"
        if path.exists():
            return path
    except ToolchainMissing:
        pass
    found = shutil.which("nvcc")
    if found is None:
        raise ToolchainMissing(f"nvcc is not installed: {install_hint('cuda-tools')}")
    return Path(found)


def _cublas_flags() -> list[str]:
    """cuBLASLt (every product) and cuBLAS (whose status type the program shares): the
    nvidia-cublas wheel ships both libraries."""
    try:
        library = cuda_root() / "lib"
        return [f"-L{library}", "-l:libcublasLt.so.13", "-l:libcublas.so.13",
                f"-Xlinker=-rpath={library}"]
    except ToolchainMissing:  # an ordinary CUDA installation
        return ["-lcublasLt", "-lcublas"]


def nccl_root() -> Path | None:
    """The nvidia-nccl-cu13 wheel's folder (include/nccl.h, lib/libnccl.so.2), if installed."""
    try:
        import nvidia.nccl
    except ImportError:
        return None
    for folder in getattr(nvidia.nccl, "__path__", ()):
        if (Path(folder) / "include" / "nccl.h").is_file():
            return Path(folder)
    return None


def _nccl_flags(source: str) -> list[str]:
    """NCCL's header and library, for a program with collectives (it includes <nccl.h>):
    the wheel's, or else the system's."""
    if not re.search(r"^\s*#\s*include\s*<nccl\.h>", source, re.MULTILINE):
        return []
    root = nccl_root()
    if root is None:
        return ["-lnccl"]
    library = root / "lib"
    return [f"-I{root / 'include'}", f"-L{library}", "-l:libnccl.so.2",
            f"-Xlinker=-rpath={library}"]


def nvcc_build(source_path: str, output: str) -> tuple[bool, str]:
    """The whole file, host program included, compiled and linked with cuBLASLt (and NCCL,
    for a program with collectives)."""
    compiler = nvcc()
    source = Path(source_path).read_text(encoding="utf-8")
    require_headers(source, compiler)
    target = architecture_of(source)
    # sm_90a's code alone: -arch=sm_90a would also embed PTX for compute_90, which has no wgmma
    arch = f"-arch={target}" if target == ARCHITECTURE else \
        f"-gencode=arch=compute_{target[3:]},code={target}"
    command = [str(compiler), arch, f"-std={LANGUAGE}", *include_flags(), *_cublas_flags(),
               *_nccl_flags(source), "-o", output, source_path]
    result = subprocess.run(command, capture_output=True, text=True)
    log = result.stdout + result.stderr
    if result.returncode != 0 and (header := missing_header(log)):
        raise _missing(header, compiler)
    return result.returncode == 0, log


@dataclass
class KernelReport:
    name: str
    registers: int
    shared_bytes: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int


def ptxas_report(source: str) -> tuple[bool, str, list[KernelReport]]:
    """Registers, static shared memory and spills of every kernel, as ptxas reports them.
    Raises ToolchainMissing where nvcc, or a CUDA header the source includes, is missing."""
    compiler = nvcc()
    require_headers(source, compiler)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "program.cu")
        Path(path).write_text(source, encoding="utf-8")
        command = [str(compiler), f"-arch={architecture_of(source)}", f"-std={LANGUAGE}",
                   *include_flags(), "-cubin", "-Xptxas=-v", "-o", os.path.join(folder, "program.cubin"), path]
        result = subprocess.run(command, capture_output=True, text=True)
    log = result.stdout + result.stderr
    if result.returncode != 0 and (header := missing_header(log)):
        raise _missing(header, compiler)
    reports, current, frame = [], None, (0, 0, 0)
    for line in log.splitlines():
        if m := re.search(r"Function properties for (\S+)", line):
            current = m.group(1)
        elif m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
                            r"(\d+) bytes spill loads", line):
            frame = (int(m.group(1)), int(m.group(2)), int(m.group(3)))
        elif (m := re.search(r"Used (\d+) registers", line)) and current:
            shared = re.search(r"(\d+) bytes smem", line)
            reports.append(KernelReport(current, int(m.group(1)),
                                        int(shared.group(1)) if shared else 0,
                                        frame[1], frame[2], frame[0]))
            current = None
    return result.returncode == 0, log, reports
