"""One rank of a data-parallel run, for tests/test_parallel.py: started by mpirun (or alone).

    python tests/parallel/worker.py BACKEND BATCH STEPS OUT [FILE [CONSTANT=VALUE ...]]

Runs STEPS steps of FILE (schedules/train_parallel.cg) in config tiny32 with cgBatch=BATCH
on this process's ranks, each rank taking its share of the windows exactly as `cgc run`
does (cgc.training.ranks.ShardedBatches over one seeded draw of BATCH x ranks windows), and writes
OUT/rank-R.npz: the losses, every entry of the parameters and gradients and AdamW's moments
(whole) after the last step. The test compares the ranks with each other and with one rank on the whole batch.
"""

from __future__ import annotations

import io
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from cgc.backends import parallel  # noqa: E402
from cgc.backends.base import state_tensors  # noqa: E402
from cgc.training import ranks as training_ranks  # noqa: E402
from cgc.training.data import Batches, load_corpus  # noqa: E402
from cgc.training.loop import train  # noqa: E402
from cgc.pipeline import analyse, open_run  # noqa: E402


def main(backend: str, batch: int, steps: int, out: str, path: str, settings=()) -> None:
    communicator = parallel.world()
    overrides = {"cgBatch": batch}
    for setting in settings:  # the model's float constants (cgClipNorm=1000, say)
        name, value = setting.split("=")
        overrides[name] = float(value)
    run = open_run(backend, analyse([path]), path, "tiny32", overrides, seed=0,
                   ranks=(communicator.rank, communicator.size))  # a program a rank (ZeRO-1)
    run.communicator = communicator
    whole = Batches(load_corpus(None), batch * communicator.size, 64, 0)
    batches = training_ranks.ShardedBatches(whole, communicator.rank, communicator.size)
    training = train(run, batches, steps, out=io.StringIO())
    arrays = {"losses": np.array(training.losses, dtype=np.float64)}
    for role in ("parameters", "gradients"):
        for name, values in run.bank_values(role).items():
            arrays[f"{role}/{name}"] = values
    # AdamW's moments, whole: the state banks (cgBankAll), or a ZeRO-1 step's
    # shards gathered in rank order (a collective: every rank takes part)
    moments = []
    for bank in run.program.bank_of_role("state"):
        offsets, total = run.program.bank_layouts[bank]
        whole = np.zeros(total, dtype=np.float32)  # the padding between entries stays 0
        for name, offset in offsets.items():
            values = run.fetch(f"{bank}.{name}")
            whole[offset:offset + values.size] = values
        moments.append(whole)
    moments = moments or [values for label, values in state_tensors(run).items()
                          if label in run.program.sharded]
    for index, values in enumerate(moments):
        arrays[f"moments/{index}"] = values
    np.savez(os.path.join(out, f"rank-{communicator.rank}.npz"), **arrays)
    if os.environ.get("CGC_TEST_LINGER"):  # the failure test: keep stepping until killed
        with open(os.path.join(out, f"pid-{communicator.rank}"), "w") as handle:
            handle.write(str(os.getpid()))
        train(run, batches, 10_000, out=io.StringIO())


if __name__ == "__main__":
    backend, batch, steps, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    main(backend, batch, steps, out,
         sys.argv[5] if len(sys.argv) > 5 else os.path.join(HERE, "..", "..", "schedules",
                                                              "train_parallel.cg"),
         sys.argv[6:])
