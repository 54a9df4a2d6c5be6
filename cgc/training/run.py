"""A training run: one whole step on a backend, its data, its learning-rate schedule, its
checkpoints, as one object that steps, loops, saves, resumes and samples.

`cgc run` is this object driven from a command line; a Python user gets the same object from
`cgc.open_training` (cgc/api.py) and calls it from their own loop. It uses the backends
through their interface only (cgc/backends/base.py: `Run`): the schedule was loaded and
checked before it came here, and its sources' SHA-256 come with it for the run's identity.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Callable, TextIO

import numpy as np

from ..backends.base import Run, state_tensors
from ..backends.parallel import Communicator
from ..core.diagnostics import OptionError, PathError, RunError
from . import checkpoint as checkpoints
from .data import HELD_OUT_EVERY, Batches, Tokens, describe, load_tokens, split_documents
from .loop import (Checkpointing, LearningRate, StepRecord, Training, Validation, take_step,
                   train, write_checkpoint)
from .ranks import Discard, ShardedBatches


@dataclass
class TrainingOptions:
    """What a training run is asked to do: `cgc run`'s options, as values. None: the
    schedule's choice (the `peakLearningRate` role), or the checkpoint's where resumed."""

    steps: int = 10  # the run's last step (the decay's default length)
    seed: int | None = None  # the parameters' and the windows' seed (default 0)
    data: list[str] | None = None  # text files, folders or llm.c token files; None: cgc's own
    lr: float | None = None
    lr_min: float | None = None  # the cosine decay's floor (default: no decay)
    warmup: int | None = None
    decay_steps: int | None = None  # default: `steps`
    val_every: int = 0  # 0: no validation (and no documents held out)
    val_steps: int = 1
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0  # 0: a checkpoint at the end (and on a stop request) only
    overrides: list[str] = field(default_factory=list)  # NAME=VALUE, as --set gives them
    config: str | None = None
    backend: str = "auto"
    kernels: list[str] = field(default_factory=list)  # folders of the user's own kernels

    def check(self) -> None:
        """OptionError for a value no run can take (before anything is loaded)."""
        for name in ("steps", "seed", "warmup", "decay_steps", "val_every", "val_steps",
                     "checkpoint_every"):
            value = getattr(self, name)
            if value is None and name in ("seed", "warmup", "decay_steps"):
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise OptionError(f"--{name.replace('_', '-')} must be a whole number, not "
                                  f"{value!r}")
        for name in ("lr", "lr_min"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or
                                      not isinstance(value, (int, float))):
                raise OptionError(f"--{name.replace('_', '-')} must be a number, not {value!r}")
        if self.steps < 1:
            raise OptionError("--steps must be at least 1")
        for name in ("checkpoint_every", "val_every", "val_steps", "warmup", "lr", "lr_min",
                     "decay_steps", "seed"):
            value = getattr(self, name)
            if value is not None and (value < 0 or not math.isfinite(value)):
                raise OptionError(f"--{name.replace('_', '-')} must be a finite number, "
                                  "not negative")
        for name in ("lr", "lr_min"):  # the device reads the rate as a float32
            value = getattr(self, name)
            if value is not None and value > 3.4e38:
                raise OptionError(f"--{name.replace('_', '-')} {value} is past float32's range")
        if self.checkpoint_every and not self.checkpoint_dir:
            raise OptionError("--checkpoint-every needs --checkpoint-dir DIR")
        if self.val_every and self.val_steps < 1:
            raise OptionError("--val-steps must be at least 1")

    def take_from(self, identity: dict) -> None:
        """The options not given take a checkpoint's values (its configuration, seed,
        overrides and learning-rate schedule): a resumed run continues the one it saved."""
        if self.config is None:
            self.config = identity.get("config")
        if self.seed is None:
            self.seed = identity.get("seed")
        if not self.overrides:
            self.overrides = [f"{name}={value}"
                              for name, value in identity.get("overrides", {}).items()]
        rate = identity.get("learning_rate", {})
        for option, key in (("lr", "peak"), ("lr_min", "floor"), ("warmup", "warmup"),
                            ("decay_steps", "decay_steps")):
            if getattr(self, option) is None:
                setattr(self, option, rate.get(key))


@dataclass
class Resumed:
    """A checkpoint a run continues from: its file, tensors and manifest."""

    path: str
    values: dict[str, np.ndarray]
    manifest: dict

    @classmethod
    def read(cls, path: str) -> "Resumed":
        """The latest checkpoint in a folder, or the file named (CheckpointError if none)."""
        found = checkpoints.latest(path)
        return cls(found, *checkpoints.load(found))


def entry_description(program) -> dict:
    """The parameter entries as a checkpoint's identity names them: what must match for a
    checkpoint's tensors to fit another program (a sampler's, a resumed run's)."""
    return {e.name: {"count": e.count, "items": e.stack, "matrix": e.matrix, "init": e.init,
                     "std": e.std} for e in program.entries}


def identity(program, sources: dict[str, str], options: TrainingOptions, tokens: Tokens,
             rate: LearningRate, ranks: int) -> dict:
    """What must be the same for a run to continue from a checkpoint: the schedule (its
    sources' SHA-256, its entry, configuration, constants, roles and entries), the seed, the
    data and its held-out split (validation changes which documents train), the learning
    rates and the ranks (each takes its share of a step's windows)."""
    constants = {name: (value if isinstance(value, (int, float, str)) else float(value))
                 for name, value in sorted(program.constants.items())}
    return {
        "schedule": {"entry": program.entry, "sources": dict(sources)},
        "config": program.config, "low": program.low,
        "overrides": {t.split("=", 1)[0]: t.split("=", 1)[1] for t in options.overrides},
        "constants": constants,
        "roles": {role: value for role, value in sorted(program.roles.items())},
        "entries": entry_description(program),
        "carried": checkpoints.carried_buffers(program),
        "seed": options.seed or 0,
        "data": {"sha256": tokens.sha256, "tokens": int(tokens.tokens.size), "kind": tokens.kind,
                 "held_out": (f"1 in {HELD_OUT_EVERY} documents (--val-every)"
                              if options.val_every else "none (no --val-every)")},
        "learning_rate": rate.manifest(),
        "ranks": ranks,
    }


def learning_rate(program, options: TrainingOptions, source: str) -> LearningRate:
    """The run's rates: --lr (or the schedule's peakLearningRate role), warmed up and decayed
    to --lr-min over --decay-steps. No decay (floor = peak) leaves the rates independent of
    --steps, so such a run may go on longer than it first meant to."""
    peak = options.lr if options.lr is not None else program.roles.get("peakLearningRate")
    if peak is None:
        raise OptionError(f"{source} declares no peakLearningRate role: give --lr")
    floor = float(options.lr_min if options.lr_min is not None else peak)
    if floor > float(peak):
        given = "--lr" if options.lr is not None else f"{source}'s peakLearningRate role"
        raise OptionError(f"--lr-min {floor:g} is above the peak rate {float(peak):g} "
                          f"({given}): the decay only lowers it")
    return LearningRate(float(peak), floor, int(options.warmup or 0),
                        (options.decay_steps or options.steps) if floor != float(peak) else 0)


class TrainingRun:
    """One whole training step on a backend, with its data, rates and checkpoints.

    `step()` runs one step and returns its record; `train()` runs to a step with a progress
    line and callbacks; `save()` writes a checkpoint that `cgc.open_training(...,
    resume=FOLDER)` continues bit for bit; `parameters()` and `gradients()` are the model's
    tensors as the backend holds them (NumPy arrays, or CuPy arrays on the GPU), without a
    copy."""

    def __init__(self, run: Run, sources: dict[str, str], options: TrainingOptions, *,
                 source: str = "the schedule", communicator: Communicator | None = None,
                 resumed: Resumed | None = None, sampler_factory: Callable | None = None):
        self.run, self.options, self.source = run, options, source
        if communicator is not None:
            run.communicator = communicator
        self.communicator = run.communicator
        self.program = program = run.program
        try:
            self.batch, self.context, self.vocab = (int(program.role(r))
                                                    for r in ("batch", "context", "vocab"))
            program.role("ids"), program.role("targets"), program.role("loss")
        except KeyError as error:
            raise RunError(f"{source} cannot be trained: {error.args[0]}") from None
        self.tokens, self.batches, self.validation = self._data()
        self.learning_rate = learning_rate(program, options, source)
        self.identity = identity(program, sources, options, self.tokens, self.learning_rate,
                                 self.communicator.size)
        self.step_number, self.losses = 0, []
        self.resumed = resumed
        if resumed is not None:
            self._resume(resumed)
        self.checkpointing = (Checkpointing(options.checkpoint_dir, options.checkpoint_every,
                                            {"identity": self.identity, "backend": run.name,
                                             "ranks": self.communicator.size})
                              if options.checkpoint_dir else None)
        self._sampler_factory, self._sampler = sampler_factory, None
        self.backend_reason: str | None = None  # why this backend (auto's choice), if said

    # ---- setting up ------------------------------------------------------------------

    def _data(self):
        """The tokens, this rank's batches and the held-out batches (with --val-every)."""
        options, size = self.options, self.communicator.size
        seed = options.seed or 0
        try:
            tokens = load_tokens(options.data, self.vocab)
            training, held_out = split_documents(tokens, held_out=bool(options.val_every))
            batches = Batches(training, self.batch * size, self.context, seed)
            if size > 1:  # this rank's share of the step's windows
                batches = ShardedBatches(batches, self.communicator.rank, size)
            validation = (Validation(Batches(held_out, self.batch, self.context, seed + 1),
                                     options.val_every, options.val_steps)
                          if options.val_every else None)
        except OSError as error:  # a file inside a --data folder
            raise PathError(f"cannot read {error.filename}: {error.strerror or error}") \
                from None
        except ValueError as error:
            raise RunError(f"cannot use the training data: {error}") from None
        return tokens, batches, validation

    def _resume(self, resumed: Resumed) -> None:
        """The checkpoint's tensors, step, losses and data positions, once its identity is
        this run's (CheckpointError naming every difference where it is not)."""
        differs = checkpoints.differences(resumed.manifest.get("identity", {}), self.identity)
        if differs:
            raise checkpoints.CheckpointError(
                f"--resume {resumed.path}: this run differs from the checkpoint's: "
                + "; ".join(differs))
        checkpoints.check_tensors(self.program, resumed.values, resumed.path)
        start = int(resumed.manifest["step"])
        if start >= self.options.steps:
            raise OptionError(f"--resume {resumed.path}: the checkpoint is at step {start}; "
                              "--steps must be more to continue")
        checkpoints.restore(self.run, resumed.values)
        self.batches.restore(resumed.manifest["data_position"])
        if self.validation and resumed.manifest.get("validation_position"):
            self.validation.batches.restore(resumed.manifest["validation_position"])
        self.step_number, self.losses = start, list(resumed.manifest.get("losses", []))

    def describe(self) -> str:
        """One line: the schedule, configuration, backend and data, as `cgc run` starts."""
        program, size = self.program, self.communicator.size
        ranks = ("" if size == 1 else
                 f"; {size} ranks, {self.batch} of {self.batch * size} sequences a step each")
        return (f"{self.source}: {program.entry}, config {program.config} (low = {program.low}), "
                f"{self.run.name} backend"
                + (f" ({self.backend_reason})" if self.backend_reason else "")
                + f"; {self.tokens.describe()} of "
                f"{describe(self.options.data)}{ranks}")

    # ---- training --------------------------------------------------------------------

    def step(self) -> StepRecord:
        """Runs the next step on the next batch at its learning rate; returns its record
        (loss, gradient norm before clipping, rate, seconds, throughput)."""
        record, _ = take_step(self.run, self.batches, self.learning_rate, self.step_number + 1)
        self.step_number += 1
        self.losses.append(record.loss)
        return record

    def train(self, steps: int | None = None, *, out: TextIO | None = None,
              on_step: Callable[[StepRecord], None] | None = None,
              stop: threading.Event | None = None, dump: str | None = None,
              trace: list | None = None, log: TextIO | None = None, sample_every: int = 0,
              replace_dump: bool = False) -> Training:
        """Runs the steps after the current one up to `steps` (default: the options' steps),
        a progress line each on `out` (default: none), `on_step(record)` after each (the
        caller's own logging), validation and checkpoints as the options say, and a sample
        every `sample_every` steps; `stop` (set from another thread or a signal handler)
        ends it after the step under way. Returns what was done (losses, validation,
        the last checkpoint)."""
        steps = self.options.steps if steps is None else steps
        if steps < self.step_number + 1:
            raise OptionError(f"the run is at step {self.step_number}; train to a later step")
        sample = (lambda: self.sample("\n", 64, stop=stop)) if sample_every else None
        result = train(self.run, self.batches, steps, out if out is not None else Discard(),
                       dump=dump, trace=trace, stop=stop, learning_rate=self.learning_rate,
                       start=self.step_number, history=self.losses, log=log,
                       checkpointing=self.checkpointing, validation=self.validation,
                       sample=sample, sample_every=sample_every, replace_dump=replace_dump,
                       on_step=on_step)
        self.step_number += len(result.seconds)
        self.losses = list(result.losses)
        return result

    def save(self, folder: str | None = None) -> str:
        """Writes a checkpoint of the run as it is now into `folder` (default: the options'
        checkpoint folder); returns its file."""
        folder = folder or self.options.checkpoint_dir
        if not folder:
            raise OptionError("save() needs a folder (or a run opened with checkpoint_dir)")
        checkpointing = Checkpointing(folder, 0, {"identity": self.identity,
                                                  "backend": self.run.name,
                                                  "ranks": self.communicator.size})
        return write_checkpoint(self.run, checkpointing, self.step_number, self.batches,
                                self.losses, self.validation)

    # ---- the model's tensors -----------------------------------------------------------

    def parameters(self) -> dict:
        """Every parameter entry by name, as the backend holds it: writing into one changes
        the model (NumPy arrays on the CPU backends, CuPy arrays on the GPU: a float32
        storage as float32, a bfloat16 one as its uint16 bit patterns)."""
        return self._bank("parameters")

    def gradients(self) -> dict:
        """The last step's gradient of every entry, as `parameters()` gives them."""
        return self._bank("gradients")

    def _bank(self, role: str) -> dict:
        bank = self.run.banks[role][0]
        return {name: self.run.view(f"{bank}.{name}") for name in self.run.entries()}

    # ---- sampling --------------------------------------------------------------------

    def sample(self, prompt: str | bytes, tokens: int = 64, temperature: float = 0.0,
               top_k: int | None = None, seed: int = 0,
               stop: threading.Event | None = None) -> str:
        """A continuation of `prompt` by the model as it is now (a forward-only schedule,
        schedules/sample.cg, given these parameters); greedy at temperature 0. OptionError
        for what `cgc sample` refuses (no prompt, a byte past the vocabulary, a negative
        temperature, tokens outside 1 .. 100,000, top_k below 1 or past the vocabulary)."""
        from .sampling import check_sampling, decode_bytes
        data = prompt.encode("utf-8") if isinstance(prompt, str) else bytes(prompt)
        check_sampling(list(data), tokens, temperature, top_k, seed, self.vocab)
        if self._sampler is None:
            if self._sampler_factory is None:
                raise RunError("this run was opened without a sampler")
            self._sampler = self._sampler_factory(self)
        self._sampler.load(state_tensors(self.run, gather=False))  # rank 0 alone samples
        return decode_bytes(self._sampler.generate(list(data), tokens, temperature, top_k,
                                                   seed, stop=stop))

