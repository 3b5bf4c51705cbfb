"""What the engine returns (vLLM-compatible names)."""

from __future__ import annotations

from dataclasses import dataclass, field

from apt_serve_ray.sampling.params import RequestOutputKind

# How the error of a request the policy turned away begins (``shed_late``): it could not start within
# its TTFT target under the load of the moment, and may be retried (the server answers 503).
OVERLOADED = "overloaded"


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


def output_of(request, detok) -> RequestOutput | None:
    """A ``Request``'s output after a token or its end, as its ``output_kind`` asks (None: nothing
    to return now, ``FINAL_ONLY`` before the end); ``detok``: its incremental detokeniser (None:
    the engine does not detokenise it). A delta costs what is new, not the request's
    length: nothing here copies the prompt or the whole output."""
    sp = request.sampling_params
    finished = request.is_finished
    kind = sp.output_kind
    if kind is RequestOutputKind.FINAL_ONLY and not finished:
        return None
    first = not request.output_emitted
    start, n = request.num_emitted_tokens, request.num_output_tokens
    request.output_emitted, request.num_emitted_tokens = True, n
    new_tokens = request.output_token_ids[start:]
    delta_text = detok.take_delta(finished) if detok is not None else ""
    with_logprobs = sp.logprobs is not None
    if kind is RequestOutputKind.DELTA:
        token_ids, text = new_tokens, delta_text
        logprobs = request.output_logprobs[start:] if with_logprobs else None
    else:
        token_ids, text = list(request.output_token_ids), detok.text if detok is not None else ""
        logprobs = list(request.output_logprobs) if with_logprobs else None
    completion = CompletionOutput(
        index=0, text=text, token_ids=token_ids,
        cumulative_logprob=request.cumulative_logprob if with_logprobs else None, logprobs=logprobs,
        finish_reason=request.status.value if finished else None, stop_reason=request.stop_reason,
        delta_text=delta_text, delta_token_ids=new_tokens,
    )
    whole = kind is not RequestOutputKind.DELTA
    metrics = None
    if whole or first or finished:
        metrics = RequestMetrics(
            request.arrival_time, request.first_scheduled_time, request.first_token_time,
            request.last_token_time, request.finish_time, list(request.token_times), request.num_preemptions,
            request.num_upgrades, request.last_kind.value if request.last_kind else None, request.num_compressions,
        )
    return RequestOutput(request.request_id, request.prompt if whole or first else None,
                         request.prompt_token_ids if whole or first else None, [completion], finished,
                         metrics, request.error, num_cached_tokens=request.num_cached_tokens,
                         num_prompt_tokens=request.num_prompt_tokens, num_output_tokens=n)

