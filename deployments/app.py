"""The app builder: ``serve run serve_config.yaml`` (import_path ``deployments.app:build_app``) or
``serve.run(build_app({...}))``.

``AppArgs`` is validated once here; engine fields left unset keep ``EngineConfig``'s defaults, and the
engine config is built (and so validated, naming the bad field) before anything is deployed.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, PositiveFloat, PositiveInt, field_validator
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from apt_serve_ray.config import EngineConfig
from apt_serve_ray.model_loader import DEFAULT_MODEL
from apt_serve_ray.scheduler.registry import make_policy
from deployments.admission import ScoreWeights
from deployments.controller import Controller
from deployments.engine_replica import EngineReplica
from deployments.request_router import FitAwareRequestRouter
from deployments.router import Router

# AppArgs fields that go to EngineConfig as they are (None: the engine's default).
_ENGINE_FIELDS = ("device", "dtype", "num_threads", "max_model_len", "block_size", "num_pages", "cache_budget_bytes",
                  "cache_ratio", "max_num_seqs", "max_num_batched_tokens", "policy", "default_ttft_slo_ms",
                  "default_tbt_slo_ms", "seed", "engine_process")


class AdmissionWeights(BaseModel):
    """Weights of the router's admission score (see ``deployments/admission.py``)."""

    model_config = ConfigDict(extra="forbid")
    time_weight: NonNegativeFloat = 1.0
    memory_weight: NonNegativeFloat = 1.0
    slo_weight: NonNegativeFloat = 1.0
    priority_weight: NonNegativeFloat = 1.0


class AppArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    # What to serve.
    model: str = DEFAULT_MODEL
    served_model_name: Optional[str] = None
    tokenizer: Optional[str] = None
    # Replicas and what each one holds (one engine replica per GPU; on CPU, per CPU slot).
    num_replicas: PositiveInt = 1
    num_routers: PositiveInt = 1
    num_cpus_per_replica: NonNegativeFloat = 1.0
    num_gpus_per_replica: NonNegativeFloat = 0.0
    num_cpus_per_router: NonNegativeFloat = 0.0
    # With num_threads set: each engine replica's compute thread(s) get CPUs of their own on its node,
    # and the Serve processes and threads of the app are kept off them (apt_serve_ray/cpu_affinity.py).
    pin_cpus: bool = True
    # Engine (None: EngineConfig's default). Any other EngineConfig field goes in engine_options.
    device: Optional[str] = None
    dtype: Optional[str] = None
    num_threads: Optional[PositiveInt] = None
    max_model_len: Optional[PositiveInt] = None
    block_size: Optional[PositiveInt] = None
    num_pages: Optional[PositiveInt] = None
    cache_budget_bytes: Optional[PositiveInt] = None
    cache_ratio: Optional[float] = None
    max_num_seqs: Optional[PositiveInt] = None
    max_num_batched_tokens: Optional[PositiveInt] = None
    policy: Optional[str] = None
    policy_weights: dict[str, float] = Field(default_factory=dict)
    default_ttft_slo_ms: Optional[PositiveFloat] = None
    default_tbt_slo_ms: Optional[PositiveFloat] = None
    seed: Optional[int] = None
    # The engine's step loop in a process of its own, off the replica's GIL (apt_serve_ray/engine_process.py);
    # measured through Serve on 2 CPU cores: saturated output 188 -> 222 tok/s, TPOT 12.8 -> 11.3 ms.
    engine_process: bool = True
    engine_options: dict[str, Any] = Field(default_factory=dict)
    # Controller: the cluster-wide watermarks.
    light_watermark: float = Field(0.7, ge=0, le=1)
    heavy_watermark: float = Field(0.9, ge=0, le=1)
    max_hidden_ratio: float = Field(0.7, ge=0, le=1)
    hidden_ratio_step: float = Field(0.1, gt=0, le=1)
    control_interval_s: PositiveFloat = 0.5
    retry_after_s: PositiveFloat = 2.0
    # Router: admission and replica choice.
    max_in_flight_per_replica: Optional[PositiveInt] = None  # default: the engine's max_num_seqs
    max_queued_requests: int = Field(1024, ge=0)
    admission_weights: AdmissionWeights = Field(default_factory=AdmissionWeights)
    output_horizon_tokens: PositiveInt = 256
    routing_stats_period_s: PositiveFloat = 1.0
    health_check_period_s: PositiveFloat = 5.0
    # Observability: where each process's spans go ("memory" keeps them in the process, for tests),
    # and whether to keep metric values in memory too (``metrics_snapshot()`` on each deployment).
    tracing_exporter: Literal["none", "console", "otlp", "memory"] = "none"
    mirror_metrics: bool = False

    @field_validator("heavy_watermark")
    @classmethod
    def _heavy_above_light(cls, heavy: float, info) -> float:
        light = info.data.get("light_watermark")
        if light is not None and heavy < light:
            raise ValueError(f"must be >= light_watermark ({light})")
        return heavy

    def engine_config(self) -> EngineConfig:
        """The replicas' engine config. The controller steers the watermarks cluster-wide, so the
        engines' own watermarks are off."""
        fields = {name: getattr(self, name) for name in _ENGINE_FIELDS if getattr(self, name) is not None}
        known = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(self.engine_options) - known)
        if unknown:
            raise ValueError(f"engine_options: unknown engine field {unknown[0]!r}; valid: {sorted(known)}")
        overlap = sorted(set(self.engine_options) & {*_ENGINE_FIELDS, "model", "tokenizer", "enable_watermarks"})
        if overlap:
            raise ValueError(f"engine_options: set {overlap[0]!r} as an app argument, not in engine_options")
        return EngineConfig(model=self.model, tokenizer=self.tokenizer, enable_watermarks=False,
                            **fields, **self.engine_options)


def build_app(args: AppArgs | dict) -> Application:
    args = args if isinstance(args, AppArgs) else AppArgs.model_validate(args or {})
    config = args.engine_config()
    if args.policy_weights:
        make_policy(config.policy, config, **args.policy_weights)  # fail here, not in every replica
    pin = args.pin_cpus and config.num_threads is not None
    engine_cpus = {"num_engine_replicas": args.num_replicas, "num_threads": config.num_threads} if pin else None
    controller = Controller.options(ray_actor_options={"num_cpus": 0}).bind(
        light_watermark=args.light_watermark, heavy_watermark=args.heavy_watermark,
        max_hidden_ratio=args.max_hidden_ratio, hidden_ratio_step=args.hidden_ratio_step,
        base_cache_ratio=config.cache_ratio, interval_s=args.control_interval_s, retry_after_s=args.retry_after_s,
        model=args.served_model_name or args.model, mirror_metrics=args.mirror_metrics, engine_cpus=engine_cpus)
    engine = EngineReplica.options(
        num_replicas=args.num_replicas,
        ray_actor_options={"num_cpus": args.num_cpus_per_replica, "num_gpus": args.num_gpus_per_replica},
        max_ongoing_requests=2 * config.max_num_seqs + 16,
        health_check_period_s=args.health_check_period_s,
        request_router_config=RequestRouterConfig(
            request_router_class=FitAwareRequestRouter,
            request_router_kwargs={"output_horizon_tokens": args.output_horizon_tokens,
                                   "default_tokens_per_page": config.block_size},
            request_routing_stats_period_s=args.routing_stats_period_s,
            request_routing_stats_timeout_s=max(args.routing_stats_period_s, 5.0)),
    ).bind(config, controller, args.policy_weights, args.control_interval_s, {
        "model_name": args.served_model_name or args.model, "tracing_exporter": args.tracing_exporter,
        "mirror_metrics": args.mirror_metrics, "light_watermark": args.light_watermark,
        "heavy_watermark": args.heavy_watermark}, pin)
    max_in_flight = (args.max_in_flight_per_replica or config.max_num_seqs) * args.num_replicas
    router_options = {
        "model": args.model, "served_model_name": args.served_model_name, "tokenizer": args.tokenizer,
        "default_ttft_slo_ms": config.default_ttft_slo_ms, "output_horizon_tokens": args.output_horizon_tokens,
        "max_in_flight": max(1, max_in_flight // args.num_routers), "max_queued_requests": args.max_queued_requests,
        "admission_weights": dataclasses.asdict(ScoreWeights(**args.admission_weights.model_dump())),
        "poll_interval_s": min(0.25, args.control_interval_s),
        "tracing_exporter": args.tracing_exporter, "mirror_metrics": args.mirror_metrics,
        "engine_cpus": engine_cpus,
    }
    return Router.options(num_replicas=args.num_routers, ray_actor_options={"num_cpus": args.num_cpus_per_router}
                          ).bind(engine, controller, router_options)
