"""The training loop, one for every backend: steps, a progress line each, the dump.

A stop request (Ctrl-C or SIGTERM in `cgc run`) ends the loop after the step under way (a
validation pass before its next batch, a sample after its token under way); what was done
is returned as it would be at the end, so the caller can still report and plot it.
"""

from __future__ import annotations

import errno
import json
import math
import os
import secrets
import shutil
import sys
import threading
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..core.diagnostics import CompileError, Diagnostic
from ..outputs import WriteFailed, discard, new_file
from ..resources import sync_to_disk
from ..backends.base import Run


@dataclass
class Training:
    losses: list[float] = field(default_factory=list)  # every step's, resumed ones included
    seconds: list[float] = field(default_factory=list)  # the steps run here
    stopped: bool = False  # ended early by a stop request, or as one (reader_left, refused)
    reader_left: bool = False  # the reader of the progress lines or the log left (`| head`)
    refused: Exception | None = None  # the progress lines' device refused them (a full disk)
    diverged: int | None = None  # the step whose loss was not finite, where training stopped
    validation: list[tuple[int, float]] = field(default_factory=list)  # (step, loss)
    checkpoint: str | None = None  # the last checkpoint written


@dataclass(frozen=True)
class LearningRate:
    """Linear warm-up from peak / warmup to `peak` over the first `warmup` steps, then a
    cosine decay to `floor` at step `decay_steps` (and `floor` after it). Step numbers start
    at 1; the rate is computed in float64 and rounded once to float32, as the device buffer
    holds it."""

    peak: float
    floor: float = 0.0
    warmup: int = 0
    decay_steps: int = 0  # 0: no decay (the peak after the warm-up)

    def at(self, step: int) -> float:
        if self.warmup and step <= self.warmup:
            rate = self.peak * step / self.warmup
        elif self.decay_steps <= self.warmup or not self.decay_steps:
            rate = self.peak
        else:
            progress = min(1.0, (step - self.warmup) / (self.decay_steps - self.warmup))
            rate = self.floor + 0.5 * (1.0 + math.cos(math.pi * progress)) * (self.peak - self.floor)
        return float(np.float32(rate))

    def manifest(self) -> dict:
        return {"peak": self.peak, "floor": self.floor, "warmup": self.warmup,
                "decay_steps": self.decay_steps}


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


@dataclass(frozen=True)
class StepRecord:
    """What one step reports: the progress line and the --log object are made from it."""

    step: int
    loss: float
    gradient_norm: float  # before clipping
    learning_rate: float
    seconds: float
    tokens_per_second: float | None
    mfu: float | None  # a fraction of the hardware's peak, where it is known

    def json(self) -> dict:
        """The record as `--log` writes it: one JSON object (kind "step")."""
        record = {"kind": "step", "step": self.step, "loss": self.loss,
                  "gradient_norm": self.gradient_norm, "learning_rate": self.learning_rate,
                  "ms": 1000.0 * self.seconds}
        if self.tokens_per_second is not None:
            record["tokens_per_second"] = self.tokens_per_second
        if self.mfu is not None:
            record["mfu"] = self.mfu
        return record


def step_record(run: Run, step: int, loss: float, gradient_norm: float, rate: float,
                seconds: float, tokens: int) -> StepRecord:
    speed = tokens / seconds if seconds > 0 else None  # a clock too coarse says nothing
    flops = model_flops_per_token(run.program)
    mfu = flops * speed / run.peak_flops if (speed and run.peak_flops and flops) else None
    return StepRecord(step, loss, gradient_norm, rate, seconds, speed, mfu)


def take_step(run: Run, batches, learning_rate: LearningRate | None, step: int,
              trace: list | None = None):
    """Step `step` on the next batch at its learning rate (the schedule's constant where
    none is given): its record, and the outcome, ids, targets and rate the dump keeps."""
    ids, targets = batches.next()
    rate = run.set_learning_rate(learning_rate.at(step) if learning_rate else None)
    outcome = run.step(ids, targets, trace)
    tokens = int(run.program.role("batch")) * int(run.program.role("context")) \
        * run.communicator.size  # every rank's: the step's throughput
    record = step_record(run, step, outcome.loss, run.gradient_norm(), rate, outcome.seconds,
                         tokens)
    return record, (outcome, ids, targets, rate)


def progress_line(record: StepRecord, steps: int, note: str = "") -> str:
    width = 24
    done = int(width * record.step / steps)
    line = (f"step {record.step:>{len(str(steps))}}/{steps} [{'#' * done}{'.' * (width - done)}] "
            f"loss {record.loss:.4f}  norm {record.gradient_norm:.4f}  "
            f"lr {record.learning_rate:.3e}  {1000 * record.seconds:.1f} ms")
    if record.tokens_per_second is not None:
        line += f"  {record.tokens_per_second:,.0f} tok/s"
    if record.mfu is not None:
        line += f"  MFU {100 * record.mfu:.1f}%"
    return line + (f"  ({note})" if note else "")


@dataclass
class Checkpointing:
    """Where and how often to checkpoint, and the manifest's fixed part (docs/checkpoint-format.md)."""

    folder: str
    every: int  # 0: only at the end and on a stop request
    manifest: dict
    # False on a rank that does not write (all but rank 0) but must take part in gathering
    # the shards of a sharded state (a ZeRO-1 step's moments)
    writes: bool = True


@dataclass
class Validation:
    batches: object  # a Batches over the held-out documents
    every: int
    steps: int  # batches averaged per validation


def stop_requested(run: Run, stop: threading.Event | None, here: bool = False) -> bool:
    """Whether to stop now: the stop request (Ctrl-C, SIGTERM), or a reason of this rank's
    own (`here`: its reader left), agreed by every rank of a data-parallel run (a rank that
    stopped alone would leave the others in a collective)."""
    stopping = here or (stop is not None and stop.is_set())
    if stop is not None and run.communicator.size > 1:
        stopping = run.communicator.average_scalar(1.0 if stopping else 0.0) > 0.0
    return stopping


def validation_loss(run: Run, validation: Validation,
                    stop: threading.Event | None = None) -> float | None:
    """The mean loss over `steps` held-out batches (Run.evaluate: the parameters, moments
    and step counter are as before); None if a stop request came before the last batch (it
    is checked before each: a pass of any length stops within one batch)."""
    losses = []
    for _ in range(validation.steps):
        if stop_requested(run, stop):
            return None
        losses.append(run.evaluate(*validation.batches.next()))
    return float(np.mean(losses))


def json_values(value):
    """`value` with every float that is not finite as null: JSON has no NaN or infinity
    (Python would write a bare NaN, which strict readers refuse)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: json_values(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_values(item) for item in value]
    return value


def _log(log, record: dict) -> None:
    if log is not None:
        try:
            log.write(json.dumps(json_values(record), sort_keys=True) + "\n")
            log.flush()
        except BrokenPipeError:  # its reader left (`--log /dev/stdout | head`): train's
            raise
        except OSError as error:
            raise OutputError(f"cannot write the log {log.name}: "
                              f"{error.strerror or error}") from None


def train(run: Run, batches, steps: int, out=sys.stdout, dump: str | None = None,
          trace: list | None = None, stop: threading.Event | None = None, *,
          learning_rate: LearningRate | None = None, start: int = 0,
          history: list[float] | None = None, log=None,
          checkpointing: Checkpointing | None = None, validation: Validation | None = None,
          sample=None, sample_every: int = 0, replace_dump: bool = False,
          on_step: Callable[[StepRecord], None] | None = None) -> Training:
    """Runs steps start+1 .. `steps`. `trace` gets the first step's per-launch times; `dump`
    the run for replay (docs/dump-format.md); `history` the losses of the steps before
    `start` (a resumed run). Each step sets the learning rate (`learning_rate`, or the
    schedule's constant where none is given), prints a progress line and writes one JSON
    object to `log` and calls `on_step` with its record; checkpoints, validation and samples
    come every so many steps."""
    result = Training(losses=list(history or []))
    if dump:
        check_dump_folder(dump, run, replace_dump)  # before the steps, not after them
    all_ids, all_targets, rates = [], [], []
    before = run.bank_values("parameters") if dump else None
    first = None
    # A line rewritten in place on a terminal; whole lines elsewhere, and on MPI ranks, whose
    # output mpirun passes through a terminal of its own whatever the user's is.
    interactive = (out.isatty() if hasattr(out, "isatty") else False) and \
        run.communicator.size == 1
    step = start

    gone = set()  # the streams whose reader left: "out", "log"

    def lost(which: str, stream, refused: Exception | None = None) -> None:
        """The reader of the progress lines or of the log left (`cgc run | head`), or the
        progress lines' device refused them (`refused`): the run stops after this step as a
        stop request stops it (its checkpoint and dump written, so that they hold every step
        the log does), and that stream gets nothing more. Without a stop request to act as
        (a caller's own loop), the error is the caller's."""
        if stop is None:
            raise refused or BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))
        if refused is None:
            result.reader_left = True
        else:
            result.refused = refused
        gone.add(which)
        discard(stream)

    def show(text: str) -> None:
        if "out" not in gone:
            try:
                out.write(text)
                out.flush()
            except BrokenPipeError:
                lost("out", out)
                return
            except WriteFailed as error:  # the standard output's (cgc/outputs.py)
                lost("out", out, error)
                return
            if getattr(out, "reader_left", False):  # the standard output said so (outputs.py)
                lost("out", out)

    def log_entry(entry: dict) -> None:
        if "log" not in gone:
            try:
                _log(log, entry)
            except BrokenPipeError:
                lost("log", log)

    for step in range(start + 1, steps + 1):
        if stop_requested(run, stop, bool(gone)):  # every rank after the same step
            result.stopped = True
            step -= 1
            break
        record, (outcome, ids, targets, rate) = take_step(
            run, batches, learning_rate, step, trace if step == start + 1 else None)
        norm = record.gradient_norm
        result.losses.append(outcome.loss)
        result.seconds.append(outcome.seconds)
        all_ids.append(ids)
        all_targets.append(targets)
        rates.append(rate)
        if step == start + 1 and dump:
            first = (run.bank_values("gradients"), run.bank_values("parameters"))
        log_entry(record.json())
        line = progress_line(record, steps, outcome.note)
        last = step == steps or (stop is not None and stop.is_set())
        show(("\r" + line + ("\n" if last else "")) if interactive else line + "\n")
        if on_step is not None:
            on_step(record)
        if not (math.isfinite(outcome.loss) and math.isfinite(norm)):  # every later step
            result.diverged = step                                   # would carry the NaN on
            if interactive and not last:
                show("\n")
            break
        if validation and validation.every and (step % validation.every == 0 or step == steps):
            position = validation.batches.position()
            loss = validation_loss(run, validation, stop)
            if loss is None:  # stopped during the pass: the step is done, its pass is not
                validation.batches.restore(position)  # the checkpoint's: before the pass
                result.stopped = True
                break
            result.validation.append((step, loss))
            log_entry({"kind": "validation", "step": step, "loss": loss})
            show(f"step {step}: validation loss {loss:.4f} ({validation.steps} batches)\n"
                 if validation.steps != 1 else f"step {step}: validation loss {loss:.4f}\n")
            if not math.isfinite(loss):  # the parameters this step wrote are ruined
                result.diverged = step
                break
        if sample is not None and sample_every and step % sample_every == 0:
            show(f"step {step}: sample: {sample()!r}\n")
        if checkpointing and checkpointing.every and step % checkpointing.every == 0 \
                and step != steps:
            result.checkpoint = write_checkpoint(run, checkpointing, step, batches,
                                                 result.losses, validation)
    # the end, or a stop request (Ctrl-C, SIGTERM); never parameters a diverged step wrote
    if checkpointing and step > start and result.diverged is None:
        result.checkpoint = write_checkpoint(run, checkpointing, step, batches, result.losses,
                                             validation)
    if dump and len(result.losses) > len(history or []):
        try:
            write_dump(dump, run, result.losses[len(history or []):], np.stack(all_ids),
                       np.stack(all_targets), before, *first, run.bank_values("parameters"),
                       corpus_sha256=_corpus_sha256(batches), learning_rates=rates,
                       learning_rate=learning_rate)
        except OSError as error:  # a full disk, a folder taken away: told as the dump's
            raise WriteFailed(f"cannot write the dump {dump}: {error.strerror or error}") \
                from None
    return result


def write_checkpoint(run: Run, checkpointing: Checkpointing, step: int, batches, losses,
                     validation: Validation | None) -> str:
    from . import checkpoint
    manifest = dict(checkpointing.manifest)
    manifest.update({"format": checkpoint.FORMAT, "step": step, "losses": list(losses),
                     "data_position": batches.position(),
                     "validation_position": validation.batches.position() if validation else None})
    tensors = checkpoint.tensors(run)  # a collective where the state is sharded
    if not checkpointing.writes:
        return None
    return checkpoint.save(checkpointing.folder, step, tensors, manifest)


def _corpus_sha256(batches) -> str | None:
    from .data import sha256_of
    corpus = getattr(batches, "corpus", None)
    return sha256_of(corpus) if corpus is not None else None


DUMP_FORMAT = "cgc-dump-1"


class OutputError(CompileError):
    """An output cgc cannot write (a full disk under the log): told as an error (exit 1)."""

    def __init__(self, message: str):
        super().__init__([Diagnostic("error", message, None)])
        self.message = message


class DumpError(OutputError):
    """A dump folder cgc will not write over: told as an error (exit 1), before the steps."""


_RUN_JSON_LIMIT = 64 * 1024 * 1024  # a dump's run.json takes kilobytes: past this, no dump


def _run_json(folder: str):
    """A dump folder's run.json, read only as a regular file of a sane size (a FIFO there
    is not waited on); None where there is none, or it is not that."""
    from ..resources import read_regular
    try:
        data = read_regular(os.path.join(folder, "run.json"), _RUN_JSON_LIMIT)
        return json.loads(data) if data is not None else None
    except (OSError, ValueError):
        return None


def _is_dump(folder: str) -> bool:
    manifest = _run_json(folder)
    return isinstance(manifest, dict) and manifest.get("format") == DUMP_FORMAT


def check_dump_folder(folder: str, run: Run | None = None, replace: bool = True) -> None:
    """A dump may go where nothing is, into an empty folder, or over an earlier dump (a
    folder whose run.json says cgc-dump-1), which it replaces whole; anything else is
    refused (DumpError), so that --dump never deletes what cgc did not write. Given the
    `run` and not told to `replace`, an earlier dump of another run (another configuration,
    seed, constants or schedule) is refused too: only the same run's dump is written over."""
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
    if empty or run is None or replace:
        return
    earlier = _run_json(folder)
    program = run.program
    now = {"config": program.config, "seed": run.seed,
           "constants": {name: (value if isinstance(value, (int, float)) else float(value))
                         for name, value in program.constants.items()},
           "roles": {role: value for role, value in sorted(program.roles.items())}}
    differs = [key for key in now if json.loads(json.dumps(now[key])) != earlier.get(key)]
    if differs:
        raise DumpError(f"--dump {folder} holds the dump of another run (its "
                        f"{', '.join(differs)} {'differs' if len(differs) == 1 else 'differ'}): "
                        "give --replace-dump to write over it, or another folder")


def write_dump(folder: str, run: Run, losses, ids, targets, before, gradients, after,
               final, corpus_sha256: str | None = None, learning_rates=None,
               learning_rate: LearningRate | None = None) -> None:
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
                          corpus_sha256, learning_rates, learning_rate)
        _install(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _install(staging: str, target: str) -> None:
    if os.path.isdir(target) and os.listdir(target):  # an earlier dump: checked above
        aside = staging.removesuffix(".cgc-tmp") + ".cgc-old"
        os.rename(target, aside)
        os.rename(staging, target)
        sync_to_disk(os.path.dirname(target))
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(staging, target)  # onto nothing, or onto an empty folder
        sync_to_disk(os.path.dirname(target))


def _save(path: str, array: np.ndarray) -> None:
    """`array` as a .npy file (np.save's bytes), in the staging folder cgc made: new, flushed.
    Its bytes go through Python's write, so a disk that fills says why (ENOSPC, EFBIG),
    where numpy's own (tofile) says only 'N requested and M written'."""
    if not (array.flags.c_contiguous or array.flags.f_contiguous):
        array = np.ascontiguousarray(array)
    header = np.lib.format.header_data_from_array_1_0(array)
    in_order = array.T if header["fortran_order"] else array  # its bytes as they lie
    with new_file(path) as handle:
        np.lib.format.write_array_header_1_0(handle, header)
        handle.write(memoryview(in_order.reshape(-1).view(np.uint8)))


def _write_dump_files(folder: str, run: Run, losses, ids, targets, before, gradients, after,
                      final, corpus_sha256: str | None, learning_rates=None,
                      learning_rate: LearningRate | None = None) -> None:
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
        "learning_rates": list(learning_rates) if learning_rates is not None else None,
        "learning_rate_schedule": learning_rate.manifest() if learning_rate else None,
    }
    if learning_rates is not None:
        _save(os.path.join(folder, "learning_rates.npy"),
              np.asarray(learning_rates, dtype=np.float32))
    _save(os.path.join(folder, "ids.npy"), ids.astype(np.int32))
    _save(os.path.join(folder, "targets.npy"), targets.astype(np.int32))
    for name, values in (("before", before), ("gradients", gradients), ("after", after),
                         ("final", final)):
        os.makedirs(os.path.join(folder, name), exist_ok=True)
        for entry, array in values.items():
            _save(os.path.join(folder, name, f"{entry}.npy"), array.astype(np.float32))
        sync_to_disk(os.path.join(folder, name))
    with new_file(os.path.join(folder, "run.json")) as handle:
        handle.write((json.dumps(json_values(manifest), indent=2, sort_keys=True) + "\n")
                     .encode("utf-8"))
    sync_to_disk(folder)


def summary(training: Training) -> str:
    """One line: the loss from first to last, and how many steps ran."""
    losses = training.losses
    if not losses:
        return "stopped before the first step finished"
    text = f"loss {losses[0]:.4f} -> {losses[-1]:.4f} after {_plural(len(losses), 'step')}"
    if training.validation:
        step, loss = training.validation[-1]
        text += f", validation loss {loss:.4f} (step {step})"
    return text + (" (stopped early)" if training.stopped else "")
