"""Text from a trained model: a forward-only schedule (schedules/sample.cg) run token by token.

The forward program takes a whole step's rows (batch x context) as any schedule does. The
text so far (its last `context` tokens) fills the first rows of sequence 0, the other rows
are token 0, and every target is -1 (ignored), so the loss the forward computes is not used;
causal attention makes each row's logits depend only on the rows before it, so what fills
the rest does not change the row read: the logits of the last token of the text (the
`logits` role). The next token is the arg-max of those logits (temperature 0: greedy,
deterministic), or drawn from their softmax at a temperature, over the `top_k` largest,
from a generator seeded with `seed`.

Whatever the user asks, NumPy never has the last word: parameters that are not finite are
refused when loaded, logits that are not finite (a model that overflows) when read, and any
temperature above 0 gives a distribution (a tiny one is greedy among equal maxima, a huge
one uniform over the `top_k` largest).
"""

from __future__ import annotations

import codecs
import threading
from typing import Callable

import numpy as np

from ..core.diagnostics import CompileError, Diagnostic
from ..backends.base import Run

# The most tokens one `cgc sample` writes (each is a forward pass of a whole step).
MAX_TOKENS = 100_000


class SamplingError(CompileError):
    """A model that cannot be sampled (parameters or logits that are not finite): told as an
    error (exit 1), in one line."""

    def __init__(self, message: str):
        super().__init__([Diagnostic("error", message, None)])
        self.message = message


def choose_token(logits: np.ndarray, temperature: float, top_k: int | None,
                 generator: np.random.Generator) -> int:
    """The next token from one row of finite logits (float64 softmax, the k largest kept).
    The logits are shifted by their maximum before the division by the temperature, so that
    no temperature overflows: the largest is 0, every other at most 0 (or -inf)."""
    logits = np.asarray(logits, dtype=np.float64)
    if temperature <= 0:
        return int(np.argmax(logits))  # the first of equal maxima: deterministic
    with np.errstate(over="ignore", under="ignore"):
        scaled = (logits - logits.max()) / temperature
    if top_k is not None and 0 < top_k < scaled.size:
        threshold = np.partition(scaled, -top_k)[-top_k]
        scaled = np.where(scaled >= threshold, scaled, -np.inf)
    with np.errstate(under="ignore"):
        weights = np.exp(scaled)  # the maxima are exp(0) = 1: the sum is at least 1
    return int(generator.choice(scaled.size, p=weights / weights.sum()))


def check_sampling(prompt: list[int], tokens: int, temperature: float, top_k: int | None,
                   seed: int, vocab: int) -> None:
    """OptionError for a sampling request this model cannot take: the same rules for `cgc
    sample` and the library."""
    check_request(tokens, temperature, top_k, seed)
    check_prompt(prompt, top_k, vocab)


def check_request(tokens: int, temperature: float, top_k: int | None, seed: int) -> None:
    """OptionError for a sampling request no model can take."""
    import math

    from ..core.diagnostics import OptionError
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= MAX_TOKENS:
        raise OptionError(f"--tokens must be at least 1 and at most {MAX_TOKENS:,}")
    for name, value in (("seed", seed), ("temperature", temperature)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 \
                or not math.isfinite(value):
            raise OptionError(f"--{name} must be a finite number, not negative")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)
                              or top_k < 1):
        raise OptionError("--top-k must be at least 1")


def check_prompt(prompt: list[int], top_k: int | None, vocab: int) -> None:
    """OptionError for a prompt (or a top-k) this model's vocabulary cannot take."""
    from ..core.diagnostics import OptionError
    if not prompt:
        raise OptionError("--prompt is empty; give at least one character")
    if not all(isinstance(t, int) and 0 <= t < vocab for t in prompt):
        raise OptionError(f"--prompt has a byte past the model's vocabulary ({vocab})")
    if top_k is not None and top_k > vocab:
        raise OptionError(f"--top-k {top_k} is more than the model's vocabulary "
                          f"({vocab} tokens)")


def forward_only_problem(program, source: str) -> str | None:
    """Why `program` cannot sample (None where it can): it must compute logits and change
    no parameter (a forward-only schedule: schedules/sample.cg)."""
    try:
        program.role("logits")
    except KeyError as error:
        return f"{source} cannot sample: {error.args[0]}"
    for launch, _, _ in program.launches():
        for binding in launch.pointers:
            parameter = launch.image.pointers.get(binding.index)
            if parameter is not None and parameter.access != "read" and \
                    binding.view.storage.kind == "bank":
                return (f"{source} cannot sample: its schedule '{program.entry}' writes the "
                        f"bank '{binding.view.storage.label}' (through '{launch.image.name}'), "
                        "and sampling runs a forward-only schedule, one that changes no "
                        "parameter (schedules/sample.cg)")
    return None


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
        run's: those this program has, every value finite (SamplingError naming the first
        tensor that is not)."""
        from .checkpoint import restore, saved_labels
        kept = set(saved_labels(self.run.program))
        chosen = {label: value for label, value in values.items() if label in kept}
        for label, value in sorted(chosen.items()):
            wide = np.asarray(value, dtype=np.float32)
            if not np.isfinite(wide).all():
                where = int(np.flatnonzero(~np.isfinite(wide))[0])
                raise SamplingError(f"the model's parameters are not all finite: {label}[{where}] "
                                    f"is {float(wide.reshape(-1)[where])} (a diverged run?)")
        restore(self.run, chosen)

    def next_logits(self, tokens: list[int]) -> np.ndarray:
        window = tokens[-self.context:]
        ids = np.zeros(self.rows, dtype=np.int32)
        ids[:len(window)] = window
        targets = np.full(self.rows, -1, dtype=np.int32)
        self.run.step(ids, targets)
        logits = self.run.fetch(self.logits).reshape(self.rows, self.vocab)
        return logits[len(window) - 1]

    def generate(self, prompt: list[int], count: int, temperature: float = 0.0,
                 top_k: int | None = None, seed: int = 0,
                 stop: threading.Event | None = None,
                 emit: Callable[[int], None] | None = None) -> list[int]:
        """`count` tokens after `prompt` (at least one token), each given to `emit` as it is
        chosen; fewer if `stop` is set (checked before each token: the one under way ends)."""
        if not prompt:
            raise ValueError("the prompt has no tokens")
        generator = np.random.default_rng(seed)
        tokens = list(prompt)
        for _ in range(count):
            if stop is not None and stop.is_set():
                break
            logits = self.next_logits(tokens)
            if not np.isfinite(logits).all():
                raise SamplingError(f"the model's logits after {len(tokens)} tokens are not all "
                                    "finite (NaN or infinite): its parameters overflow the "
                                    "forward pass")
            tokens.append(choose_token(logits, temperature, top_k, generator))
            if emit is not None:
                emit(tokens[-1])
        return tokens[len(prompt):]


def decode_bytes(tokens: list[int]) -> str:
    """Byte tokens as text (UTF-8; a byte sequence that is not is shown as U+FFFD)."""
    return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")


class ByteText:
    """Byte tokens turned into text as they come (UTF-8, U+FFFD for what is not): a
    character split over two tokens is shown once whole, as decode_bytes shows it."""

    def __init__(self):
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, tokens) -> str:
        return self.decoder.decode(bytes(t for t in tokens if t < 256))

    def end(self) -> str:
        return self.decoder.decode(b"", final=True)
