"""What both backends share: the checked program, its memory plan, and the parameter banks.

A backend stores and fetches whole storages by label (`cgBankP.cgQkvWeight`, `cgLoss`);
everything else here is written once on top of those two.
"""

from __future__ import annotations

import numpy as np

from ..frontend.declarations import Declarations
from ..frontend.api import Frontend, check, evaluate
from ..core.ir import Program
from ..checking.memory import plan_memory

ROLES = ("parameters", "gradients", "state", "copies")


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


class Run:
    def __init__(self, frontend: Frontend, path: str, config: str | None,
                 overrides: dict | None):
        self.program = evaluate(frontend, path, config=config, overrides=overrides)
        self.warnings = self.program.warnings + check(frontend, self.program)
        self.declarations = frontend.declarations
        self.plan = plan_memory(self.program, self.declarations)
        self.banks = {role: [b.name for b in self.declarations.banks.values() if b.role == role]
                      for role in ROLES}

    def store(self, label: str, values) -> None:
        raise NotImplementedError

    def fetch(self, label: str) -> np.ndarray:
        raise NotImplementedError

    @property
    def constants(self) -> dict:
        return self.program.constants

    def entries(self) -> list[str]:
        return [e.name for e in self.declarations.storages.values() if e.kind == "entry"]

    def load_parameters(self, values: dict[str, np.ndarray]) -> None:
        """Each entry into every parameter bank, and into the copies bank if it has one."""
        for name, value in values.items():
            for bank in self.banks["parameters"]:
                self.store(f"{bank}.{name}", value)
            for bank in self.banks["copies"]:
                if f"{bank}.{name}" in self.program.storages:
                    self.store(f"{bank}.{name}", value)

    def bank_values(self, role: str) -> dict[str, np.ndarray]:
        bank = self.banks[role][0]
        return {name: self.fetch(f"{bank}.{name}") for name in self.entries()}

    def mean_loss(self) -> float:
        losses = self.fetch("cgLoss").astype(np.float64)
        return float(losses.sum() / losses.size)
