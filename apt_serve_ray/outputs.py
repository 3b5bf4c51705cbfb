"""What the engine returns (vLLM-compatible names)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    delta_text: str = ""  # new since the previous output of this request (streaming)
    delta_token_ids: list[int] = field(default_factory=list)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps in ``time.monotonic()`` seconds."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    finish_time: float | None
    token_times: list[float]
    num_preemptions: int
    num_upgrades: int
    cache_kind: str | None
    num_compressions: int = 0  # in place, to an int8 kind


@dataclass
class RequestOutput:
    """One output of a request. What it carries depends on the request's ``output_kind``
    (``RequestOutputKind``): everything so far (``CUMULATIVE``, the offline API's), or what is new
    (``DELTA``, what the async engine streams: ``outputs[0].token_ids`` / ``text`` / ``logprobs`` hold
    the new part only, ``prompt`` and ``prompt_token_ids`` come on the first output only (None after),
    ``metrics`` on the first and the last). The counts are always whole."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = None
    # Prompt tokens found in the prefix cache when it was first admitted (None before it was admitted).
    num_cached_tokens: int | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # generated so far
