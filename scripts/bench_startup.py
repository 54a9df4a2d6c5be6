#!/usr/bin/env python3
"""`cgc compile schedules/backward.cg` as a whole process, next to `python3 -c pass`, in the
same run: alternated, best and median of N each, with the caches (Lark's table, Jinja's
bytecode) warm and cold. The figure that matters is the difference: cgc's own start-up
and work above the interpreter's."""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def timed(command, environment) -> float:
    start = time.perf_counter()
    subprocess.run(command, cwd=ROOT, env=environment, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    cache = tempfile.mkdtemp(prefix="cgc-bench-cache-")
    out = os.path.join(cache, "backward.cu")
    environment = {**os.environ, "XDG_CACHE_HOME": cache, "PYTHONPATH": ROOT}
    interpreter = [sys.executable, "-c", "pass"]
    compile_ = [sys.executable, "-m", "cgc", "compile", "schedules/backward.cg", "-o", out]
    times = {"python3 -c pass": [], "cgc compile, caches warm": [],
             "cgc compile, caches cold": []}
    timed(compile_, environment)  # fills the caches
    for _ in range(args.runs):
        times["python3 -c pass"].append(timed(interpreter, environment))
        times["cgc compile, caches warm"].append(timed(compile_, environment))
        shutil.rmtree(os.path.join(cache, "cgc"), ignore_errors=True)
        times["cgc compile, caches cold"].append(timed(compile_, environment))
    shutil.rmtree(cache, ignore_errors=True)
    base = statistics.median(times["python3 -c pass"])
    print(f"whole processes, {args.runs} runs each, alternated (python {sys.version.split()[0]}):")
    for name, values in times.items():
        median = statistics.median(values)
        above = "" if name.startswith("python3") else f"   {1000 * (median - base):6.0f} ms above"
        print(f"  {name:<26} best {1000 * min(values):6.0f} ms  median {1000 * median:6.0f} ms"
              f"{above}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    from cgc.outputs import script_status
    sys.exit(script_status(main))
