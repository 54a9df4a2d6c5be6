#!/usr/bin/env python3
"""What the static checker adds to `cgc check`: train.cg at GPT-2 small's shape and at 96 layers.

Prints, for each, the time to evaluate the launch program, the time the checker takes
on it, and the memory plan's time (best of several runs, in one process), against the
requirement that checking adds under 0.2 s.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from cgc.pipeline import analyse, check, evaluate  # noqa: E402
from cgc.checking.memory import plan_memory  # noqa: E402


def best(function, runs: int) -> tuple[float, object]:
    result, times = None, []
    for _ in range(runs):
        start = time.perf_counter()
        result = function()
        times.append(time.perf_counter() - start)
    return min(times), result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    path = os.path.join(ROOT, "schedules", "train.cg")
    frontend = analyse([path])
    print(f"train.cg, config gpt2 (best of {args.runs}):")
    print(f"  {'layers':<8} {'launches':>8} {'evaluate':>10} {'check':>10} {'memory plan':>12}")
    worst = 0.0
    for layers in (12, 96):
        overrides = {"cgLayers": layers}
        evaluating, program = best(lambda: evaluate(frontend, path, config="gpt2",
                                                    overrides=overrides), args.runs)
        checking, warnings = best(lambda: check(program), args.runs)
        planning, _ = best(lambda: plan_memory(program), args.runs)
        assert warnings == []
        launches = sum(1 for _ in program.launches())
        print(f"  {layers:<8} {launches:>8} {evaluating * 1000:7.1f} ms {checking * 1000:7.1f} ms "
              f"{planning * 1000:9.1f} ms")
        worst = max(worst, checking + planning)
    verdict = "ok" if worst < 0.2 else "TOO SLOW"
    print(f"  the checker and the memory plan add at most {worst * 1000:.1f} ms "
          f"(requirement: under 200 ms): {verdict}")
    return 0 if worst < 0.2 else 1


if __name__ == "__main__":
    from cgc.outputs import script_status
    sys.exit(script_status(main))
