"""The app builder: ``serve run serve_config.yaml`` (import_path ``deployments.app:build_app``) or
``serve.run(build_app({...}))``.

``AppArgs`` is validated once here: the app's own arguments, plus every ``EngineConfig`` field as a
top-level argument (left unset: ``EngineConfig``'s default). The engine config is built (and so
validated, naming the bad field) before anything is deployed; its watermark fields are also the
controller's, which applies them cluster-wide.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Annotated, Any, Literal, Optional

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, NonNegativeFloat, PositiveFloat, PositiveInt,
                      SecretStr, create_model, field_validator, model_validator)
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from apt_serve_ray.config import EngineConfig
from apt_serve_ray.models.loader import DEFAULT_MODEL
from apt_serve_ray.scheduler.registry import make_policy
from apt_serve_ray.scheduler.value import FAIRNESS_PENALTY, MAX_WAIT_S, ValueWeights
from deployments.admission import ADMISSION_WEIGHTS
from deployments.auth import resolve_keys
from deployments.autoscaling import AutoscalingOptions
from deployments.controller import Controller, ControllerOptions
from deployments.engine_replica import EngineReplica, ReplicaOptions
from deployments.request_router import OUTPUT_HORIZON_TOKENS, FitAwareRequestRouter
from deployments.request_body import MAX_REQUEST_BODY_BYTES
from deployments.router import Router
from deployments.router_options import RouterOptions
from deployments.service_classes import DEFAULT_SERVICE_CLASS, SERVICE_CLASSES, ServiceClass, ServiceClasses


def _admission_weights(value):
    """Fields left out keep the value model's defaults (``ADMISSION_WEIGHTS``, the engine's too)."""
    return {**dataclasses.asdict(ADMISSION_WEIGHTS), **value} if isinstance(value, dict) else value


def policy_kwargs(args: _AppArgs, config: EngineConfig) -> dict:
    """The engine policy's keyword arguments as every replica gets them (in its ``EngineConfig``):
    ``policy_weights`` over ``policy_options``."""
    return {**(config.policy_options or {}), **args.policy_weights}


def replica_scaling(args: _AppArgs, config: EngineConfig) -> dict:
    """The engine replicas' count as ``EngineReplica.options`` takes it: ``num_replicas``, or with
    ``autoscaling`` an ``autoscaling_config`` sized on the engine's batch (``max_num_seqs``)."""
    if args.autoscaling is None:
        return {"num_replicas": args.num_replicas}
    return {"autoscaling_config": args.autoscaling.autoscaling_config(config.max_num_seqs)}


def admission_weights(args: _AppArgs, config: EngineConfig) -> ValueWeights:
    """The router's admission weights: the app's ``admission_weights`` if given, else the engine policy's
    (``policy_weights`` over ``policy_options``), so the router and the engines order by one value model."""
    if args.admission_weights is not None:
        return args.admission_weights
    return ValueWeights.of_policy(policy_kwargs(args, config))


# The router's admission weights: the value model's one weights type (apt_serve_ray/scheduler/value.py),
# validated by it (unknown fields and bad values are rejected naming the field).
AdmissionWeights = Annotated[ValueWeights, BeforeValidator(_admission_weights)]


class _AppArgs(BaseModel):
    """The app's own arguments; ``AppArgs`` adds the engine's (see ``_engine_arguments``)."""

    # arbitrary types: an EngineConfig field of a type pydantic does not know is still an argument.
    model_config = ConfigDict(extra="forbid", protected_namespaces=(), arbitrary_types_allowed=True)

    # What to serve.
    model: str = DEFAULT_MODEL
    served_model_name: Optional[str] = None
    tokenizer: Optional[str] = None
    # Replicas and what each one holds (one engine replica per GPU; on CPU, per CPU slot).
    num_replicas: PositiveInt = 1
    # Or engine replicas that scale (deployments/autoscaling.py): {"max_replicas": N, ...}, between min_replicas
    # and max_replicas, ahead of the forecast peak of arrivals ("forecast", the default) or on what is in
    # flight now (Ray Serve's "default" policy). None: num_replicas, fixed.
    autoscaling: Optional[AutoscalingOptions] = None
    num_routers: PositiveInt = 1
    num_cpus_per_replica: NonNegativeFloat = 1.0
    num_gpus_per_replica: NonNegativeFloat = 0.0
    num_cpus_per_router: NonNegativeFloat = 0.0
    # With num_threads set: each engine replica's compute thread(s) get CPUs of their own on its node,
    # and the Serve processes and threads of the app are kept off them (apt_serve_ray/worker/cpu_affinity.py).
    pin_cpus: bool = True
    # True: each engine replica puts its node's Ray processes (proxy, router, controllers, GCS, raylet, its own
    # actor) under SCHED_BATCH: their timer wake-ups wait for the kernel's tick instead of preempting the
    # engine's compute threads, whose process stays SCHED_OTHER (cpu_affinity.yield_to_engines). For
    # throughput: with as many compute threads as cores, saturated output 1.11x, but issue 44's burst trace
    # lost attainment (docs/benchmarks.md, issue 41's tenth pass), so off by default. Needs the engine process.
    yield_to_engines: bool = False
    # "module:callable" building each engine replica's engine client (deployments.engine_replica.make_engine_client;
    # e.g. a fake engine in tests); None: AsyncLLMEngine, the engine in a process of the replica's own.
    engine_client: Optional[str] = None
    # Engine: every EngineConfig field is an argument too (None: EngineConfig's default), among them
    # the watermarks the controller applies cluster-wide (light_watermark, heavy_watermark,
    # max_hidden_ratio, hidden_ratio_step). policy_weights: the policy's keyword arguments.
    policy_weights: dict[str, float] = Field(default_factory=dict)
    engine_options: dict[str, Any] = Field(default_factory=dict)  # older spelling of engine arguments
    # Streaming: after the first token, at most one item per stream_interval_s seconds goes from a replica
    # to the router (never more than a quarter of the request's TBT target); the tokens of the steps in
    # between travel together. Each item costs CPU in the replica, the router and the proxy; see
    # docs/benchmarks.md (issue 14) for what one item per decode step cost on 2 cores. 0: one per step.
    stream_interval_s: NonNegativeFloat = 0.05
    # ... and while a replica's streams would together send more than stream_items_per_s items a second,
    # each waits longer (n streams: n / stream_items_per_s s), still never more than a quarter of its TBT
    # target: under load the Serve path's CPU goes to the engines (docs/benchmarks.md, issue 14:
    # on/off 1 <-> 14 req/s on 2 cores). 0: no bound (stream_interval_s alone).
    stream_items_per_s: NonNegativeFloat = 50.0
    # Controller (deployments/cluster_control.py: the rules per replica, cluster-wide and on the forecast).
    control_interval_s: PositiveFloat = 0.5
    retry_after_s: PositiveFloat = 2.0
    # While the controller has closed admission (summed memory over heavy_watermark): "hold" new requests
    # in the routers' admission line until it reopens (503 + Retry-After once a request's TTFT target has
    # passed), or "refuse" them at once with 503 + Retry-After. "hold" by default: refusing at once cost
    # more attainment than the preemptions it spared on the on/off runs (docs/benchmarks.md, issue 14).
    heavy_watermark_action: Literal["hold", "refuse"] = "hold"
    # vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter (a PEFT folder on this machine, by path); off by
    # default, as in vLLM. Replicas load such an adapter on their first request for it (``max_loras`` slots, the
    # least recently used run-time adapter making room).
    allow_runtime_lora_updating: bool = False
    # A request that names a LoRA adapter goes to a replica holding it in a slot, else to one with a slot to
    # spare (deployments/request_router.py; Ray Serve's model multiplexing does the same by model id). Off:
    # adapters are not looked at (every replica loads what its requests name, slots permitting).
    adapter_affinity: bool = True
    # With predictive_control the controller forecasts arrivals (apt_serve_ray/scheduler/predictor.py) from what the
    # routers receive and acts forecast_horizon_s ahead: ratios rise, and the routers let only
    # predictive_admission_share of their in-flight slots through, before a forecast peak crosses the
    # light / heavy watermark (1, the default: admission is not tightened on a forecast; measured to
    # cost attainment on the smoke run, docs/benchmarks.md). Off by default: on a 2-core CPU box it lost
    # to reactive control (the watermarks alone) in every on/off run measured, by 3-30 points
    # (docs/benchmarks.md, issue 14).
    predictive_control: bool = False
    forecast_horizon_s: PositiveFloat = 10.0
    forecast_history_s: PositiveFloat = 300.0
    predictive_admission_share: float = Field(1.0, gt=0.0, le=1.0)
    # Router: admission and replica choice.
    max_in_flight_per_replica: Optional[PositiveInt] = None  # default: the engine's max_num_seqs
    max_queued_requests: int = Field(1024, ge=0)
    admission_weights: Optional[AdmissionWeights] = None  # None: the engine policy's (``admission_weights``)
    # None: a request's urgency rises over its whole TTFT target, as in the engine's value model.
    urgency_slack_s: Optional[PositiveFloat] = None
    output_horizon_tokens: PositiveInt = OUTPUT_HORIZON_TOKENS
    routing_stats_period_s: PositiveFloat = 1.0
    health_check_period_s: PositiveFloat = 5.0
    # Service classes (deployments/service_classes.py): named SLO targets and priority, chosen per request
    # by ``service_class`` / ``x-service-class``; a request that names none gets ``default_service_class``.
    service_classes: dict[str, ServiceClass] = Field(default_factory=lambda: dict(SERVICE_CLASSES))
    default_service_class: str = DEFAULT_SERVICE_CLASS
    # Observability: where each process's spans go ("memory" keeps them in the process, for tests),
    # and whether to keep metric values in memory too (``metrics_snapshot()`` on each deployment).
    tracing_exporter: Literal["none", "console", "otlp", "memory"] = "none"
    mirror_metrics: bool = False
    # HTTP hardening (deployments/auth.py, request_body.py): bearer keys (None: the APT_SERVE_API_KEYS
    # environment variable, comma-separated; neither: no auth; SecretStr: never shown in a repr or log)
    # and the largest request body (413 above it).
    api_keys: Optional[list[SecretStr]] = None
    max_request_body_bytes: PositiveInt = MAX_REQUEST_BODY_BYTES

    @field_validator("engine_client")
    @classmethod
    def _check_engine_client(cls, value):
        module, _, name = (value or "x:x").partition(":")
        if not module or not name:
            raise ValueError(f"engine_client: expected 'module:callable', got {value!r}")
        return value

    @model_validator(mode="after")
    def _check_service_classes(self):
        ServiceClasses(self.service_classes, self.default_service_class)  # raises naming the field
        return self

    @model_validator(mode="after")
    def _check_autoscaling(self):
        if self.autoscaling is not None and "num_replicas" in self.model_fields_set:
            raise ValueError("num_replicas: a fixed count, and autoscaling scales the same replicas; give one")
        return self

    @property
    def max_engine_replicas(self) -> int:
        """The most engine replicas at once (what the routers' in-flight slots and the CPU plan are for)."""
        return self.autoscaling.max_replicas if self.autoscaling is not None else self.num_replicas

    def engine_config(self) -> EngineConfig:
        """The replicas' engine config. The controller steers the watermarks cluster-wide, so the
        engines' own watermarks are off."""
        given = {name: value for name in ENGINE_ARGUMENTS if (value := getattr(self, name)) is not None}
        unknown = sorted(set(self.engine_options) - set(ENGINE_ARGUMENTS))
        if unknown:
            name = unknown[0]
            where = "an app argument of its own" if name in _AppArgs.model_fields else (
                "set by the app" if name in _SET_BY_APP else "not an engine field")
            raise ValueError(f"engine_options: {name!r} is {where}; engine fields: {sorted(ENGINE_ARGUMENTS)}")
        twice = sorted(set(self.engine_options) & set(given))
        if twice:
            raise ValueError(f"engine_options: {twice[0]!r} is also given as an app argument; give it once")
        return EngineConfig(model=self.model, tokenizer=self.tokenizer,
                            enable_watermarks=False, **given, **self.engine_options)


# EngineConfig fields the app sets itself: the controller applies the watermarks, not each engine.
_SET_BY_APP = {"enable_watermarks"}


def _comma_list(value):
    """``serve run app key=a,b`` passes strings: a list field also takes a comma-separated one."""
    if isinstance(value, str):
        return [part.strip() for part in value.strip("[]").split(",") if part.strip()]
    return value


def _json_dict(value):
    """``serve run app key='{"a": 1}'`` passes strings: a dict field also takes one as JSON."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError as exc:
            raise ValueError(f"not a JSON object: {exc}") from None
    return value


def _argument_type(hint):
    """An EngineConfig field's type as an app argument (optional; list fields also from "a,b", dict
    fields also from a JSON string)."""
    origins = {typing.get_origin(hint) or hint, *(typing.get_origin(a) or a for a in typing.get_args(hint))}
    if tuple in origins:
        return Annotated[Optional[hint], BeforeValidator(_comma_list)]
    if dict in origins:
        return Annotated[Optional[hint], BeforeValidator(_json_dict)]
    return Optional[hint]


def _engine_arguments() -> dict[str, tuple]:
    """Every EngineConfig field not already an app argument, as an optional one (None: the engine's
    default). EngineConfig validates the values and names the field; pydantic only checks the types."""
    hints = typing.get_type_hints(EngineConfig)
    return {f.name: (_argument_type(hints[f.name]), None) for f in dataclasses.fields(EngineConfig)
            if f.name not in _AppArgs.model_fields and f.name not in _SET_BY_APP}


ENGINE_ARGUMENTS: dict[str, tuple] = _engine_arguments()
AppArgs = create_model("AppArgs", __base__=_AppArgs, __module__=__name__, **ENGINE_ARGUMENTS,
                       __doc__="The app's arguments (``serve_config.yaml``'s ``args``): its own (``_AppArgs``) "
                               "and every EngineConfig field but ``enable_watermarks``.")


def build_app(args: AppArgs | dict) -> Application:
    args = args if isinstance(args, AppArgs) else AppArgs.model_validate(args or {})
    config = args.engine_config()
    if args.policy_weights:
        make_policy(config.policy, config, **args.policy_weights)  # fail here, not in every replica
    # The policy's options merged once, here: every replica gets them in its EngineConfig, and the
    # router reads the same ones (``policy_kwargs``).
    engine_config = config.replace(policy_options=policy_kwargs(args, config) or None)
    pin = args.pin_cpus and config.num_threads is not None
    engine_cpus = {"num_engine_replicas": args.max_engine_replicas, "num_threads": config.num_threads} if pin else None
    name = args.served_model_name or args.model
    controller = Controller.options(ray_actor_options={"num_cpus": 0}).bind(config, ControllerOptions(
        interval_s=args.control_interval_s, retry_after_s=args.retry_after_s, model=name,
        mirror_metrics=args.mirror_metrics, engine_cpus=engine_cpus,
        prediction={"horizon_s": args.forecast_horizon_s, "history_s": args.forecast_history_s,
                    "admission_share": args.predictive_admission_share} if args.predictive_control else None))
    engine = EngineReplica.options(
        **replica_scaling(args, config),
        ray_actor_options={"num_cpus": args.num_cpus_per_replica, "num_gpus": args.num_gpus_per_replica},
        max_ongoing_requests=2 * config.max_num_seqs + 16,
        health_check_period_s=args.health_check_period_s,
        request_router_config=RequestRouterConfig(
            request_router_class=FitAwareRequestRouter,
            request_router_kwargs={"output_horizon_tokens": args.output_horizon_tokens,
                                   "default_tokens_per_page": config.block_size,
                                   "adapter_affinity": args.adapter_affinity},
            request_routing_stats_period_s=args.routing_stats_period_s,
            request_routing_stats_timeout_s=max(args.routing_stats_period_s, 5.0)),
    ).bind(engine_config, controller, ReplicaOptions(
        model_name=name, report_interval_s=args.control_interval_s, pin_cpus=pin,
        stream_interval_s=args.stream_interval_s, stream_items_per_s=args.stream_items_per_s or None,
        tracing_exporter=args.tracing_exporter, mirror_metrics=args.mirror_metrics, engine_client=args.engine_client,
        yield_to_engines=args.yield_to_engines))
    max_in_flight = (args.max_in_flight_per_replica or config.max_num_seqs) * args.max_engine_replicas
    router_options = RouterOptions(
        model=args.model, served_model_name=args.served_model_name, tokenizer=args.tokenizer,
        default_ttft_slo_ms=config.default_ttft_slo_ms, output_horizon_tokens=args.output_horizon_tokens,
        max_in_flight=max(1, max_in_flight // args.num_routers), max_queued_requests=args.max_queued_requests,
        admission_weights=admission_weights(args, config), urgency_slack_s=args.urgency_slack_s,
        max_wait_s=policy_kwargs(args, config).get("max_wait_time", MAX_WAIT_S),
        fairness_penalty=policy_kwargs(args, config).get("fairness_penalty", FAIRNESS_PENALTY),
        service_classes=args.service_classes, default_service_class=args.default_service_class,
        poll_interval_s=min(0.25, args.control_interval_s),
        tracing_exporter=args.tracing_exporter, mirror_metrics=args.mirror_metrics, engine_cpus=engine_cpus,
        api_keys=resolve_keys(args.api_keys), max_request_body_bytes=args.max_request_body_bytes,
        heavy_watermark_action=args.heavy_watermark_action, lora_modules=config.lora_module_paths(),
        allow_runtime_lora_updating=args.allow_runtime_lora_updating)
    return Router.options(num_replicas=args.num_routers, ray_actor_options={"num_cpus": args.num_cpus_per_router}
                          ).bind(engine, controller, router_options)
