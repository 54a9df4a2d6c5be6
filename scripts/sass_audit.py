#!/usr/bin/env python3
"""The SASS audit: every kernel of a schedule's emitted CUDA, read from its machine code.

Builds the emitted file for sm_90 with nvcc (CUDA's wheels: the `cuda-tools` extra),
disassembles the cubin with nvdisasm, reads each kernel's resources with cuobjdump, and
prints per kernel: registers, shared memory (static, and dynamic as the host program
launches it), blocks per SM on an H200 and what limits them, tensor-core instructions
(HMMA), shared-memory accesses by kind (LDSM, LDS, STS, LDGSTS), generic loads and stores
(LD/ST), global ones (LDG/STG, and how many are 128-bit), local memory (LDL/STL) and atomics.
No GPU is needed. tests/test_sass_audit.py holds the promises each kernel keeps.

    python3 scripts/sass_audit.py                 # train.cg, config gpt2
    python3 scripts/sass_audit.py --json          # the same figures, for other scripts
    python3 scripts/sass_audit.py --shipped       # every shipped schedule in every config

What is built is an emitted file's device code (device_code: what NVRTC compiles; nothing in
the host program after it can change a kernel). The cubin is cached by content (that code,
nvcc's version and flags) under $CGC_SASS_CACHE, else cgc's cache folder. --shipped builds
each distinct kernel of a configuration once (kernel_units), and audits each file from its
own kernels' machine code.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from cgc.resources import install_hint  # noqa: E402
from cgc.backends.cuda.toolchain import (ARCHITECTURE, LANGUAGE, ToolchainMissing,  # noqa: E402
                                         architecture_of, cuda_root, include_flags, nvcc)

KB = 1024


# ---- the machine ---------------------------------------------------------------------

@dataclass(frozen=True)
class Hardware:
    """One GPU's figures: the occupancy rules of its compute capability (as CUDA's
    cuda_occupancy.h states them for 9.x) and the rates the cost model prices work at.
    This is the one table of hardware constants; scripts/cost_model.py reads it too."""

    name: str
    architecture: str
    sms: int
    clock_hz: float  # the clock NVIDIA's peak rates are quoted at
    warp_size: int
    threads_per_sm: int
    blocks_per_sm: int
    registers_per_sm: int
    registers_per_block: int
    register_granularity: int  # registers are given to warps in units of this many
    max_registers_per_thread: int
    sub_partitions: int  # an SM's register file is split between its 4 schedulers
    shared_per_sm: int  # the largest shared-memory carveout
    shared_per_block: int  # the most one block may opt in to
    shared_reserved_per_block: int  # what the driver keeps per block (sm_80 onwards)
    shared_granularity: int
    tensor_flops: float  # dense bf16 products, float32 accumulation
    hbm_bytes_per_s: float
    shared_bytes_per_clock: int  # per SM: one 128-byte wavefront a clock
    shared_banks: int
    l2_bytes: int
    # What an H200 reaches, measured (docs/performance-model.md "Calibrated"): the
    # calibrated cost model prices work at these, the optimistic bound at the peaks above
    measured_tensor_flops: float  # a large bfloat16 product through cuBLAS
    measured_hbm_bytes_per_s: float  # a device-to-device copy
    mufu_per_clock: int  # special-function (MUFU) results an SM a clock


H200 = Hardware(
    name="H200 SXM", architecture="sm_90", sms=132, clock_hz=1.83e9, warp_size=32,
    threads_per_sm=2048, blocks_per_sm=32, registers_per_sm=65536, registers_per_block=65536,
    register_granularity=256, max_registers_per_thread=255, sub_partitions=4,
    shared_per_sm=228 * KB, shared_per_block=227 * KB, shared_reserved_per_block=1 * KB,
    shared_granularity=128,
    # 4096 flop a clock per SM x 132 SMs x 1.83 GHz = 989 TFLOP/s, NVIDIA's dense figure.
    tensor_flops=989e12, hbm_bytes_per_s=4.8e12, shared_bytes_per_clock=128, shared_banks=32,
    l2_bytes=50 * KB * KB,
    # 16 MUFU results a clock an SM: the CUDA C++ Programming Guide's throughput table,
    # compute capability 9.0 (exp2, log2, reciprocal, reciprocal square root, sine, cosine)
    measured_tensor_flops=790e12, measured_hbm_bytes_per_s=4.3e12, mufu_per_clock=16)


def _round_up(x: int, unit: int) -> int:
    return -(-x // unit) * unit


@dataclass(frozen=True)
class Occupancy:
    blocks: int  # resident blocks per SM
    limiter: str  # threads | blocks | registers | shared memory
    warps: int  # resident warps per SM


def occupancy(threads: int, registers: int, shared_bytes: int, hw: Hardware = H200) -> Occupancy:
    """Blocks of `threads` threads, `registers` registers a thread and `shared_bytes` of shared
    memory a block (static plus dynamic, without the driver's reserve) resident on one SM.
    The rules of CUDA's occupancy calculator for compute capability 9.x: registers go to
    warps in units of `register_granularity`, each scheduler's quarter of the register file
    holds whole warps; shared memory is allocated in `shared_granularity` units with the
    driver's reserve added per block, out of the largest carveout. 0 when a block does not
    fit at all."""
    warps = -(-threads // hw.warp_size)
    limits = {"blocks": hw.blocks_per_sm, "threads": hw.threads_per_sm // (warps * hw.warp_size)}
    per_warp = _round_up(registers * hw.warp_size, hw.register_granularity)
    if registers > hw.max_registers_per_thread or \
            per_warp * _round_up(warps, hw.sub_partitions) > hw.registers_per_block:
        limits["registers"] = 0
    elif per_warp:
        per_scheduler = (hw.registers_per_sm // hw.sub_partitions) // per_warp
        limits["registers"] = per_scheduler * hw.sub_partitions // warps
    per_block = _round_up(shared_bytes + hw.shared_reserved_per_block, hw.shared_granularity)
    if shared_bytes > hw.shared_per_block:
        limits["shared memory"] = 0
    else:
        limits["shared memory"] = hw.shared_per_sm // per_block
    # On a tie, name the limit a kernel cannot do better than (threads, blocks) first.
    order = ["threads", "blocks", "registers", "shared memory"]
    limiter = min(limits, key=lambda k: (limits[k], order.index(k)))
    blocks = limits[limiter]
    return Occupancy(blocks, limiter, blocks * warps)


# ---- the machine code ----------------------------------------------------------------

# Instruction classes, by base opcode (the mnemonic before its first dot).
CLASSES = {
    "HMMA": "tensor", "HGMMA": "tensor",
    "LDSM": "ldsm", "LDS": "lds", "STS": "sts", "LDGSTS": "ldgsts",
    "LD": "generic", "ST": "generic",
    "LDG": "global", "STG": "global",
    "LDL": "local", "STL": "local",
    "ATOM": "atomic", "ATOMS": "atomic", "ATOMG": "atomic", "RED": "atomic", "REDG": "atomic",
    "BAR": "barrier",
    "MUFU": "mufu",  # the special-function unit: ex2, rcp, rsq, sin, cos, lg2
}

# Opcodes counted one by one as well (`op:FFMA`), for the promises the design makes of its
# arithmetic (an exponential's argument one FFMA, a select only where a mask is); `ex2`
# counts MUFU.EX2.
OPCODES_COUNTED = ("FFMA", "FMUL", "FADD", "FSEL", "FMNMX", "FSETP", "ISETP")

# The accesses that take shared-memory wavefronts (generic ones priced as shared).
SHARED_KINDS = ("lds", "sts", "ldsm", "ldgsts", "generic")
# The accesses that pass through an SM's L1 data path, which shared memory and the L1 cache
# share (128 bytes a clock): the shared ones and the global loads and stores, whose
# wavefronts are counted at their least (coalesced: 128 bytes a wavefront).
DATA_PATH_KINDS = SHARED_KINDS + ("global",)

_SECTION = re.compile(r"^\s*\.section\s+\.text\.([^,\s]+)")
_LABEL = re.compile(r"^(\.L_\w+):")
# An opcode may spell a shape with a small x: Hopper's HGMMA.64x64x16.F32.BF16.
_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?"
                          r"([A-Z][A-Z0-9_.]*(?:x[0-9][A-Z0-9_.x]*)?)(.*?);")
_TARGET = re.compile(r"`\((\.L_\w+)\)")
# The predicates that are never true: an instruction under them never executes
# (`@!PT LDS RZ, [RZ]` pads the code after cp.async), so it counts for nothing.
_NEVER = ("@!PT", "@!UPT")


@dataclass
class Instruction:
    address: int
    opcode: str  # with its modifiers: LDG.E.128.CONSTANT
    operands: str
    predicated: bool = False

    @property
    def base(self) -> str:
        return self.opcode.split(".", 1)[0]

    @property
    def kind(self) -> str | None:
        return CLASSES.get(self.base)

    @property
    def wide(self) -> bool:
        """A 128-bit access."""
        return ".128" in self.opcode

    @property
    def wavefronts(self) -> int:
        """A warp's shared-memory access in 128-byte wavefronts, without bank conflicts:
        32 threads of 4 bytes or less take one, of 8 bytes two, of 16 bytes four; ldmatrix
        moves one 8 x 8 matrix (128 bytes) a wavefront, 1, 2 or 4 of them (.4)."""
        if self.base == "LDSM":
            return int(self.opcode.rsplit(".", 1)[1]) if self.opcode[-2:] in (".2", ".4") \
                else 1
        return 4 if ".128" in self.opcode else 2 if ".64" in self.opcode else 1


@dataclass
class Loop:
    """A backward branch's range of addresses: the body of a loop."""

    start: int
    end: int

    def holds(self, address: int) -> bool:
        return self.start <= address <= self.end


@dataclass
class KernelCode:
    name: str
    instructions: list[Instruction] = field(default_factory=list)
    loops: list[Loop] = field(default_factory=list)

    def counts(self, where=lambda i: True) -> Counter:
        """Instructions by class, `op:OPCODE` for the OPCODES_COUNTED and `ex2` for
        MUFU.EX2, `wide` for 128-bit global accesses, `ticket` for the
        atomics that are atomicInc (ATOMG.E.INC: they count, they add no data), `instructions` for
        all of them, and `wavefronts:KIND` for the wavefronts of the accesses that pass
        through the L1 data path (DATA_PATH_KINDS: a generic access is priced as shared, in
        these kernels that is where they go; cp.async as the shared-memory store it ends
        in; a global access at its least, coalesced)."""
        found = Counter()
        for instruction in self.instructions:
            if not where(instruction):
                continue
            found["instructions"] += 1
            if instruction.base in OPCODES_COUNTED:
                found[f"op:{instruction.base}"] += 1
            if instruction.opcode.startswith("MUFU.EX2"):
                found["ex2"] += 1
            if instruction.kind is None:
                continue
            found[instruction.kind] += 1
            if instruction.kind == "atomic" and ".INC" in instruction.opcode:
                found["ticket"] += 1  # atomicInc: a ticket (the layer-norm backward's two levels)
            if instruction.kind == "global" and instruction.wide:
                found["wide"] += 1
            if instruction.kind in DATA_PATH_KINDS:
                found[f"wavefronts:{instruction.kind}"] += instruction.wavefronts
        return found

    def outermost_loops(self) -> list[Loop]:
        return [loop for loop in self.loops
                if not any(o is not loop and o.start <= loop.start and loop.end <= o.end
                           and (o.start, o.end) != (loop.start, loop.end) for o in self.loops)]

    def _issues_tensor(self, loop: Loop) -> bool:
        return any(i.kind == "tensor" and loop.holds(i.address) for i in self.instructions)

    def tile_loops(self) -> list[tuple[Loop, Counter]]:
        """The innermost loops that issue tensor-core instructions (no loop inside them
        does), each with the counts of its body: one iteration of a tiled kernel's main loop.
        A loop around them (the attention backward's loops over tiles around its chunk
        loops; the grouped-query backward's over the query heads a block serves) is not
        one: KernelCode.around_tiles."""
        found = []
        tensor_loops = [loop for loop in self.loops if self._issues_tensor(loop)]
        for loop in sorted(tensor_loops, key=lambda l: l.start):
            if any(o is not loop and loop.start <= o.start and o.end <= loop.end
                   and (o.start, o.end) != (loop.start, loop.end) for o in tensor_loops):
                continue
            found.append((loop, self.counts(lambda i, loop=loop: loop.holds(i.address))))
        return found

    def around_tiles(self) -> list[Counter]:
        """The loops that hold main loops (tile_loops) without being one, in address order,
        each with the counts of one trip of its own code: its body outside those main loops
        and outside the other such loops it holds (the attention backward's loops over query
        and key tiles around its chunk loops, the peeled diagonal steps, and the
        grouped-query backward's loops over the query heads a block serves around those)."""
        tiles = [loop for loop, _ in self.tile_loops()]
        spans = {(loop.start, loop.end): loop for loop in self.loops
                 if any(loop.start <= t.start and t.end <= loop.end for t in tiles)
                 and all((t.start, t.end) != (loop.start, loop.end) for t in tiles)}
        arounds = [spans[span] for span in sorted(spans)]
        found = []
        for loop in arounds:
            inside = [o for o in arounds if o is not loop and loop.start <= o.start
                      and o.end <= loop.end]
            found.append(self.counts(
                lambda i, loop=loop, inside=inside: loop.holds(i.address)
                and not any(t.holds(i.address) for t in tiles + inside)))
        return found

    def outside_tiles(self) -> Counter:
        """The counts of the code outside every main loop (tile_loops): what runs once a
        thread, and once a head around them."""
        tiles = [loop for loop, _ in self.tile_loops()]
        return self.counts(lambda i: not any(t.holds(i.address) for t in tiles))

    def inner_loops(self, outer: Loop) -> list[Counter]:
        """The counts of each loop directly inside `outer` (not inside another inner one), in
        address order: one trip's body. The cost model multiplies them by their trips."""
        inside = [l for l in self.loops if outer.start <= l.start and l.end <= outer.end
                  and (l.start, l.end) != (outer.start, outer.end)]
        direct = [l for l in inside
                  if not any(o is not l and o.start <= l.start and l.end <= o.end
                             and (o.start, o.end) != (l.start, l.end) for o in inside)]
        return [self.counts(lambda i, l=l: l.holds(i.address))
                for l in sorted(direct, key=lambda l: l.start)]

    def straight(self) -> Counter:
        """The counts of the code outside every loop: what each thread runs once."""
        return self.counts(lambda i: not any(l.holds(i.address) for l in self.loops))

    def untiled_loops(self) -> list[Counter]:
        """The counts of each outermost loop that issues no tensor-core instruction (a
        grid-stride loop, a sort's pass), one trip's body with its inner loops once, in
        address order; the cost model takes their trips from the design. The one-instruction
        loop after a kernel's last EXIT (the branch to itself that ends every kernel) runs
        never and is none of them."""
        found = []
        for loop in sorted(self.outermost_loops(), key=lambda l: l.start):
            counts = self.counts(lambda i, loop=loop: loop.holds(i.address))
            if not counts["tensor"] and loop.start != loop.end:
                found.append(counts)
        return found

    def tensor_outside_loops(self) -> int:
        """The tensor-core instructions outside every main loop (tile_loops): the peeled
        diagonal steps, each once (a loop around the main loops repeats them:
        around_tiles)."""
        tiles = [loop for loop, _ in self.tile_loops()]
        return sum(1 for i in self.instructions
                   if i.kind == "tensor" and not any(t.holds(i.address) for t in tiles))


def parse_sass(text: str) -> dict[str, KernelCode]:
    """nvdisasm's listing, by kernel. A kernel's section holds its own code and the
    subroutines the compiler placed after it (division slow paths), counted with it. A
    __noinline__ device function would have a section of its own, not counted with its
    callers; cgc's kernels inline all their device code."""
    kernels: dict[str, KernelCode] = {}
    current, labels, pending = None, {}, []
    for line in text.splitlines():
        if m := _SECTION.match(line):
            current = kernels.setdefault(m.group(1), KernelCode(m.group(1)))
            labels, pending = {}, []
            continue
        if current is None:
            continue
        if m := _LABEL.match(line.strip()):
            pending.append(m.group(1))
            continue
        if m := _INSTRUCTION.match(line):
            if m.group(2) is not None and m.group(2).strip() in _NEVER:
                continue  # padding the compiler predicates off (after cp.async): never runs
            instruction = Instruction(int(m.group(1), 16), m.group(3), m.group(4).strip(),
                                      m.group(2) is not None)
            current.instructions.append(instruction)
            for label in pending:
                labels[label] = instruction.address
            pending = []
            # A loop closes at a branch back to a label already seen.
            if instruction.base == "BRA" and (t := _TARGET.search(instruction.operands)) \
                    and t.group(1) in labels:
                current.loops.append(Loop(labels[t.group(1)], instruction.address))
    for kernel in kernels.values():
        kernel.loops = _true_loops(kernel)
    return kernels


def _true_loops(kernel: KernelCode) -> list[Loop]:
    """Loops nest or are disjoint. A backward branch whose range crosses another's and
    holds an unconditional EXIT is no loop: it is the return from an out-of-line path
    (a divergent warp's shuffle slow path, placed after the kernel's end, jumps back)."""
    exits = [i.address for i in kernel.instructions
             if i.base in ("EXIT", "RET") and not i.predicated]

    def crosses(a: Loop, b: Loop) -> bool:
        return a.start < b.start <= a.end < b.end or b.start < a.start <= b.end < a.end

    return [loop for loop in kernel.loops
            if not (any(crosses(loop, other) for other in kernel.loops)
                    and any(loop.start <= e < loop.end for e in exits))]


# ---- the build -----------------------------------------------------------------------

def tool(name: str) -> Path:
    """A CUDA tool from the wheels (cuda-tools extra), else from PATH."""
    try:
        path = cuda_root() / "bin" / name
        if path.exists():
            return path
    except ToolchainMissing:
        pass
    found = shutil.which(name)
    if found is None:
        raise ToolchainMissing(f"{name} is not installed: {install_hint('cuda-tools')}")
    return Path(found)


def release(program: Path) -> tuple[int, int]:
    """A CUDA tool's release (13, 5) from its --version."""
    text = subprocess.run([str(program), "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release (\d+)\.(\d+)", text)
    if not m:
        raise ToolchainMissing(f"{program} --version names no release")
    return int(m.group(1)), int(m.group(2))


def check_versions() -> None:
    """nvdisasm and cuobjdump read cubins of their own release or older: refuse, clearly,
    a pair where nvcc is newer than either."""
    compiler = release(nvcc())
    for name in ("nvdisasm", "cuobjdump"):
        found = release(tool(name))
        if found < compiler:
            raise ToolchainMissing(
                f"{name} {found[0]}.{found[1]} is older than nvcc {compiler[0]}.{compiler[1]} "
                f"and may misread its cubins: {install_hint('cuda-tools')}, with -U")


def cache_folder() -> Path:
    if folder := os.environ.get("CGC_SASS_CACHE"):
        return Path(folder)
    from cgc.resources import cache_dir
    return Path(cache_dir()) / "sass"


def build_cubin(source: str, folder: Path | None = None, architecture: str | None = None) -> Path:
    """The cubin of `source` for its architecture (architecture_of: sm_90, or sm_90a where a
    kernel uses Hopper's own wgmma and tensor copies) or `architecture`, built once per content
    (nvcc takes a minute)."""
    architecture = architecture or architecture_of(source)
    compiler = nvcc()
    flags = [f"-arch={architecture}", f"-std={LANGUAGE}", "-cubin"]
    version = subprocess.run([str(compiler), "--version"], capture_output=True,
                             text=True).stdout
    key = hashlib.sha256("\0".join([source, version, *flags]).encode()).hexdigest()[:32]
    folder = folder or cache_folder()
    folder.mkdir(parents=True, exist_ok=True)
    cubin = folder / f"{key}.cubin"
    if cubin.exists():
        return cubin
    with tempfile.TemporaryDirectory() as work:
        path = os.path.join(work, "program.cu")
        Path(path).write_text(source, encoding="utf-8")
        built = os.path.join(work, "program.cubin")
        result = subprocess.run([str(compiler), *flags, *include_flags(), "-o", built, path],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"nvcc failed:\n{result.stdout}{result.stderr}")
        partial = folder / f"{key}.{os.getpid()}.part"
        shutil.copyfile(built, partial)
        os.replace(partial, cubin)  # atomic: a concurrent reader sees all of it or none
    return cubin


def disassemble(cubin: Path) -> str:
    result = subprocess.run([str(tool("nvdisasm")), "-c", str(cubin)], capture_output=True,
                            text=True)
    if result.returncode != 0:
        raise RuntimeError(f"nvdisasm failed: {result.stderr}")
    return result.stdout


@dataclass(frozen=True)
class Resources:
    registers: int
    static_shared: int  # bytes the kernel declares, without the driver's reserve
    stack: int
    local: int


def resources(cubin: Path, hw: Hardware = H200) -> dict[str, Resources]:
    """cuobjdump -res-usage per kernel. Its SHARED counts the block's reserved kilobyte
    (sm_90 cubins carry .nv.shared.reserved), which is taken off here: occupancy() adds it
    back, as the driver does."""
    result = subprocess.run([str(tool("cuobjdump")), "-res-usage", str(cubin)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"cuobjdump failed: {result.stderr}")
    found, name = {}, None
    for line in result.stdout.splitlines():
        if m := re.match(r"\s*Function (\S+):", line):
            name = m.group(1)
        elif name and "REG:" in line:
            fields = dict(re.findall(r"(\w+(?:\[\d+\])?):(\d+)", line))
            shared = int(fields.get("SHARED", 0))
            found[name] = Resources(int(fields["REG"]),
                                    max(shared - hw.shared_reserved_per_block, 0),
                                    int(fields.get("STACK", 0)), int(fields.get("LOCAL", 0)))
            name = None
    return found


# ---- the audit -----------------------------------------------------------------------

@dataclass
class KernelAudit:
    name: str
    threads: int
    registers: int
    static_shared: int
    dynamic_shared: int
    stack: int
    occupancy: Occupancy
    counts: Counter
    tile_loops: list[Counter]  # per innermost loop issuing HMMA: one iteration's counts
    tensor_outside_loops: int
    # per tiled main loop, the counts of one trip of each loop directly inside it
    inner_loops: list[list[Counter]] = field(default_factory=list)
    # bank-conflict ways of each ldmatrix (attention_ldmatrix_ways): 1 = conflict-free
    ldsm_conflicts: int = 1
    # the code outside every loop (each thread runs it once), and each outermost loop that
    # issues no HMMA, one trip (KernelCode.straight, untiled_loops)
    straight: Counter = field(default_factory=Counter)
    untiled_loops: list[Counter] = field(default_factory=list)
    # each loop around main loops, one trip outside them; and all the code outside the main
    # loops (KernelCode.around_tiles, outside_tiles)
    around_tiles: list[Counter] = field(default_factory=list)
    outside_tiles: Counter = field(default_factory=Counter)

    def row(self) -> dict:
        c = self.counts
        return {"kernel": self.name, "threads": self.threads, "registers": self.registers,
                "static_shared": self.static_shared, "dynamic_shared": self.dynamic_shared,
                "stack": self.stack, "blocks_per_sm": self.occupancy.blocks,
                "limiter": self.occupancy.limiter, "warps_per_sm": self.occupancy.warps,
                **{k: c[k] for k in ("tensor", "ldsm", "lds", "sts", "ldgsts", "generic",
                                     "global", "wide", "local", "atomic", "ticket",
                                     "barrier", "mufu")},
                "tile_loops": [dict(t) for t in self.tile_loops],
                "tensor_outside_loops": self.tensor_outside_loops,
                "inner_loops": [[dict(c) for c in loops] for loops in self.inner_loops],
                "ldsm_conflicts": self.ldsm_conflicts, "straight": dict(self.straight),
                "untiled_loops": [dict(c) for c in self.untiled_loops],
                "around_tiles": [dict(c) for c in self.around_tiles]}


@dataclass
class LaunchShape:
    threads: int
    dynamic_shared: int


def audit_code(code: dict[str, KernelCode], usage: dict[str, Resources],
               shapes: dict[str, LaunchShape], hw: Hardware = H200) -> dict[str, KernelAudit]:
    """The audit of each kernel from its parsed code, its resources and its launch shape."""
    found = {}
    for name in sorted(shapes):
        shape, used = shapes[name], usage[name]
        kernel = code[name]
        found[name] = KernelAudit(
            name, shape.threads, used.registers, used.static_shared, shape.dynamic_shared,
            used.stack,
            occupancy(shape.threads, used.registers, used.static_shared + shape.dynamic_shared,
                      hw),
            kernel.counts(), [c for _, c in kernel.tile_loops()], kernel.tensor_outside_loops(),
            [kernel.inner_loops(loop) for loop, _ in kernel.tile_loops()],
            straight=kernel.straight(), untiled_loops=kernel.untiled_loops(),
            around_tiles=kernel.around_tiles(), outside_tiles=kernel.outside_tiles())
    return found


def emitted_file(path: str, config: str, overrides: dict | None = None):
    """The emitted CUDA of `path` in `config` (with constants `overrides` set, as `--set`
    does), and each kernel's launch shape."""
    from cgc.backends.cuda.emit import emit_program
    from cgc.pipeline import analyse, checked
    result = checked(analyse([path]), path, config=config, overrides=overrides)
    emitted = emit_program(result.program, result.plan)
    shapes = {}
    for kernel in emitted.kernels:
        block = result.program.images[kernel.image].block
        shapes[kernel.image] = LaunchShape(block[0] * block[1] * block[2], kernel.shared_bytes)
    return emitted.text, shapes


def ldmatrix_conflict_ways(row_bytes: int) -> int:
    """Bank-conflict ways of one ldmatrix 8 x 8 matrix: its 8 rows of 16 bytes, `row_bytes`
    apart, over 32 banks of 4 bytes (8 groups of 16 bytes): the most rows in one group.
    Unpadded rows of 64 bfloat16 (128 bytes) put all 8 in one group: 8 ways."""
    return max(Counter((row * row_bytes // 16) % 8 for row in range(8)).values())


def attention_ldmatrix_ways(source: str) -> int:
    """The ldmatrix conflict ways of the attention tiles in an emitted file, from the row
    stride it declares (kHeadWidth + kAttentionRowPadding 16-bit elements): what the SASS
    cannot show, read from the code that sets it rather than assumed."""
    width = re.search(r"\bkHeadWidth = (\d+)", source)
    padding = re.search(r"constexpr int kAttentionRowPadding = (\d+);", source)
    if width is None or padding is None:
        return 1  # no attention tiles in this file
    return ldmatrix_conflict_ways((int(width.group(1)) + int(padding.group(1))) * 2)


# The host program's opening line (templates/program.cu.j2): it follows every kernel, and
# NVRTC (which defines __CUDACC_RTC__) skips it.
HOST_PART = "#ifndef __CUDACC_RTC__\n"


def device_code(source: str) -> str:
    """An emitted file's device code: its text before the host program, without the opening
    comment that names the schedule and configuration. It is what NVRTC compiles, and nvcc's
    machine code for each kernel is the same from it as from the whole file: the host part
    comes after every kernel and cannot change one. Two files with equal device code (a
    schedule and its data-parallel or recomputing variant, in one configuration) have the
    same kernels, built once."""
    lines = source.split("\n")
    first = next(i for i, line in enumerate(lines) if not line.startswith("//"))
    text = "\n".join(lines[first:])
    at = text.find("\n" + HOST_PART)
    code = text if at < 0 else text[:at + 1]
    target = architecture_of(source)  # kept: the line build_cubin reads it from
    return code if target == ARCHITECTURE else f"// Architecture: {target}\n{code}"


@dataclass
class Built:
    """One build of device code: its parsed machine code, its resources and the ldmatrix
    conflict ways of its attention tiles, which each file sharing it audits with its own
    launch shapes."""

    code: dict[str, KernelCode]
    usage: dict[str, Resources]
    ldsm_ways: int

    def audit(self, shapes: dict[str, LaunchShape], hw: Hardware = H200) -> dict[str, KernelAudit]:
        audits = audit_code(self.code, self.usage, shapes, hw)
        for audit in audits.values():
            if audit.counts["ldsm"]:
                audit.ldsm_conflicts = self.ldsm_ways
        return audits


def build(code: str, folder: Path | None = None, hw: Hardware = H200) -> Built:
    cubin = build_cubin(code, folder)
    return Built(parse_sass(disassemble(cubin)), resources(cubin, hw),
                 attention_ldmatrix_ways(code))


def audit_file(path: str, config: str, hw: Hardware = H200) -> dict[str, KernelAudit]:
    check_versions()
    return audit_source(*emitted_file(path, config), hw=hw)


def audit_source(source: str, shapes: dict, folder: Path | None = None,
                 hw: Hardware = H200) -> dict[str, KernelAudit]:
    """Every kernel of an emitted file, audited from its machine code (its device code,
    built in `folder`), with what the code shows besides (the ldmatrix conflict ways of its
    row stride)."""
    return build(device_code(source), folder, hw).audit(shapes, hw)


# ---- every shipped configuration -----------------------------------------------------

# The models whose schedules are shipped: the GPT step's folder and the Llama-style one's.
SHIPPED_FOLDERS = ("", "llama")


def shipped_files() -> list[tuple[str, str]]:
    """(schedule file, config) for every shipped configuration of every shipped schedule:
    each .cg file of SHIPPED_FOLDERS that declares a schedule and a configuration (compiled
    as `cgc compile FILE` does, its last schedule the entry), in each configuration it
    declares (its model's). A file of declarations only (model.cg, images.cg), or of
    definitions a model's steps import (launches.cg), compiles to no file of
    its own."""
    from cgc.pipeline import analyse
    from cgc.resources import data_dir
    found = []
    for folder in SHIPPED_FOLDERS:
        for path in sorted((data_dir("schedules") / folder).glob("*.cg")):
            frontend = analyse([str(path)])
            if frontend.default_entry(str(path)) is not None:
                found += [(str(path), config) for config in frontend.configs]
    return found


def shipped_name(path: str) -> str:
    """A shipped file's name from the schedules folder: train.cg, llama/train.cg."""
    from cgc.resources import data_dir
    return Path(path).relative_to(data_dir("schedules")).as_posix()


@dataclass
class ShippedAudit:
    """The audit of every shipped file, keyed by (schedule file name, config); the files
    grouped by device code (`builds`: more than one in a group, files identical in kernels);
    and `compiled`, the nvcc builds that made the machine code (each distinct kernel of a
    configuration once: kernel_units)."""

    files: dict[tuple[str, str], dict[str, KernelAudit]]
    builds: list[list[tuple[str, str]]]
    compiled: int = 0


# The kernels' section of the device code (templates/program.cu.j2): each kernel follows
# a blank line and its "// NAME: summary" line.
KERNELS_HEADER = "// ---- kernels: one per image"


def split_kernels(code: str, names) -> tuple[str, dict[str, str]]:
    """Device code's common part (everything before the kernels' section) and the text of
    each kernel `names` lists, from the blank line before its "// NAME: " line to the next
    kernel's. The pieces must rebuild the code, each one kernel of its own name."""
    at = code.index("\n" + KERNELS_HEADER) + 1
    starts = []
    for name in names:
        found = code.find(f"\n\n// {name}: ", at)
        assert found >= 0, f"no kernel {name} in the device code"
        starts.append((found + 1, name))
    starts.sort()
    ends = [start for start, _ in starts[1:]] + [len(code)]
    kernels = {name: code[start:end] for (start, name), end in zip(starts, ends)}
    assert code[:at] + code[at:starts[0][0]] + "".join(kernels.values()) == code
    assert all(len(re.findall(r"__global__ void", text)) == 1 and
               re.search(rf"__global__ void (__launch_bounds__\([^)]*\) )?{name}\(", text)
               for name, text in kernels.items()), "a kernel's text is not one kernel of its own"
    return code[:at], kernels


def unit_code(common: str, kernels: dict[str, str]) -> str:
    """The device code of one build of kernel_units: the common part and the kernels."""
    return common + KERNELS_HEADER + "\n" + "".join(kernels.values())


def kernel_units(codes: list[tuple[str, dict]]) -> list[tuple[str, dict[str, str]]]:
    """The builds for a set of files (each its device code and its kernels' launch shapes):
    (common part, kernel texts by name), each distinct kernel of each common part once. A
    build holds one text of each name, so a kernel two files emit differently goes in a
    second build. ptxas makes each kernel's machine code alone (no kernel's code changes
    another's), so a kernel's SASS is the same in any build of its common part
    (test_a_kernel_built_beside_others_is_the_same)."""
    rounds: dict[str, list[dict[str, str]]] = {}
    for code, shapes in codes:
        common, kernels = split_kernels(code, shapes)
        builds = rounds.setdefault(common, [])
        for name, text in kernels.items():
            if any(done.get(name) == text for done in builds):
                continue
            free = next((done for done in builds if name not in done), None)
            if free is None:
                builds.append(free := {})
            free[name] = text
    return [(common, kernels) for common, builds in rounds.items() for kernels in builds]


def audit_shipped(folder: Path | None = None, hw: Hardware = H200,
                  workers: int | None = None) -> ShippedAudit:
    """Every shipped file (shipped_files), audited: each distinct kernel of a configuration
    built once (kernel_units), the builds run `workers` at a time (default: one a CPU; nvcc
    is a process); each file audited from its own kernels' machine code."""
    from concurrent.futures import ThreadPoolExecutor
    check_versions()
    shapes, by_code = {}, {}
    for path, config in shipped_files():
        key = (shipped_name(path), config)
        source, shapes[key] = emitted_file(path, config)
        by_code.setdefault(device_code(source), []).append(key)
    units = kernel_units([(code, shapes[keys[0]]) for code, keys in by_code.items()])
    with ThreadPoolExecutor(workers or os.cpu_count() or 1) as pool:
        built = list(pool.map(lambda unit: build(unit_code(*unit), folder, hw), units))
    code_of, usage_of = {}, {}  # by (common part, kernel text)
    for (common, kernels), done in zip(units, built):
        for name, text in kernels.items():
            code_of[common, text], usage_of[common, text] = done.code[name], done.usage[name]
    files = {}
    for code, keys in by_code.items():
        common, kernels = split_kernels(code, shapes[keys[0]])
        own = Built({name: code_of[common, text] for name, text in kernels.items()},
                    {name: usage_of[common, text] for name, text in kernels.items()},
                    attention_ldmatrix_ways(code))
        files.update({key: own.audit(shapes[key], hw) for key in keys})
    return ShippedAudit(dict(sorted(files.items())), list(by_code.values()), len(units))


COLUMNS = [("kernel", "kernel"), ("threads", "threads"), ("registers", "regs"),
           ("static_shared", "static smem"), ("dynamic_shared", "dynamic smem"),
           ("blocks_per_sm", "blocks/SM"), ("limiter", "limited by"), ("tensor", "HMMA"),
           ("ldsm", "LDSM"), ("lds", "LDS"), ("sts", "STS"), ("ldgsts", "LDGSTS"),
           ("generic", "LD/ST generic"), ("global", "LDG/STG"), ("wide", "128-bit LDG/STG"),
           ("local", "LDL/STL"), ("atomic", "atomics")]


def table(audits: dict[str, KernelAudit]) -> str:
    lines = ["| " + " | ".join(title for _, title in COLUMNS) + " |",
             "| --- | " + " | ".join("---:" for _ in COLUMNS[1:]) + " |"]
    for audit in audits.values():
        row = audit.row()
        lines.append("| " + " | ".join(str(row[key]) for key, _ in COLUMNS) + " |")
    loops = [f"- {a.name}: HMMA loop bodies "
             + ", ".join(f"{t['tensor']} HMMA, {t['ldsm']} LDSM, {t['lds']} LDS, "
                         f"{t['sts']} STS, {t['generic']} generic" for t in a.tile_loops)
             + f"; {a.tensor_outside_loops} HMMA outside loops"
             for a in audits.values() if a.tile_loops or a.tensor_outside_loops]
    return "\n".join(lines + ([""] + loops if loops else []))


def print_shipped(shipped: ShippedAudit, as_json: bool) -> int:
    """A table per build, naming the files it stands for; then every kernel with local
    memory (stack, LDL/STL) in any of them, or that none has."""
    if as_json:
        print(json.dumps([{"files": [list(key) for key in keys],
                           "kernels": [a.row() for a in shipped.files[keys[0]].values()]}
                          for keys in shipped.builds], indent=1))
        return 0
    for keys in shipped.builds:
        names = ", ".join(sorted({name for name, _ in keys}))
        same = f" (the same device code)" if len(keys) > 1 else ""
        audits = shipped.files[keys[0]]
        print(f"{names}, config {keys[0][1]}{same}: {len(audits)} kernels, {ARCHITECTURE}")
        print(table(audits) + "\n")
    local = [f"{name} {config}: {kernel} (stack {a.stack} bytes, {a.counts['local']} LDL/STL)"
             for (name, config), audits in shipped.files.items()
             for kernel, a in audits.items() if a.stack or a.counts["local"]]
    print("\n".join(["local memory:"] + local) if local else
          f"local memory: none, in the {sum(map(len, shipped.files.values()))} kernels of "
          f"{len(shipped.files)} shipped files ({len(shipped.builds)} distinct device codes, "
          f"{shipped.compiled} nvcc builds)")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--file", default=os.path.join(ROOT, "schedules", "train.cg"))
    parser.add_argument("--config", default="gpt2")
    parser.add_argument("--json", action="store_true", help="print the audit as JSON")
    parser.add_argument("--shipped", action="store_true",
                        help="every shipped schedule in every configuration (not --file, "
                             "--config): a table per distinct device code")
    args = parser.parse_args()
    from cgc.core.diagnostics import CompileError, render_all
    try:
        if args.shipped:
            return print_shipped(audit_shipped(), args.json)
        audits = audit_file(args.file, args.config)
    except ToolchainMissing as error:
        print(f"sass_audit: error: {error}", file=sys.stderr)
        return 1
    except CompileError as error:  # the schedule itself: cgc's own diagnostics
        print(render_all(error.diagnostics), file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps([a.row() for a in audits.values()], indent=1))
        return 0
    print(f"{os.path.relpath(args.file, ROOT)}, config {args.config}: {len(audits)} kernels, "
          f"{ARCHITECTURE} ({H200.name}: {H200.shared_per_sm // KB} KB shared and "
          f"{H200.registers_per_sm} registers an SM)")
    print(table(audits))
    return 0


if __name__ == "__main__":
    from cgc.outputs import script_status
    sys.exit(script_status(main))
