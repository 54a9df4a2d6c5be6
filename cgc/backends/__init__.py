"""Where a checked launch program runs. One registry line per backend: its name, the module
that holds its `Backend` (a subclass of base.Run), and what it is. Modules load only when
asked for, so a command pays for no backend it does not use.

Adding a backend: a module with a `Backend` class implementing base.Run, and a line here
(docs/backends.md).
"""

from __future__ import annotations

import importlib

REGISTRY = {
    "numpy": ("cgc.backends.numpy.backend",
              "the CPU reference machine: every image's NumPy semantics, every access checked"),
    "cupy": ("cgc.backends.cuda.backend",
             "the emitted CUDA kernels on an NVIDIA GPU, through CuPy, replayed as a CUDA graph"),
    "emulated": ("cgc.backends.cuda.emulated",
                 "the emitted CUDA file built for the CPU with cgc's own CUDA headers: the "
                 "same kernels and host program, every CUDA thread a fiber"),
}


def backend(name: str):
    """The Run class of a registered backend."""
    module, _ = REGISTRY[name]
    return importlib.import_module(module).Backend


def choose(asked: str) -> tuple[str, str]:
    """The backend to use for `--backend asked` (a name, or auto), and why it was chosen.
    Raises base.Unavailable with the reason when the one asked for cannot run here."""
    from .base import Unavailable
    if asked != "auto":
        reason = backend(asked).unavailable()
        if reason:
            raise Unavailable(reason)
        return asked, "asked for"
    reason = backend("cupy").unavailable()
    if reason is None:
        return "cupy", "auto: an NVIDIA GPU is present"
    return "numpy", f"auto: {reason.rstrip('.')}"
