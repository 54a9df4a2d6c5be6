#!/usr/bin/env python3
"""GPT-2 small's shape on one GPU: the cgc step against PyTorch, in the same run.

cgc: schedules/train.cg, config gpt2 (8 x 1024 tokens a step, bfloat16 products), through
the CuPy backend, the step captured as a CUDA graph. PyTorch: the same model written
plainly, with bfloat16 autocast, flash attention (scaled_dot_product_attention, causal),
fused AdamW with the same hyper-parameters and clipping, and torch.compile. Prints tokens
per second of both, their ratio, and each one's MFU against the H200's datasheet peak
(989 TFLOP/s dense bf16), with model flops counted as 6 N + 12 L W T per token.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from cgc.backends.cuda.backend import H200_PEAK_FLOPS as PEAK  # noqa: E402


def bench_cgc(steps: int, warmup: int, overrides: dict | None = None):
    from cgc.training.data import Batches, load_corpus
    from cgc.training.loop import model_flops_per_token
    from cgc.pipeline import analyse, open_run
    path = os.path.join(ROOT, "schedules", "train.cg")
    run = open_run("cupy", analyse([path]), path, "gpt2", overrides or {}, 0)
    constants = run.program.constants
    batches = Batches(load_corpus(None), constants["cgBatch"], constants["cgContext"], 0)
    run.step(*batches.next())  # eager, then captured as a graph
    for _ in range(warmup):
        run.step(*batches.next())
    times, losses = [], []
    for _ in range(steps):
        result = run.step(*batches.next())
        times.append(result.seconds)
        losses.append(result.loss)
    tokens = constants["cgBatch"] * constants["cgContext"]
    return tokens, sorted(times)[len(times) // 2], model_flops_per_token(run.program), losses


def bench_torch(steps: int, warmup: int, constants: dict):
    import torch
    import torch.nn.functional as F
    batch, context = constants["cgBatch"], constants["cgContext"]
    vocab, width = constants["cgVocab"], constants["cgWidth"]
    layers, heads = constants["cgLayers"], constants["cgHeads"]
    device = "cuda"
    d = width // heads

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
            self.qkv = torch.nn.Linear(width, 3 * width, bias=False)
            self.out = torch.nn.Linear(width, width, bias=False)
            self.fc = torch.nn.Linear(width, 4 * width, bias=False)
            self.proj = torch.nn.Linear(4 * width, width, bias=False)

        def forward(self, x, cos, sin):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, heads, d).transpose(1, 3).unbind(2)

            def rotate(z):
                a, c = z[..., : d // 2], z[..., d // 2:]
                return torch.cat([a * cos - c * sin, a * sin + c * cos], dim=-1)

            y = F.scaled_dot_product_attention(rotate(q), rotate(k), v, is_causal=True)
            x = x + self.out(y.transpose(1, 2).reshape(b, t, width))
            return x + self.proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = torch.nn.Embedding(vocab, width)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(layers))
            self.final = torch.nn.LayerNorm(width)
            i = torch.arange(d // 2, dtype=torch.float32)
            angle = torch.arange(context)[:, None] * torch.pow(10000.0, -2.0 * i / d)[None, :]
            self.register_buffer("cos", torch.cos(angle))
            self.register_buffer("sin", torch.sin(angle))

        def forward(self, ids, targets):
            x = self.embedding(ids)
            for block in self.blocks:
                x = block(x, self.cos, self.sin)
            logits = self.final(x) @ self.embedding.weight.T
            return F.cross_entropy(logits.float().view(-1, vocab), targets.view(-1))

    model = Model().to(device)
    for name, parameter in model.named_parameters():
        if parameter.dim() == 2:
            std = 0.02 / math.sqrt(2 * layers) if name.endswith(("out.weight", "proj.weight")) \
                else 0.02
            torch.nn.init.normal_(parameter, 0.0, std)
    decayed = [p for p in model.parameters() if p.dim() == 2]
    plain = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decayed, "weight_decay": 0.1},
                                   {"params": plain, "weight_decay": 0.0}],
                                  lr=6e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    compiled = torch.compile(model)
    ids = torch.randint(0, 256, (batch, context), device=device)
    targets = torch.randint(0, 256, (batch, context), device=device)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = compiled(ids, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    tokens, cgc_seconds, flops_per_token, losses = bench_cgc(args.steps, args.warmup)
    from cgc.frontend.api import analyse, evaluate
    path = os.path.join(ROOT, "schedules", "train.cg")
    constants = evaluate(analyse([path]), path, config="gpt2").constants
    # the attention forward on wgmma, TMA and mbarrier (cgAttentionHopper 1), off by default
    # until this row is faster than the first
    _, hopper_seconds, _, hopper_losses = bench_cgc(args.steps, args.warmup,
                                                    {"cgAttentionHopper": 1})
    torch_seconds = bench_torch(args.steps, args.warmup, constants)
    rows = [("cgc (CUDA graph)", cgc_seconds),
            ("cgc, attention forward on wgmma/TMA", hopper_seconds),
            ("PyTorch (compile, flash, fused AdamW)", torch_seconds)]
    print(f"GPT-2 small's shape, {tokens} tokens a step, median of {args.steps} steps; "
          f"cgc's last losses {losses[-3:]}")
    print(f"{'':<40} {'ms/step':>9} {'tokens/s':>12} {'MFU':>7}")
    for name, seconds in rows:
        print(f"{name:<40} {seconds * 1e3:9.2f} {tokens / seconds:12,.0f} "
              f"{100 * flops_per_token * tokens / seconds / PEAK:6.1f}%")
    print(f"ratio (cgc tokens/s over PyTorch's): {torch_seconds / cgc_seconds:.2f}")
    print(f"ratio (wgmma/TMA forward's tokens/s over mma.sync's): "
          f"{cgc_seconds / hopper_seconds:.3f}; its last losses {hopper_losses[-3:]}")
    return 0


if __name__ == "__main__":
    from cgc.outputs import script_status
    sys.exit(script_status(main))
