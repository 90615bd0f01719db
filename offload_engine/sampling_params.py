"""Per-request sampling settings, validated when they are made."""
import math
import numbers
import operator
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens. temperature=0 means greedy; top_k=-1 (or 0) and top_p=1 switch those filters
    off. A `seed` makes the request's samples reproducible whatever else shares its batch. As vLLM's: `n` completions
    of the prompt (the i-th seeded with seed + i), which share its prefix's KV blocks; `stop` strings end a completion
    where its text shows one (left out of the text unless include_stop_str_in_output, as a stop token's text is);
    skip_special_tokens and detokenize shape the text. min_p drops tokens below min_p x the likeliest's probability;
    presence_penalty and frequency_penalty (OpenAI's) lower the logits of tokens already generated, once and per
    occurrence; repetition_penalty (CTRL's) divides positive and multiplies negative logits of tokens in the prompt or
    the output; min_tokens keeps eos and stop_token_ids from being drawn before that many tokens. logprobs /
    prompt_logprobs: the top-k log-probabilities of each generated / prompt token's distribution (the model's, before
    any penalty, filter or temperature), with the chosen token's.

    Made only from valid values (else ValueError naming the field): bools are not numbers here, integral values
    (numpy's too) are stored as int, real ones as float, and stop_token_ids as a tuple of ints."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    seed: int | None = None
    n: int = 1
    stop: str | tuple[str, ...] | list[str] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self):
        self._set("temperature", _real("temperature", self.temperature, "a finite number >= 0 (0 means greedy)",
                                       lambda t: 0 <= t < math.inf))
        self._set("top_p", _real("top_p", self.top_p, "a number in (0, 1]", lambda p: 0 < p <= 1))
        self._set("top_k", _int("top_k", self.top_k, "a positive int, or -1 or 0 to switch it off", least=-1))
        self._set("max_tokens", _int("max_tokens", self.max_tokens, "an int >= 1", least=1))
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {_shown(self.ignore_eos)}")
        self._set("stop_token_ids", _token_ids("stop_token_ids", self.stop_token_ids))
        if self.seed is not None:
            self._set("seed", _int("seed", self.seed, "an int or None", least=None))
        self._set("n", _int("n", self.n, "an int >= 1 (completions of the prompt)", least=1))
        self._set("stop", _stop_strings(self.stop))
        for flag in ("include_stop_str_in_output", "skip_special_tokens", "detokenize"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be True or False, got {_shown(getattr(self, flag))}")
        self._set("min_p", _real("min_p", self.min_p, "a number in [0, 1] (0 switches it off)", lambda p: 0 <= p <= 1))
        for name in ("presence_penalty", "frequency_penalty"):
            self._set(name, _real(name, getattr(self, name), "a number in [-2, 2] (0 switches it off)",
                                  lambda x: -2 <= x <= 2))
        self._set("repetition_penalty", _real("repetition_penalty", self.repetition_penalty,
                                              "a number > 0 (1 switches it off)", lambda x: 0 < x < math.inf))
        self._set("min_tokens", _int("min_tokens", self.min_tokens, "an int >= 0", least=0))
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} exceeds max_tokens={self.max_tokens}: lower it")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                self._set(name, _int(name, getattr(self, name), "an int >= 0 (top-k log-probabilities) or None",
                                     least=0))
        if self.stop and not self.detokenize:
            raise ValueError("stop strings are matched on the text: with stop=..., leave detokenize=True")
        # Read by every step of every row: worked out once (not fields: replace() and the wire leave them out).
        penalized = self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
        self._set("penalized", penalized)
        self._set("processed", penalized or self.min_p > 0 or self.min_tokens > 0)

    def _set(self, name: str, value) -> None:
        object.__setattr__(self, name, value)  # frozen: only __post_init__ normalizes

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    # penalized: some penalty reads the tokens so far. processed: its logits change before the draw beyond temperature,
    # top-k and top-p (layers/logits_processing.py). Both set in __post_init__.
    penalized: ClassVar[bool]
    processed: ClassVar[bool]


def _real(name: str, value, wanted: str, test) -> float:
    if not isinstance(value, bool) and isinstance(value, numbers.Real) and test(value):
        return float(value)
    raise ValueError(f"{name} must be {wanted}, got {_shown(value)}")


def _int(name: str, value, wanted: str, least: int | None) -> int:
    if _is_int(value) and (least is None or value >= least):
        return operator.index(value)
    raise ValueError(f"{name} must be {wanted}, got {_shown(value)}")


def _token_ids(name: str, value) -> tuple[int, ...]:
    """A list (or tuple, or array) of non-negative token ids; None means none."""
    if value is None:
        return ()
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ValueError(f"{name} must be a list of token ids, got {_shown(value)}: pass a list, even for one id "
                         "(e.g. [2])")
    ids = tuple(value)
    bad = next((t for t in ids if not _is_int(t) or t < 0), None)
    if bad is not None:
        raise ValueError(f"{name} must hold non-negative ints, got {bad!r} in {value!r}")
    return tuple(operator.index(t) for t in ids)


def _stop_strings(value) -> tuple[str, ...]:
    """A string or a list of non-empty strings; None means none."""
    if value is None:
        return ()
    strings = (value,) if isinstance(value, str) else tuple(value) if isinstance(value, (list, tuple)) else None
    if strings is None or not all(isinstance(s, str) and s for s in strings):
        raise ValueError(f"stop must be a string or a list of non-empty strings, got {_shown(value)}")
    return strings


def _is_int(value) -> bool:
    """An integral value, numpy's included; not a bool, which Python counts as an int."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _shown(value) -> str:
    """The value and its type, since a wrong type often prints like the right one ('4' and 4)."""
    return f"{value!r} (type {type(value).__name__})"
