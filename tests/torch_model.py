"""An independent PyTorch model of the training step, written from the design notes
(section 4), for the tests only. It shares no code with cgc: it reads a dump
(docs/dump-format.md) and computes the same step its own way, with autograd and
torch.optim.AdamW."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

MATRICES = ("cgEmbeddingEntry", "cgQkvWeight", "cgOutputWeight", "cgFcWeight", "cgProjWeight")


class Dump:
    def __init__(self, folder: Path):
        folder = Path(folder)
        self.manifest = json.loads((folder / "run.json").read_text())
        self.constants = self.manifest["constants"]
        self.ids = np.load(folder / "ids.npy")
        self.targets = np.load(folder / "targets.npy")
        self.parts = {part: {path.stem: np.load(path) for path in (folder / part).glob("*.npy")}
                      for part in ("before", "gradients", "after", "final")}


class Trained:
    """What both models' tests train through: torch's AdamW with weight decay on the
    matrices alone (`matrices`, their entry names), one step with the gradient clipped, and
    the parameters or their gradients as flat arrays by entry name."""

    matrices: tuple = ()

    def optimizer(self, constants: dict) -> torch.optim.Optimizer:
        decayed = [self.parameters[name] for name in self.matrices]
        plain = [p for name, p in self.parameters.items() if name not in self.matrices]
        return torch.optim.AdamW(
            [{"params": decayed, "weight_decay": float(constants["cgWeightDecay"])},
             {"params": plain, "weight_decay": 0.0}],
            lr=float(constants["cgLearningRate"]),
            betas=(float(constants["cgBeta1"]), float(constants["cgBeta2"])),
            eps=float(constants["cgAdamEpsilon"]))

    def step(self, optimizer, ids, targets, clip: float) -> float:
        optimizer.zero_grad()
        loss = self.loss(ids, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(self.parameters.values()), clip)
        optimizer.step()
        return float(loss.detach())

    def flat(self, gradients: bool = False) -> dict[str, np.ndarray]:
        return {name: (p.grad if gradients else p).detach().cpu().numpy().reshape(-1).copy()
                for name, p in self.parameters.items()}


class Gpt(Trained):
    matrices = MATRICES

    def __init__(self, constants: dict, flat: dict[str, np.ndarray], device: str = "cpu"):
        c = constants
        self.batch, self.context = int(c["cgBatch"]), int(c["cgContext"])
        self.vocab, self.width = int(c["cgVocab"]), int(c["cgWidth"])
        self.layers, self.heads = int(c["cgLayers"]), int(c["cgHeads"])
        w, layers = self.width, self.layers
        shapes = {
            "cgEmbeddingEntry": (self.vocab, w),
            "cgLn1Gamma": (layers, w), "cgLn1Beta": (layers, w),
            "cgQkvWeight": (layers, w, 3 * w), "cgOutputWeight": (layers, w, w),
            "cgLn2Gamma": (layers, w), "cgLn2Beta": (layers, w),
            "cgFcWeight": (layers, w, 4 * w), "cgProjWeight": (layers, 4 * w, w),
            "cgFinalGamma": (w,), "cgFinalBeta": (w,),
        }
        self.device = device
        self.parameters = {name: torch.tensor(flat[name].reshape(shape), dtype=torch.float32,
                                              device=device, requires_grad=True)
                           for name, shape in shapes.items()}

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """Rotary positions: x is [batch, heads, T, D]; pair (i, i + D/2) turns by p * 10000^(-2i/D)."""
        d = x.shape[-1]
        i = torch.arange(d // 2, dtype=torch.float32, device=self.device)
        angle = torch.arange(self.context, dtype=torch.float32, device=self.device)[:, None] * \
            torch.pow(torch.tensor(10000.0, device=self.device), -2.0 * i / d)[None, :]
        cos, sin = torch.cos(angle), torch.sin(angle)
        a, b = x[..., : d // 2], x[..., d // 2:]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)

    def loss(self, ids: np.ndarray, targets: np.ndarray) -> torch.Tensor:
        p = self.parameters
        b, t, w, h = self.batch, self.context, self.width, self.heads
        d = w // h
        x = p["cgEmbeddingEntry"][torch.tensor(ids, dtype=torch.long, device=self.device)]
        mask = torch.ones(t, t, dtype=torch.bool, device=self.device).triu(1)
        for layer in range(self.layers):
            normed = F.layer_norm(x, (w,), p["cgLn1Gamma"][layer], p["cgLn1Beta"][layer], 1e-5)
            qkv = normed @ p["cgQkvWeight"][layer]
            q, k, v = (qkv[:, i * w:(i + 1) * w].reshape(b, t, h, d).transpose(1, 2)
                       for i in range(3))
            q, k = self.rotate(q), self.rotate(k)
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)
            attention = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1) @ v
            x = x + attention.transpose(1, 2).reshape(b * t, w) @ p["cgOutputWeight"][layer]
            normed = F.layer_norm(x, (w,), p["cgLn2Gamma"][layer], p["cgLn2Beta"][layer], 1e-5)
            hidden = F.gelu(normed @ p["cgFcWeight"][layer], approximate="tanh")
            x = x + hidden @ p["cgProjWeight"][layer]
        final = F.layer_norm(x, (w,), p["cgFinalGamma"], p["cgFinalBeta"], 1e-5)
        logits = final @ p["cgEmbeddingEntry"].T
        target = torch.tensor(targets, dtype=torch.long, device=self.device)
        return F.cross_entropy(logits, target, ignore_index=-1, reduction="sum") / (b * t)

