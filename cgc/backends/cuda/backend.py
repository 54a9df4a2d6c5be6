"""The CuPy backend: the emitted kernels on an NVIDIA GPU.

CuPy compiles the file `cgc compile` emits with NVRTC; the banks, the step buffers and the
arena are one allocation each, laid out by the memory plan; parameters start from the same
seeded generator as the NumPy backend, and tokens come from the same windows, so both
backends start from the same point. Each launch of the program becomes one prepared call
(a kernel launch, or a cuBLAS product); after a first, eager step the whole step is
captured as a CUDA graph and replayed.

Not yet run on a GPU in this repository's history: see docs/benchmarks.md for what has
been verified where.
"""

from __future__ import annotations

import numpy as np

from ...core.affine import Affine
from .emit import CUBLAS_PRODUCTS, emit_program
from ...frontend.evaluate import Int
from ...frontend.api import Frontend
from ...checking.memory import element_bytes, storage_home
from ..numerics import decode, encode, storage_dtype
from ..base import Run, initial_parameters
from .toolchain import include_flags


def gpu_available() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, or no device: all mean "no GPU here"
        return False


def _value(value, point):
    if isinstance(value, Affine):
        return value.at(point)
    return int(value) if isinstance(value, Int) else value


class CupyRun(Run):
    def __init__(self, frontend: Frontend, path: str, config: str | None, overrides: dict | None,
                 seed: int):
        import cupy
        from cupy_backends.cuda.libs import cublas
        self.cupy, self.cublas = cupy, cublas
        super().__init__(frontend, path, config, overrides)
        self.low = self.program.low
        self.emitted = emit_program(self.program, self.declarations, self.plan)
        self.module = cupy.RawModule(code=self.emitted.text, backend="nvrtc",
                                     options=("-std=c++17", *include_flags()))
        self.kernels = {}
        for kernel in self.emitted.kernels:
            function = self.module.get_function(kernel.image)
            if kernel.shared_bytes > 48 * 1024:
                function.max_dynamic_shared_size_bytes = kernel.shared_bytes
            self.kernels[kernel.image] = (function, kernel.shared_bytes)
        self.memory = {bank: cupy.zeros(size, dtype=cupy.uint8)
                       for bank, (_, _, size, _) in self.plan.banks.items()}
        self.memory["buffers"] = cupy.zeros(max(self.plan.buffers_bytes, 256), dtype=cupy.uint8)
        self.memory["arena"] = cupy.zeros(max(self.plan.arena_bytes, 256), dtype=cupy.uint8)
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.handle = cupy.cuda.device.get_cublas_handle()
        self.load_parameters(initial_parameters(self.program, self.declarations, seed))
        self.stream.synchronize()
        self.calls = [self._prepare(launch, point) for launch, _, point in self.program.unrolled()]
        self.graph = None

    # ---- memory ------------------------------------------------------------------

    def address(self, storage, offset: int = 0) -> int:
        home, start = storage_home(self.program, self.plan, storage)
        return self.memory[home].data.ptr + start + offset * element_bytes(storage.element, self.low)

    def array(self, label: str):
        """A whole storage by label, as a CuPy array (bfloat16 as its uint16 patterns)."""
        storage = self.program.storages[label]
        dtype = np.dtype(storage_dtype(storage.element, self.low))
        home, start = storage_home(self.program, self.plan, storage)
        return self.memory[home][start:start + storage.count * dtype.itemsize].view(dtype)

    def store(self, label: str, values) -> None:
        storage = self.program.storages[label]
        host = encode(np.asarray(values).reshape(-1), storage.element, self.low)
        self.array(label).set(host, stream=self.stream)

    def fetch(self, label: str) -> np.ndarray:
        storage = self.program.storages[label]
        host = self.array(label).get(stream=self.stream)
        self.stream.synchronize()
        return decode(host, storage.element, self.low)

    # ---- launches ----------------------------------------------------------------

    def _prepare(self, launch, point):
        """One launch at one repeat index, as a call with every argument computed."""
        image = launch.image
        pointers = {b.index: b for b in launch.pointers}
        scalars = {b.index: b for b in launch.scalars}
        arguments = []
        for index in sorted(image.pointers):
            view = pointers[index].view
            arguments.append(np.uint64(self.address(view.storage, _value(view.offset, point))))
        values = {}
        for index in sorted(image.scalars):
            parameter = image.scalars[index]
            value = _value(scalars[index].value, point) if index in scalars else \
                self.program.evaluator.eval(parameter.default, {}, ())
            value = np.float32(value) if parameter.type == "float32" else np.int32(int(value))
            values[parameter.name] = value
            arguments.append(value)
        if image.library is not None:
            return self._product(image.name, arguments, values)
        function, shared = self.kernels[image.name]
        grid = tuple(int(_value(g, point)) for g in launch.grid)
        block = self.program.blocks[image.name]
        stream = self.stream

        def call():
            function(grid, block, tuple(arguments), shared_mem=shared, stream=stream)

        call.image = image.name
        return call

    def _product(self, name: str, arguments, values):
        cublas, stream = self.cublas, self.stream
        product = CUBLAS_PRODUCTS[name]
        op_b, op_a, ld_b, ld_a = product.op_b, product.op_a, product.ld_b, product.ld_a
        low_output, beta = product.low_output, product.beta
        m, n, k = (int(values[x]) for x in ("m", "n", "k"))
        sizes = {"m": m, "n": n, "k": k}
        low_type = 14 if self.low == "bfloat16" else 0  # CUDA_R_16BF, CUDA_R_32F
        output_type = low_type if low_output else 0
        operations = {"N": cublas.CUBLAS_OP_N, "T": cublas.CUBLAS_OP_T}
        output, a, b = (int(x) for x in arguments[:3])
        residual = int(arguments[3]) if product.copies_residual else None
        alpha, beta_value = np.array(1.0, np.float32), np.array(beta, np.float32)
        handle, copy_bytes = self.handle, 4 * m * n
        runtime = self.cupy.cuda.runtime

        def call():
            cublas.setStream(handle, stream.ptr)
            if residual is not None and residual != output:
                runtime.memcpyAsync(output, residual, copy_bytes,
                                    runtime.memcpyDeviceToDevice, stream.ptr)
            cublas.gemmEx(handle, operations[op_b], operations[op_a], n, m, k,
                          alpha.ctypes.data, b, low_type, sizes[ld_b], a, low_type, sizes[ld_a],
                          beta_value.ctypes.data, output, output_type, n,
                          cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT)

        call.image = name
        return call

    # ---- steps -------------------------------------------------------------------

    def eager(self) -> None:
        with self.stream:
            for call in self.calls:
                call()

    def capture(self) -> None:
        """Records the whole step as one CUDA graph."""
        self.stream.begin_capture()
        try:
            for call in self.calls:
                call()
        finally:
            self.graph = self.stream.end_capture()

    def step(self, ids, targets, use_graph: bool = True) -> tuple[float, float]:
        """One step: (loss, seconds on the GPU)."""
        self.store("cgIds", ids)
        self.store("cgTargets", targets)
        start, end = self.cupy.cuda.Event(), self.cupy.cuda.Event()
        start.record(self.stream)
        if use_graph and self.graph is not None:
            self.graph.launch(self.stream)
        else:
            self.eager()
        end.record(self.stream)
        end.synchronize()
        seconds = self.cupy.cuda.get_elapsed_time(start, end) / 1000.0
        return self.mean_loss(), seconds

    def trace(self, ids, targets) -> tuple[float, list]:
        """One eager step timed launch by launch: (loss, (image, phase, start, end) seconds)."""
        self.store("cgIds", ids)
        self.store("cgTargets", targets)
        events = []
        origin = self.cupy.cuda.Event()
        origin.record(self.stream)
        with self.stream:
            for (launch, phase, _), call in zip(self.program.unrolled(), self.calls):
                before, after = self.cupy.cuda.Event(), self.cupy.cuda.Event()
                before.record(self.stream)
                call()
                after.record(self.stream)
                events.append((launch.image.name, phase, before, after))
        self.stream.synchronize()
        timings = [(name, phase, self.cupy.cuda.get_elapsed_time(origin, before) / 1000.0,
                    self.cupy.cuda.get_elapsed_time(origin, after) / 1000.0)
                   for name, phase, before, after in events]
        return self.mean_loss(), timings


def model_flops_per_token(constants: dict) -> float:
    """6 N for the products of the parameters, plus the attention's own (PaLM's count)."""
    width, layers = int(constants["cgWidth"]), int(constants["cgLayers"])
    vocab, context = int(constants["cgVocab"]), int(constants["cgContext"])
    parameters = vocab * width + layers * 12 * width * width
    return 6.0 * parameters + 12.0 * layers * width * context


def run_training(run: CupyRun, batches, steps: int, out, peak_flops: float = 790e12,
                 trace: list | None = None) -> list[tuple[float, float]]:
    """Steps with a progress line each: loss, tokens/s, MFU. A warm-up step runs eagerly
    (timed launch by launch into `trace` if given), then the step is captured as a graph
    and replayed."""
    tokens = int(run.program.constants["cgBatch"]) * int(run.program.constants["cgContext"])
    flops = model_flops_per_token(run.program.constants) * tokens
    results = []
    for step in range(1, steps + 1):
        ids, targets = batches.next()
        if step == 1 and trace is not None:
            loss, timings = run.trace(ids, targets)
            trace.extend(timings)
            seconds = timings[-1][3] - timings[0][2]
        else:
            loss, seconds = run.step(ids, targets, use_graph=step > 1)
        if step == 1:
            run.capture()
        results.append((loss, seconds))
        out.write(f"step {step:>{len(str(steps))}}/{steps} loss {loss:.4f}  "
                  f"{tokens / seconds:,.0f} tokens/s  MFU {100 * flops / seconds / peak_flops:.1f}%"
                  f"{'  (eager, before capture)' if step == 1 else ''}\n")
        out.flush()
    return results
