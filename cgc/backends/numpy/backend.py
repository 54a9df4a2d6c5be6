"""The NumPy backend: runs a checked launch program on the bounds-checked reference machine,
each image by its NumPy reference function (reference.py), on the CPU."""

from __future__ import annotations

import time

import numpy as np

from ...core.diagnostics import Diagnostic, Note
from ...core.ir import Program
from ..base import Run, initial_parameters
from .machine import Machine
from .reference import KERNELS


class NumpyRun(Run):
    name = "numpy"

    def __init__(self, program, plan, seed: int):
        super().__init__(program, plan, seed)
        self.machine = Machine(program, plan, KERNELS)
        self.load_parameters(initial_parameters(program, seed))

    @staticmethod
    def problems(program: Program) -> list[Diagnostic]:
        used = {launch.image.name: launch.image for launch, _, _ in program.launches()}
        return [Diagnostic("error", f"image '{name}' has no reference function: the numpy "
                                    f"backend looks for '{name}' in its KERNELS table",
                           image.span,
                           (Note("cgc/backends/numpy/reference.py defines every image's NumPy "
                                 "semantics (docs/backends.md)"),))
                for name, image in sorted(used.items()) if name not in KERNELS]

    def store(self, label: str, values) -> None:
        self.machine.store(label, values)

    def fetch(self, label: str) -> np.ndarray:
        return self.machine.array(label)

    def run_step(self, trace: list | None) -> float:
        started = time.perf_counter()
        self.machine.communicator = self.communicator
        # IEEE arithmetic as a GPU does it, silently: an overflow or a NaN is a value the step
        # carries (a diverged run is told once, by the training loop), not a warning a launch
        with np.errstate(all="ignore"):
            self.machine.run(trace)
        return time.perf_counter() - started


Backend = NumpyRun
