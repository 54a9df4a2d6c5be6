"""cgc: a compiler for schedules of GPU kernel launches (a GPT training step)."""

import os as _os
import sys as _sys
from typing import TYPE_CHECKING as _TYPE_CHECKING

__version__ = "0.1.0"

# The reference machine's products are small (tiny: at most 256 x 256 x 256) and come out
# the same bits at any thread count (cgc/backends/numpy/portable.py), so the thread count is
# only a matter of speed: one BLAS thread is fastest for them on 2 cores (a quick start step
# took 30 ms with one thread, and 80 ms to 2 s with two on a machine that other work
# loaded, OpenBLAS's threads waiting on each other). OpenBLAS reads its thread count once,
# when NumPy loads it, so this is set here, before cgc imports NumPy, and only where the
# user chose nothing (OPENBLAS_NUM_THREADS, or GOTO_NUM_THREADS and OMP_NUM_THREADS, which
# OpenBLAS also reads); a process that loaded NumPy before cgc keeps its own setting.
if "numpy" not in _sys.modules and not any(
        _os.environ.get(name) for name in
        ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")):
    _os.environ["OPENBLAS_NUM_THREADS"] = "1"

# The Python API (cgc/api.py, docs/api.md), loaded on first use: `import cgc` and the
# commands that need no run (`cgc compile`) load neither NumPy nor the backends.
__all__ = ["CompileError", "CheckpointError", "Diagnostic", "OptionError", "PathError",
           "RunError", "Unavailable", "Schedule", "Sampling",
           "TrainingOptions", "TrainingRun", "StepRecord", "Training", "load",
           "open_training", "open_sampler", "__version__"]

_HOMES = {
    "CompileError": "cgc.core.diagnostics", "Diagnostic": "cgc.core.diagnostics",
    "OptionError": "cgc.core.diagnostics", "RunError": "cgc.core.diagnostics",
    "PathError": "cgc.core.diagnostics", "CheckpointError": "cgc.training.checkpoint",
    "Unavailable": "cgc.backends.base",
    "Schedule": "cgc.api", "Sampling": "cgc.api", "load": "cgc.api",
    "open_training": "cgc.api", "open_sampler": "cgc.api",
    "TrainingOptions": "cgc.training.run", "TrainingRun": "cgc.training.run",
    "StepRecord": "cgc.training.loop", "Training": "cgc.training.loop",
}


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'cgc' has no attribute '{name}'")
    import importlib
    return getattr(importlib.import_module(home), name)


def __dir__() -> list[str]:
    return sorted(__all__)


if _TYPE_CHECKING:  # for type checkers and editors: the names above, statically
    from .api import Sampling, Schedule, load, open_sampler, open_training  # noqa: F401
    from .backends.base import Unavailable  # noqa: F401
    from .core.diagnostics import (CompileError, Diagnostic, OptionError, PathError,  # noqa: F401
                                   RunError)
    from .training.checkpoint import CheckpointError  # noqa: F401
    from .training.loop import StepRecord, Training  # noqa: F401
    from .training.run import TrainingOptions, TrainingRun  # noqa: F401
