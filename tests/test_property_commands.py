"""Every command under random and mutated inputs: exit 0, 1 or 2, never 3 (an internal
error), within a time and a memory bound.

A subprocess, its address space capped (RLIMIT_AS), runs each command of the CLI in
process on a series of inputs: token-level mutations of every schedule (the other files
beside it, so imports resolve), random bytes, extreme literals, and inputs that are not
schedules at all. Each run is timed; the whole series' memory is bounded by the cap.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from conftest import ROOT

INPUTS = 80  # mutated or random files, each through every command
SECONDS_PER_RUN = 20.0
MEMORY_CAP = 6 * 2 ** 30  # bytes of address space: the CLI's thread reserves a 512 MiB stack

PROBE = textwrap.dedent("""
    import json, os, random, resource, shutil, sys, time
    resource.setrlimit(resource.RLIMIT_AS, ({cap}, {cap}))
    sys.path.insert(0, {root!r})
    sys.path.insert(0, os.path.join({root!r}, "tests"))
    from cgc.cli import main
    from test_fuzz import EXTRA, pieces
    work = sys.argv[1]
    generator = random.Random(int(sys.argv[2]))
    schedules = os.path.join({root!r}, "schedules")
    names = sorted(n for n in os.listdir(schedules) if n.endswith(".cg"))
    texts = {{n: open(os.path.join(schedules, n)).read() for n in names}}

    split = {{n: pieces(texts[n]) for n in names}}
    # each file's natural literals (a file may have digits only in its comments)
    numbered = {{n: [i for i in range(1, len(split[n]) - 1) if split[n][i].strip().isdigit()]
                for n in names}}

    def renumbered():
        # One natural literal changed: mostly still well typed, so the checker, the
        # emitter and the run see it.
        name = generator.choice([n for n in names if numbered[n]])
        parts = pieces(texts[name])
        i = generator.choice(numbered[name])
        value = int(parts[i])
        parts[i] = str(generator.choice([0, 1, 2, 3, 7, 16, 31, 33, 64, 65, 100, 1024,
                                         value + 1, max(value - 1, 0), 2 * value, 10 ** 12]))
        return name, "".join(parts)

    def mutated():
        name = generator.choice(names)
        parts = pieces(texts[name])
        for _ in range(generator.randint(1, 4)):
            i = generator.randrange(1, len(parts) - 1)
            action = generator.choice(["delete", "duplicate", "replace", "swap", "number"])
            if action == "delete":
                parts[i] = ""
            elif action == "duplicate":
                parts[i] = parts[i] + " " + parts[i]
            elif action == "replace":
                parts[i] = generator.choice(EXTRA + parts[1::2])
            elif action == "number":
                parts[i] = generator.choice(["0", "1", "7", "65", "4096", "99999999999",
                                             "9" * 40, "-5", "1e309"])
            else:
                j = generator.randrange(1, len(parts) - 1)
                parts[i], parts[j] = parts[j], parts[i]
        return name, "".join(parts)

    def random_bytes():
        return "random.cg", bytes(generator.randrange(256) for _ in
                                  range(generator.randint(0, 400))).decode("latin-1")

    results = []
    for index in range(int(sys.argv[3])):
        folder = os.path.join(work, str(index))
        shutil.copytree(schedules, folder)
        name, text = (random_bytes() if index % 5 == 0 else
                      renumbered() if index % 5 in (1, 2) else mutated())
        path = os.path.join(folder, name)
        with open(path, "w", encoding="utf-8", errors="surrogateescape") as handle:
            handle.write(text)
        commands = [["check", path], ["ir", path, "-o", os.path.join(folder, "out.ir")],
                    ["compile", path, "-o", os.path.join(folder, "out.cu")],
                    ["fmt", "--check", path], ["doc", path, "-o", os.path.join(folder, "doc")],
                    ["run", path, "--backend", "numpy", "--steps", "1"]]
        for command in commands:
            started = time.perf_counter()
            status = main(command)
            results.append([index, command[0], status, time.perf_counter() - started])
    print(json.dumps(results))
""")


def test_every_command_on_random_and_mutated_inputs_exits_0_1_or_2(tmp_path):
    probe = PROBE.format(root=str(ROOT), cap=MEMORY_CAP)
    result = subprocess.run([sys.executable, "-c", probe, str(tmp_path), "20261130",
                             str(INPUTS)], capture_output=True, text=True, timeout=1500)
    assert result.returncode == 0, result.stderr[-4000:]
    runs = json.loads(result.stdout.splitlines()[-1])
    assert len(runs) == INPUTS * 6
    bad = [r for r in runs if r[2] not in (0, 1, 2)]
    assert bad == [], (bad, result.stderr[-4000:])
    slow = [r for r in runs if r[3] > SECONDS_PER_RUN]
    assert slow == [], slow
    statuses = {r[2] for r in runs}
    assert {0, 1} <= statuses  # the inputs reach both sides: not all rejected, not all fine
