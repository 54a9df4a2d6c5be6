"""A training run on top of the backends' interface (cgc/backends/base.py): the loop and its
progress line (loop.py), the run object that steps, saves, resumes and samples (run.py), the
data and its held-out split (data.py), checkpoints (checkpoint.py), sampling (sampling.py)
and the ranks of a data-parallel run (ranks.py)."""
