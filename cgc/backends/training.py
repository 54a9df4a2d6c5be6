"""The training loop, one for every backend: steps, a progress line each, the dump.

A stop request (Ctrl-C in `cgc run`) ends the loop after the step under way; what was
done is returned as it would be at the end, so the caller can still report and plot it.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
import threading
from dataclasses import dataclass, field

import numpy as np

from ..core.diagnostics import CompileError, Diagnostic
from .base import Run


@dataclass
class Training:
    losses: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    stopped: bool = False  # ended early by a stop request


def model_flops_per_token(program) -> float | None:
    """6 N for the products of the parameters, plus the attention's own (PaLM's count), from
    the model's roles; None where the schedule does not declare the shape."""
    roles = program.roles
    try:
        width, layers = int(roles["width"]), int(roles["layers"])
        vocab, context = int(roles["vocab"]), int(roles["context"])
    except KeyError:
        return None
    parameters = vocab * width + layers * 12 * width * width
    return 6.0 * parameters + 12.0 * layers * width * context


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def progress_line(run: Run, step: int, steps: int, loss: float, seconds: float,
                  tokens: int, note: str = "") -> str:
    width = 24
    done = int(width * step / steps)
    line = (f"step {step:>{len(str(steps))}}/{steps} [{'#' * done}{'.' * (width - done)}] "
            f"loss {loss:.4f}  {seconds:.3f} s/step")
    if seconds <= 0:  # a clock too coarse to time the step says nothing of its speed
        return line + (f"  ({note})" if note else "")
    line += f"  {tokens / seconds:,.0f} tokens/s"
    flops = model_flops_per_token(run.program)
    if run.peak_flops and flops:
        line += f"  MFU {100 * flops * tokens / seconds / run.peak_flops:.1f}%"
    return line + (f"  ({note})" if note else "")


def train(run: Run, batches, steps: int, out=sys.stdout, dump: str | None = None,
          trace: list | None = None, stop: threading.Event | None = None) -> Training:
    """Runs `steps` steps. `trace` gets the first step's per-launch times; `dump` the run
    for replay (docs/dump-format.md)."""
    result = Training()
    if dump:
        check_dump_folder(dump)  # before the steps, not after them
    all_ids, all_targets = [], []
    before = run.bank_values("parameters") if dump else None
    first = None
    tokens = int(run.program.role("batch")) * int(run.program.role("context")) \
        * run.communicator.size  # every rank's: the step's throughput
    interactive = out.isatty() if hasattr(out, "isatty") else False
    for step in range(1, steps + 1):
        if stop is not None and stop.is_set():
            result.stopped = True
            break
        ids, targets = batches.next()
        outcome = run.step(ids, targets, trace if step == 1 else None)
        result.losses.append(outcome.loss)
        result.seconds.append(outcome.seconds)
        all_ids.append(ids)
        all_targets.append(targets)
        if step == 1 and dump:
            first = (run.bank_values("gradients"), run.bank_values("parameters"))
        line = progress_line(run, step, steps, outcome.loss, outcome.seconds, tokens,
                             outcome.note)
        last = step == steps or (stop is not None and stop.is_set())
        out.write(("\r" + line + ("\n" if last else "")) if interactive else line + "\n")
        out.flush()
    if dump and result.losses:
        write_dump(dump, run, result.losses, np.stack(all_ids), np.stack(all_targets), before,
                   *first, run.bank_values("parameters"),
                   corpus_sha256=_corpus_sha256(batches))
    return result


def _corpus_sha256(batches) -> str | None:
    from .data import sha256_of
    corpus = getattr(batches, "corpus", None)
    return sha256_of(corpus) if corpus is not None else None


DUMP_FORMAT = "cgc-dump-1"


class DumpError(CompileError):
    """A dump folder cgc will not write over: told as an error (exit 1), before the steps."""

    def __init__(self, message: str):
        super().__init__([Diagnostic("error", message, None)])
        self.message = message


def _is_dump(folder: str) -> bool:
    try:
        with open(os.path.join(folder, "run.json"), encoding="utf-8") as handle:
            return json.load(handle).get("format") == DUMP_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def check_dump_folder(folder: str) -> None:
    """A dump may go where nothing is, into an empty folder, or over an earlier dump (a
    folder whose run.json says cgc-dump-1), which it replaces whole; anything else is
    refused (DumpError), so that --dump never deletes what cgc did not write."""
    if not os.path.lexists(folder):
        return
    if not os.path.isdir(folder):
        raise DumpError(f"--dump {folder}: it exists and is not a folder; give a new folder, "
                        "an empty one, or an earlier dump's")
    try:
        empty = not os.listdir(folder)
    except OSError as error:
        raise DumpError(f"--dump {folder}: {error.strerror or error}") from None
    if not empty and not _is_dump(folder):
        raise DumpError(f"--dump {folder}: the folder holds files that are not a cgc dump "
                        f"(no run.json of format {DUMP_FORMAT}); cgc replaces only an "
                        "earlier dump: give a new folder, or an empty one")


def write_dump(folder: str, run: Run, losses, ids, targets, before, gradients, after,
               final, corpus_sha256: str | None = None) -> None:
    """Writes the dump into a temporary folder beside `folder`, every file flushed to the
    disk, then renames it into place: `folder` is never seen half written. An earlier dump
    there is renamed aside first and deleted after (a crash between the two renames leaves
    no `folder`, and the earlier dump as `.NAME.*.cgc-old` beside it)."""
    check_dump_folder(folder)
    target = os.path.realpath(folder)  # a link to a dump: the dump it points to
    parent, name = os.path.split(target)
    os.makedirs(parent, exist_ok=True)
    staging = os.path.join(parent, f".{name}.{secrets.token_hex(6)}.cgc-tmp")
    os.mkdir(staging)  # as any new folder (the umask's mode), unlike mkdtemp's 0700
    try:
        _write_dump_files(staging, run, losses, ids, targets, before, gradients, after, final,
                          corpus_sha256)
        _install(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _install(staging: str, target: str) -> None:
    if os.path.isdir(target) and os.listdir(target):  # an earlier dump: checked above
        aside = staging.removesuffix(".cgc-tmp") + ".cgc-old"
        os.rename(target, aside)
        os.rename(staging, target)
        _sync(os.path.dirname(target))
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(staging, target)  # onto nothing, or onto an empty folder
        _sync(os.path.dirname(target))


def _sync(path: str) -> None:
    """Flushes a file, or a folder's entries, to the disk (where the system allows it)."""
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def _save(path: str, array: np.ndarray) -> None:
    with open(path, "wb") as handle:
        np.save(handle, array)
        handle.flush()
        os.fsync(handle.fileno())


def _write_dump_files(folder: str, run: Run, losses, ids, targets, before, gradients, after,
                      final, corpus_sha256: str | None) -> None:
    program = run.program
    entries = {entry.name: {"count": entry.count, "items": entry.stack, "matrix": entry.matrix}
               for entry in program.entries}
    constants = {name: (value if isinstance(value, (int, float)) else float(value))
                 for name, value in program.constants.items()}
    manifest = {
        "format": DUMP_FORMAT,
        "backend": run.name,
        "config": program.config,
        "low": program.low,
        "constants": constants,
        "roles": {role: value for role, value in sorted(program.roles.items())},
        "seed": run.seed,
        "steps": len(losses),
        "losses": losses,
        "entries": entries,
        "corpus_sha256": corpus_sha256,
        # Data parallel: the ranks that ran; the tokens are rank 0's share (docs/parallel.md).
        "ranks": getattr(getattr(run, "communicator", None), "size", 1),
    }
    _save(os.path.join(folder, "ids.npy"), ids.astype(np.int32))
    _save(os.path.join(folder, "targets.npy"), targets.astype(np.int32))
    for name, values in (("before", before), ("gradients", gradients), ("after", after),
                         ("final", final)):
        os.makedirs(os.path.join(folder, name), exist_ok=True)
        for entry, array in values.items():
            _save(os.path.join(folder, name, f"{entry}.npy"), array.astype(np.float32))
        _sync(os.path.join(folder, name))
    with open(os.path.join(folder, "run.json"), "w", encoding="utf-8") as handle:
        json.dump(manifest, handle, indent=2, sort_keys=True)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())
    _sync(folder)


def summary(training: Training) -> str:
    """One line: the loss from first to last, and how many steps ran."""
    losses = training.losses
    if not losses:
        return "stopped before the first step finished"
    text = f"loss {losses[0]:.4f} -> {losses[-1]:.4f} after {_plural(len(losses), 'step')}"
    return text + (" (stopped early)" if training.stopped else "")
