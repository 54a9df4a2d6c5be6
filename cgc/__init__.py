"""cgc: a compiler for schedules of GPU kernel launches (a GPT training step)."""

__version__ = "0.1.0"
