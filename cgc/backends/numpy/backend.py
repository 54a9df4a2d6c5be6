"""The NumPy backend: runs a checked launch program on the bounds-checked reference machine,
each image by its NumPy reference function (reference.py), on the CPU."""

from __future__ import annotations

import functools
import time

import numpy as np

from ...core.diagnostics import Diagnostic, Note
from ...core.ir import Program, View
from ..base import Run, initial_parameters
from .machine import Machine
from .reference import KERNELS


USER_REFERENCES = "reference.py"  # in a folder of the user's kernels: its KERNELS table


def user_kernels(program: Program) -> tuple[dict, list[Diagnostic]]:
    """The reference functions of the user's kernel folders (`--kernels DIR`: the KERNELS
    table of DIR/reference.py, by image name), and an error for each file that cannot be
    loaded. Only folders the user named are read: cgc runs no Python it was not given."""
    import os
    found, problems = {}, []
    for folder in program.kernel_folders:
        path = os.path.join(folder, USER_REFERENCES)
        if not os.path.isfile(path):
            continue
        stat = os.stat(path)
        table, problem = _reference_table(path, stat.st_mtime_ns, stat.st_size)
        if problem is not None:
            problems.append(problem)
            continue
        found.update({name: function for name, function in table.items() if name not in found})
    return found, problems


@functools.lru_cache(maxsize=32)
def _reference_table(path: str, mtime_ns: int, size: int) -> tuple[dict, Diagnostic | None]:
    """One reference.py's KERNELS table, run once per version of the file (checking every
    configuration and then opening the run would otherwise run it each time)."""
    import importlib.util
    name = f"cgc_user_kernels_{abs(hash((path, mtime_ns, size)))}"
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        table = getattr(module, "KERNELS")
        if not isinstance(table, dict) or not all(
                isinstance(key, str) and callable(function) for key, function in table.items()):
            raise TypeError("KERNELS is not a dict of image names (str) to functions")
    except (Exception, SystemExit) as error:  # the user's code: its fault, told as such
        return {}, Diagnostic("error", f"cannot load the reference functions in {path}: "
                                       f"{type(error).__name__}: {error}", None)
    return dict(table), None


def reference_functions(program: Program) -> dict:
    """cgc's reference functions, then the user's for the images cgc has none of."""
    user, _ = user_kernels(program)
    return {**user, **KERNELS}


class NumpyRun(Run):
    name = "numpy"

    def __init__(self, program, plan, seed: int):
        super().__init__(program, plan, seed)
        self.machine = Machine(program, plan, reference_functions(program))
        self.load_parameters(initial_parameters(program, seed))

    @staticmethod
    def problems(program: Program) -> list[Diagnostic]:
        used = {launch.image.name: launch.image for launch, _, _ in program.launches()}
        user, problems = user_kernels(program)
        known = {**user, **KERNELS}
        where = "its KERNELS table" + "".join(
            f" and {folder}/{USER_REFERENCES}" for folder in program.kernel_folders)
        return problems + [
            Diagnostic("error", f"image '{name}' has no reference function: the numpy backend "
                                f"looks for '{name}' in {where}", image.span,
                       (Note("cgc/backends/numpy/reference.py defines every image's NumPy "
                             "semantics (docs/backends.md); your own go in the KERNELS table of "
                             "reference.py in a folder given with --kernels DIR "
                             "(docs/tutorial.md)"),))
            for name, image in sorted(used.items()) if name not in known]

    def store(self, label: str, values) -> None:
        self.machine.store(label, values)

    def fetch(self, label: str) -> np.ndarray:
        return self.machine.array(label)

    def view(self, label: str) -> np.ndarray:
        storage = self.machine.program.storages[label]
        return self.machine.storage_array(View(storage, 0, storage.count))

    def run_step(self, trace: list | None) -> float:
        started = time.perf_counter()
        self.machine.communicator = self.communicator
        # IEEE arithmetic as a GPU does it, silently: an overflow or a NaN is a value the step
        # carries (a diverged run is told once, by the training loop), not a warning a launch
        with np.errstate(all="ignore"):
            self.machine.run(trace)
        return time.perf_counter() - started


Backend = NumpyRun
