"""Per-request sampling parameters (vLLM-compatible names).

Validated once at construction: every bad value raises ``ValueError`` naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to sample one request's output.

    ``temperature=0`` means greedy. ``top_k=0`` or ``-1`` disables top-k; ``top_p=1`` disables top-p.
    ``seed`` makes sampling reproducible per request, independent of the batch it runs in.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.n != 1:
            raise ValueError(f"n: only n=1 is supported, got {self.n!r}")
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k: must be -1, 0 (disabled) or positive, got {self.top_k}")
        if self.seed is not None:
            _check_int("seed", self.seed)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens: must be >= 1, got {self.max_tokens}")
        _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens: must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens: {self.min_tokens} exceeds max_tokens {self.max_tokens}")
        if self.stop is None:
            stops: list[str] = []
        elif isinstance(self.stop, str):
            stops = [self.stop]
        elif isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) for s in self.stop):
            stops = list(self.stop)
        else:
            raise ValueError(f"stop: must be a string or a list of strings, got {self.stop!r}")
        if any(s == "" for s in stops):
            raise ValueError("stop: stop strings must not be empty")
        self._stop_list = stops
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError(f"stop_token_ids: must be a list of non-negative ints, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs)
            if not 0 <= self.logprobs <= 20:
                raise ValueError(f"logprobs: must be in [0, 20], got {self.logprobs}")

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}: must be a number, got {value!r}")
    if value != value:  # NaN
        raise ValueError(f"{name}: must not be NaN")


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: must be an integer, got {value!r}")
