"""The element types: one table, read by the language, the memory plan, the emitter, the
numerics and the runtimes.

`low` is not an element of its own: it is the configuration's 16-bit choice (bfloat16, or
float32 in a configuration that runs the whole step in float32), resolved with `concrete`.
"""

from __future__ import annotations

from dataclasses import dataclass

LOW = "low"


@dataclass(frozen=True)
class Element:
    name: str
    c_type: str  # in the emitted CUDA
    storage: str  # the NumPy dtype of its bytes on the host: bfloat16 as its bit patterns
    bytes: int
    cuda_data_type: str | None  # cudaDataType for cuBLAS products, where it can be an operand
    cuda_data_type_code: int | None  # its value, for calls made through CuPy
    low_choice: bool  # may be a configuration's `low`
    scalar: bool  # may type a scalar argument


ELEMENTS: dict[str, Element] = {
    "float32": Element("float32", "float", "float32", 4, "CUDA_R_32F", 0, True, True),
    "bfloat16": Element("bfloat16", "__nv_bfloat16", "uint16", 2, "CUDA_R_16BF", 14, True,
                        False),
    "int32": Element("int32", "int", "int32", 4, None, None, False, True),
}

# What a declaration may name: the concrete elements and the configuration's choice.
ELEMENT_NAMES = (*ELEMENTS, LOW)
LOW_CHOICES = tuple(name for name, element in ELEMENTS.items() if element.low_choice)
SCALAR_TYPES = tuple(name for name, element in ELEMENTS.items() if element.scalar)
DEFAULT_LOW = "bfloat16"


def concrete(element: str, low: str) -> Element:
    """The element a declared element type stands for in a configuration."""
    return ELEMENTS[low if element == LOW else element]


def element_bytes(element: str, low: str) -> int:
    return concrete(element, low).bytes


def c_type(element: str, low: str) -> str:
    return concrete(element, low).c_type
