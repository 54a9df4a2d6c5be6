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

from ...frontend.api import Frontend
from .machine import Machine
from .reference import KERNELS
from ..base import Run, initial_parameters


class NumpyRun(Run):
    def __init__(self, frontend: Frontend, path: str, config: str | None,
                 overrides: dict | None, seed: int):
        super().__init__(frontend, path, config, overrides)
        self.machine = Machine(self.program, self.declarations, self.plan, KERNELS)
        self.load_parameters(initial_parameters(self.program, self.declarations, seed))

    def store(self, label: str, values) -> None:
        self.machine.store(label, values)

    def fetch(self, label: str) -> np.ndarray:
        return self.machine.array(label)

    def step(self, ids: np.ndarray, targets: np.ndarray, trace: list | None = None) -> float:
        self.store("cgIds", ids)
        self.store("cgTargets", targets)
        self.machine.run(trace)
        return self.mean_loss()


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
