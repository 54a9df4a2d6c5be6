"""An independent PyTorch model of the Llama-style training step (schedules/llama/), for the
tests only: RMSNorm, grouped-query attention with rotary positions, a SwiGLU MLP, an untied
output head, AdamW. Written from the usual definitions of those layers, sharing no code
with cgc; it reads a dump (docs/dump-format.md) like tests/torch_model.py."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from torch_model import Trained

MATRICES = ("cgEmbeddingEntry", "cgHeadWeight", "cgQkvWeight", "cgOutputWeight",
            "cgGateUpWeight", "cgDownWeight")


class Llama(Trained):
    matrices = MATRICES

    # key/value head j serves query heads j G .. j G + G - 1 (G = heads / kvHeads); False:
    # query head h reads key/value head h mod kvHeads, a wrong grouping the tests must tell
    consecutive_groups = True

    def __init__(self, constants: dict, flat: dict[str, np.ndarray]):
        c = constants
        self.batch, self.context = int(c["cgBatch"]), int(c["cgContext"])
        self.vocab, self.width = int(c["cgVocab"]), int(c["cgWidth"])
        self.layers, self.heads = int(c["cgLayers"]), int(c["cgHeads"])
        self.kv_heads, self.ffn = int(c["cgKvHeads"]), int(c["cgFfnWidth"])
        self.epsilon = float(c["cgRmsNormEpsilon"])
        w, layers, d = self.width, self.layers, self.width // self.heads
        qkv = w + 2 * self.kv_heads * d
        shapes = {
            "cgEmbeddingEntry": (self.vocab, w), "cgHeadWeight": (self.vocab, w),
            "cgQkvWeight": (layers, w, qkv), "cgOutputWeight": (layers, w, w),
            "cgGateUpWeight": (layers, w, 2 * self.ffn), "cgDownWeight": (layers, self.ffn, w),
            "cgNorm1Gamma": (layers, w), "cgNorm2Gamma": (layers, w), "cgFinalGamma": (w,),
        }
        self.parameters = {name: torch.tensor(flat[name].reshape(shape), dtype=torch.float32,
                                              requires_grad=True)
                           for name, shape in shapes.items()}

    def rms_norm(self, x: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.epsilon) * gain

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x is [batch, heads, T, D]; pair (i, i + D/2) turns by p * 10000^(-2i/D)."""
        d = x.shape[-1]
        i = torch.arange(d // 2, dtype=torch.float32)
        angle = torch.arange(self.context, dtype=torch.float32)[:, None] * \
            torch.pow(torch.tensor(10000.0), -2.0 * i / d)[None, :]
        cos, sin = torch.cos(angle), torch.sin(angle)
        a, b = x[..., : d // 2], x[..., d // 2:]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)

    def loss(self, ids: np.ndarray, targets: np.ndarray) -> torch.Tensor:
        p = self.parameters
        b, t, w, h, kv = self.batch, self.context, self.width, self.heads, self.kv_heads
        d = w // h
        x = p["cgEmbeddingEntry"][torch.tensor(ids, dtype=torch.long)]
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        for layer in range(self.layers):
            qkv = self.rms_norm(x, p["cgNorm1Gamma"][layer]) @ p["cgQkvWeight"][layer]
            q = qkv[:, :w].reshape(b, t, h, d).transpose(1, 2)
            k = qkv[:, w:w + kv * d].reshape(b, t, kv, d).transpose(1, 2)
            v = qkv[:, w + kv * d:].reshape(b, t, kv, d).transpose(1, 2)
            q, k = self.rotate(q), self.rotate(k)
            # each key/value head serves h / kv consecutive query heads
            if self.consecutive_groups:
                k, v = k.repeat_interleave(h // kv, dim=1), v.repeat_interleave(h // kv, dim=1)
            else:
                k, v = k.repeat(1, h // kv, 1, 1), v.repeat(1, h // kv, 1, 1)
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)
            attention = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1) @ v
            x = x + attention.transpose(1, 2).reshape(b * t, w) @ p["cgOutputWeight"][layer]
            gate_up = self.rms_norm(x, p["cgNorm2Gamma"][layer]) @ p["cgGateUpWeight"][layer]
            gate, up = gate_up[:, :self.ffn], gate_up[:, self.ffn:]
            x = x + (F.silu(gate) * up) @ p["cgDownWeight"][layer]
        logits = self.rms_norm(x, p["cgFinalGamma"]) @ p["cgHeadWeight"].T
        target = torch.tensor(targets, dtype=torch.long)
        return F.cross_entropy(logits, target, ignore_index=-1, reduction="sum") / (b * t)

