"""An image's C parameter list, generated from its one declaration.

The CUDA emitter writes every kernel's parameters with this, so a kernel cannot drift
from the signature the checker proved its launches against.
"""

from __future__ import annotations

from ..core.elements import c_type
from ..core.ir import Image


def c_parameters(image: Image, low: str) -> list[str]:
    """Pointers in index order, then scalars in index order.

    A pointer only read is `const`; a pointer the image lets alias another is not
    `__restrict__`, since the compiler may not assume it is the only way to that memory.
    """
    aliased = {index for pair in image.aliases for index in pair}
    parameters = []
    for index in sorted(image.pointers):
        pointer = image.pointers[index]
        const = "const " if pointer.access == "read" else ""
        restrict = "" if index in aliased else " __restrict__"
        parameters.append(f"{const}{c_type(pointer.element, low)}*{restrict} {pointer.name}")
    for index in sorted(image.scalars):
        scalar = image.scalars[index]
        parameters.append(f"{c_type(scalar.type, low)} {scalar.name}")
    return parameters
