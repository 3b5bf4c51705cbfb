"""What the deployments send each other: one frozen dataclass per seam, documented here once.

::

    Router ──EngineRequest──► EngineReplica.generate ──StreamItem… (or one InvalidRequest)──► Router
    EngineReplica ──LoadReport──► Controller.report ──Knobs──► EngineReplica      (the heartbeat)
    EngineReplica.record_routing_stats ──LoadReport.to_dict()──► FitAwareRequestRouter
    Router ──Controller.get_state(ArrivalCount)──► ControllerState (LoadReports, Knobs, ControllerDecisions)

A contract is versioned by its fields: a new field gets a default, so that a sender of the previous
version still makes a valid object. Every object crosses Ray by pickle; the one exception is the load
report the request router reads, which Serve requires to be a dict (``to_dict``/``from_dict``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Sequence

from apt_serve_ray.scheduler.predictor import Forecast
from apt_serve_ray.sampling.params import SamplingParams


RECEIVED_WINDOW_S = 5.0  # how long a replica lists a request it received (LoadReport.received)


@dataclass(frozen=True)
class EngineRequest:
    """One request for ``EngineReplica.generate``, validated (``SamplingParams``) and usually tokenised.

    ``priority`` / ``ttft_slo_ms`` / ``tbt_slo_ms``: scheduling hints (None: the engine's defaults).
    ``trace_context``: a W3C carrier; the engine's span for the request becomes a child of the caller's.
    ``service_class``: the app's class the router resolved the hints from (``service_classes.py``); to
    the engine only a label for its metrics (None: "none").
    """

    prompt: list[int] | str
    sampling: SamplingParams
    request_id: str | None = None  # None: the engine makes one
    priority: int | None = None
    ttft_slo_ms: float | None = None
    tbt_slo_ms: float | None = None
    trace_context: dict[str, str] | None = None
    service_class: str | None = None
    # The conversation it belongs to (the ``x-session-id`` header, else the body's ``user``): the
    # request router keeps a session on the replica that holds its history. The engine never sees it.
    session_id: str | None = None
    # vLLM's ``cache_salt``: only requests with the same salt share cached prefix pages.
    cache_salt: str | None = None
    # The LoRA adapter it runs with (the body's ``model`` named one; None: the base model), and where it is:
    # a replica that does not hold an adapter loaded at run time loads it from there first.
    lora_name: str | None = None
    lora_path: str | None = None

    @property
    def prefix_salt(self):
        """What a prompt's page names start from in the request router's index: its ``cache_salt``, and
        its adapter (an adapter's cached prefixes never serve another, in the engine as here)."""
        return self.cache_salt if self.lora_name is None else (self.cache_salt, "lora", self.lora_name)

    def __post_init__(self) -> None:
        if not isinstance(self.sampling, SamplingParams):
            raise ValueError(f"sampling: must be a SamplingParams, got {type(self.sampling).__name__}")

    @property
    def num_prompt_tokens(self) -> int | None:
        """None for a text prompt (not tokenised yet): routing then leaves the choice to Serve."""
        return None if isinstance(self.prompt, str) else len(self.prompt)

    @property
    def max_tokens(self) -> int | None:
        return self.sampling.max_tokens

    def scheduling_kwargs(self) -> dict:
        """Keyword arguments of ``AsyncLLMEngine.generate`` beyond prompt, sampling and id."""
        kwargs = {"priority": self.priority, "ttft_slo_ms": self.ttft_slo_ms, "tbt_slo_ms": self.tbt_slo_ms,
                  "trace_context": self.trace_context or None, "service_class": self.service_class,
                  "cache_salt": self.cache_salt, "lora_name": self.lora_name}
        return {k: v for k, v in kwargs.items() if v is not None}


@dataclass(frozen=True)
class StreamItem:
    """One item of a replica's token stream: the text and token ids new since the previous item.

    The first item also carries who serves it and the prompt's size (and ``engine_ttft_s``, the
    engine's own TTFT, which the router subtracts from the TTFT it sees); the final item carries
    ``finish_reason`` ("stop" | "length" | "abort" | "error") and the totals. One item may be both.
    """

    text: str
    token_ids: tuple[int, ...] = ()
    # Where the request asked for logprobs: per token of ``token_ids``, the top ones ({token id:
    # logprob}, the sampled token's among them).
    logprobs: tuple[dict[int, float], ...] | None = None
    # The first item.
    replica_id: str | None = None
    num_prompt_tokens: int | None = None
    engine_ttft_s: float | None = None
    # The final item.
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_output_tokens: int | None = None
    error: str | None = None
    engine_e2e_s: float | None = None
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache

    @property
    def is_final(self) -> bool:
        return self.finish_reason is not None

    @property
    def is_failed(self) -> bool:
        return self.error is not None or self.finish_reason == "error"

    @staticmethod
    def merge(items: Sequence[StreamItem]) -> StreamItem:
        """Items that piled up in transit, as one (``deployments.streaming.coalesced``): texts and token
        ids concatenate; the other fields are the last item's where it has them, else the first's."""
        if len(items) == 1:
            return items[0]
        first, last = items[0], items[-1]
        extras = {f.name: getattr(last, f.name) if getattr(last, f.name) is not None else getattr(first, f.name)
                  for f in dataclasses.fields(StreamItem) if f.name not in ("text", "token_ids", "logprobs")}
        logprobs = None if first.logprobs is None else tuple(lp for item in items for lp in item.logprobs or ())
        return StreamItem(text="".join(item.text for item in items),
                          token_ids=tuple(t for item in items for t in item.token_ids), logprobs=logprobs, **extras)


@dataclass(frozen=True)
class InvalidRequest:
    """The whole stream of a request the engine refused: ``message`` is "field: what is wrong"."""

    message: str


@dataclass(frozen=True)
class LoadReport:
    """A replica's load, for the request router (``record_routing_stats``) and the controller (heartbeat)."""

    replica_id: str
    actor_name: str
    model: str
    time: float  # wall clock when taken: the request router compares it with when it routed requests
    num_pages: int
    num_free_pages: int
    # Prompt pages of requests received but not prefilled yet: they hold no pages yet, but will.
    num_pending_pages: int
    tokens_per_kv_page: int
    hidden_allowed: bool  # whether the hidden kind can be used at all (else the ratio has no effect)
    cache_ratio: float  # the hidden-cache target in force
    num_running: int
    num_waiting: int
    max_num_seqs: int
    max_model_len: int
    step_time_ms: float  # mean of the engine's recent steps
    seed: int
    num_requests: int
    num_aborted: int  # callers that went away before the end
    # Pages in use by kind ("kv", "hidden", "kv-int8", "hidden-int8"), and the compressed kinds this
    # replica's engine is offered (none: cache_ratio changes nothing there).
    pages_by_kind: dict[str, int] = field(default_factory=dict)
    compressed_kinds: tuple[str, ...] = ()
    # The controller marked this replica pressured (its own usage over the heavy watermark): the request router sends new requests to the others while they have room.
    is_pressured: bool = False
    # The least important running request's priority value (None: none running): a more important
    # arrival may displace it, so the routers do not hold such arrivals over the heavy watermark.
    max_running_priority: int | None = None
    # Serve's internal ids of the ``generate`` calls this replica received in the last
    # ``RECEIVED_WINDOW_S`` (None: not reported): the request router keeps a request it routed here in
    # its ledger until a snapshot lists it, so one taken while the request was still on its way
    # (a busy host: tens of milliseconds and more) does not make its pages vanish from both.
    received: tuple[str, ...] | None = None
    # LoRA adapters in the engine's slots, those of them requests hold, and how many slots there are: the
    # request router sends a request to a replica holding its adapter, else to one with a slot to spare.
    loras: tuple[str, ...] = ()
    busy_loras: tuple[str, ...] = ()
    max_loras: int = 0

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - self.num_free_pages

    @classmethod
    def from_engine(cls, cache, config, *, max_model_len: int, step_time_ms: float, **replica) -> LoadReport:
        """The report of an engine whose ``cache_stats()`` is ``cache`` and whose ``EngineConfig`` is
        ``config``; ``replica``: the fields only the replica knows (its ids, clock, pending pages,
        counts, the controller's pressure flag, the calls received). The engine replica and the fleet
        simulator's replicas build it here."""
        pages = cache.pages_by_kind or {"kv": cache.num_kv_pages, "hidden": cache.num_hidden_pages}
        return cls(num_pages=cache.num_pages, num_free_pages=cache.num_free_pages,
                   tokens_per_kv_page=cache.kv_tokens_per_page, hidden_allowed=cache.hidden_allowed,
                   cache_ratio=cache.cache_ratio, num_running=cache.num_running, num_waiting=cache.num_waiting,
                   max_num_seqs=config.max_num_seqs, max_model_len=max_model_len, step_time_ms=step_time_ms,
                   seed=config.seed, pages_by_kind=dict(pages), compressed_kinds=tuple(cache.compressed_kinds),
                   max_running_priority=cache.max_running_priority, loras=tuple(cache.loras[0]),
                   busy_loras=tuple(cache.loras[1]), max_loras=config.max_loras or 0, **replica)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> LoadReport:
        received = data.get("received")
        return cls(**{**data, "compressed_kinds": tuple(data.get("compressed_kinds", ())),
                      "loras": tuple(data.get("loras", ())), "busy_loras": tuple(data.get("busy_loras", ())),
                      "received": tuple(received) if received is not None else None})


@dataclass(frozen=True)
class Knobs:
    """The controller's reply to a heartbeat: this replica's knobs (``cluster_control.py``)."""

    cache_ratio: float
    is_pressured: bool = False  # reported back in the replica's LoadReport, for the request router
    # The LoRA adapters loaded at run time ({name: path}): a replica unloads those it holds that are gone.
    adapters: dict[str, str] | None = None


@dataclass(frozen=True)
class ArrivalCount:
    """Requests a router received since its previous poll (sent with ``Controller.get_state``), for the
    controller's ``TrafficPredictor``; counted before admission, so refused requests are demand too."""

    router_id: str
    num_requests: int
    num_prompt_tokens: int
    num_output_tokens: int  # max_tokens, capped at the router's output horizon


@dataclass(frozen=True)
class ControllerDecision:
    """One change of the knobs, with why (kept for ``get_state`` and logged): the cluster's
    (``replica_id`` None: admission, its ratio floor, the admission limit) or one replica's (its ratio,
    ``admission_open`` False: pressured). With prediction on, the forecast in force when it was taken."""

    time: float
    usage: float  # the cluster's, or the replica's own
    cache_ratio: float
    admission_open: bool
    reason: str
    replica_id: str | None = None
    forecast: Forecast | None = None
    forecast_usage: float | None = None
    admission_limit: float = 1.0
    actions: tuple[str, ...] = ()  # e.g. "raise_hidden_target", "pressure_replica", "tighten_admission"


@dataclass(frozen=True)
class ControllerState:
    """What routers poll: whether to admit, and the replicas' last reports (by replica id)."""

    admission_open: bool
    cache_ratio: float
    usage: float  # pages in use / pages, over the replicas that reported recently
    retry_after_s: float
    replicas: dict[str, LoadReport] = field(default_factory=dict)
    decisions: tuple[ControllerDecision, ...] = ()
    knobs: dict[str, Knobs] = field(default_factory=dict)  # replica id -> its knobs
    forecast: Forecast | None = None  # with predictive_control: the last forecast
    forecast_usage: float | None = None
    admission_limit: float = 1.0  # share of each router's in-flight slots to let through
    adapters: dict[str, str] = field(default_factory=dict)  # LoRA adapters loaded at run time: {name: path}
