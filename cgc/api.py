"""cgc from Python: load and check a schedule, read its launch program, memory plan and CUDA,
and train it (docs/api.md).

    import cgc
    schedule = cgc.load("schedules/train.cg", config="tiny")   # checked, or CompileError
    run = cgc.open_training(schedule, backend="numpy", steps=20)
    record = run.step()                                       # one step: loss, norm, rate
    run.train(on_step=lambda r: print(r.step, r.loss))       # on to step 20
    run.save("checkpoints/")                                  # resume=... continues it

Every command of `cgc` is a call of this module (cgc/cli.py parses the command line and
prints); each stage below it (cgc/frontend, cgc/checking, cgc/backends, cgc/training) is
one call here.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Mapping, Sequence
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from .checking.memory import MemoryPlan, format_memory_plan
from .core.diagnostics import CompileError, Diagnostic, Note, OptionError, RunError
from .core.ir import Program, format_program
from .pipeline import (Frontend, analyse, checked, collective_problems, kernel_folders, open_run,
                       parse_override)

if TYPE_CHECKING:  # loaded when a run is opened: `cgc compile` needs no NumPy
    from .backends.parallel import Communicator
    from .training.run import TrainingOptions, TrainingRun

__all__ = ["Schedule", "Sampling", "load", "open_training", "open_sampler", "overrides_of",
           "sample_schedule", "schedule_sources"]


def overrides_of(frontend: Frontend, overrides: Mapping[str, object] | Sequence[str] | None
                 ) -> dict[str, object]:
    """`--set`-style overrides (`["cgLayers=4"]`, or `{"cgLayers": 4}`) as the evaluator
    takes them: each a declared model constant with a value of its type (OptionError, with
    the reason, where not)."""
    texts = override_texts(overrides)
    found = {}
    for text in texts:
        try:
            name, value = parse_override(frontend, text)
        except ValueError as error:
            raise OptionError(str(error)) from None
        found[name] = value
    return found


def override_texts(overrides: Mapping[str, object] | Sequence[str] | None) -> list[str]:
    """Overrides as NAME=VALUE texts (a checkpoint's identity records them so)."""
    if isinstance(overrides, Mapping):
        return [f"{name}={value}" for name, value in overrides.items()]
    texts = as_list(overrides, "overrides")
    for text in texts:
        if not isinstance(text, str):
            raise OptionError(f"an override is NAME=VALUE text, not {type(text).__name__}")
    return texts


def config_of(frontend: Frontend, asked: str | None) -> str:
    """The configuration asked for, or the first one declared (OptionError if unknown)."""
    if asked is not None and asked not in frontend.declarations.configs:
        raise OptionError(f"unknown config '{asked}' (known: {', '.join(frontend.configs)})")
    return asked if asked is not None else (frontend.configs[0] if frontend.configs else None)


def as_list(value, what: str) -> list:
    """A list of names or paths given as one (a str or a path) or as several: a single str
    is one item, never its characters."""
    if value is None:
        return []
    if isinstance(value, (str, os.PathLike)):
        return [os.fspath(value)]
    try:
        return [os.fspath(item) if isinstance(item, os.PathLike) else item for item in value]
    except TypeError:
        raise OptionError(f"{what} must be a str, a path or a list of them, not "
                          f"{type(value).__name__}") from None


def schedule_sources(frontend: Frontend, path: str, kernels=()) -> dict[str, str]:
    """The SHA-256 of every file the schedule loads, and of every file in the folders of the
    user's kernels (`kernels`), by its path from the schedule's folder: a checkpoint's
    identity names them, so that a changed source or kernel is told on resume."""
    root = os.path.dirname(os.path.abspath(path))
    files = [m.path for m in frontend.modules] + sorted(
        os.path.join(folder, name) for folder in kernel_folders(kernels)
        for name in os.listdir(folder) if name.endswith((".cu.j2", ".py")))
    sources = {}
    for file in files:
        with open(file, "rb") as handle:
            sources[os.path.relpath(os.path.abspath(file), root)] = \
                hashlib.sha256(handle.read()).hexdigest()
    return sources


@dataclass
class Schedule:
    """A schedule file's entry in one configuration, evaluated and checked: its launch
    program, its memory plan and every warning the front end and the checker gave."""

    path: str
    frontend: Frontend
    program: Program
    plan: MemoryPlan
    warnings: list[Diagnostic] = field(default_factory=list)
    overrides: list[str] = field(default_factory=list)  # NAME=VALUE, as given

    @property
    def entry(self) -> str:
        """The schedule evaluated (a `def` of the file)."""
        return self.program.entry

    @property
    def config(self) -> str:
        """The configuration it was evaluated in."""
        return self.program.config

    def launch_program(self) -> str:
        """The launch program as `cgc ir` prints it."""
        return format_program(self.program)

    def memory_report(self) -> str:
        """The memory plan as `cgc check --memory` prints it."""
        return format_memory_plan(self.plan)

    def cuda(self) -> str:
        """The one CUDA file (host and device) `cgc compile` writes (CompileError where an
        image has no CUDA template)."""
        from .backends.cuda.emit import emit_program, image_problems
        problems = image_problems(self.program)
        if problems:
            raise CompileError(problems)
        return emit_program(self.program, self.plan).text


def load(path: str | os.PathLike, *, config: str | None = None, entry: str | None = None,
         overrides: Mapping[str, object] | Sequence[str] | None = None,
         kernels: Sequence[str | os.PathLike] = (), rank: int = 0, ranks: int = 1) -> Schedule:
    """Parses, resolves, type-checks and evaluates the schedule `entry` of the file `path`
    (default: its last schedule) in `config` (default: the first declared), with `overrides`
    of its model constants, and checks every launch; `kernels` are folders of your own kernel
    images (templates and reference functions, docs/tutorial.md); `rank` of `ranks`: the rank
    of a data-parallel run it is for (cgRank, cgRanks). Raises CompileError, whose
    text is the diagnostics as `cgc check` prints them; OptionError for an unknown config or
    override; PathError for a kernels folder that cannot be read."""
    path = os.fspath(path)
    return check_schedule(analyse([path]), path, config=config, entry=entry,
                          overrides=overrides, kernels=kernels, rank=rank, ranks=ranks)


def check_schedule(frontend: Frontend, path: str, *, config: str | None = None,
                   entry: str | None = None,
                   overrides: Mapping[str, object] | Sequence[str] | None = None,
                   kernels: Sequence[str | os.PathLike] = (), rank: int = 0,
                   ranks: int = 1) -> Schedule:
    """`load` on a front end already analysed (`cgc check` analyses a file once for all its
    configurations): evaluated, checked, and asked of every backend what it lacks (an image
    without a kernel template or a reference function), as `cgc check` does."""
    from .pipeline import backend_problems
    values = overrides_of(frontend, overrides)
    if not (isinstance(ranks, int) and isinstance(rank, int) and 0 <= rank < ranks):
        raise OptionError(f"rank {rank} of {ranks}: a rank runs from 0 to ranks - 1")
    try:
        result = checked(frontend, path, entry, config_of(frontend, config), values,
                         as_list(kernels, "kernels"), (rank, ranks))
    except CompileError as error:
        if ranks == 1:
            raise
        # which rank's program: each rank's differs where the schedule shards
        where = Note(f"in the program of rank {rank} of {ranks} (cgRank, cgRanks)")
        raise CompileError([dataclasses.replace(d, notes=d.notes + (where,))
                            if d.severity == "error" else d for d in error.diagnostics]) \
            from None
    problems = backend_problems(result.program)
    if problems:
        raise CompileError(problems + result.warnings)
    return Schedule(path, frontend, result.program, result.plan,
                    list(frontend.warnings) + result.warnings, override_texts(overrides))


def open_training(schedule: str | os.PathLike | Schedule, backend: str = "auto", *,
                  resume: str | None = None, communicator: "Communicator | None" = None,
                  options: TrainingOptions | None = None, entry: str | None = None,
                  **settings) -> TrainingRun:
    """A training run of a whole step (a schedule given the `step` role) on `backend`
    (numpy, emulated, cupy, or auto: cupy where a GPU is, else numpy). `settings` are
    TrainingOptions' fields (steps, seed, data, lr, lr_min, warmup, decay_steps, val_every,
    val_steps, checkpoint_dir, checkpoint_every, config, overrides, kernels). With `resume` (a
    checkpoint file or folder) the run continues it: the settings not given take the
    checkpoint's, and one that differs from it is an error naming it.

    Raises CompileError (the schedule, or a part of a step), CheckpointError, OptionError,
    RunError (data that does not fit), or backends.base.Unavailable (a backend that cannot
    run here)."""
    from .backends import choose
    from .backends.base import RunFault
    from .training.run import Resumed, TrainingOptions, TrainingRun
    options = options or TrainingOptions()
    given = isinstance(schedule, Schedule)
    path = schedule.path if given else os.fspath(schedule)
    if given:  # the schedule's own choices; the settings' overrides add to its own
        settings.setdefault("config", schedule.config)
        settings["overrides"] = list(schedule.overrides) + override_texts(
            settings.get("overrides"))
        settings.setdefault("kernels", list(schedule.program.kernel_folders))
        entry = entry or schedule.entry
    for name, value in settings.items():
        if not hasattr(options, name):
            raise TypeError(f"open_training() got an unknown setting '{name}'")
        if name == "overrides":
            value = override_texts(value)
        elif name in ("data", "kernels"):
            value = as_list(value, name) or (None if name == "data" else [])
        setattr(options, name, value)
    from .backends import REGISTRY
    if backend != "auto" and backend not in REGISTRY:
        raise OptionError(f"unknown backend '{backend}' (known: auto, {', '.join(REGISTRY)})")
    options.backend = backend
    options.check()
    if options.checkpoint_dir:  # a bad one told now, as `cgc run` tells it
        from .training.checkpoint import make_folder
        make_folder(options.checkpoint_dir)
    resumed = Resumed.read(resume) if resume else None
    if resumed is not None:
        options.take_from(resumed.manifest.get("identity", {}))
    chosen, why = choose(backend)
    frontend = analyse([path])
    values = overrides_of(frontend, options.overrides)
    try:
        # a program per rank: one that shards (cgRank, cgRanks) differs from rank to rank
        ranks = (communicator.rank, communicator.size) if communicator is not None else (0, 1)
        run = open_run(chosen, frontend, path, config_of(frontend, options.config), values,
                       options.seed or 0, entry, whole_step=True, kernels=options.kernels,
                       ranks=ranks)
    except RunFault as error:
        raise RunError(f"the {chosen} backend cannot run {path}: {error}") from None
    if communicator is not None:
        run.communicator = communicator
    problems = collective_problems(frontend, run.program, run.communicator.size)
    if problems:
        raise CompileError(problems)
    training = TrainingRun(run, schedule_sources(frontend, path, options.kernels), options,
                           source=path,
                           resumed=resumed, sampler_factory=_training_sampler)
    training.backend_reason = why
    return training


def sample_schedule(asked: str | None = None) -> str:
    """The forward-only schedule that samples (default: the shipped schedules/sample.cg)."""
    if asked:
        return asked
    from .resources import data_dir
    try:
        return str(data_dir("schedules") / "sample.cg")
    except FileNotFoundError:
        raise OptionError("cgc is installed without its schedules/ folder: give the sampling "
                          "schedule (--schedule FILE)") from None


# The forward-only schedules shipped beside each model's training steps.
SHIPPED_SAMPLERS = ("sample.cg", "llama/sample.cg")


def sampler_candidates(beside: str | None = None) -> list[str]:
    """The forward-only schedules that may sample a model nobody named one for: the
    sample.cg beside its training schedule `beside` (where there is one), then each shipped
    sampler (schedules/sample.cg, schedules/llama/sample.cg)."""
    found = []
    if beside and os.path.isfile(os.path.join(os.path.dirname(beside) or ".", "sample.cg")):
        found.append(os.path.join(os.path.dirname(beside) or ".", "sample.cg"))
    from .resources import data_dir
    try:
        shipped = data_dir("schedules")
    except FileNotFoundError:
        shipped = None
    for name in SHIPPED_SAMPLERS if shipped is not None else ():
        path = str(shipped / name)
        if os.path.isfile(path) and not any(os.path.samefile(path, f) for f in found):
            found.append(path)
    return found


def _matching_sampler(backend: str, asked: str | None, identity: dict, beside: str | None = None):
    """The sampler of the schedule asked for; else the first candidate (sampler_candidates)
    whose model is the one `identity` describes; CheckpointError naming each one's
    differences where none is."""
    from .training import checkpoint as checkpoints
    if asked:
        return _sampler_for(backend, asked, identity)
    problems = []
    for schedule in sampler_candidates(beside):
        try:
            return _sampler_for(backend, schedule, identity)
        except (checkpoints.CheckpointError, OptionError) as error:
            problems.append(getattr(error, "message", None) or str(error))
    if not problems:
        raise OptionError("cgc is installed without its schedules/ folder: give the sampling "
                          "schedule (--schedule FILE)")
    raise checkpoints.CheckpointError(
        "no shipped sampling schedule runs this model; give one with --schedule FILE (a "
        "forward-only schedule of the same entries): " + " | ".join(problems))


@dataclass
class Sampling:
    """A forward-only run of a checkpoint's model: `generate` continues a text."""

    sampler: object  # cgc.training.sampling.Sampler
    path: str | None  # the checkpoint, where one was read
    manifest: dict

    @property
    def vocab(self) -> int:
        """The model's vocabulary: token ids run 0 .. vocab - 1."""
        return self.sampler.vocab

    def generate(self, prompt: list[int], tokens: int, temperature: float = 0.0,
                 top_k: int | None = None, seed: int = 0, stop: threading.Event | None = None,
                 emit: Callable[[int], None] | None = None) -> list[int]:
        """`tokens` tokens after `prompt` (token ids), each given to `emit` as it is chosen;
        OptionError for what `cgc sample` refuses."""
        from .training.sampling import check_sampling
        if isinstance(prompt, (str, bytes)):
            raise OptionError("generate() takes the prompt's tokens (a list of ints; byte "
                              "tokens: list(text.encode()))")
        check_sampling(list(prompt), tokens, temperature, top_k, seed, self.vocab)
        return self.sampler.generate(prompt, tokens, temperature, top_k, seed, stop=stop,
                                     emit=emit)


def _sampler_for(backend: str, schedule: str, identity: dict):
    """The forward-only schedule in the model's configuration, as a Sampler; CheckpointError
    naming what differs where its model is not the one `identity` describes."""
    from .training import checkpoint as checkpoints
    from .training.run import entry_description
    from .training.sampling import Sampler, forward_only_problem
    frontend = analyse([schedule])
    overrides = overrides_of(frontend, [f"{name}={value}" for name, value
                                        in identity.get("overrides", {}).items()])
    config = config_of(frontend, identity.get("config"))
    run = open_run(backend, frontend, schedule, config, overrides, 0)
    problem = forward_only_problem(run.program, schedule)
    if problem:
        raise checkpoints.CheckpointError(problem)
    mine = {"entries": entry_description(run.program),
            "vocab": run.program.roles.get("vocab"), "low": run.program.low}
    theirs = {"entries": identity.get("entries"),
              "vocab": identity.get("roles", {}).get("vocab"), "low": identity.get("low")}
    differs = checkpoints.differences(theirs, mine)
    if differs:
        raise checkpoints.CheckpointError(f"{schedule} is not the checkpoint's model: "
                                          + "; ".join(differs))
    return Sampler(run)


def _training_sampler(training: TrainingRun):
    """A training run's sampler: the forward schedule beside its own (or a shipped one) whose
    model is the run's, in the run's configuration."""
    return _matching_sampler(training.run.name, None, training.identity, training.source)


def open_sampler(checkpoint: str, backend: str = "auto", schedule: str | None = None
                 ) -> Sampling:
    """The model a checkpoint holds (a file, or a folder's latest), on a forward-only
    schedule that `generate` runs token by token (default: the shipped sampler whose model is
    the checkpoint's, schedules/sample.cg or schedules/llama/sample.cg)."""
    from .backends import REGISTRY, choose
    from .training import checkpoint as checkpoints
    from .training.run import Resumed
    if backend != "auto" and backend not in REGISTRY:
        raise OptionError(f"unknown backend '{backend}' (known: auto, {', '.join(REGISTRY)})")
    chosen, _ = choose(backend)
    resumed = Resumed.read(checkpoint)
    identity = resumed.manifest.get("identity", {})
    if identity.get("data", {}).get("kind", "bytes") != "bytes":
        raise checkpoints.CheckpointError(
            f"{resumed.path} was trained on token files: cgc has no tokenizer to turn a "
            "prompt into its tokens (it samples byte-level models)")
    sampler = _matching_sampler(chosen, schedule, identity)
    sampler.load(resumed.values)
    return Sampling(sampler, resumed.path, resumed.manifest)

