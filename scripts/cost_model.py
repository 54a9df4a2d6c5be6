#!/usr/bin/env python3
"""The cost model: what each image must move and compute in one step, and its floor time.

For every launch of the step (repeats counted once per iteration): the bytes of every
buffer it binds (a read or a write once, a read-and-write or an accumulation twice) and
the floating-point operations of its products; the floor time is the larger of bytes over
the copy bandwidth and operations over the bf16 product rate, both as measured on an H200.
The sum is the limit the runtime is measured against.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from cgc.core.affine import Affine  # noqa: E402
from cgc.frontend.api import analyse, evaluate  # noqa: E402
from cgc.checking.memory import element_bytes  # noqa: E402

BANDWIDTH = 4.3e12  # bytes/s, H200 copy bandwidth as measured
PRODUCT_RATE = 790e12  # flop/s, H200 dense bf16 products as measured


def value(x, point):
    return x.at(point) if isinstance(x, Affine) else int(x)


def flops(launch, point, roles) -> float:
    name = launch.image.name
    scalars = {launch.image.scalars[b.index].name: value(b.value, point) for b in launch.scalars}
    if launch.image.library is not None:
        return 2.0 * scalars["m"] * scalars["n"] * scalars["k"]
    if name in ("cgImageAttention", "cgImageAttentionBackward"):
        batch, heads = int(roles["batch"]), int(roles["heads"])
        context, width = int(roles["context"]), int(roles["width"])
        head_width = width // heads
        causal_pairs = context * (context + 1) / 2  # query-key pairs under the mask
        one_product = 2.0 * batch * heads * causal_pairs * head_width
        # forward: S = Q K^T and O = P V; backward (as written: dK, dV pass, then dQ pass):
        # S, dP, dV, dK, then S, dP, dQ again.
        return one_product * (2 if name == "cgImageAttention" else 7)
    return 0.0


def traffic(launch, low) -> int:
    total = 0
    for binding in launch.pointers:
        parameter = launch.image.pointers[binding.index]
        passes = 2 if parameter.access in ("readwrite", "accumulate") else 1
        total += passes * binding.view.count * element_bytes(binding.view.storage.element, low)
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="gpt2")
    args = parser.parse_args()
    path = os.path.join(ROOT, "schedules", "train.cg")
    frontend = analyse([path])
    program = evaluate(frontend, path, config=args.config)
    rows = defaultdict(lambda: [0, 0, 0.0, 0.0])
    for launch, _, point in program.unrolled():
        row = rows[launch.image.name]
        moved, work = traffic(launch, program.low), flops(launch, point, program.roles)
        row[0] += 1
        row[1] += moved
        row[2] += work
        row[3] += max(moved / BANDWIDTH, work / PRODUCT_RATE)
    print(f"train.cg, config {args.config}: one step, floors at {BANDWIDTH / 1e12:.1f} TB/s "
          f"and {PRODUCT_RATE / 1e12:.0f} TFLOP/s")
    print("| image | launches | MB moved | GFLOP | floor (us) | bound by |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    total = [0, 0, 0.0, 0.0]
    for name, (count, moved, work, floor) in sorted(rows.items(), key=lambda r: -r[1][3]):
        bound = "products" if work / PRODUCT_RATE > moved / BANDWIDTH else "memory"
        print(f"| {name} | {count} | {moved / 1e6:,.1f} | {work / 1e9:,.1f} | "
              f"{floor * 1e6:,.1f} | {bound} |")
        for i, x in enumerate((count, moved, work, floor)):
            total[i] += x
    print(f"| **step** | {total[0]} | {total[1] / 1e6:,.1f} | {total[2] / 1e9:,.1f} | "
          f"{total[3] * 1e6:,.1f} | |")
    tokens = int(program.roles["batch"]) * int(program.roles["context"])
    print(f"floor: {total[3] * 1e3:.2f} ms a step, {tokens / total[3]:,.0f} tokens/s "
          f"({tokens} tokens a step)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
