"""cgc: a compiler for schedules of GPU kernel launches (a GPT training step)."""

import os as _os
import sys as _sys

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
