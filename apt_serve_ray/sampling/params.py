"""Per-request sampling parameters (vLLM-compatible names).

Validated once at construction: every bad value raises ``ValueError`` naming the field.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from apt_serve_ray.sampling.structured import StructuredOutput


class RequestOutputKind(enum.Enum):
    """What each ``RequestOutput`` of a request carries (vLLM's names). ``CUMULATIVE``: everything so
    far (the prompt, every output token, its text, its metrics). ``DELTA``: what is new since the
    last one (token ids, text, logprobs); the prompt on the first output only, the metrics on the first
    and the last. ``FINAL_ONLY``: one output, when it finishes, whole."""

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


@dataclass
class SamplingParams:
    """How to sample one request's output.

    ``temperature=0`` means greedy. ``top_k=0`` or ``-1`` disables top-k; ``top_p=1`` disables top-p;
    ``min_p`` drops tokens less likely than that share of the likeliest one. ``seed`` makes sampling
    reproducible per request, independent of the batch it runs in.

    Before any of that (greedy too), the logits are adjusted as OpenAI and vLLM define it:
    ``logit_bias`` ({token id: -100..100}) is added; ``presence_penalty`` (subtracted once from every
    token already generated) and ``frequency_penalty`` (once per time it was generated), both in
    [-2, 2]; ``repetition_penalty`` (> 0; 1 is off) divides positive and multiplies negative logits
    of every token in the prompt or the output. ``logprobs`` report the model's distribution before
    these adjustments (vLLM's default).

    ``output_kind``: what each output carries (``RequestOutputKind``; the async engine streams
    deltas whatever is set here). ``detokenize=False``: the engine returns token ids and no text
    (stop strings need the text, so they refuse it); the async engine uses it to detokenise in its
    caller instead of on the step loop.
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
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    # The output must match this (``apt_serve_ray.sampling.structured``): a JSON schema, any JSON object, a
    # regular expression or one of some strings. None: free text.
    structured_output: "StructuredOutput | None" = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    detokenize: bool = True
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
        if not isinstance(self.output_kind, RequestOutputKind):
            try:
                self.output_kind = RequestOutputKind(self.output_kind)
            except ValueError:
                raise ValueError(f"output_kind: must be one of {[k.value for k in RequestOutputKind]}, "
                                 f"got {self.output_kind!r}") from None
        if not isinstance(self.detokenize, bool):
            raise ValueError(f"detokenize: must be a boolean, got {self.detokenize!r}")
        if stops and not self.detokenize:
            raise ValueError("detokenize: stop strings are found in the text, so they need detokenize=True")
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
        _check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p: must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name}: must be in [-2, 2], got {value}")
        _check_number("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError(f"repetition_penalty: must be in (0, 10], got {self.repetition_penalty}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias: must be a mapping of token ids to biases, got {self.logit_bias!r}")
            bias = {}
            for token, value in self.logit_bias.items():
                if isinstance(token, str) and token.strip().lstrip("-").isdigit():
                    token = int(token)  # JSON object keys are strings
                if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                    raise ValueError(f"logit_bias: keys must be token ids (non-negative integers), got {token!r}")
                _check_number("logit_bias", value)
                if not -100.0 <= value <= 100.0:
                    raise ValueError(f"logit_bias: biases must be in [-100, 100], got {value} for token {token}")
                bias[token] = float(value)
            self.logit_bias = bias or None
        if self.structured_output is not None:
            from apt_serve_ray.sampling.structured import StructuredOutput

            if isinstance(self.structured_output, dict):
                self.structured_output = StructuredOutput(**self.structured_output)
            if not isinstance(self.structured_output, StructuredOutput):
                raise ValueError(f"structured_output: must be a StructuredOutput, got {self.structured_output!r}")

    @property
    def adjusts_logits(self) -> bool:
        """Whether the logits are changed before sampling (a bias or a penalty)."""
        return bool(self.logit_bias) or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 \
            or self.repetition_penalty != 1.0

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
