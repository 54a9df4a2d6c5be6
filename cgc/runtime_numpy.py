"""The NumPy backend: runs a checked launch program on the reference machine.

It sets parameters up from a seeded generator (each entry's `(init ...)`), feeds windows
of byte tokens, runs steps, reports the loss, and can dump a step for anyone to replay
(docs/dump-format.md).
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

from .declarations import Declarations
from .frontend import Frontend, check, evaluate
from .ir import Program
from .machine import Machine
from .memory import plan_memory
from .reference import KERNELS


def initial_parameters(program: Program, declarations: Declarations,
                       seed: int) -> dict[str, np.ndarray]:
    """Every entry's starting value, in declaration order from one seeded generator."""
    generator = np.random.default_rng(seed)
    values = {}
    parameter_bank = next(b.name for b in declarations.banks.values() if b.role == "parameters")
    for entry in declarations.storages.values():
        if entry.kind != "entry":
            continue
        count = program.storages[f"{parameter_bank}.{entry.name}"].count
        kind = entry.init.arguments[0].text if entry.init is not None else "zeros"
        if kind == "normal":
            std = float(program.evaluator.eval(entry.init.arguments[1], {}, ()))
            values[entry.name] = generator.standard_normal(count, dtype=np.float32) * np.float32(std)
        elif kind == "ones":
            values[entry.name] = np.ones(count, dtype=np.float32)
        else:
            values[entry.name] = np.zeros(count, dtype=np.float32)
    return values


class NumpyRun:
    def __init__(self, frontend: Frontend, path: str, config: str | None,
                 overrides: dict | None, seed: int):
        self.program = evaluate(frontend, path, config=config, overrides=overrides)
        self.warnings = self.program.warnings + check(frontend, self.program)
        self.declarations = frontend.declarations
        self.plan = plan_memory(self.program, self.declarations)
        self.machine = Machine(self.program, self.declarations, self.plan, KERNELS)
        self.banks = {role: [b.name for b in self.declarations.banks.values() if b.role == role]
                      for role in ("parameters", "gradients", "state", "copies")}
        self.load_parameters(initial_parameters(self.program, self.declarations, seed))

    @property
    def constants(self) -> dict:
        return self.program.constants

    def entries(self) -> list[str]:
        return [e.name for e in self.declarations.storages.values() if e.kind == "entry"]

    def load_parameters(self, values: dict[str, np.ndarray]) -> None:
        for name, value in values.items():
            for bank in self.banks["parameters"]:
                self.machine.store(f"{bank}.{name}", value)
            for bank in self.banks["copies"]:
                if f"{bank}.{name}" in self.program.storages:
                    self.machine.store(f"{bank}.{name}", value)

    def bank_values(self, role: str) -> dict[str, np.ndarray]:
        bank = self.banks[role][0]
        return {name: self.machine.array(f"{bank}.{name}") for name in self.entries()}

    def step(self, ids: np.ndarray, targets: np.ndarray, trace: list | None = None) -> float:
        self.machine.store("cgIds", ids)
        self.machine.store("cgTargets", targets)
        self.machine.run(trace)
        losses = self.machine.array("cgLoss").astype(np.float64)
        return float(losses.sum() / losses.size)


def _progress(step: int, steps: int, loss: float, seconds: float) -> str:
    width = 24
    done = int(width * step / steps)
    return (f"step {step:>{len(str(steps))}}/{steps} [{'#' * done}{'.' * (width - done)}] "
            f"loss {loss:.4f}  {seconds:.2f} s/step")


def chrome_trace(timings: list) -> list[dict]:
    """(image, phase, start, end) times as Chrome trace events: launches, and phases above."""
    if not timings:
        return []
    origin = timings[0][2]
    launches = [{"name": image, "cat": phase or "", "ph": "X", "pid": 0, "tid": 1,
                 "ts": (start - origin) * 1e6, "dur": (end - start) * 1e6,
                 "args": {"phase": phase}}
                for image, phase, start, end in timings]
    phases: list[dict] = []
    for event in launches:
        if phases and phases[-1]["name"] == event["cat"]:
            phases[-1]["dur"] = event["ts"] + event["dur"] - phases[-1]["ts"]
        else:
            phases.append({"name": event["cat"], "cat": "phase", "ph": "X", "pid": 0, "tid": 0,
                           "ts": event["ts"], "dur": event["dur"]})
    return phases + launches


def train(run: NumpyRun, batches, steps: int, dump: str | None = None, out=sys.stdout,
          seed: int = 0, trace: list | None = None) -> list[float]:
    losses, all_ids, all_targets = [], [], []
    before = run.bank_values("parameters") if dump else None
    first = None
    interactive = out.isatty() if hasattr(out, "isatty") else False
    for step in range(1, steps + 1):
        ids, targets = batches.next()
        started = time.perf_counter()
        loss = run.step(ids, targets, trace if step == 1 else None)
        seconds = time.perf_counter() - started
        losses.append(loss)
        all_ids.append(ids)
        all_targets.append(targets)
        if step == 1 and dump:
            first = (run.bank_values("gradients"), run.bank_values("parameters"))
        line = _progress(step, steps, loss, seconds)
        if interactive:
            out.write("\r" + line + ("\n" if step == steps else ""))
        else:
            out.write(line + "\n")
        out.flush()
    if dump:
        write_dump(dump, run, seed, losses, np.stack(all_ids), np.stack(all_targets), before,
                   *first, run.bank_values("parameters"))
    return losses


def write_dump(folder: str, run: NumpyRun, seed: int, losses, ids, targets, before,
               gradients, after, final) -> None:
    os.makedirs(folder, exist_ok=True)
    declarations = run.declarations
    entries = {}
    for entry in declarations.storages.values():
        if entry.kind != "entry":
            continue
        storage = run.program.storages[f"{run.banks['parameters'][0]}.{entry.name}"]
        entries[entry.name] = {"count": storage.count, "items": storage.stack,
                               "matrix": entry.matrix}
    constants = {name: (value if isinstance(value, (int, float)) else float(value))
                 for name, value in run.constants.items()}
    manifest = {
        "format": "cgc-dump-1",
        "config": run.program.config,
        "low": run.program.low,
        "constants": constants,
        "seed": seed,
        "steps": len(losses),
        "losses": losses,
        "entries": entries,
    }
    with open(os.path.join(folder, "run.json"), "w", encoding="utf-8") as handle:
        json.dump(manifest, handle, indent=2, sort_keys=True)
        handle.write("\n")
    np.save(os.path.join(folder, "ids.npy"), ids.astype(np.int32))
    np.save(os.path.join(folder, "targets.npy"), targets.astype(np.int32))
    for name, values in (("before", before), ("gradients", gradients), ("after", after),
                         ("final", final)):
        os.makedirs(os.path.join(folder, name), exist_ok=True)
        for entry, array in values.items():
            np.save(os.path.join(folder, name, f"{entry}.npy"), array.astype(np.float32))
