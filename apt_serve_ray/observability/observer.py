"""What the engine tells observers: request lifecycle events and per-step statistics."""

from __future__ import annotations

import enum
import json
import logging

import numpy as np

from apt_serve_ray.request import Request
from apt_serve_ray.engine.stats import StepStats

request_logger = logging.getLogger("apt_serve_ray.requests")


class RequestEvent(str, enum.Enum):
    QUEUED = "queued"
    SCHEDULED = "scheduled"
    FIRST_TOKEN = "first_token"
    PREEMPTED = "preempted"
    UPGRADED = "upgraded"
    COMPRESSED = "compressed"  # in place, to an int8 kind
    FINISHED = "finished"


class EngineObserver:
    """Override what you need; every hook runs on the engine's loop thread and must be cheap."""

    def on_request_event(self, request: Request, event: RequestEvent, now: float, attrs: dict) -> None:
        pass

    def on_step(self, engine, stats: StepStats, now: float) -> None:
        """After every step that ran something; ``stats.cache`` is the state after it."""


def request_record(request: Request) -> dict:
    """The figures of one finished request, for its log line and metrics."""
    ttft = None if request.first_token_time is None else request.first_token_time - request.arrival_time
    gaps = np.diff(request.token_times) if len(request.token_times) > 1 else np.zeros(0)
    queue = None if request.first_scheduled_time is None else request.first_scheduled_time - request.arrival_time
    e2e = None if request.finish_time is None else request.finish_time - request.arrival_time
    tpot = None
    if e2e is not None and ttft is not None and request.num_output_tokens > 1:
        tpot = (e2e - ttft) / (request.num_output_tokens - 1)
    p99_gap = float(np.percentile(gaps, 99)) if len(gaps) else None
    return {
        "request_id": request.request_id,
        "outcome": request.status.value,
        "prompt_tokens": request.num_prompt_tokens,
        "output_tokens": request.num_output_tokens,
        "ttft_s": ttft,
        "queue_s": queue,
        "e2e_s": e2e,
        "tpot_s": tpot,
        "gaps_s": gaps.tolist(),
        "p99_gap_s": p99_gap,
        "kind": request.last_kind.value if request.last_kind else None,
        "preemptions": request.num_preemptions,
        "upgrades": request.num_upgrades,
        "compressions": request.num_compressions,
        "priority": request.priority,
        "service_class": request.service_class,
        "ttft_slo_s": request.ttft_slo_ms / 1000.0,
        "tbt_slo_s": request.tbt_slo_ms / 1000.0,
        "met_ttft": ttft is not None and ttft < request.ttft_slo_ms / 1000.0,
        "met_tbt": p99_gap is None or p99_gap < request.tbt_slo_ms / 1000.0,
        "error": request.error,
    }


class RequestLogger(EngineObserver):
    """One structured (JSON) line per finished request on the ``apt_serve_ray.requests`` logger."""

    def on_request_event(self, request, event, now, attrs) -> None:
        if event is RequestEvent.FINISHED and request_logger.isEnabledFor(logging.INFO):
            rec = request_record(request)
            rec.pop("gaps_s")
            request_logger.info(json.dumps({k: (round(v, 6) if isinstance(v, float) else v) for k, v in rec.items()}))
