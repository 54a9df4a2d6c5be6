"""The CUDA backend: one host + device .cu file for a checked launch program.

The emitter computes every name, size, grid and offset; the Jinja templates in templates/
only place them (StrictUndefined: a missing value is an error, never an empty string).
Each kernel image has a template named after it (cgImageLayerNorm: kernels/layer_norm.cu.j2);
each image of a library (cuBLAS: products, through cuBLASLt) has a host function of its own
name in program.cu.j2.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import jinja2

from ... import __version__
from ...checking.concurrency import COMMUNICATOR, on_streams, stream_count
from ...checking.memory import MemoryPlan
from ...checking.signature import c_parameters
from ...core.affine import format_nat
from ...core.diagnostics import Diagnostic, Note
from ...core.elements import ELEMENTS, c_type, element_bytes
from ...core.ir import SHARDED_COLLECTIVES, Concurrent, Launch, PhaseRegion, Program, Repeat, View
from ...core.roles import KERNEL_CONSTANTS, TRAINING_ROLES
from ...resources import cache_dir, data_dir, read_regular


@dataclass(frozen=True)
class CublasProduct:
    """How a product image maps onto cublasLtMatmul. Row-major C[m, n] = A B is column-major
    C^T = B^T A^T, so B comes first: its operation and leading dimension, then A's. The
    element-wise epilogue and its aux matrix ([m, n], laid out as D) are unaffected by the swap.

    `c` is the image's pointer cuBLASLt reads as C (scaled by beta): the output itself (C = D,
    an accumulation, or not read at all when beta is 0), or a distinct matrix (the residual:
    D = C + A B with no copy before, and C == D, in place, works as well). `epilogue` is
    cuBLASLt's CUBLASLT_EPILOGUE_ name; `aux` is the image's pointer the epilogue writes
    (GELU_AUX: the pre-activation) or reads (DGELU), with leading dimension n."""

    op_b: str  # N or T
    op_a: str
    ld_b: str  # m, n or k
    ld_a: str
    low_output: bool
    beta: float
    epilogue: str = "DEFAULT"
    c: str = "output"
    aux: str | None = None


# The one table both the emitted host program and the CuPy backend call cuBLASLt from.
CUBLAS_PRODUCTS = {
    "cgImageProductData": CublasProduct("N", "N", "n", "k", False, 0.0),
    "cgImageProductDataLow": CublasProduct("N", "N", "n", "k", True, 0.0),
    "cgImageProductGelu": CublasProduct("N", "N", "n", "k", True, 0.0, "GELU_AUX", aux="pre"),
    "cgImageProductTransposed": CublasProduct("T", "N", "k", "k", False, 0.0),
    "cgImageProductTransposedLow": CublasProduct("T", "N", "k", "k", True, 0.0),
    "cgImageProductTransposedGeluBackward": CublasProduct("T", "N", "k", "k", True, 0.0, "DGELU",
                                                          aux="pre"),
    "cgImageProductResidual": CublasProduct("N", "N", "n", "k", False, 1.0, c="residual"),
    "cgImageProductWeight": CublasProduct("N", "T", "n", "m", False, 1.0),
    "cgImageProductWeightSet": CublasProduct("N", "T", "n", "m", False, 0.0),
}

# cuBLASLt's workspace: one allocation of the program, shared by every product (they run one
# at a time on the one stream). 32 MiB is what NVIDIA's cuBLAS documentation recommends for
# Hopper; the heuristic is told this much and picks no algorithm that needs more.
CUBLASLT_WORKSPACE_BYTES = 32 * 1024 * 1024


# The choice of algorithm, as both GPU backends make it (the emitted cg_choose_algorithm, the CuPy
# run's _choose_algorithm): of the heuristic's first ALGORITHMS_OFFERED, those that make one
# pass over k and give the first's bits on the shape's first operands are each timed over
# ALGORITHM_TRIAL_RUNS runs, and the fastest kept. A product whose output is larger than
# ALGORITHM_TRIAL_BYTES keeps the first (its trial copies would cost more memory than the choice
# is worth; the heuristic's first is the one tuned for large shapes).
ALGORITHMS_OFFERED = 4
ALGORITHM_TRIAL_BYTES = 64 << 20
ALGORITHM_TRIAL_RUNS = 5


def workspace_beside_plan(program: Program) -> tuple[int, str]:
    """What a program's run allocates beside its memory plan: cuBLASLt's workspace, one a
    compute stream (the emitted program's cg_lt_workspace, the CuPy run's lt_workspace)."""
    compute, _ = stream_count(program)
    return (CUBLASLT_WORKSPACE_BYTES * compute,
            f"cuBLASLt's workspace ({CUBLASLT_WORKSPACE_BYTES >> 20} MiB for each of {compute} "
            f"stream{'s' if compute > 1 else ''})")

# cuBLASLt's aux matrix (the GELU input) must have a leading dimension divisible by 8
# (cublasLt.h, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD); ours is n.
CUBLASLT_AUX_LD_MULTIPLE = 8


@dataclass(frozen=True)
class NcclCall:
    """How a collective image maps onto NCCL: the function, its reduction operator (None for
    the all-gather, which copies), and which of its buffers is this rank's shard of the
    image's one buffer (None: both are the whole buffer). In place, as NCCL defines it: a
    reduce-scatter's receive buffer is the send buffer's shard (recvbuff == sendbuff +
    rank * recvcount), an all-gather's send buffer the receive buffer's (sendbuff == recvbuff
    + rank * sendcount), the shard count / ranks elements."""

    function: str
    operator: str | None
    shard: str | None = None  # "receive" (reduce-scatter), "send" (all-gather)


# The one table both the emitted host program and the CuPy backend call NCCL from, by the
# image's (collective OPERATION REDUCTION); and NCCL's name for each element a collective
# carries (every element the language lets a collective carry: tests/test_parallel.py).
NCCL_CALLS = {
    ("allReduce", "average"): NcclCall("ncclAllReduce", "ncclAvg"),
    ("allReduce", "sum"): NcclCall("ncclAllReduce", "ncclSum"),
    ("reduceScatter", "average"): NcclCall("ncclReduceScatter", "ncclAvg", shard="receive"),
    ("allGather", None): NcclCall("ncclAllGather", None, shard="send"),
}
NCCL_TYPES = {"float32": "ncclFloat32"}


def shards(program: Program) -> bool:
    """Whether the program launches a collective that takes this rank's shard of its buffer
    (a reduce-scatter, an all-gather): it runs only as the rank it was compiled for."""
    return any(launch.image.collective is not None
               and launch.image.collective[0] in SHARDED_COLLECTIVES
               for launch, _, _ in program.launches())


def rank_mismatch(program: Program, rank: int, size: int) -> str | None:
    """Why the program may not run as rank `rank` of `size` (None where it may): one that
    shards was compiled for one rank of one number of ranks."""
    if not shards(program) or (rank, size) == (program.rank, program.ranks):
        return None
    return (f"this program was compiled for rank {program.rank} of {program.ranks} ranks, but "
            f"runs as rank {rank} of {size}: its reduce-scatters and all-gathers would take "
            "another rank's shard (each rank runs its own program: cgc compile --rank R "
            "--ranks N)")


def template_name(image: str) -> str:
    """cgImageLayerNormBackwardAdd -> layer_norm_backward_add."""
    stem = image.removeprefix("cgImage")
    return re.sub(r"(?<!^)(?=[A-Z])", "_", stem).lower()


# Elements of padding after each row of the attention kernels' shared tiles (16 bytes in
# bfloat16): rows of a head then start 4 banks apart, so that the 8 rows an ldmatrix reads at
# once fall on 8 different groups of 4 banks. The kernel reads it as kAttentionRowPadding.
ATTENTION_ROW_PADDING = 8

# The most dynamic shared memory a block may opt into on sm_90 (H100, H200): 227 KiB.
MAX_DYNAMIC_SHARED_BYTES = 227 * 1024


@dataclass(frozen=True)
class SharedMemory:
    """An image's dynamic shared memory: the kernel constants it is sized from, its bytes
    (from those constants by C name and the low type's bytes), and what it holds, for the
    diagnostic of a size past MAX_DYNAMIC_SHARED_BYTES."""
    constants: tuple[str, ...]
    size: object
    holds: str


def _tiles(count: int):
    return lambda c, low_bytes: \
        count * c["kAttentionTile"] * (c["kHeadWidth"] + ATTENTION_ROW_PADDING) * low_bytes


# The Hopper attention's tiles are unpadded (TMA writes them swizzled) and start on the
# 128-byte swizzle's 1024-byte repeat, which dynamic shared memory need not start on: 1024
# bytes more let the kernel round its first tile up.
SWIZZLE_REPEAT_BYTES = 1024


def _attention_shared(c, low_bytes: int) -> int:
    if c.get("kAttentionHopper"):  # a query tile, two stages of key and value tiles
        return 5 * c["kAttentionTile"] * c["kHeadWidth"] * low_bytes + SWIZZLE_REPEAT_BYTES
    return _tiles(5)(c, low_bytes)


SHARED_MEMORY = {
    # the query tile and two stages of key and value tiles (padded rows of low_t; unpadded
    # and swizzled in the Hopper kernel)
    "cgImageAttention": SharedMemory(
        ("kAttentionTile", "kHeadWidth"), _attention_shared,
        "the kernel holds a query tile and two stages of key and value tiles of "
        "{kAttentionTile} rows of {kHeadWidth}"),
    # the two tiles a block holds (k and v, then q and dO), two stages of the two it
    # streams (q and dO, then k and v) and, with each stage, its query rows' lse and delta
    "cgImageAttentionBackward": SharedMemory(
        ("kAttentionTile", "kHeadWidth"),
        lambda c, low_bytes: _tiles(6)(c, low_bytes) + 2 * 2 * c["kAttentionTile"] * 4,
        "the kernel holds six tiles of {kAttentionTile} rows of {kHeadWidth} and two "
        "stages of {kAttentionTile} rows' lse and delta"),
    "cgImageClassifier": SharedMemory(
        ("kVocab",), lambda c, low_bytes: c["kVocab"] * low_bytes,
        "the classifier holds its whole row of {kVocab} logits on chip, in the low type; a "
        "larger vocabulary needs another classifier image"),
}


def shared_memory_bytes(image, constants: dict[str, int], low: str) -> int:
    """Dynamic shared memory of a kernel image (`image`: its declaration; SHARED_MEMORY),
    0 for the images without. `constants` are the kernel constants by C name."""
    shared = SHARED_MEMORY.get(image.name)
    return shared.size(constants, element_bytes("low", low)) if shared else 0


def _environment(kernel_folders: tuple[str, ...] = ()) -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader([str(data_dir("templates")), *kernel_folders]),
        bytecode_cache=_bytecode_cache(),
        undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True,
        keep_trailing_newline=True, autoescape=False)


def _float(value: float) -> str:
    """A float32 literal that reads back to the same float32."""
    text = repr(float(value))
    if "e" not in text and "." not in text and "inf" not in text:
        text += ".0"
    return text + "f"


def _bytecode_cache():
    """Jinja's compiled templates, kept between processes (keyed by each template's path and
    checksum); none where no cache folder can be written."""
    base = cache_dir()
    if base is None:
        return None
    folder = base / "jinja"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return _BoundedBytecodeCache(str(folder))


class _BoundedBytecodeCache(jinja2.FileSystemBytecodeCache):
    """Jinja's file cache, reading only a regular file of a sane size (Jinja's own opens
    whatever has the name: a FIFO there would hang every compile, /dev/zero be read whole);
    anything else, or a damaged entry, is a miss and the template is compiled again."""

    LIMIT = 16 * 1024 * 1024  # an entry takes some 30 KB

    def load_bytecode(self, bucket) -> None:
        import io
        try:
            data = read_regular(self._get_cache_filename(bucket), self.LIMIT)
            if data is not None:
                bucket.load_bytecode(io.BytesIO(data))
                return
        except Exception:  # noqa: BLE001 (an unreadable or damaged cache entry: rebuild)
            pass
        bucket.reset()


@dataclass(frozen=True)
class TensorMap:
    """A 2D tensor map a launch passes by value (after the pointers and scalars): of the
    image's pointer `pointer`, a row-major matrix of low_t `width` elements wide, its rows
    the pointer's elements over `width`, copied in boxes of box_width x box_rows with the
    swizzle of `swizzle` bytes (TMA: cp.async.bulk.tensor)."""
    pointer: int
    width: int
    box_width: int
    box_rows: int
    swizzle: int


@dataclass(frozen=True)
class KernelVariant:
    """A second kernel of an image, selected by a kernel constant set to 1 in the
    configuration: its template stem, the architecture it needs, its tensor map (from the
    kernel constants by C name), and what the configuration must be for it (from the
    constants and the low type: a message each, empty when it holds)."""
    constant: str
    template: str
    architecture: str
    tensor_map: object
    requires: object


def _attention_hopper_requires(c, low: str) -> list[str]:
    found = []
    if low != "bfloat16":
        found.append(f"it multiplies bfloat16 on wgmma, and this configuration's low type is "
                     f"{low}")
    if c["kHeadWidth"] not in (16, 32, 64):
        found.append(f"its tiles are one swizzled row a head (32, 64 or 128 bytes: heads of 16, "
                     f"32 or 64), and the heads here are {c['kHeadWidth']} wide")
    return found


KERNEL_VARIANTS = {
    # the attention forward on wgmma, TMA and mbarrier (attention_hopper.cu.j2): one map of
    # the qkv rows, a box a head wide and a tile deep, swizzled by the head's row of bytes
    "cgImageAttention": KernelVariant(
        "kAttentionHopper", "attention_hopper", "sm_90a",
        lambda c: TensorMap(2, (c["kHeads"] + 2 * c["kKvHeads"]) * c["kHeadWidth"],
                            c["kHeadWidth"], c["kAttentionTile"], 2 * c["kHeadWidth"]),
        _attention_hopper_requires),
}


def kernel_variant(image: str, constants: dict[str, int]) -> KernelVariant | None:
    """The variant of `image`'s kernel the constants select, or None (its own template)."""
    variant = KERNEL_VARIANTS.get(image)
    return variant if variant is not None and constants.get(variant.constant) == 1 else None


def launch_tensor_map(image, constants: dict[str, int], bound) -> tuple[TensorMap, int] | None:
    """The tensor map a launch of `image` passes (its variant's), with its rows (the
    elements its pointer binds over the map's width); None where it passes none."""
    variant = kernel_variant(image.name, constants)
    if variant is None or variant.tensor_map is None:
        return None
    tensor_map = variant.tensor_map(constants)
    pointer = next(p for p in bound.pointers if p.parameter.index == tensor_map.pointer)
    return tensor_map, int(pointer.view.count) // tensor_map.width


def architecture(program: Program) -> str:
    """What the program's kernels compile for: sm_90, or sm_90a where a variant needs
    Hopper's own instructions."""
    constants = dict(program.kernel_constants())
    for launch, _, _ in program.launches():
        variant = kernel_variant(launch.image.name, constants)
        if variant is not None:
            return variant.architecture
    return "sm_90"


def template_path(image: str) -> str:
    return f"kernels/{template_name(image)}.cu.j2"


def template_file(program: Program, image: str) -> tuple[str, Path] | None:
    """An image's kernel template, as the Jinja loader names it and as a file: the variant
    the configuration selects (KERNEL_VARIANTS), else cgc's own
    (templates/kernels/SNAKE_NAME.cu.j2), else the first folder of the user's kernels that
    holds SNAKE_NAME.cu.j2 (`--kernels DIR`); None where there is none."""
    variant = kernel_variant(image, dict(program.kernel_constants()))
    if variant is not None:
        name = f"kernels/{variant.template}.cu.j2"
        return name, data_dir("templates") / name
    builtin = data_dir("templates") / template_path(image)
    if builtin.is_file():
        return template_path(image), builtin
    for folder in program.kernel_folders:
        path = Path(folder) / f"{template_name(image)}.cu.j2"
        if path.is_file():
            return path.name, path
    return None


_CONSTANT = re.compile(r"\b(" + "|".join(KERNEL_CONSTANTS) + r")\b")


def _aux_problems(program: Program) -> list[Diagnostic]:
    """A product with an epilogue's aux matrix needs n (its leading dimension) divisible by
    CUBLASLT_AUX_LD_MULTIPLE, or cuBLASLt refuses it at run time: said here, at the launch."""
    found = []
    for launch, _, _ in program.launches():
        product = CUBLAS_PRODUCTS.get(launch.image.name)
        if product is None or product.aux is None:
            continue
        for scalar in launch.arguments().scalars:
            value = scalar.value
            if scalar.parameter.name == "n" and isinstance(value, int) \
                    and value % CUBLASLT_AUX_LD_MULTIPLE:
                found.append(Diagnostic(
                    "error", f"image '{launch.image.name}' is launched with n = {value}, but "
                    f"cuBLASLt's {product.epilogue} epilogue needs the leading dimension of its "
                    f"aux matrix ({product.aux}, n) divisible by {CUBLASLT_AUX_LD_MULTIPLE}",
                    launch.span))
    return found


def _set_flags(program: Program) -> str:
    """The program's --set values as the command line gives them (" --set NAME=VALUE" each)."""
    return "".join(f" --set {name}={value!r}" for name, value in program.overrides)


def _configuration(program: Program) -> str:
    """The configuration as the front end's notes name it: its name and its --set values."""
    sets = _set_flags(program)
    return f"in config '{program.config}'" + (f" with{sets}" if sets else "")


def image_problems(program: Program) -> list[Diagnostic]:
    """What the CUDA backend lacks for the images the program launches, as errors at each
    image's declaration: a kernel without its template, a template or a shared-memory size
    that needs a model constant no role gives, a library image cuBLAS cannot run."""
    found = []
    constants = dict(program.kernel_constants())
    given = set(constants)
    used = sorted({launch.image.name: launch.image for launch, _, _ in program.launches()}.items())
    found += _aux_problems(program)
    for name, image in used:
        if image.collective is not None:
            continue  # each (collective ...) the language accepts has a line in NCCL_CALLS
        if image.library is not None:
            if name not in CUBLAS_PRODUCTS:
                found.append(Diagnostic("error", f"image '{name}' is a (library cublas) image, "
                                        "but the CUDA backend has no product of that name "
                                        f"(it has: {', '.join(CUBLAS_PRODUCTS)})", image.span))
            continue
        found_template = template_file(program, name)
        if found_template is None:
            places = [f"templates/{template_path(name)}"] + \
                [str(Path(folder) / f"{template_name(name)}.cu.j2")
                 for folder in program.kernel_folders]
            found.append(Diagnostic(
                "error", f"image '{name}' has no kernel template: the CUDA backend looks for "
                + " and ".join(places), image.span,
                (Note("every kernel image needs a template named after it, and a reference "
                      "function of the same name for the numpy backend; your own go in a "
                      "folder given with --kernels DIR (docs/tutorial.md)"),)))
            continue
        path = found_template[1]
        if str(path.parent) in program.kernel_folders:  # the user's own: does it render?
            problem = _template_problem(program, image, *found_template)
            if problem is not None:
                found.append(problem)
                continue
        needed = set(_CONSTANT.findall(path.read_text(encoding="utf-8")))
        shared = SHARED_MEMORY.get(name)
        needed |= set(shared.constants if shared else ())
        variant = kernel_variant(name, constants)
        if variant is not None:
            for problem in variant.requires(constants, program.low):
                role = KERNEL_CONSTANTS[variant.constant]
                found.append(Diagnostic(
                    "error", f"the configuration selects image '{name}''s "
                    f"{variant.template} kernel (role '{role}' is 1), but {problem}",
                    image.span, (Note(f"the image's own kernel runs any of them: set the "
                                      f"constant of role '{role}' to 0"),
                                 Note(_configuration(program)))))
        for constant in sorted(needed - given):
            role = KERNEL_CONSTANTS[constant]
            found.append(Diagnostic(
                "error", f"the kernel of image '{name}' uses {constant}, but no `roles` "
                f"declaration gives the role '{role}'", image.span,
                (Note(f"add ({role} NAME) to the model's roles declaration"),)))
        if shared and needed <= given:
            size = shared_memory_bytes(image, constants, program.low)
            if size > MAX_DYNAMIC_SHARED_BYTES:
                found.append(Diagnostic(
                    "error", f"the kernel of image '{name}' needs {size:,} bytes of dynamic "
                    f"shared memory a block at this configuration, more than the "
                    f"{MAX_DYNAMIC_SHARED_BYTES:,} (227 KiB) a block may have on sm_90",
                    image.span, (Note(shared.holds.format(**constants)),)))
    return found


def _render(environment: jinja2.Environment, template: str, image, low: str) -> str:
    """An image's kernel from its template: its name, C parameters and thread count."""
    block = image.block
    return environment.get_template(template).render(
        name=image.name, parameters=", ".join(c_parameters(image, low)),
        threads=block[0] * block[1] * block[2])


def _template_problem(program: Program, image, template: str, path: Path) -> Diagnostic | None:
    """An error at the line of a user's template that Jinja cannot parse or render (a
    syntax error, a name cgc does not give it), or cannot read as UTF-8 text, with the image
    it is for."""
    from ...core.source import Source, Span
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeError) as error:
        return Diagnostic("error", f"cannot read the kernel template {path} of image "
                                   f"'{image.name}': {getattr(error, 'strerror', None) or error}",
                          image.span)
    try:
        _render(_environment(program.kernel_folders), template, image, program.low)
        return None
    except jinja2.TemplateError as error:
        source = Source(str(path), text)
        line = getattr(error, "lineno", None) or 1
        start = source.line_starts[min(line, len(source.line_starts)) - 1]
        return Diagnostic("error", f"the kernel template of image '{image.name}' does not "
                                   f"render: {error.message or error}", Span(source, start, start + 1),
                          (Note("a template gets {{ name }}, {{ parameters }} and "
                                "{{ threads }} (docs/tutorial.md)", image.span),))


@dataclass
class Kernel:
    image: str
    summary: str
    code: str
    shared_bytes: int
    template: str  # as the Jinja loader names it
    template_file: str = ""  # the file itself (cgc's, or one of the user's kernels)


class Emitter:
    def __init__(self, program: Program, plan: MemoryPlan):
        self.program, self.plan = program, plan
        self.low = program.low
        self.environment = _environment(program.kernel_folders)
        self.root = os.path.dirname(program.source)
        self.phase_count = 0
        self.phases: list[dict] = []
        self.constants = dict(program.kernel_constants())
        # Streams: 0 is the step's own (cg_step's argument), then the side streams of
        # concurrent branches, then the communicator's, where a branch of collectives has one.
        self.compute_streams, communicator = stream_count(program)
        self.communicator_stream = self.compute_streams if communicator else None
        self.event_count = 0

    # ---- names -------------------------------------------------------------------

    @staticmethod
    def pointer_name(view: View) -> str:
        storage = view.storage
        if storage.kind == "bank":
            return f"{storage.name}_{storage.entry}" if storage.entry else storage.name + "_all"
        return storage.name

    def where(self, launch: Launch) -> str:
        """The launch's source line, and the outermost call that led there."""
        def at(span):
            return f"{os.path.relpath(span.path, self.root)}:{span.line}:{span.column}"
        if launch.trace and launch.trace[0] is not launch.span:
            return f"{at(launch.span)} (from {at(launch.trace[0])})"
        return at(launch.span)

    # ---- memory ------------------------------------------------------------------

    def allocations(self) -> list[dict]:
        found = []
        for bank, (role, element, size, entries) in self.plan.banks.items():
            found.append({"name": f"cg_bank_{bank}", "bytes": size,
                          "comment": f"bank {bank} ({role}, {element}), {len(entries)} entries"})
        found.append({"name": "cg_buffers", "bytes": max(self.plan.buffers_bytes, 256),
                      "comment": f"{len(self.plan.buffers)} step buffers"})
        found.append({"name": "cg_arena", "bytes": max(self.plan.arena_bytes, 256),
                      "comment": f"{len(self.plan.arena)} arena slots, shared where never "
                                 "live together"})
        if self.products():
            found.append({"name": "cg_lt_workspace",
                          "bytes": CUBLASLT_WORKSPACE_BYTES * self.compute_streams,
                          "comment": "cuBLASLt's workspace, 32 MiB (what NVIDIA recommends "
                                     "for Hopper)" + (
                                         f" for each of {self.compute_streams} streams: "
                                         "products on two streams never share one"
                                         if self.compute_streams > 1 else
                                         ", for every product")})
        return found

    def buffers(self) -> list[dict]:
        """A named pointer for every step buffer and arena slot, for every entry of the
        banks the standalone program loads (parameters, copies), and for the other entries
        (and whole banks) that some launch binds: an unused name is a compiler warning."""
        bound = {(binding.view.storage.name, binding.view.storage.entry)
                 for launch, _, _ in self.program.launches() for binding in launch.pointers}
        loaded = set(self.program.bank_of_role("parameters") + self.program.bank_of_role("copies"))
        found = []
        for bank, (role, element, size, entries) in self.plan.banks.items():
            ctype = c_type(element, self.low)
            for entry in entries:
                if bank not in loaded and (bank, entry.name) not in bound:
                    continue
                storage = self.program.storages[f"{bank}.{entry.name}"]
                items = f" x {storage.stack} items" if storage.stack else ""
                found.append({"name": f"{bank}_{entry.name}", "c_type": ctype,
                              "allocation": f"cg_bank_{bank}", "offset": entry.offset,
                              "shape": f"{element}[{entry.count}]{items}: {bank}.{entry.name}"})
            if (bank, None) in bound:  # the whole bank, as cgBankAll or cgEntries binds it
                found.append({"name": f"{bank}_all", "c_type": ctype,
                              "allocation": f"cg_bank_{bank}", "offset": 0,
                              "shape": f"{element}[{size // element_bytes(element, self.low)}]: "
                                       f"the whole of {bank}"})
        for buffer in self.plan.buffers:
            storage = self.program.storages[buffer.name]
            items = f" x {storage.stack} items" if storage.stack else ""
            found.append({"name": buffer.name, "c_type": c_type(buffer.element, self.low),
                          "allocation": "cg_buffers", "offset": buffer.offset,
                          "shape": f"{buffer.element}[{storage.item_count}]{items}: step buffer"})
        for slot in self.plan.arena:
            found.append({"name": slot.name, "c_type": c_type(slot.element, self.low),
                          "allocation": "cg_arena", "offset": slot.offset,
                          "shape": f"{slot.element}[{slot.count}]: arena slot"})
        return found

    def regions(self) -> list[dict]:
        """Each step buffer and arena slot with its size in bytes: what a sanitizer build
        leaves unpoisoned in the allocation they share."""
        return [{"name": placed.name, "bytes": placed.bytes}
                for placed in (*self.plan.buffers, *self.plan.arena)]

    # ---- kernels -----------------------------------------------------------------

    def kernels(self) -> list[Kernel]:
        used = sorted({launch.image.name for launch, _, _ in self.program.launches()})
        found = []
        for name in used:
            image = self.program.images[name]
            if image.library is not None:
                continue
            template, file = template_file(self.program, name)  # image_problems: it has one
            code = _render(self.environment, template, image, self.low)
            summary = (image.doc or name).replace("\n", " ")
            found.append(Kernel(name, summary, code.rstrip("\n"),
                                shared_memory_bytes(image, self.constants, self.low),
                                template, str(file)))
        return found

    # ---- the schedule ------------------------------------------------------------

    def launch_lines(self, launch: Launch) -> list[str]:
        image = launch.image
        where = f"{self.where(launch)} {image.name}"
        bound = launch.arguments()
        arguments = []
        for pointer in bound.pointers:
            view = pointer.view
            name = self.pointer_name(view)
            if view.item is not None:  # item i of a stack: i items of `count` elements in
                arguments.append(f"{name} + {view.count}L * ({format_nat(view.item)})")
            elif view.offset != 0:
                arguments.append(f"{name} + ({format_nat(view.offset)})")
            else:
                arguments.append(name)
        for scalar in bound.scalars:
            value = scalar.value
            arguments.append(_float(value) if scalar.parameter.type == "float32"
                             else format_nat(value))
        comment = f"// {where}"
        if image.library is not None:
            call = f"{image.name}(stream, \"{where}\", {', '.join(arguments)});"
            return [comment, call]
        variant = kernel_variant(image.name, self.constants)
        if variant is not None:
            arguments.append(self.tensor_map_argument(variant.tensor_map(self.constants),
                                                      bound, arguments))
        grid = ", ".join(format_nat(g) for g in bound.grid)
        block = ", ".join(str(b) for b in image.block)
        shared = shared_memory_bytes(image, self.constants, self.low)
        call = (f"CG_LAUNCH({image.name}, dim3({grid}), dim3({block}), {shared}, stream)"
                f"({', '.join(arguments)});")
        return [comment, call, f"CG_LAUNCHED(\"{where}\");"]

    @staticmethod
    def tensor_map_argument(tensor_map: TensorMap, bound, arguments: list[str]) -> str:
        """The call that makes a launch's tensor map, on the host, from its pointer's
        argument: its rows are the elements the pointer binds over the map's width."""
        index = [p.parameter.index for p in bound.pointers].index(tensor_map.pointer)
        count = bound.pointers[index].view.count
        return (f"cg_tensor_map_2d({arguments[index]}, {tensor_map.width}, "
                f"({format_nat(count)}) / {tensor_map.width}, {tensor_map.box_width}, "
                f"{tensor_map.box_rows}, {tensor_map.swizzle})")

    def stream_name(self, stream: int) -> str:
        return f"cg_streams[{self.communicator_stream if stream == COMMUNICATOR else stream}]"

    def concurrent_lines(self, node: Concurrent, loops: list[str], indent: str,
                         stream: int, busy: frozenset[int]) -> list[str]:
        """Each branch on its stream: a side stream waits for what its parent's did so far
        (fork), and the parent waits for every side stream before going on (join)."""
        branches, inner = on_streams(node, stream, busy)
        where = f"{os.path.relpath(node.span.path, self.root)}:{node.span.line}:" \
                f"{node.span.column}"
        side = [s for _, s in branches if s != stream]
        fork = self.event_count
        self.event_count += 1
        lines = [f"// concurrently, {where}: {len(branches)} branches"]
        lines += [f"cg_fork(stream, {self.stream_name(s)}, cg_events[{fork}], \"{where}\");"
                  for s in side]
        for number, (branch, branch_stream) in enumerate(branches):
            on = "this stream" if branch_stream == stream else (
                "the communicator's stream" if branch_stream == COMMUNICATOR
                else f"stream {branch_stream}")
            lines.append(f"{{  // branch {number}, on {on}")
            if branch_stream != stream:
                lines.append(f"  cudaStream_t stream = {self.stream_name(branch_stream)};")
            lines += self.schedule(branch, loops, "  ", branch_stream, inner)
            lines.append("}")
        for s in side:
            lines.append(f"cg_join(stream, {self.stream_name(s)}, cg_events[{self.event_count}], "
                         f"\"{where}\");")
            self.event_count += 1
        return [indent + line for line in lines]

    def schedule(self, nodes, loops: list[str], indent: str, stream: int = 0,
                 busy: frozenset[int] = frozenset({0})) -> list[str]:
        lines = []
        for node in nodes:
            if isinstance(node, Launch):
                lines.extend(indent + line for line in self.launch_lines(node))
            elif isinstance(node, Repeat):
                variable = node.variable.name
                lines.append(f"{indent}for (int {variable} = 0; {variable} < "
                             f"{node.variable.count}; ++{variable}) {{")
                lines.extend(self.schedule(node.body, loops + [variable], indent + "  ",
                                           stream, busy))
                lines.append(f"{indent}}}")
            elif isinstance(node, Concurrent):
                lines.extend(self.concurrent_lines(node, loops, indent, stream, busy))
            else:
                assert isinstance(node, PhaseRegion)
                function = f"cg_phase_{self.phase_count}_{node.phase}"
                self.phase_count += 1
                body = self.schedule(node.body, loops, "", stream, busy)
                self.phases.append({
                    "function": function,
                    "comment": f"phase {node.phase}"
                               + (f", inside the repeat of {', '.join(loops)}" if loops else ""),
                    "parameters": "".join(f", int {loop}" for loop in loops),
                    "lines": body})
                lines.append(f"{indent}{function}(stream{''.join(', ' + v for v in loops)});")
        return lines

    def main(self) -> str:
        """The standalone program's main, for a schedule that declares what a training step
        needs (its ids, targets and loss buffers) and has a parameter bank."""
        program = self.program
        parameter_banks = program.bank_of_role("parameters")
        if not all(role in program.roles for role in TRAINING_ROLES) or not parameter_banks:
            return ""
        template = self.environment.get_template("main.cu.j2")
        parameter_bank = parameter_banks[0]
        copies = program.bank_of_role("copies")
        entries = []
        for entry in program.entries:
            storage = program.storages[f"{parameter_bank}.{entry.name}"]
            copy = [f"{bank}_{entry.name}" for bank in copies
                    if f"{bank}.{entry.name}" in program.storages]
            entries.append({"name": entry.name, "count": storage.count,
                            "parameter": f"{parameter_bank}_{entry.name}",
                            "half_copy": copy[0] if copy else "nullptr"})
        names = {role: program.storages[program.roles[role]].name
                 for role in ("ids", "targets", "loss")}
        # the buffer the learning rate is copied into before each step, where there is one
        learning_rates = [program.storages[program.roles["learningRate"]].name] \
            if "learningRate" in program.roles else []
        rows = program.storages[program.roles["ids"]].count
        collectives = self.collectives()
        return template.render(entries=entries, rows=rows, low=self.low, names=names,
                               collectives=bool(collectives), products=bool(self.products()),
                               sharded=any(c["shard"] is not None for c in collectives),
                               learning_rates=learning_rates)

    def products(self) -> list[dict]:
        """The host functions of the cuBLAS images the program uses, from CUBLAS_PRODUCTS:
        one cg_matmul call each (program.cu.j2)."""
        used = sorted({launch.image.name for launch, _, _ in self.program.launches()
                       if launch.image.library == "cublas"})
        found = []
        for name in used:
            image, product = self.program.images[name], CUBLAS_PRODUCTS[name]
            found.append({
                "image": name, "summary": (image.doc or name).replace("\n", " "),
                "parameters": ", ".join(c_parameters(image, self.low)),
                "op_b": product.op_b, "op_a": product.op_a, "ld_b": product.ld_b,
                "ld_a": product.ld_a, "beta": _float(product.beta), "c": product.c,
                "epilogue": product.epilogue, "aux": product.aux or "nullptr",
                "output_type": ("cg_low_type" if product.low_output
                                else ELEMENTS["float32"].cuda_data_type)})
        return found

    def collectives(self) -> list[dict]:
        """The host functions of the collective images the program uses: one NCCL call each
        on the run's communicator (cg_nccl), in place over the one buffer (a reduce-scatter
        or an all-gather with this rank's shard of it as the other buffer)."""
        used = sorted({launch.image.name for launch, _, _ in self.program.launches()
                       if launch.image.collective is not None})
        found = []
        for name in used:
            image = self.program.images[name]
            call = NCCL_CALLS[image.collective]
            (pointer,) = image.pointers.values()
            (count,) = image.scalars.values()
            found.append({
                "image": name, "summary": (image.doc or name).replace("\n", " "),
                "parameters": ", ".join(c_parameters(image, self.low)),
                "function": call.function, "operator": call.operator, "shard": call.shard,
                "data": pointer.name, "count": count.name,
                "type": NCCL_TYPES[pointer.element]})
        return found

    def render(self) -> str:
        common = self.environment.get_template("common.cuh.j2").render(
            low=self.low, low_c_type=ELEMENTS[self.low].c_type, config=self.program.config,
            constants=list(self.constants.items()), attention_row_padding=ATTENTION_ROW_PADDING)
        kernels = self.rendered_kernels = self.kernels()
        step_lines = self.schedule(self.program.body, [], "")
        collectives = self.collectives()
        source = os.path.basename(self.program.source)
        return self.environment.get_template("program.cu.j2").render(
            version=__version__, source=source, entry=self.program.entry,
            config=self.program.config,
            config_flag=f" --config {self.program.config}{_set_flags(self.program)}",
            low=self.low, common=common.rstrip("\n"), kernels=kernels,
            architecture=architecture(self.program),
            tensor_maps=any(getattr(kernel_variant(k.image, self.constants), "tensor_map", None)
                            for k in kernels),
            large_shared_memory=[k for k in kernels if k.shared_bytes > 48 * 1024],
            allocations=self.allocations(), buffers=self.buffers(), regions=self.regions(),
            buffers_bytes=max(self.plan.buffers_bytes, 256),
            arena_bytes=max(self.plan.arena_bytes, 256),
            low_cuda_type=ELEMENTS[self.low].cuda_data_type, phases=self.phases,
            products=self.products(), collectives=collectives,
            sharded=any(c["shard"] is not None for c in collectives),
            rank=self.program.rank, ranks=self.program.ranks,
            workspace_bytes=CUBLASLT_WORKSPACE_BYTES,
            algorithms_offered=ALGORITHMS_OFFERED, algorithm_trial_bytes=ALGORITHM_TRIAL_BYTES,
            algorithm_trial_runs=ALGORITHM_TRIAL_RUNS,
            streams=self.compute_streams + (self.communicator_stream is not None),
            compute_streams=self.compute_streams, communicator_stream=self.communicator_stream,
            events=self.event_count,
            step_lines=step_lines, main=self.main())


@dataclass
class Emitted:
    """The emitted text, and where each kernel's lines came from."""

    text: str
    kernels: list[Kernel]
    starts: dict[str, int]  # image -> the emitted line (1-based) of its template's line 1

    def origin(self, line: int) -> tuple[Kernel, int] | None:
        """The kernel whose template produced an emitted line, and the template's line."""
        for kernel in self.kernels:
            start = self.starts[kernel.image]
            if start <= line < start + kernel.code.count("\n") + 1:
                return kernel, line - start + 1
        return None


def emit_program(program: Program, plan: MemoryPlan) -> Emitted:
    emitter = Emitter(program, plan)
    text = emitter.render()
    lines = text.splitlines()
    starts = {}
    for kernel in emitter.rendered_kernels:
        marker = f"// {kernel.image}: "
        index = next(i for i, line in enumerate(lines) if line.startswith(marker))
        starts[kernel.image] = index + 2  # the line after the marker, 1-based
    return Emitted(text, emitter.rendered_kernels, starts)
