"""Checkpoints: a training run saved in one safetensors file, and read back for `--resume`.

What a checkpoint holds is read off the program, not off today's model: every entry of
every bank whose role is parameters, state (the AdamW moments) or copies (the 16-bit copies,
as bfloat16 through ml_dtypes where the program's low type is bfloat16), and the step
buffers the step carries from one step to the next (those whose first access in the step is
a read-modify-write, such as the optimizer's step counter). Gradients and the arena are not
kept: the step writes them before it reads them (the checker proves it). The manifest (the
format, the step, the seed, the data position, the configuration, every constant, the
schedule sources' SHA-256, the learning-rate schedule) is the file's metadata, as JSON under
the key `cgc`. docs/checkpoint-format.md describes the file.

A checkpoint is written to a temporary file beside its name, flushed to the disk and renamed
onto it, so a run killed at any moment leaves either the previous checkpoint or the new one,
never half of one; a folder's checkpoint is the one with the highest step whose name reads
`step-NNNNNNNN.safetensors` (temporary files are never read).
"""

from __future__ import annotations

import json
import os
import re

import ml_dtypes
import numpy as np

from ..core.diagnostics import CompileError, Diagnostic
from ..outputs import Refused, WriteFailed, write_file
from ..resources import sync_to_disk

FORMAT = "cgc-checkpoint-1"
METADATA_KEY = "cgc"
SAVED_BANK_ROLES = ("parameters", "state", "copies")
_NAME = re.compile(r"^step-(\d{8})\.safetensors$")
# safetensors' dtype names for the element types a storage can hold (bfloat16 through
# ml_dtypes, which numpy lacks).
_DTYPES = {"F32": np.dtype(np.float32), "I32": np.dtype(np.int32),
           "BF16": np.dtype(ml_dtypes.bfloat16)}


class CheckpointError(CompileError):
    """A checkpoint cgc cannot write or resume from: told as an error (exit 1), in one line."""

    def __init__(self, message: str):
        super().__init__([Diagnostic("error", message, None)])
        self.message = message


def file_name(step: int) -> str:
    return f"step-{step:08d}.safetensors"


def carried_buffers(program) -> list[str]:
    """The step buffers whose first access in the step reads what the previous step left
    (readwrite or accumulate): state the run carries, kept by a checkpoint."""
    first: dict[str, str] = {}
    for launch, _, _ in program.launches():
        for binding in launch.pointers:
            parameter = launch.image.pointers.get(binding.index)
            storage = binding.view.storage
            if parameter is None or storage.kind != "buffer":
                continue
            first.setdefault(storage.label, parameter.access)
    return [label for label, access in first.items() if access in ("readwrite", "accumulate")]


def saved_labels(program) -> list[str]:
    """Every storage a checkpoint keeps, by label, in a stable order."""
    labels = []
    for role in SAVED_BANK_ROLES:
        for bank in program.bank_of_role(role):
            labels += [f"{bank}.{entry.name}" for entry in program.entries
                       if f"{bank}.{entry.name}" in program.storages]
    return labels + carried_buffers(program)


def _element_dtype(program, label: str) -> np.dtype:
    from ..core.elements import concrete
    element = concrete(program.storages[label].element, program.low).name
    return {"float32": _DTYPES["F32"], "int32": _DTYPES["I32"],
            "bfloat16": _DTYPES["BF16"]}[element]


def tensors(run) -> dict[str, np.ndarray]:
    """What the run's checkpoint holds, each storage in its own element type (a 16-bit copy
    as bfloat16: fetch widens it to float32 exactly, and narrowing it back is exact too)."""
    program = run.program
    return {label: np.ascontiguousarray(run.fetch(label).astype(_element_dtype(program, label)))
            for label in saved_labels(program)}


def restore(run, values: dict[str, np.ndarray]) -> None:
    """Stores a checkpoint's tensors into the run (widened to float32 or int32 for `store`,
    which rounds them to the storage's type: exact, as they came from that type)."""
    for label, array in values.items():
        wide = array.astype(np.int32 if array.dtype == np.int32 else np.float32)
        run.store(label, wide)


def tensors_sha256(values: dict[str, np.ndarray]) -> str:
    """One SHA-256 over every tensor's name and bytes, in name order: the manifest records
    it, so that a damaged or altered tensor is told, not trained on."""
    import hashlib
    digest = hashlib.sha256()
    for name in sorted(values):
        digest.update(name.encode() + b"\0")
        digest.update(np.ascontiguousarray(values[name]).view(np.uint8).tobytes())
    return digest.hexdigest()


def save(folder: str, step: int, values: dict[str, np.ndarray], manifest: dict) -> str:
    """Writes `values` and `manifest` as FOLDER/step-NNNNNNNN.safetensors: a temporary file,
    flushed, then renamed into place. Returns the path."""
    from safetensors.numpy import save as serialize
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as error:
        raise CheckpointError(f"--checkpoint-dir {folder}: {error.strerror or error}") from None
    manifest = {**manifest, "tensors_sha256": tensors_sha256(values)}
    data = serialize(values, metadata={METADATA_KEY: json.dumps(manifest, sort_keys=True)})
    path = os.path.join(folder, file_name(step))
    try:  # cgc/outputs.py: a link there is followed, a read-only file refused
        write_file(path, data, "the checkpoint")
    except (Refused, WriteFailed) as error:
        raise CheckpointError(str(error)) from None
    sync_to_disk(folder)
    return path


def latest(path: str) -> str:
    """The checkpoint `--resume PATH` means: PATH itself, or a folder's highest step."""
    if not os.path.isdir(path):
        if not os.path.exists(path):
            raise CheckpointError(f"--resume {path}: no such file or folder")
        return path
    try:
        names = [name for name in os.listdir(path) if _NAME.match(name)]
    except OSError as error:
        raise CheckpointError(f"--resume {path}: {error.strerror or error}") from None
    if not names:
        raise CheckpointError(f"--resume {path}: the folder holds no checkpoint "
                              "(no step-NNNNNNNN.safetensors)")
    return os.path.join(path, max(names))


def load(path: str) -> tuple[dict[str, np.ndarray], dict]:
    """A checkpoint's tensors and manifest; CheckpointError, naming the file, for anything
    that is not a whole cgc checkpoint (truncated, corrupt, another format)."""
    import safetensors
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except OSError as error:
        raise CheckpointError(f"cannot read the checkpoint {path}: "
                              f"{error.strerror or error}") from None
    broken = f"{path} is not a whole cgc checkpoint"
    try:
        header_bytes = int.from_bytes(data[:8], "little")
        if len(data) < 8 or 8 + header_bytes > len(data):
            raise ValueError(f"the file has {len(data)} bytes, fewer than its header says "
                             "(truncated?)")
        header = json.loads(data[8:8 + header_bytes])
        manifest = json.loads(header.get("__metadata__", {})[METADATA_KEY])
        items = safetensors.deserialize(data)
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{broken}: its header or manifest is not JSON ({error})") from None
    except KeyError:
        raise CheckpointError(f"{broken}: its header has no {METADATA_KEY!r} manifest (a "
                              "safetensors file cgc did not write, or a damaged one)") from None
    except (TypeError, AttributeError) as error:
        raise CheckpointError(f"{broken}: its header is not laid out as a cgc checkpoint's "
                              f"({error})") from None
    except (ValueError, safetensors.SafetensorError) as error:
        raise CheckpointError(f"{broken}: {error}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{broken}: its format is {manifest.get('format')!r}, not "
                              f"{FORMAT!r}" if isinstance(manifest, dict) else broken)
    values = {}
    for name, item in items:
        dtype = _DTYPES.get(item["dtype"])
        if dtype is None:
            raise CheckpointError(f"{broken}: tensor {name} has the type {item['dtype']}")
        values[name] = np.frombuffer(bytes(item["data"]), dtype=dtype).reshape(item["shape"])
    if manifest.get("tensors_sha256") != tensors_sha256(values):
        raise CheckpointError(f"{broken}: its tensors do not have the SHA-256 its manifest "
                              "records (a damaged or altered file)")
    return values, manifest


def check_tensors(program, values: dict[str, np.ndarray], path: str) -> None:
    """Every storage the program's checkpoint keeps is there, with its size and type."""
    for label in saved_labels(program):
        if label not in values:
            raise CheckpointError(f"{path} has no tensor {label}, which this schedule keeps")
        storage, array = program.storages[label], values[label]
        if array.size != storage.count or array.dtype != _element_dtype(program, label):
            raise CheckpointError(f"{path}: tensor {label} holds {array.size} {array.dtype} "
                                  f"values; this schedule's holds {storage.count} "
                                  f"{_element_dtype(program, label)}")
    extra = sorted(set(values) - set(saved_labels(program)))
    if extra:
        raise CheckpointError(f"{path} holds tensors this schedule does not have: "
                              f"{', '.join(extra[:5])}")


def differences(saved: dict, current: dict, prefix: str = "") -> list[str]:
    """What differs between two manifests' fields, as 'name: saved -> now' (nested keys
    joined with dots)."""
    found = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            found += differences(a, b, f"{prefix}{key}.")
        elif a != b:
            found.append(f"{prefix}{key}: {_short(a)} in the checkpoint, {_short(b)} now")
    return found


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."
