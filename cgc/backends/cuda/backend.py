"""The CuPy backend: the emitted kernels on an NVIDIA GPU.

CuPy compiles the file `cgc compile` emits with NVRTC; the banks, the step buffers and the
arena are one allocation each, laid out by the memory plan; parameters start from the same
seeded generator as the NumPy backend, and tokens come from the same windows, so both
backends start from the same point. Each launch of the program becomes one prepared call
(a kernel launch, or a cuBLASLt product); after a first, eager step the whole step is
captured as a CUDA graph and replayed.

docs/benchmarks.md says what has been verified on which machine.
"""

from __future__ import annotations

import os
import sys
import tempfile

import numpy as np

from ...checking.concurrency import scheduled, stream_count
from ...checking.memory import storage_home
from ...core.elements import ELEMENTS, element_bytes
from ..base import Run, RunFault, initial_parameters
from ..numerics import decode, encode, storage_dtype
from . import cublaslt
from . import tensor_map as tensor_maps
from .cublaslt import alignment
from .emit import (ALGORITHM_TRIAL_BYTES, ALGORITHM_TRIAL_RUNS, ALGORITHMS_OFFERED,
                   CUBLAS_PRODUCTS, CUBLASLT_WORKSPACE_BYTES, NCCL_CALLS, NCCL_TYPES,
                   emit_program, image_problems, launch_tensor_map, rank_mismatch,
                   workspace_beside_plan)
from .toolchain import ARCHITECTURE, architecture_of, include_flags, nvrtc_compile

# MFU is reported against the H200's dense bfloat16 tensor-core peak (NVIDIA's datasheet:
# 989 TFLOP/s without sparsity).
H200_PEAK_FLOPS = 989e12


def unavailable_reason() -> str | None:
    try:
        import cupy
    except ImportError:
        from ...resources import install_hint
        return (f"CuPy is not installed: {install_hint('cuda')} (it brings cupy-cuda13x and "
                "CUDA's own wheels)")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "CuPy finds no NVIDIA GPU here"
    except Exception as error:  # no driver, or no device: CuPy says which
        return f"CuPy finds no NVIDIA GPU here ({type(error).__name__}: {error})"
    try:
        cublaslt.load()
    except cublaslt.CublasLtError as error:
        return str(error)
    return None


def gpu_available() -> bool:
    return unavailable_reason() is None


def _cupy_nccl(nccl, name: str) -> int:
    """NCCL's constant (ncclFloat32, ncclAvg) as CuPy's binding names it (NCCL_FLOAT32)."""
    return getattr(nccl, "NCCL_" + name.removeprefix("nccl").upper())


class CupyRun(Run):
    name = "cupy"
    peak_flops = H200_PEAK_FLOPS

    def __init__(self, program, plan, seed: int):
        import cupy
        self.cupy = cupy
        self.cublaslt = cublaslt.load()  # a clear error where libcublasLt is missing
        super().__init__(program, plan, seed)
        self.low = self.program.low
        self.kernel_constants = dict(self.program.kernel_constants())
        self.emitted = emit_program(self.program, self.plan)
        self.module = self._module(cupy)
        self.encoder = tensor_maps.driver_encoder  # a launch's tensor map (emit.TensorMap)
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
        # The branches of concurrent regions on streams of their own (the step's is 0), as
        # the emitted host program puts them; capture makes them the graph's branches.
        compute, communicator = stream_count(self.program)
        self.streams = [self.stream] + [cupy.cuda.Stream(non_blocking=True)
                                        for _ in range(compute - 1 + communicator)]
        self.memory["lt_workspace"] = cupy.zeros(CUBLASLT_WORKSPACE_BYTES * compute,
                                                 dtype=cupy.uint8)
        self.lt_handle = self.cublaslt.create()
        self.matmul_plans = {}
        self.load_parameters(initial_parameters(self.program, seed))
        self.stream.synchronize()
        self.steps = list(scheduled(self.program))
        self.calls = [self._prepare(step) for step in self.steps]
        self.graph = None
        self.replay = True  # capture the first step as a CUDA graph and replay it after
        self.steps_run = 0

    def _module(self, cupy):
        """The kernels: CuPy compiles the file with NVRTC for this device; a file of Hopper's
        own instructions (sm_90a, which CuPy's compile cannot ask for) is compiled to a cubin
        here and loaded."""
        if architecture_of(self.emitted.text) == ARCHITECTURE:
            return cupy.RawModule(code=self.emitted.text, backend="nvrtc",
                                  options=("-std=c++17", *include_flags()))
        ok, log, cubin = nvrtc_compile(self.emitted.text, "program.cu", cubin=True)
        if not ok:
            raise RunFault(f"NVRTC could not compile the kernels for "
                           f"{architecture_of(self.emitted.text)}:\n{log}")
        self._cubin = tempfile.TemporaryDirectory(prefix="cgc-cubin-")
        path = os.path.join(self._cubin.name, "program.cubin")
        with open(path, "wb") as handle:
            handle.write(cubin)
        return cupy.RawModule(path=path)

    @staticmethod
    def unavailable() -> str | None:
        return unavailable_reason()

    @staticmethod
    def problems(program):
        return image_problems(program)

    @staticmethod
    def memory_limit() -> tuple[int, str] | None:
        """The GPU's free memory (and what CuPy's pool holds free for reuse)."""
        import cupy
        free, total = cupy.cuda.runtime.memGetInfo()
        free += cupy.get_default_memory_pool().free_bytes()
        return (free, f"the free memory of GPU {cupy.cuda.runtime.getDevice()} "
                      f"({total / 2 ** 30:.2f} GiB in all)")

    beside_plan = staticmethod(workspace_beside_plan)

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

    def view(self, label: str):
        return self.array(label)

    def fetch(self, label: str) -> np.ndarray:
        storage = self.program.storages[label]
        host = self.array(label).get(stream=self.stream)
        self.stream.synchronize()
        return decode(host, storage.element, self.low)

    # ---- launches ----------------------------------------------------------------

    def _prepare(self, step):
        """A launch at one repeat index on its stream, as a call with every argument
        computed; or a fork or join between two streams, as an event."""
        stream = self.streams[step.stream]
        if step.kind != "launch":
            event = self.cupy.cuda.Event(block=False, disable_timing=True)
            waits, records = ((self.streams[step.branch], stream) if step.kind == "fork"
                              else (stream, self.streams[step.branch]))

            def order():
                event.record(records)
                waits.wait_event(event)

            order.image = None
            return order
        launch, point = step.launch, step.point
        image = launch.image
        bound = launch.arguments(point)
        arguments = [np.uint64(self.address(p.view.storage, p.offset)) for p in bound.pointers]
        values = {}
        for scalar in bound.scalars:
            value = (np.float32(scalar.value) if scalar.parameter.type == "float32"
                     else np.int32(int(scalar.value)))
            values[scalar.parameter.name] = value
            arguments.append(value)
        if image.collective is not None:
            return self._collective(image, arguments[0], int(values[image.scalars[0].name]),
                                    stream)
        if image.library is not None:
            return self._product(image.name, arguments, values, step.stream)
        function, shared = self.kernels[image.name]
        grid = tuple(int(g) for g in bound.grid)
        block = image.block
        found = launch_tensor_map(image, self.kernel_constants, bound)
        if found is not None:  # the map of its pointer, passed by value after the scalars
            tensor_map, rows = found
            address = int(arguments[[p.parameter.index for p in bound.pointers]
                                    .index(tensor_map.pointer)])
            arguments.append(tensor_maps.encode_2d(
                self.encoder(), address, tensor_map.width, rows, tensor_map.box_width,
                tensor_map.box_rows, tensor_map.swizzle))

        def call():
            function(grid, block, tuple(arguments), shared_mem=shared, stream=stream)

        call.image = image.name
        return call

    def _product(self, name: str, arguments, values, stream_number: int):
        """A product image through cuBLASLt, from CUBLAS_PRODUCTS as the emitted program's
        cg_matmul does it: column-major D^T = B^T A^T (cuBLASLt's A is our B), C the output
        or a distinct matrix (the residual: no copy), the epilogue's aux matrix laid out as
        D. Descriptors, layouts and algorithm are made once per shape and alignment; the
        algorithm is chosen at the shape's first call (_choose_algorithm)."""
        lt, stream = self.cublaslt, self.streams[stream_number]
        product = CUBLAS_PRODUCTS[name]
        image = self.program.images[name]
        m, n, k = (int(values[x]) for x in ("m", "n", "k"))
        sizes = {"m": m, "n": n, "k": k}
        pointers = {image.pointers[index].name: int(arguments[position])
                    for position, index in enumerate(sorted(image.pointers))}
        a, b, d, c = pointers["a"], pointers["b"], pointers["output"], pointers[product.c]
        aux = pointers[product.aux] if product.aux is not None else 0
        low_type = ELEMENTS[self.low].cuda_data_type_code
        d_element = ELEMENTS[self.low if product.low_output else "float32"]
        d_type = d_element.cuda_data_type_code
        alignments = tuple(alignment(x) for x in (b, a, c, d, aux if aux else 256))
        key = (product, m, n, k, alignments)
        plan = self.matmul_plans.get(key)
        if plan is None:
            desc = lt.matmul_desc(product.op_b, product.op_a, product.epilogue,
                                  n if product.aux is not None else None)
            if aux:  # the heuristic reads the aux pointer for its alignment
                lt.set_aux(desc, aux)
            b_n, a_n = product.op_b == "N", product.op_a == "N"
            layouts = (lt.layout(low_type, n if b_n else k, k if b_n else n, sizes[product.ld_b]),
                       lt.layout(low_type, k if a_n else m, m if a_n else k, sizes[product.ld_a]),
                       lt.layout(d_type, n, m, n), lt.layout(d_type, n, m, n))
            results = lt.heuristic(self.lt_handle, desc, layouts, CUBLASLT_WORKSPACE_BYTES,
                                   alignments[:4], ALGORITHMS_OFFERED)
            # a split-K first has no rival (the bits would differ)
            rivals = [r for r in results[1:] if lt.one_pass(r)] if lt.one_pass(results[0]) else []
            offered = results[:1] + rivals
            plan = self.matmul_plans[key] = {"desc": desc, "layouts": layouts,
                                             "offered": offered, "algo": offered[0],
                                             "chosen": False}
        desc, layouts = plan["desc"], plan["layouts"]
        alpha, beta = np.array(1.0, np.float32), np.array(product.beta, np.float32)
        handle = self.lt_handle  # the stream's own workspace, as the emitted program's
        workspace = self.memory["lt_workspace"].data.ptr + stream_number * CUBLASLT_WORKSPACE_BYTES

        def run(algo, c_at, d_at, aux_at):
            if aux_at:  # this call's aux matrix (the descriptor is the shape's)
                lt.set_aux(desc, aux_at)
            lt.matmul(handle, desc, alpha.ctypes.data, b, layouts[0], a, layouts[1],
                      beta.ctypes.data, c_at, layouts[2], d_at, layouts[3], algo, workspace,
                      CUBLASLT_WORKSPACE_BYTES, stream.ptr)

        def call():
            if not plan["chosen"]:
                self._choose_algorithm(plan, run, stream, name, (m, n, k), c, d, aux,
                                       d_element.bytes, product.epilogue == "GELU_AUX",
                                       product.beta)
            run(plan["algo"], c, d, aux)

        call.image = name
        return call

    def _choose_algorithm(self, plan, run, stream, name, shape, c, d, aux, element: int,
                          writes_aux: bool, beta: float) -> None:
        """The emitted program's cg_choose_algorithm, here: each offered algorithm writes D
        (and a written aux matrix) into scratch memory, C copied there first where C is D;
        those whose bits differ from the first's are dropped, the rest timed
        (ALGORITHM_TRIAL_RUNS runs each) and the fastest kept. Not under a capture, nor where
        D is larger than ALGORITHM_TRIAL_BYTES: the first is kept. CG_ALGORITHM_REPORT in the
        environment prints each choice on stderr."""
        cupy = self.cupy
        plan["chosen"] = True
        m, n, k = shape
        size = m * n * element
        if len(plan["offered"]) < 2 or stream.is_capturing() or size > ALGORITHM_TRIAL_BYTES:
            return
        trial = cupy.zeros(size, dtype=cupy.uint8)
        trial_aux = cupy.zeros(size, dtype=cupy.uint8) if writes_aux else None
        trial_c = trial.data.ptr if c == d else c
        expected, best, best_seconds, same = None, 0, 0.0, 0
        for index, algo in enumerate(plan["offered"]):
            if c == d and beta != 0.0:
                cupy.cuda.runtime.memcpyAsync(trial.data.ptr, d, size,
                                              cupy.cuda.runtime.memcpyDeviceToDevice, stream.ptr)
            aux_at = trial_aux.data.ptr if writes_aux else aux

            def once():
                run(algo, trial_c, trial.data.ptr, aux_at)

            once()
            got = (trial.get(stream=stream).tobytes(),
                   trial_aux.get(stream=stream).tobytes() if writes_aux else b"")
            stream.synchronize()
            if expected is None:
                expected = got
            elif got != expected:
                continue  # other bits: never chosen
            same += 1
            start, stop = cupy.cuda.Event(), cupy.cuda.Event()
            start.record(stream)
            for _ in range(ALGORITHM_TRIAL_RUNS):
                once()
            stop.record(stream)
            stop.synchronize()
            seconds = cupy.cuda.get_elapsed_time(start, stop) / 1000.0
            if index == 0 or seconds < best_seconds:
                best, best_seconds = index, seconds
        plan["algo"] = plan["offered"][best]
        if os.environ.get("CG_ALGORITHM_REPORT") is not None:
            print(f"{name}: cuBLASLt product m {m} n {n} k {k}: {len(plan['offered'])} "
                  f"algorithms in one pass over k, {same} give the first's bits, chose algorithm "
                  f"{best} ({1e6 * best_seconds / ALGORITHM_TRIAL_RUNS:.1f} us a run)",
                  file=sys.stderr)

    def _collective(self, image, data, count: int, stream):
        """A collective image through CuPy's NCCL binding, on the run's stream (so that the
        graph capture records it), on a communicator made at the first step from the id
        rank 0 draws and the run's communicator (MPI) broadcasts. In place, as the emitted
        program calls it (NCCL_CALLS): a reduce-scatter receives into this rank's shard of
        the buffer, an all-gather sends from it (the rank the program was compiled for)."""
        nccl_call = NCCL_CALLS[image.collective]
        (pointer,) = image.pointers.values()
        data = int(data)
        first, end = self.program.shard(0, count)
        shard, mine = end - first, data + first * element_bytes(pointer.element, self.low)

        def call():
            nccl = self._nccl()
            data_type = _cupy_nccl(nccl, NCCL_TYPES[pointer.element])
            if nccl_call.shard == "receive":
                self.nccl_communicator.reduceScatter(data, mine, shard, data_type,
                                                     _cupy_nccl(nccl, nccl_call.operator),
                                                     stream.ptr)
            elif nccl_call.shard == "send":
                self.nccl_communicator.allGather(mine, data, shard, data_type, stream.ptr)
            else:
                self.nccl_communicator.allReduce(data, data, count, data_type,
                                                 _cupy_nccl(nccl, nccl_call.operator),
                                                 stream.ptr)

        call.image = image.name
        return call

    def _nccl(self):
        """CuPy's NCCL module, and this run's NCCL communicator (made once, before capture)."""
        import importlib
        nccl = importlib.import_module("cupy.cuda.nccl")
        if getattr(self, "nccl_communicator", None) is None:
            communicator = self.communicator
            identifier = nccl.get_unique_id() if communicator.lead else None
            identifier = communicator.broadcast_object(identifier)
            made = nccl.NcclCommunicator(communicator.size, identifier, communicator.rank)
            # a program that shards runs only as the rank it was compiled for
            mismatch = rank_mismatch(self.program, made.rank_id(), made.size())
            if mismatch is not None:
                raise RunFault(mismatch)
            self.nccl_communicator = made
        return nccl

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

    def run_step(self, trace: list | None) -> float:
        """The first step runs eagerly (launch by launch, timed into `trace` if asked) and is
        then captured as a CUDA graph; later steps replay the graph."""
        if trace is not None:
            trace.extend(self.timed_launches())
            seconds = trace[-1][3] - trace[0][2] if trace else 0.0
        else:
            seconds = self.timed(use_graph=self.graph is not None and self.replay)
        if self.graph is None and self.replay:
            self.capture()
        self.steps_run += 1
        return seconds

    def step(self, ids, targets, trace: list | None = None):
        eager = self.graph is None or not self.replay
        result = super().step(ids, targets, trace)
        if eager and self.replay:
            result.note = "eager, before capture"
        return result

    def timed(self, use_graph: bool) -> float:
        """One step on the GPU, timed with CUDA events."""
        start, end = self.cupy.cuda.Event(), self.cupy.cuda.Event()
        start.record(self.stream)
        if use_graph:
            self.graph.launch(self.stream)
        else:
            self.eager()
        end.record(self.stream)
        end.synchronize()
        return self.cupy.cuda.get_elapsed_time(start, end) / 1000.0

    def timed_launches(self) -> list:
        """One eager step timed launch by launch: (image, phase, start, end) seconds."""
        events = []
        origin = self.cupy.cuda.Event()
        origin.record(self.stream)
        with self.stream:
            for step, call in zip(self.steps, self.calls):
                if step.kind != "launch":
                    call()
                    continue
                stream = self.streams[step.stream]
                before, after = self.cupy.cuda.Event(), self.cupy.cuda.Event()
                before.record(stream)
                call()
                after.record(stream)
                events.append((step.launch.image.name, step.phase, before, after))
        self.stream.synchronize()
        timings = [(name, phase, self.cupy.cuda.get_elapsed_time(origin, before) / 1000.0,
                    self.cupy.cuda.get_elapsed_time(origin, after) / 1000.0)
                   for name, phase, before, after in events]
        return timings


Backend = CupyRun
