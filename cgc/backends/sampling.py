"""Text from a trained model: a forward-only schedule (schedules/sample.cg) run token by token.

The forward program takes a whole step's rows (batch x context) as any schedule does. The
text so far (its last `context` tokens) fills the first rows of sequence 0, the other rows
are token 0, and every target is -1 (ignored), so the loss the forward computes is not used;
causal attention makes each row's logits depend only on the rows before it, so what fills
the rest does not change the row read: the logits of the last token of the text (the
`logits` role). The next token is the arg-max of those logits (temperature 0: greedy,
deterministic), or drawn from their softmax at a temperature, over the `top_k` largest,
from a generator seeded with `seed`.
"""

from __future__ import annotations

import numpy as np

from .base import Run


def choose_token(logits: np.ndarray, temperature: float, top_k: int | None,
                 generator: np.random.Generator) -> int:
    """The next token from one row of logits (float64 softmax, the k largest kept)."""
    logits = np.asarray(logits, dtype=np.float64)
    if temperature <= 0:
        return int(np.argmax(logits))  # the first of equal maxima: deterministic
    scaled = logits / temperature
    if top_k is not None and 0 < top_k < scaled.size:
        threshold = np.partition(scaled, -top_k)[-top_k]
        scaled = np.where(scaled >= threshold, scaled, -np.inf)
    weights = np.exp(scaled - scaled.max())
    return int(generator.choice(scaled.size, p=weights / weights.sum()))


class Sampler:
    """A forward-only run and what it needs to continue a text."""

    def __init__(self, run: Run):
        self.run = run
        program = run.program
        self.logits = program.role("logits")
        self.batch, self.context = int(program.role("batch")), int(program.role("context"))
        self.vocab = int(program.role("vocab"))
        self.rows = self.batch * self.context

    def load(self, values: dict[str, np.ndarray]) -> None:
        """The parameters (and 16-bit copies) from a checkpoint's tensors, or a training
        run's: those this program has."""
        from .checkpoint import restore, saved_labels
        kept = set(saved_labels(self.run.program))
        restore(self.run, {label: value for label, value in values.items() if label in kept})

    def next_logits(self, tokens: list[int]) -> np.ndarray:
        window = tokens[-self.context:]
        ids = np.zeros(self.rows, dtype=np.int32)
        ids[:len(window)] = window
        targets = np.full(self.rows, -1, dtype=np.int32)
        self.run.step(ids, targets)
        logits = self.run.fetch(self.logits).reshape(self.rows, self.vocab)
        return logits[len(window) - 1]

    def generate(self, prompt: list[int], count: int, temperature: float = 0.0,
                 top_k: int | None = None, seed: int = 0) -> list[int]:
        """`count` tokens after `prompt` (at least one token)."""
        if not prompt:
            raise ValueError("the prompt has no tokens")
        generator = np.random.default_rng(seed)
        tokens = list(prompt)
        for _ in range(count):
            tokens.append(choose_token(self.next_logits(tokens), temperature, top_k, generator))
        return tokens[len(prompt):]


def decode_bytes(tokens: list[int]) -> str:
    """Byte tokens as text (UTF-8; a byte sequence that is not is shown as U+FFFD)."""
    return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")
