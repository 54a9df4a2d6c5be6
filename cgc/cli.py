"""The `cgc` command: check schedules, print their launch programs."""

from __future__ import annotations

import argparse
from functools import partial
import difflib
import os
import signal
import stat
import sys
import threading
import time
import traceback

from . import __version__, api
from .backends import REGISTRY
from .core.diagnostics import CompileError, OptionError, PathError, RunError, render_all
from .outputs import Refused, WriteFailed, script_status
from .resources import install_hint
from .pipeline import Frontend, analyse, check, evaluate

EXIT_OK, EXIT_DIAGNOSTICS, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a command stopped by Ctrl-C
EXIT_TERMINATED = 143  # 128 + SIGTERM: a batch system's stop, told apart from Ctrl-C

_DESCRIPTION = """\
cgc compiles schedules of GPU kernel launches (.cg files) that describe a training step
of a GPT-style transformer. It proves every launch safe before anything runs.

exit status: 0 success, 1 diagnostics (errors in a schedule, a missing tool, an output the
disk refused), 2 usage errors (an unknown command or option, a bad value, a FILE that cannot
be read, an output that must not be written), 130 stopped by Ctrl-C, 143 stopped by SIGTERM."""


# A command line cgc cannot act on: exit 2, the usage and the reason; a path that cannot
# be read (or written): exit 2, one line. The library raises them too (cgc/api.py).
_UsageError, _PathError = OptionError, PathError


def _count(count: int, word: str, plural: str | None = None) -> str:
    """'1 launch', '2 launches', '0 files'."""
    return f"{count} {word if count == 1 else plural or word + 's'}"


def _readable(paths, folders: bool = False) -> None:
    """Every path named on the command line exists and can be read (a folder too where
    `folders`), checked before the front end sees it: a missing one is a usage error
    (exit 2), not a diagnostic. (A missing file that a .cg file imports is an error in that
    source: a diagnostic at the import.)"""
    for path in paths:
        try:
            mode = os.stat(path).st_mode
            if stat.S_ISDIR(mode):
                if not folders:
                    raise IsADirectoryError(21, "Is a directory")
                if not os.access(path, os.R_OK | os.X_OK):
                    raise PermissionError(13, "Permission denied")
            elif not stat.S_ISREG(mode):
                raise _PathError(f"cannot read {path}: not a regular file (a FIFO, device or "
                                 "socket is never read)")
            else:  # opened without blocking, never read here
                os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
        except OSError as error:
            raise _PathError(f"cannot read {path}: {error.strerror or error}") from None


def _writable(path: str | None) -> None:
    """An output can be written (its folder exists, it is no folder, not read-only), checked
    before any work is done (cgc/outputs.py; exit 2 where not)."""
    if path and path != "-":
        from .outputs import check
        check(path)


def _write_text(path: str, text: str) -> bool:
    """Whether `path` got all of `text` (not where a pipe's reader left first)."""
    from .outputs import write_file
    return write_file(path, text)  # cgc/outputs.py: Refused (exit 2) or WriteFailed (exit 1)


def _add_program_options(parser: argparse.ArgumentParser, several_configs: bool) -> None:
    parser.add_argument("--entry", metavar="NAME",
                        help="the schedule to use (default: the last schedule declared in FILE)")
    if several_configs:
        parser.add_argument("--config", metavar="NAME", action="append",
                            help="check this configuration (repeatable; default: every "
                                 "configuration declared)")
    else:
        parser.add_argument("--config", metavar="NAME",
                            help="the configuration (default: the first one declared)")
    parser.add_argument("--set", metavar="CONSTANT=VALUE", action="append", default=[],
                        help="override a model constant, e.g. --set cgLayers=96 (repeatable)")
    parser.add_argument("--kernels", metavar="DIR", action="append", default=[],
                        help="a folder of your own kernel images: SNAKE_NAME.cu.j2 templates "
                             "and a reference.py whose KERNELS table the numpy backend runs "
                             "(repeatable; docs/tutorial.md)")


def _add_rank_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=_rank_count, default=1, metavar="N",
                        help="the program of one of N data-parallel ranks (a schedule that "
                             "shards, with cgRank and cgRanks, is one program a rank; "
                             "default: 1)")
    parser.add_argument("--rank", type=int, default=0, metavar="R",
                        help="which rank's program, 0 to N - 1 (default: 0)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cgc", description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"cgc {__version__}")
    # no abbreviated options: `--rank` must not be taken for `--ranks` where only one exists
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=partial(
        argparse.ArgumentParser, allow_abbrev=False))
    for add in (_check_parser, _ir_parser, _compile_parser, _fmt_parser, _doc_parser,
                _run_parser, _sample_parser):
        add(commands)
    return parser


def _check_parser(commands) -> None:
    """`cgc check`."""
    checker = commands.add_parser(
        "check", help="prove schedules safe: types, slots, extents, permissions, aliasing",
        description="Parse, resolve and type-check FILE (and what it imports), evaluate its "
                    "entry schedule in every configuration, and check every launch: each "
                    "argument slot bound once with the right type, every access inside its "
                    "buffer for every grid index and repeat iteration, no write a phase may "
                    "not make, no unallowed aliasing. Prints all diagnostics, sorted by "
                    "position; the rules are in docs/checker.md.")
    checker.add_argument("files", nargs="+", metavar="FILE_OR_DIR",
                         help="a .cg schedule file, or a folder: every .cg file under it. "
                              "The files of one folder are checked together (one model's); "
                              "each folder on its own (schedules/ and schedules/llama/ are "
                              "two models)")
    _add_program_options(checker, several_configs=True)
    checker.add_argument("--ranks", type=_rank_count, default=1, metavar="N",
                         help="check the program of each of N data-parallel ranks (a "
                              "schedule that shards, with cgRank and cgRanks, is one "
                              "program a rank); with --memory, also print each rank's total "
                              "(default: 1)")
    checker.add_argument("--memory", action="store_true",
                         help="also print the memory plan: banks and entries, step buffers, "
                              "arena slots with offsets and sizes (shared when their "
                              "lifetimes never overlap), total and peak bytes")


def _ir_parser(commands) -> None:
    """`cgc ir`."""
    ir = commands.add_parser(
        "ir", help="print the launch program of a schedule",
        description="Print the evaluated launch program of FILE's entry schedule: one line per "
                    "launch (phase, image, grid, source location) and one per bound slot, with "
                    "repeats kept as loops. The text is stable: the same input gives the same "
                    "bytes.")
    ir.add_argument("file", metavar="FILE", help="a .cg schedule file")
    _add_program_options(ir, several_configs=False)
    _add_rank_options(ir)
    ir.add_argument("-o", "--output", metavar="PATH",
                    help="write the text here, not to stdout (- for stdout)")


def _compile_parser(commands) -> None:
    """`cgc compile`."""
    compiler = commands.add_parser(
        "compile", help="emit one CUDA file (kernels and host program) for a schedule",
        description="Check FILE and emit its entry schedule as one .cu file: the kernels "
                    "(one per image, from templates/), and under #ifndef __CUDACC_RTC__ the host "
                    "program (memory plan, one function per phase, a checked launch per "
                    "cgLaunch, cuBLAS for the products, and a main that replays a dumped run). "
                    "NVRTC compiles the file as it is; nvcc builds the whole of it. The same "
                    "input gives the same bytes.")
    compiler.add_argument("file", metavar="FILE", help="a .cg schedule file")
    _add_program_options(compiler, several_configs=False)
    _add_rank_options(compiler)
    compiler.add_argument("-o", "--output", metavar="OUT.cu",
                          help="where to write (default: STEM.CONFIG.cu here; - for stdout)")
    compiler.add_argument("--nvrtc", action="store_true",
                          help="also compile the device part with NVRTC for sm_90 (sm_90a where "
                               "a kernel uses Hopper's own instructions) and report its "
                               "messages at the template lines they come from")
    compiler.add_argument("--report", action="store_true",
                          help="print each kernel's registers, shared memory and spills as "
                               f"ptxas reports them (needs nvcc: {install_hint('cuda-tools')})")


def _fmt_parser(commands) -> None:
    """`cgc fmt`."""
    formatter = commands.add_parser(
        "fmt", help="lay schedules out in the one canonical way",
        description="Rewrite each FILE (or every .cg file under a folder) in the canonical "
                    "layout: declarations in column 1, terms broken to fit 100 columns, "
                    "comments kept. Only layout changes: the launch program and the emitted "
                    "CUDA stay the same. Formatting twice changes nothing.")
    formatter.add_argument("files", nargs="+", metavar="FILE", help="a .cg file or a folder")
    formatter.add_argument("--check", action="store_true",
                           help="change nothing; list the files that would change and exit 1 "
                                "if there are any")


def _doc_parser(commands) -> None:
    """`cgc doc`."""
    doc = commands.add_parser(
        "doc", help="write HTML pages of schedules, every name linked to its declaration",
        description="Write static HTML (no network, no scripts): one page per .cg file with "
                    "its declarations, their types and rendered documentation, and its "
                    "highlighted source with line numbers, every use of a name linked to its "
                    "declaration in whatever file; and index.html, every declaration. The "
                    "files of one folder are documented together (one model's); each other "
                    "folder's go to a folder of their own under OUT_DIR.")
    doc.add_argument("files", nargs="+", metavar="DIR_OR_FILE", help="a .cg file or a folder")
    doc.add_argument("-o", "--output", metavar="OUT_DIR", required=True,
                     help="the folder to write the pages into")


def _run_parser(commands) -> None:
    """`cgc run`: the schedule, the backend, the data; then the option groups."""
    run = commands.add_parser(
        "run", help="run training steps of a schedule",
        description="Check FILE, then run its entry schedule as training steps. The numpy "
                    "backend runs every launch on the bounds-checked reference machine (each "
                    "kernel's NumPy semantics, every access checked against its declared "
                    "extent and its buffer) on the CPU; it is the ground truth the GPU is "
                    "compared with. Tokens are bytes (the tiny configuration's vocabulary is "
                    "256) of the --data files, or by default of the corpus shipped with cgc "
                    "(cgc/training/corpus.txt: cgc's own Python and Markdown sources, frozen; the "
                    "same bytes on every machine).")
    run.add_argument("file", metavar="FILE", help="a .cg schedule file (schedules/train.cg: "
                                                  "the whole step)")
    _add_program_options(run, several_configs=False)
    run.add_argument("--backend", choices=("auto", *REGISTRY), default="auto",
                     help="where to run: " + "; ".join(
                         f"{name}: {what}" for name, (_, what) in REGISTRY.items())
                     + "; auto (the default): cupy when a GPU is present, else numpy")
    run.add_argument("--steps", type=int, default=10, metavar="N",
                     help="train up to step N, counting the steps of a resumed run "
                          "(default 10)")
    run.add_argument("--seed", type=int, metavar="S",
                     help="seeds the parameters and the choice of windows (default 0; with "
                          "--resume, the checkpoint's)")
    run.add_argument("--data", nargs="+", metavar="PATH",
                     help="text files or folders to take byte tokens from, or llm.c token "
                          "files (.bin: uint16 tokens after a 256-int32 header); default: the "
                          "corpus shipped with cgc, cgc/training/corpus.txt")
    _run_rate_options(run)
    _run_keep_options(run)
    _run_output_options(run)


def _run_rate_options(run) -> None:
    """`cgc run`'s learning-rate schedule."""
    rates = run.add_argument_group(
        "learning rate", "linear warm-up to --lr over --warmup steps, then a cosine decay to "
                         "--lr-min at step --decay-steps; written into a device buffer each step "
                         "(with --resume, each defaults to the checkpoint's)")
    rates.add_argument("--lr", type=float, metavar="RATE",
                       help="the peak learning rate (default: the schedule's "
                            "peakLearningRate role)")
    rates.add_argument("--lr-min", type=float, metavar="RATE",
                       help="the floor of the cosine decay (default: --lr, no decay)")
    rates.add_argument("--warmup", type=int, metavar="N", help="warm-up steps (default 0)")
    rates.add_argument("--decay-steps", type=int, metavar="N",
                       help="the step at which the decay reaches --lr-min (default: --steps)")


def _run_keep_options(run) -> None:
    """`cgc run`'s checkpoints, log, validation and samples."""
    keep = run.add_argument_group("checkpoints and logs")
    keep.add_argument("--checkpoint-dir", metavar="DIR",
                      help="write checkpoints here (step-NNNNNNNN.safetensors, "
                           "docs/checkpoint-format.md): at the end, every --checkpoint-every "
                           "steps, and on Ctrl-C or SIGTERM")
    keep.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                      help="also checkpoint every N steps")
    keep.add_argument("--resume", metavar="DIR_OR_FILE",
                      help="continue a run from a checkpoint (a folder: its latest); the "
                           "continued run is bit-identical to one that never stopped")
    keep.add_argument("--log", metavar="FILE.jsonl",
                      help="write one JSON object per step and per validation")
    held = run.add_argument_group("validation and samples")
    held.add_argument("--val-every", type=int, default=0, metavar="N",
                      help="every N steps (and at the end), the loss on held-out documents "
                           "(every tenth document of the data is held out)")
    held.add_argument("--val-steps", type=int, default=4, metavar="K",
                      help="held-out batches averaged per validation (default 4)")
    held.add_argument("--sample-every", type=int, default=0, metavar="N",
                      help="every N steps, print a greedy sample from the model (the "
                           "sample.cg beside the schedule, else the shipped one that runs "
                           "its model)")


def _run_output_options(run) -> None:
    """`cgc run`'s dump, trace, plot and ranks."""
    run.add_argument("--dump", metavar="DIR",
                     help="write the run for replay: configuration, tokens, every entry before "
                          "and after the first step, its gradients, the losses "
                          "(docs/dump-format.md); an earlier dump of the same run there is "
                          "replaced, one of another run refused")
    run.add_argument("--replace-dump", action="store_true",
                     help="let --dump write over the dump of another run")
    run.add_argument("--trace", metavar="FILE.json",
                     help="time the first step launch by launch (CUDA events on the GPU) and "
                          "write per-phase and per-launch times in Chrome's trace format "
                          "(open it in Perfetto or chrome://tracing)")
    run.add_argument("--plot", metavar="FILE.png", help="draw the loss curve")
    run.add_argument("--ranks", type=_rank_count, metavar="N",
                     help="data parallel on N ranks: starts `mpirun -n N cgc run ...` (the "
                          "same as running it yourself under mpirun); each rank takes its "
                          "share of every step's sequences and the schedule's all-reduce "
                          "averages the gradients (schedules/train_parallel.cg, "
                          "docs/parallel.md); at most as many ranks as cores unless "
                          "--oversubscribe; ranks not all started in 120 s end the job "
                          "(CGC_RANKS_START_SECONDS in the environment sets the time)")
    run.add_argument("--oversubscribe", action="store_true",
                     help="with --ranks: allow more ranks than this machine has cores (they "
                          "share them, each waiting its turn: for trying data parallel on a "
                          "small machine)")


def _sample_parser(commands) -> None:
    """`cgc sample`."""
    sample = commands.add_parser(
        "sample", help="write text with a trained model (a checkpoint of cgc run)",
        description="Load CHECKPOINT's parameters into a forward-only schedule (by default "
                    "the shipped one that runs its model, schedules/sample.cg or "
                    "schedules/llama/sample.cg, checked by the same pipeline as the training step, "
                    "in the checkpoint's configuration) and continue --prompt by --tokens "
                    "byte tokens, one forward pass each: the arg-max of the last row's logits "
                    "(--temperature 0, the default: greedy, deterministic), or a draw from "
                    "their softmax at --temperature over the --top-k largest, seeded by --seed.")
    sample.add_argument("checkpoint", metavar="CHECKPOINT",
                        help="a checkpoint file, or a --checkpoint-dir folder (its latest)")
    sample.add_argument("--prompt", default="\n", metavar="TEXT",
                        help="the text to continue (default: a newline)")
    sample.add_argument("--tokens", type=int, default=200, metavar="N",
                        help="tokens to write (default 200, at most 100,000), each printed "
                             "as it comes")
    sample.add_argument("--temperature", type=float, default=0.0, metavar="T",
                        help="0 (the default): greedy; above 0: draw from softmax(logits / T)")
    sample.add_argument("--top-k", type=int, metavar="K",
                        help="draw only among the K most likely tokens")
    sample.add_argument("--seed", type=int, default=0, metavar="S",
                        help="seeds the draws (default 0)")
    sample.add_argument("--schedule", metavar="FILE",
                        help="the forward-only schedule (default: cgc's schedules/sample.cg or "
                             "schedules/llama/sample.cg, whichever runs the checkpoint's model)")
    sample.add_argument("--backend", choices=("auto", *REGISTRY), default="auto",
                        help="where to run (as for cgc run)")


def _configs(frontend: Frontend, asked) -> list[str]:
    """The configurations asked for (each checked by the library), or every one declared
    (None where none is: the library says so at the schedule)."""
    return [api.config_of(frontend, name) for name in asked] if asked else frontend.configs or [None]


MAX_CHECKED_RANKS = 1024  # --ranks: each rank's program is checked, one after another


def _rank_count(text: str) -> int:
    """argparse's type for --ranks N: a whole number from 1 to 1024."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_CHECKED_RANKS:
        raise argparse.ArgumentTypeError(f"expected a number of ranks from 1 to "
                                         f"{MAX_CHECKED_RANKS}, not '{text}'")
    return value


def _check(args) -> int:
    """`cgc check`: every file's entry in every configuration asked, by the library's
    check_schedule (cgc.load on a front end analysed once a folder)."""
    warnings = []
    for files in _by_folder(_cg_files(args.files)):
        _check_together(args, files, warnings)
    if warnings:
        print(render_all(warnings), file=sys.stderr)
    return EXIT_OK


def _by_folder(files: list[str]) -> list[list[str]]:
    """The files in groups of one folder each, in order of first appearance: the files of a
    folder are one model's and are checked together (they may share declarations); two
    folders may hold two models that declare the same names (schedules/, schedules/llama/)."""
    groups: dict[str, list[str]] = {}
    for path in files:
        groups.setdefault(os.path.dirname(os.path.abspath(path)), []).append(path)
    return list(groups.values())


def _check_together(args, files: list[str], warnings: list) -> None:
    """`cgc check` on files analysed together: each one's entry in every configuration."""
    frontend = analyse(files)
    api.overrides_of(frontend, args.set)  # a bad --set is told before any file
    configs = _configs(frontend, args.config)
    warnings.extend(w for w in frontend.warnings if w not in warnings)
    for path in files:
        if args.entry is None and frontend.default_entry(path) is None:
            print(f"{path}: ok: declarations only (no schedule to evaluate)")
            continue
        launches = {}
        for config in configs:
            # one program a rank (cgRank): each checked; the memory plan is rank 0's
            schedules = [api.check_schedule(frontend, path, config=config, entry=args.entry,
                                            overrides=args.set, kernels=args.kernels,
                                            rank=rank, ranks=args.ranks)
                         for rank in range(args.ranks)]
            program = schedules[0].program
            launches[config] = sum(1 for _ in program.launches())
            for schedule in schedules:
                warnings.extend(w for w in schedule.warnings if w not in warnings)
            if args.memory:
                print(schedules[0].memory_report())
                if args.ranks > 1:
                    from .checking.memory import format_rank_totals
                    print(format_rank_totals([s.plan for s in schedules]))
        summary = ", ".join(f"{config} ({_count(count, 'launch', 'launches')})"
                            for config, count in launches.items())
        print(f"{path}: ok: {program.entry} in {summary}")


def _outputs_not_inputs(frontend: Frontend, outputs: dict, read=(), replaced=None) -> None:
    """Refused (exit 2) before any work where an output is a file the command reads (FILE,
    what it imports, the files `read` names) or two outputs are one file (cgc/outputs.py)."""
    from .outputs import check_command, files_under
    check_command(outputs, [m.path for m in frontend.modules] + files_under(read), replaced)


def _checked_program(args, output_for=None):
    """FILE's entry in the chosen configuration, evaluated and checked; warnings printed.
    `output_for(config)`: where the output goes (default: -o)."""
    _readable([args.file])
    _writable(args.output)
    frontend = analyse([args.file])
    overrides = api.overrides_of(frontend, args.set)
    config = _configs(frontend, [args.config] if args.config else None)[0]
    _outputs_not_inputs(frontend, {"-o": output_for(config) if output_for else args.output})
    if not 0 <= args.rank < args.ranks:
        raise _UsageError(f"--rank {args.rank}: a rank of --ranks {args.ranks} runs from 0 to "
                          f"{args.ranks - 1}")
    program = evaluate(frontend, args.file, args.entry, config, overrides, args.kernels,
                       (args.rank, args.ranks))
    warnings = frontend.warnings + program.warnings + check(program)
    if warnings:
        print(render_all(warnings), file=sys.stderr)
    return frontend, program


def _ir(args) -> int:
    from .core.ir import format_program
    _, program = _checked_program(args)
    text = format_program(program)
    if args.output and args.output != "-":
        _write_text(args.output, text)
    else:
        sys.stdout.write(text)
    return EXIT_OK


def _compile(args) -> int:
    from .backends.cuda.compile import compiler_diagnostics, default_output
    from .backends.cuda.emit import emit_program, image_problems
    from .backends.cuda.toolchain import (ToolchainMissing, architecture_of, nvrtc_compile,
                                          ptxas_report)
    from .checking.memory import plan_memory
    _, program = _checked_program(
        args, lambda config: default_output(args.file, config, args.output))
    problems = image_problems(program)
    if problems:
        raise CompileError(problems)
    emitted = emit_program(program, plan_memory(program))
    output = default_output(args.file, program.config, args.output)
    if output == "-":
        sys.stdout.write(emitted.text)
    else:
        if _write_text(output, emitted.text):
            print(f"wrote {output}: {_count(len(emitted.kernels), 'kernel')}, "
                  f"{_count(emitted.text.count(chr(10)), 'line')}", file=sys.stderr)
    name = output if output != "-" else "<stdout>"
    try:
        if args.nvrtc:
            ok, log, _ = nvrtc_compile(emitted.text, name)
            found = compiler_diagnostics(emitted, log, name)
            if found or not ok:
                print(render_all(found) if found else log, file=sys.stderr)
                if not ok:
                    return EXIT_DIAGNOSTICS
            target = architecture_of(emitted.text)
            print(f"NVRTC compiled {name} for {target} with no warnings" if not found else
                  f"NVRTC compiled {name} for {target}", file=sys.stderr)
        if args.report:
            ok, log, reports = ptxas_report(emitted.text)
            if not ok:
                print(render_all(compiler_diagnostics(emitted, log, name)) or log, file=sys.stderr)
                return EXIT_DIAGNOSTICS
            dynamic = {k.image: k.shared_bytes for k in emitted.kernels}
            print(f"{'kernel':<36} {'registers':>9} {'static smem':>12} {'dynamic smem':>13} "
                  f"{'spill stores':>13} {'spill loads':>12}")
            for report in sorted(reports, key=lambda r: r.name):
                print(f"{report.name:<36} {report.registers:>9} {report.shared_bytes:>12} "
                      f"{dynamic.get(report.name, 0):>13} {report.spill_stores:>13} "
                      f"{report.spill_loads:>12}")
    except ToolchainMissing as error:
        print(f"cgc: error: {error}", file=sys.stderr)
        return EXIT_DIAGNOSTICS
    return EXIT_OK


def _cg_files(paths: list[str]) -> list[str]:
    found = []
    for path in paths:
        if os.path.isdir(path):
            found += sorted(os.path.join(folder, name) for folder, _, names in os.walk(path)
                            for name in names if name.endswith(".cg"))
        else:
            found.append(path)
    if not found:
        raise _PathError("no .cg files found in " + ", ".join(paths))
    _readable(found)
    return found


def _fmt(args) -> int:
    from .core.diagnostics import CompileError as Broken, Diagnostic
    from .frontend.load import SourceError, read_source
    from .tools.format import format_text, replace_file
    changed, problems = [], []
    files = _cg_files(args.files)
    for path in files:
        try:
            text = read_source(path)
            formatted = format_text(text, path)
        except OSError as error:
            raise _PathError(f"cannot read {path}: {error.strerror or error}") from None
        except SourceError as error:  # not a regular file, too large, not UTF-8
            problems.append(Diagnostic("error", f"cannot read '{path}': {error}", None))
            continue
        except Broken as error:
            problems.extend(error.diagnostics)
            continue
        if formatted != text:
            changed.append(path)
            if not args.check:  # a temporary file renamed onto the file: never half written
                replace_file(path, formatted)
    if problems:
        print(render_all(problems), file=sys.stderr)
        return EXIT_DIAGNOSTICS
    for path in changed:
        print(f"{'would reformat' if args.check else 'reformatted'} {path}")
    verb = "would be reformatted" if args.check else "reformatted"
    print(f"{_count(len(changed), 'file')} {verb}, {_count(len(files) - len(changed), 'file')} "
          "unchanged", file=sys.stderr)
    return EXIT_DIAGNOSTICS if args.check and changed else EXIT_OK


def _doc(args) -> int:
    """`cgc doc`: the pages of each folder's files (one model's, _by_folder) in a folder of
    their own: the first folder's in OUT_DIR, another's in OUT_DIR/ITS_PATH from the first
    (schedules/llama/ in OUT_DIR/llama/)."""
    from .tools.doc import write_documentation
    groups = _by_folder(_cg_files(args.files))
    if os.path.exists(args.output) and not os.path.isdir(args.output):
        raise _PathError(f"cannot write {args.output}: Not a directory")
    frontends = [analyse(files) for files in groups]  # every folder's errors before any page
    top = os.path.dirname(os.path.abspath(groups[0][0]))
    for files, frontend in zip(groups, frontends):
        where = os.path.relpath(os.path.dirname(os.path.abspath(files[0])), top)
        if where.startswith(os.pardir):
            where = os.path.basename(os.path.dirname(os.path.abspath(files[0])))
        output = os.path.normpath(os.path.join(args.output, where))
        try:
            written = write_documentation(frontend, output)
        except OSError as error:
            raise _PathError(f"cannot write {output}: {error.strerror or error}") from None
        print(f"wrote {_count(len(written), 'page')} to {output} (start at "
              f"{os.path.join(output, 'index.html')})")
    return EXIT_OK


def _choose_backend(name: str) -> tuple[str, str] | None:
    """The backend `--backend NAME` picks and why; None, the reason told, where it cannot
    run here."""
    from .backends import choose
    from .backends.base import Unavailable
    try:
        return choose(name)
    except Unavailable as error:
        print(f"cgc: error: --backend {name}: {error}; the CPU reference machine runs "
              "anywhere: --backend numpy", file=sys.stderr)
        return None


def _launch_ranks(args) -> int:
    """`cgc run --ranks N`: what every rank would refuse is refused here, before mpirun
    starts (a schedule that is not a data-parallel whole step, more ranks than cores)."""
    from .backends.parallel import CommunicatorError
    from .pipeline import collective_problems, whole_step_problems
    from .training import ranks
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if args.ranks > (cores or 1) and not args.oversubscribe:
        raise _UsageError(f"--ranks {args.ranks} is more ranks than this machine's {cores} "
                          "cores: each rank would wait for a core; give --oversubscribe to "
                          "run them anyway")
    try:
        seconds = ranks.start_seconds()
    except ValueError as error:
        raise _UsageError(str(error)) from None
    _readable([args.file])
    # each rank's program, as that rank will evaluate it (a sharded step differs by rank)
    for rank in range(args.ranks):
        schedule = api.load(args.file, config=args.config, entry=args.entry,
                            overrides=args.set, kernels=args.kernels, rank=rank,
                            ranks=args.ranks)
    problems = whole_step_problems(schedule.frontend, schedule.program, args.file) or \
        collective_problems(schedule.frontend, schedule.program, args.ranks)
    if problems:
        raise CompileError(problems)
    try:
        return ranks.launch_ranks(args.ranks, ranks.without_ranks(args.argv), seconds)
    except (CommunicatorError, ranks.LaunchFailed) as error:
        print(f"cgc: error: {error}", file=sys.stderr)
        return EXIT_DIAGNOSTICS


def _training_options(args):
    """`cgc run`'s options as the library's TrainingOptions (checked: OptionError)."""
    from .training.run import TrainingOptions
    options = TrainingOptions(
        steps=args.steps, seed=args.seed, data=args.data, lr=args.lr, lr_min=args.lr_min,
        warmup=args.warmup, decay_steps=args.decay_steps, val_every=args.val_every,
        val_steps=args.val_steps, checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every, overrides=list(args.set), config=args.config,
        kernels=list(args.kernels))
    options.check()
    if args.sample_every is not None and args.sample_every < 0:
        raise _UsageError("--sample-every must be a finite number, not negative")
    return options


def _run_outputs(args) -> None:
    """Every path `cgc run` reads can be read and every output may be written, and the
    checkpoint folder is made: all before any work, so that a bad one is told at once."""
    from .outputs import check_command
    _readable([args.file])
    _readable(args.data or (), folders=True)
    if args.resume:
        _readable([args.resume], folders=True)
    check_command({"--log": args.log, "--plot": args.plot, "--trace": args.trace}, (),
                  {"--dump": args.dump}, {"--checkpoint-dir": args.checkpoint_dir})
    if args.checkpoint_dir:
        from .training.checkpoint import make_folder
        make_folder(args.checkpoint_dir)
    frontend = analyse([args.file])  # an output that is one of the run's inputs: refused
    _outputs_not_inputs(frontend, {"--log": args.log, "--plot": args.plot, "--trace": args.trace},
                        [*(args.data or ()), args.resume,
                         api.sample_schedule() if args.sample_every else None],
                        {"--dump": args.dump})


def _run(args) -> int:
    """`cgc run`: the library's training run (cgc/training/run.py), opened, trained with a
    progress line a step, and reported."""
    from .backends import parallel
    options = _training_options(args)
    if args.ranks is not None and args.ranks > 1 and parallel.launched_size() <= 1:
        return _launch_ranks(args)
    try:
        communicator = parallel.world()
    except parallel.CommunicatorError as error:
        print(f"cgc: error: {error}", file=sys.stderr)
        return EXIT_DIAGNOSTICS
    if communicator.size > 1:
        from .training.ranks import check_in
        check_in(communicator.rank)  # to the `cgc run --ranks N` that started it, if one did
    if args.ranks is not None and args.ranks != communicator.size:
        raise _UsageError(f"--ranks {args.ranks}, but mpirun started {communicator.size}")
    _run_outputs(args)
    chosen = _choose_backend(args.backend)
    if chosen is None:
        return EXIT_DIAGNOSTICS
    try:
        training = api.open_training(args.file, chosen[0], resume=args.resume,
                                     entry=args.entry, communicator=communicator,
                                     options=options)
    except CompileError:
        if communicator.lead:
            raise
        return EXIT_DIAGNOSTICS  # every rank sees the same schedule: rank 0 says it, once
    training.backend_reason = chosen[1]
    lead = communicator.lead
    if training.run.warnings and lead:
        print(render_all(training.run.warnings), file=sys.stderr)
    if lead:
        if training.resumed:
            print(f"resumed from {training.resumed.path} at step {training.step_number}",
                  file=sys.stderr)
        print(training.describe(), file=sys.stderr)
    else:  # rank 0 alone prints, dumps, traces, plots, logs, samples and checkpoints
        args.dump = args.trace = args.plot = args.log = None
        args.sample_every = 0
        if training.checkpointing is not None and training.program.sharded:
            training.checkpointing.writes = False  # it gives its shards, rank 0 writes
        else:
            training.checkpointing = None
    return _train(args, training)


def _train(args, training) -> int:
    """The steps, then what `cgc run` reports of them; the exit status."""
    from .backends.base import DataError, RunFault
    from .backends.parallel import CommunicatorError
    from .training.ranks import quiet_unless_lead
    start, timings = training.step_number, ([] if args.trace else None)
    log = None
    if args.log:  # written as it goes, by cgc/outputs.py's rules; appended to on --resume
        from .outputs import Stream
        log = Stream(args.log, append=bool(training.resumed), what="the log")
    _STEPPING.set()
    try:
        result = training.train(out=quiet_unless_lead(training.communicator), stop=_STOP,
                                dump=args.dump, trace=timings, log=log,
                                sample_every=args.sample_every, replace_dump=args.replace_dump)
    except CommunicatorError as error:
        print(f"cgc: error: {error}", file=sys.stderr)
        return EXIT_DIAGNOSTICS
    except DataError as error:
        print(f"cgc: error: the training data does not fit the model: {error}",
              file=sys.stderr)
        return EXIT_DIAGNOSTICS
    except RunFault as error:
        print(_step_failure(training.run.name, error), file=sys.stderr)
        return EXIT_DIAGNOSTICS
    finally:
        _STEPPING.clear()
        if log is not None:
            try:
                log.close()
            except OSError:
                pass  # the write that failed has said so
    _report(args, training, result, start, timings)
    return _training_status(training, result)


def _step_failure(backend: str, error) -> str:
    """A failed step as a diagnostic at its launch, with the calls to it, where the backend
    knows them; one line where not."""
    if error.span is None:
        return f"cgc: error: the step failed on the {backend} backend: {error}"
    from .core.diagnostics import Diagnostic, Note
    notes = tuple(Note("required from the call here", span) for span in reversed(error.trace))
    return render_all([Diagnostic("error", f"the step failed on the {backend} backend: {error}",
                                  error.span, notes)])


def _report(args, training, result, start: int, timings) -> None:
    """What a run wrote (dump, checkpoint, trace, plot), then its one-line summary."""
    from .training.loop import summary
    if args.dump and len(result.losses) > start:
        print(f"dumped the run to {args.dump}", file=sys.stderr)
    if result.checkpoint:
        print(f"wrote the checkpoint {result.checkpoint}", file=sys.stderr)
    if args.trace and timings:
        from .tools.trace import write_trace
        if write_trace(args.trace, timings, training.run.name):  # WriteFailed: exit 1
            print(f"wrote the first step's trace to {args.trace}", file=sys.stderr)
    if args.plot and result.losses:
        from .tools.plot import write_loss_plot
        if write_loss_plot(args.plot, result.losses):
            print(f"drew the loss curve in {args.plot}", file=sys.stderr)
    size = training.communicator.size
    if training.communicator.lead:
        print(summary(result) + ("" if size == 1 else f" on {size} ranks"))


def _training_status(training, result) -> int:
    if result.refused is not None:  # the progress lines: the run stopped after that step
        print(f"cgc: error: {result.refused}", file=sys.stderr)
        return EXIT_DIAGNOSTICS
    if result.diverged is not None:
        if training.communicator.lead:  # every rank sees it (the loss is their mean)
            rate = training.learning_rate.at(result.diverged)
            print(f"cgc: error: step {result.diverged} made the loss, the gradient norm or "
                  "the validation loss a number that is not finite: training diverged, so "
                  "it stopped there and wrote no checkpoint of it (learning rate "
                  f"{rate:.4g}: a lower --lr or a --warmup may help)", file=sys.stderr)
        return EXIT_DIAGNOSTICS
    # a run whose reader left (`| head`) stopped as a stop request stops, quietly: exit 0
    return _stopped_status() if result.stopped and not result.reader_left else EXIT_OK


def _sample(args) -> int:
    """`cgc sample`: a checkpoint's model continues --prompt, each token as it comes."""
    from .training.sampling import check_prompt, check_request
    check_request(args.tokens, args.temperature, args.top_k, args.seed)
    _readable([args.checkpoint], folders=True)
    _readable([api.sample_schedule(args.schedule)])
    chosen = _choose_backend(args.backend)
    if chosen is None:
        return EXIT_DIAGNOSTICS
    sampling = api.open_sampler(args.checkpoint, chosen[0], args.schedule)
    # the command line's bytes as given: text that is not UTF-8 comes as surrogate escapes
    prompt = list(args.prompt.encode("utf-8", "surrogateescape"))
    check_prompt(prompt, args.top_k, sampling.vocab)
    tokens = _stream_sample(args, sampling, prompt)
    print(f"sampled {_count(len(tokens), 'token')} from {sampling.path} "
          f"(step {sampling.manifest['step']}) on the {chosen[0]} backend, "
          + ("greedy" if args.temperature == 0 else
             f"temperature {args.temperature:g}" + (f", top {args.top_k}" if args.top_k else "")
             + f", seed {args.seed}") + (" (stopped early)" if _STOP.is_set() else ""),
          file=sys.stderr)
    return _stopped_status() if _STOP.is_set() else EXIT_OK


def _stream_sample(args, sampling, prompt: list[int]) -> list[int]:
    """The prompt, then each token as it comes (not the whole text at the end)."""
    from .training.sampling import ByteText
    text = ByteText()

    def emit(token: int) -> None:
        sys.stdout.write(text.add([token]))
        sys.stdout.flush()

    class Stop:  # a stop request, or the reader gone (`| head -c 100`): no more tokens
        @staticmethod
        def is_set() -> bool:
            return _STOP.is_set() or getattr(sys.stdout, "reader_left", False)

    sys.stdout.write(text.add(prompt))
    sys.stdout.flush()
    _STEPPING.set()  # a stop request ends the sample after the token under way
    try:
        return sampling.generate(prompt, args.tokens, args.temperature, args.top_k, args.seed,
                                 stop=Stop, emit=emit)
    finally:
        _STEPPING.clear()
        sys.stdout.write(text.end() + "\n")
        sys.stdout.flush()


# Set by Ctrl-C (SIGINT) while `cgc run` trains (_STEPPING): it stops after the step under
# way and still reports, plots and traces what was done. Elsewhere Ctrl-C stops at once.
_STOP = threading.Event()
_STEPPING = threading.Event()


def main(argv: list[str] | None = None) -> int:
    """`cgc ARGV` (the process's own arguments where None). A library caller's standard
    descriptors are theirs again after it (a reader that left had the null device put
    there, for a process that ends: outputs.descriptors_kept)."""
    if argv is None:
        return _main_on_a_thread(argv)
    from .outputs import descriptors_kept
    with descriptors_kept((sys.stdout, sys.stderr)):
        return _main_on_a_thread(argv)


def _main_on_a_thread(argv: list[str] | None) -> int:
    """Runs the command on a thread with a deep stack: terms nest, and so does the compiler."""
    result: list[int] = []
    threading.stack_size(_STACK_BYTES)
    previous = sys.getrecursionlimit()
    sys.setrecursionlimit(max(previous, _RECURSION_LIMIT))
    finished = threading.Event()

    def work() -> None:
        try:
            result.append(_main(argv))
        finally:
            finished.set()

    # Waits on an event, not on join(): on Python 3.11 a Ctrl-C that interrupts join() marks
    # the thread stopped while it still runs (threading's bpo-45274 handler releases the
    # lock the running thread holds), and the run would end with no summary, exit 3.
    worker = threading.Thread(target=work, daemon=True)
    streams = sys.stdout, sys.stderr  # the process's: the worker wraps them (_main)
    requests = {"at": 0.0, "forwarded": False}
    _STOP.clear()
    _STOP_SIGNAL[0] = signal.SIGINT
    _REQUESTED.clear()
    _STEPPING.clear()
    previous_term = _take_sigterm()
    try:
        worker.start()
        while not finished.is_set():
            try:
                finished.wait(0.1)
            except KeyboardInterrupt:  # Ctrl-C (SIGINT's own handler): never quiet
                if _quiet():
                    _STOP_SIGNAL[0] = signal.SIGINT
                _REQUESTED.set()
            if _REQUESTED.is_set():
                _REQUESTED.clear()
                status = _interrupted(requests)
                if status is not None:
                    return status
    finally:
        sys.stdout, sys.stderr = streams  # stopped now (Ctrl-C twice): not left to the worker
        sys.setrecursionlimit(previous)
        for number, handler in (previous_term or {}).items():
            if argv is None and number != signal.SIGTERM and handler == signal.SIG_DFL:
                # the process's own command has ended: a stop request now (a rank whose
                # launcher's reader left as the run ended) is nothing to do, not a kill
                handler = signal.SIG_IGN
            signal.signal(number, handler)
    if not result:
        return EXIT_INTERNAL
    if requests["forwarded"]:  # the ranks were asked to stop: mpirun's status is its own
        return _stopped_status()
    return _stopped_status() if _STOP.is_set() and result[0] == EXIT_OK else result[0]


def _interrupted(requests: dict) -> int | None:
    """A stop request while a command runs (Ctrl-C; SIGTERM, SIGUSR1 and SIGUSR2 through
    _take_sigterm): the same Ctrl-C again (delivered to the process and its group) ignored;
    passed on to the ranks a `--ranks` run started, which stop after their step, and asked
    again, the ranks ended now; a training run stopped after the step under way; anything
    else stopped now: its status returned. `requests`: when the last
    request came ("at") and whether one was passed on ("forwarded")."""
    from .backends.parallel import launched_rank
    from .training.ranks import QUIET_STOP_SIGNAL, end_launched, forward_stop, \
        launched_by_cgc, starting_launch
    # of ranks started by hand, rank 0 alone says it; a rank `cgc run --ranks N` started
    # never does: its launcher says what it passes on (quietly), and another request is
    # mpirun's own ending of the job (a rank died), which the launcher tells
    quiet = _quiet() or launched_rank() > 0 or launched_by_cgc()
    now = time.monotonic()
    if (_STOP.is_set() or requests["forwarded"]) and \
            now - requests["at"] < _DUPLICATE_SIGNAL_SECONDS:
        return None  # the same Ctrl-C, delivered to the process and its group
    if requests["forwarded"] and end_launched():  # --ranks, asked again: end them now
        print("\ncgc: stopped", file=sys.stderr)
        return _stopped_status()
    starting = starting_launch()
    if starting is not None:  # --ranks, the ranks not all up: nothing to keep, ended now
        if not quiet:  # said first: a start-up that hangs takes seconds to end
            print("\ncgc: stopped", file=sys.stderr)
        starting.end()
        return _stopped_status()
    # --ranks: the ranks stop after a step, quietly (each would say so, and end with a status
    # mpirun would report as a failure); this process says so once, and ends with the status
    if forward_stop(QUIET_STOP_SIGNAL):
        requests["forwarded"], requests["at"] = True, now
        if not quiet:
            print("\ncgc: stopping after the step under way (Ctrl-C again to stop now)",
                  file=sys.stderr)
        return None
    if _STOP.is_set() or not _STEPPING.is_set():  # stop now
        if not quiet:
            print("\ncgc: stopped", file=sys.stderr)
        return _stopped_status()
    _STOP.set()
    requests["at"] = now
    if not quiet:
        print("\ncgc: stopping after the step under way (Ctrl-C again to stop now)",
              file=sys.stderr)
    return None


# The signal that asked the run to stop, the last one: its exit status says which (128 + the
# signal), or QUIET_STOP_SIGNAL's (a rank whose launcher's reader left): nothing said, 0.
_STOP_SIGNAL = [signal.SIGINT]
# A stop request by a signal _take_sigterm handles: main's loop takes it within 0.1 s (the
# handlers raise nothing, so a request that comes as the command ends, past the loop, is
# nothing: no KeyboardInterrupt out of main's last lines)
_REQUESTED = threading.Event()


def _quiet() -> bool:
    from .training.ranks import QUIET_STOP_SIGNAL
    return _STOP_SIGNAL[0] == QUIET_STOP_SIGNAL


def _stopped_status() -> int:
    from .training.ranks import launched_by_cgc
    if _quiet() or launched_by_cgc():  # a rank: its launcher tells the outcome
        return EXIT_OK
    return EXIT_TERMINATED if _STOP_SIGNAL[0] == signal.SIGTERM else EXIT_INTERRUPTED


def _take_sigterm():
    """SIGTERM (a batch system's stop) as Ctrl-C: a training run stops after the step under
    way and writes its checkpoint; so does SIGUSR1, which mpirun forwards to the ranks, and
    SIGUSR2 quietly (no message, exit 0: the launcher's reader left, ranks.relay).
    Returns the handlers it replaced, by signal (None off the main thread, where Python
    cannot set one)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def stop(signum, frame):
        _STOP_SIGNAL[0] = signal.SIGTERM
        _REQUESTED.set()

    def stop_quietly(signum, frame):
        _STOP_SIGNAL[0] = signum
        _REQUESTED.set()

    # what mpirun forwards to a rank: STOP_SIGNAL as SIGTERM, QUIET_STOP_SIGNAL quietly
    from .training.ranks import QUIET_STOP_SIGNAL, STOP_SIGNAL
    handlers = {number: signal.signal(number, stop) for number in (signal.SIGTERM, STOP_SIGNAL)}
    handlers[QUIET_STOP_SIGNAL] = signal.signal(QUIET_STOP_SIGNAL, stop_quietly)
    return handlers


# A second SIGINT this soon after the first is the same Ctrl-C: `timeout -s INT` and some
# shells deliver it to the process and again to its group.
_DUPLICATE_SIGNAL_SECONDS = 1.0
_STACK_BYTES = 512 * 1024 * 1024
_RECURSION_LIMIT = 200_000


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    [commands] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return commands


def _command_list(parser: argparse.ArgumentParser) -> str:
    """A short usage and every command with its one-line help: what `cgc` alone prints."""
    commands = _subparsers(parser)
    width = max(len(c.dest) for c in commands._choices_actions)
    lines = [f"  {c.dest:<{width}}  {c.help}" for c in commands._choices_actions]
    return ("usage: cgc COMMAND [ARGUMENTS]\n\ncommands:\n" + "\n".join(lines) +
            "\n\n'cgc COMMAND --help' tells a command's arguments; 'cgc --help' tells more.")


def _unknown_command(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """The error for a first argument that is no command, suggesting the nearest one."""
    names = list(_COMMANDS)
    for argument in argv:
        if argument in ("-h", "--help", "--version"):
            return None  # argparse answers these before looking at the command
        if argument.startswith("-"):
            continue
        if argument in names:
            return None
        close = difflib.get_close_matches(argument, names, n=1)
        if close:
            return f"cgc: error: unknown command '{argument}'; did you mean '{close[0]}'?"
        return f"cgc: error: unknown command '{argument}'\n\n{_command_list(parser)}"
    return None


def _main(argv: list[str] | None) -> int:
    # cgc/outputs.py: a reader that left, a device that refuses (--help's text too)
    return script_status(lambda: _parsed_command_status(argv), "cgc")


def _parsed_command_status(argv: list[str] | None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    unknown = _unknown_command(parser, argv)
    if unknown:
        print(unknown, file=sys.stderr)
        return EXIT_USAGE
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit:  # --help, --version and usage errors
        return int(exit.code or 0)
    if args.command is None:  # `cgc` alone: what there is to do
        print(_command_list(parser), file=sys.stderr)
        return EXIT_USAGE
    args.argv = argv  # what `cgc run --ranks N` passes on to each rank
    return _command_status(parser, args)


def _command_status(parser, args) -> int:
    """The command's exit status; its errors told, each as its kind is."""
    try:
        return _COMMANDS[args.command](args)
    except CompileError as error:
        status = EXIT_DIAGNOSTICS if any(d.severity == "error" for d in error.diagnostics) \
            else EXIT_OK
        print(render_all(error.diagnostics), file=sys.stderr)
        return status
    except RunError as error:  # a run that cannot start or go on: one line
        print(f"cgc: error: {error}", file=sys.stderr)
        return EXIT_DIAGNOSTICS
    except _UsageError as error:
        if not isinstance(error, _PathError):  # a path's problem is told in one line
            _subparsers(parser).choices[args.command].print_usage(sys.stderr)
        print(f"cgc: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except Refused as error:  # an output cgc must not write: nothing written, one line
        print(f"cgc: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except WriteFailed as error:  # an output the disk or device refused (a full disk)
        print(f"cgc: error: {error}", file=sys.stderr)
        return EXIT_DIAGNOSTICS
    except Exception as error:  # a bug in cgc, never a user error
        if os.environ.get("CGC_DEBUG"):
            traceback.print_exc()
        print(f"cgc: internal error: {type(error).__name__}: {error}\n"
              "cgc: this is a bug in cgc; set CGC_DEBUG=1 for the traceback", file=sys.stderr)
        return EXIT_INTERNAL


_COMMANDS = {"check": _check, "ir": _ir, "compile": _compile, "run": _run, "fmt": _fmt,
             "doc": _doc, "sample": _sample}


if __name__ == "__main__":
    sys.exit(main())
