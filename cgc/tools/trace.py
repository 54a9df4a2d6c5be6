"""Per-launch timings as a Chrome trace (Perfetto and chrome://tracing open it)."""

from __future__ import annotations

import json

from ..outputs import write_file

PHASES_THREAD, LAUNCHES_THREAD = 0, 1


def chrome_trace(timings: list, backend: str = "") -> list[dict]:
    """(image, phase, start, end) times, in seconds, as trace events: a row of launches,
    and above it a row of the phases they belong to, each row named."""
    if not timings:
        return []
    origin = timings[0][2]
    process = f"cgc step ({backend})" if backend else "cgc step"
    names = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": process}}]
    names += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": name}}
              for tid, name in ((PHASES_THREAD, "phases"), (LAUNCHES_THREAD, "launches"))]
    launches = [{"name": image, "cat": phase or "", "ph": "X", "pid": 0, "tid": LAUNCHES_THREAD,
                 "ts": (start - origin) * 1e6, "dur": (end - start) * 1e6,
                 "args": {"phase": phase}}
                for image, phase, start, end in timings]
    phases: list[dict] = []
    for event in launches:
        if phases and phases[-1]["name"] == event["cat"]:
            phases[-1]["dur"] = event["ts"] + event["dur"] - phases[-1]["ts"]
        else:
            phases.append({"name": event["cat"], "cat": "phase", "ph": "X", "pid": 0,
                           "tid": PHASES_THREAD, "ts": event["ts"], "dur": event["dur"]})
    return names + phases + launches


def write_trace(path: str, timings: list, backend: str = "") -> bool:
    """Whether it was written whole (outputs.write_file)."""
    return write_file(path, json.dumps({"traceEvents": chrome_trace(timings, backend),
                                 "displayTimeUnit": "ms"}) + "\n", "the trace")
