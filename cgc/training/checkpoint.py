"""Checkpoints: a training run saved in one safetensors file, and read back for `--resume`.

What a checkpoint holds is read off the program, not off today's model: every entry of
every bank whose role is parameters, state (the AdamW moments) or copies (the 16-bit copies,
as bfloat16 through ml_dtypes where the program's low type is bfloat16), and the step
buffers the step carries from one step to the next (those whose first access in the step is
a read-modify-write, such as the optimizer's step counter). Gradients and the arena are not
kept: the step writes them before it reads them (the checker proves it). The manifest (the
format, the step, the seed, the data position, the configuration, every constant, the
schedule sources' SHA-256, the learning-rate schedule, the tensors' and its own SHA-256) is
the file's metadata, as JSON under the key `cgc`. docs/checkpoint-format.md describes the file.

A checkpoint is written to a temporary file beside its name, flushed to the disk and renamed
onto it, so a run killed at any moment leaves either the previous checkpoint or the new one,
never half of one; a folder's checkpoint is the one with the highest step whose name reads
`step-NNNNNNNN.safetensors` (temporary files are never read).

Reading one trusts nothing in it: only a regular file is read (a FIFO or a device is
refused without waiting), only as many bytes as its header declares, and only if the file
has exactly that many; the manifest carries its own SHA-256 (format 2) and every field cgc
reads is checked for its type and range, each a one-line error.
"""

from __future__ import annotations

import json
import os
import re

import ml_dtypes
import numpy as np

# the state a checkpoint keeps is the run's (cgc/backends/base.py), re-exported here
from ..backends.base import carried_buffers, saved_count, saved_dtype, saved_labels  # noqa: F401
from ..backends.base import restore_state as restore  # noqa: F401
from ..backends.base import state_tensors as tensors  # noqa: F401
from ..core.diagnostics import CompileError, Diagnostic
from ..outputs import Refused, WriteFailed, write_file
from ..resources import sync_to_disk

FORMAT = "cgc-checkpoint-2"  # 2: the manifest carries its own SHA-256 (manifest_sha256)
OLD_FORMAT = "cgc-checkpoint-1"  # read still: its fields are checked, but it has no hash
READABLE_FORMATS = (FORMAT, OLD_FORMAT)
METADATA_KEY = "cgc"
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


def make_folder(folder: str) -> None:
    """The folder checkpoints go into, made before any step runs (PathError where it is a
    file or cannot be made): a bad one is told at once, not after the steps."""
    from ..core.diagnostics import PathError
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise PathError(f"cannot write checkpoints into {folder}: not a folder")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as error:
        raise PathError(f"cannot write {folder}: {error.strerror or error}") from None


def file_name(step: int) -> str:
    return f"step-{step:08d}.safetensors"


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
    manifest = json.loads(json.dumps({**manifest, "tensors_sha256": tensors_sha256(values)}))
    manifest["manifest_sha256"] = manifest_sha256(manifest)  # over the JSON as read back
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


# safetensors' own bound on a header (its MAX_HEADER_SIZE): a header said to be longer is
# refused before it is read.
MAX_HEADER_BYTES = 100_000_000


def _read_whole(path: str) -> bytearray:
    """The checkpoint file's bytes, read only if it is a regular file whose size is what its
    header declares (8 bytes of length, the JSON header, the tensors' bytes up to the last
    data offset), and no more than that: a FIFO is refused without waiting, /dev/zero or a
    sparse file grown past its header without reading it."""
    from ..resources import open_regular, read_at_most
    broken = f"{path} is not a whole cgc checkpoint"
    try:
        handle, status = open_regular(path)
    except OSError as error:
        raise CheckpointError(f"cannot read the checkpoint {path}: "
                              f"{error.strerror or error}") from None
    with handle:
        size = status.st_size
        if size < 8:
            raise CheckpointError(f"{broken}: the file has {size} bytes, fewer than a "
                                  "safetensors header's 8 (truncated?)")
        data = read_at_most(handle, 8)
        header_bytes = int.from_bytes(data[:8], "little")
        if header_bytes > min(MAX_HEADER_BYTES, size - 8):
            raise CheckpointError(f"{broken}: the file has {size} bytes, and its header says "
                                  f"it alone takes {header_bytes} (truncated?)")
        data += read_at_most(handle, header_bytes)
        declared = 8 + header_bytes + _data_bytes(data[8:], broken)
        if declared != size:
            raise CheckpointError(f"{broken}: the file has {size} bytes, and its header says "
                                  f"{declared} ({'truncated?' if size < declared else 'bytes after its tensors'})")
        from ..backends.base import byte_count, host_memory
        available = host_memory()  # what it is read into
        if available is not None and declared > available[0]:
            raise CheckpointError(f"{path}: its tensors take {byte_count(declared)}, more "
                                  f"than {available[1]}: {byte_count(available[0])}")
        whole = bytearray(declared)  # one buffer, filled in place: no copy while reading
        whole[:len(data)] = data
        view, done = memoryview(whole), len(data)
        while done < declared:
            got = handle.readinto(view[done:])
            if not got:
                view.release()
                raise CheckpointError(f"{broken}: the file became shorter while it was read")
            done += got
        view.release()
    return whole


def _data_bytes(header_text: bytes, broken: str) -> int:
    """Where the header says the tensors' bytes end (the largest data offset)."""
    try:
        header = json.loads(header_text)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{broken}: its header or manifest is not JSON ({error})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{broken}: its header is not a JSON object")
    end = 0
    for name, item in header.items():
        if name == "__metadata__":
            continue
        offsets = item.get("data_offsets") if isinstance(item, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(_integer(o) for o in offsets) and offsets[0] <= offsets[1]):
            raise CheckpointError(f"{broken}: tensor {_short(name)} has no data offsets "
                                  "(two whole numbers, ascending)")
        end = max(end, offsets[1])
    return end


def load(path: str) -> tuple[dict[str, np.ndarray], dict]:
    """A checkpoint's tensors and manifest; CheckpointError, naming the file, for anything
    that is not a whole cgc checkpoint (not a regular file, truncated, corrupt, another
    format, a manifest altered or out of range)."""
    import safetensors
    data = _read_whole(path)
    broken = f"{path} is not a whole cgc checkpoint"
    try:
        header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
        manifest = json.loads(header.get("__metadata__", {})[METADATA_KEY])
        items = safetensors.deserialize(bytes(data))
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
    del data
    if not isinstance(manifest, dict) or manifest.get("format") not in READABLE_FORMATS:
        raise CheckpointError(f"{broken}: its format is {_short(manifest.get('format'))}, not "
                              f"{FORMAT!r}" if isinstance(manifest, dict) else
                              f"{broken}: its manifest is not a JSON object")
    if manifest["format"] != OLD_FORMAT and manifest.get("manifest_sha256") != \
            manifest_sha256(manifest):
        raise CheckpointError(f"{broken}: its manifest does not have the SHA-256 it records "
                              "(a damaged or altered file)")
    values = {}
    for name, item in items:
        dtype = _DTYPES.get(item["dtype"])
        if dtype is None:
            raise CheckpointError(f"{broken}: tensor {name} has the type {item['dtype']}")
        values[name] = np.frombuffer(bytes(item["data"]), dtype=dtype).reshape(item["shape"])
    if manifest.get("tensors_sha256") != tensors_sha256(values):
        raise CheckpointError(f"{broken}: its tensors do not have the SHA-256 its manifest "
                              "records (a damaged or altered file)")
    check_manifest(manifest, path)
    return values, manifest


def manifest_sha256(manifest: dict) -> str:
    """SHA-256 of the manifest's fields but this one, as canonical JSON (keys sorted, no
    spaces, ASCII): an edited step, position, identity or loss is told, not resumed from."""
    import hashlib
    fields = {key: value for key, value in manifest.items() if key != "manifest_sha256"}
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


# ---- the manifest's fields, each checked (docs/checkpoint-format.md) --------------------


def _integer(value, low: int = 0, high: int | None = None) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low \
        and (high is None or value < high)


def _number(value) -> bool:
    import math
    return isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value)


def _hex(value) -> bool:
    return isinstance(value, str) and re.fullmatch(r"[0-9a-f]{64}", value) is not None


def _text_map(value) -> bool:
    return isinstance(value, dict) and all(isinstance(v, str) for v in value.values())


def _scalar_map(value) -> bool:
    return isinstance(value, dict) and all(
        isinstance(v, str) or _number(v) for v in value.values())


def _entry(value) -> bool:
    return (isinstance(value, dict) and _integer(value.get("count"))
            and (value.get("items") is None or _integer(value.get("items")))
            and isinstance(value.get("matrix"), bool)
            and value.get("init") in ("normal", "ones", "zeros")
            and (value.get("std") is None or _number(value.get("std"))))


_IDENTITY = {  # key: (check, what it must be)
    "schedule": (lambda v: isinstance(v, dict) and isinstance(v.get("entry"), str)
                 and isinstance(v.get("sources"), dict)
                 and all(_hex(h) for h in v["sources"].values()),
                 "an object with the entry's name and each source's SHA-256"),
    "config": (lambda v: isinstance(v, str), "a configuration's name"),
    "low": (lambda v: isinstance(v, str), "a type's name"),
    "overrides": (_text_map, "an object of --set texts"),
    "constants": (_scalar_map, "an object of numbers and names"),
    "roles": (_scalar_map, "an object of numbers and names"),
    "entries": (lambda v: isinstance(v, dict) and all(_entry(e) for e in v.values()),
                "an object of entries (count, items, matrix, init, std)"),
    "carried": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
                "a list of buffer names"),
    "seed": (_integer, "a whole number, 0 or more"),
    "data": (lambda v: isinstance(v, dict) and _hex(v.get("sha256"))
             and _integer(v.get("tokens")) and v.get("kind") in ("bytes", "tokens"),
             "an object with the data's sha256, its tokens and its kind (bytes or tokens)"),
    "learning_rate": (lambda v: isinstance(v, dict) and _number(v.get("peak"))
                      and _number(v.get("floor")) and v["peak"] >= 0 and v["floor"] >= 0
                      and _integer(v.get("warmup")) and _integer(v.get("decay_steps")),
                      "an object with peak and floor (numbers, 0 or more), warmup and "
                      "decay_steps (whole numbers, 0 or more)"),
    "ranks": (lambda v: _integer(v, 1), "a whole number, 1 or more"),
}


def _position(value) -> bool:
    """A PCG64 state as NumPy writes it (128-bit state, odd increment) that NumPy takes."""
    if not (isinstance(value, dict) and value.get("bit_generator") == "PCG64"
            and isinstance(value.get("state"), dict)
            and _integer(value["state"].get("state"), 0, 1 << 128)
            and _integer(value["state"].get("inc"), 0, 1 << 128) and value["state"]["inc"] % 2
            and value.get("has_uint32") in (0, 1) and _integer(value.get("uinteger"), 0, 1 << 32)):
        return False
    try:
        np.random.PCG64().state = value
    except (TypeError, ValueError, OverflowError, KeyError):
        return False
    return True


_POSITION = "a PCG64 state (bit_generator, state, has_uint32, uinteger) as NumPy writes it"


def check_manifest(manifest: dict, path: str) -> None:
    """Every field cgc reads from a checkpoint's manifest is there, of its type and in its
    range: a one-line CheckpointError naming the first that is not. Keys it does not know
    (another version's) are left to the identity's comparison."""
    def refuse(field: str, value, wanted: str):
        raise CheckpointError(f"{path}: the manifest's {field} is {_short(value)}; it must be "
                              f"{wanted}")
    step = manifest.get("step")
    if not _integer(step):
        refuse("step", step, "a whole number of steps, 0 or more")
    losses = manifest.get("losses")
    if not (isinstance(losses, list) and all(_number(loss) for loss in losses)):
        refuse("losses", losses, "a list of finite numbers, one a step")
    if len(losses) != step:
        refuse("losses", losses, f"a list of {step} numbers, one for each step done")
    if not _position(manifest.get("data_position")):
        refuse("data_position", manifest.get("data_position"), _POSITION)
    validation = manifest.get("validation_position")
    if validation is not None and not _position(validation):
        refuse("validation_position", validation, f"null or {_POSITION}")
    # What the training loop writes is there always; what its caller adds (cgc run: the
    # backend, the ranks, the identity) is checked where it is there.
    if "backend" in manifest and not isinstance(manifest["backend"], str):
        refuse("backend", manifest["backend"], "a backend's name")
    if "ranks" in manifest and not _integer(manifest["ranks"], 1):
        refuse("ranks", manifest["ranks"], "a whole number, 1 or more")
    identity = manifest.get("identity", {})
    if not isinstance(identity, dict):
        refuse("identity", identity, "an object (the run's identity)")
    for key, (check, wanted) in _IDENTITY.items():
        if key in identity and not check(identity[key]):
            refuse(f"identity.{key}", identity[key], wanted)


def check_tensors(program, values: dict[str, np.ndarray], path: str) -> None:
    """Every storage the program's checkpoint keeps is there, with its size and type."""
    for label in saved_labels(program):
        if label not in values:
            raise CheckpointError(f"{path} has no tensor {label}, which this schedule keeps")
        array, count = values[label], saved_count(program, label)
        if array.size != count or array.dtype != saved_dtype(program, label):
            raise CheckpointError(f"{path}: tensor {label} holds {array.size} {array.dtype} "
                                  f"values; this schedule's holds {count} "
                                  f"{saved_dtype(program, label)}")
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
