"""The router's settings (``RouterOptions``), validated once: ``app.py`` builds them from the app's arguments,
where their defaults are."""

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveFloat, PositiveInt, SecretStr

from apt_serve_ray.scheduler.value import ValueWeights
from deployments.service_classes import ServiceClass


class RouterOptions(BaseModel):
    """The router's settings, validated once (``app.py`` builds them from the app's arguments, where their
    defaults are; the router has none of its own)."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    model: str
    served_model_name: Optional[str]  # None: the model's name
    tokenizer: Optional[str]  # None: the model's own
    default_ttft_slo_ms: PositiveFloat  # for requests that name no ``ttft_slo_ms`` (admission urgency)
    output_horizon_tokens: PositiveInt  # output a request is assumed to reach, for its admission pages
    max_in_flight: PositiveInt  # requests this router lets through to the engines at once
    max_queued_requests: NonNegativeInt  # requests waiting for a slot before new ones get 429
    admission_weights: ValueWeights  # the admission score's (``admission.py``)
    service_classes: dict[str, ServiceClass]  # checked by ``ServiceClasses``
    default_service_class: str
    # None: a request's urgency rises over its whole TTFT target, as in the engine's value model.
    urgency_slack_s: Optional[PositiveFloat]
    max_wait_s: PositiveFloat  # a request waiting this long is admitted first (apt's max_wait_time)
    # Share of its value a waiting request keeps once it can no longer meet its TTFT target (apt's).
    fairness_penalty: float = Field(..., gt=0.0, le=1.0)
    poll_interval_s: PositiveFloat  # how often the controller's state is read
    tracing_exporter: Literal["none", "console", "otlp", "memory"]
    mirror_metrics: bool
    engine_cpus: Optional[dict]  # CPUs kept for the engines (``affinity.keep_off_engine_cpus``)
    api_keys: tuple[SecretStr, ...]  # none: no auth (``auth.py``); SecretStr: never in a repr or log
    max_request_body_bytes: PositiveInt  # larger bodies get 413
    # While the controller has closed admission: "hold" new requests in the admission line until it
    # reopens (503 once a request's TTFT target has passed), or "refuse" them at once with 503.
    heavy_watermark_action: Literal["hold", "refuse"]
    lora_modules: dict[str, str]  # LoRA adapters every engine replica loads at start: {name: path}
    # vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter (off: 404, as vLLM without
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING): they load a PEFT folder on this machine's path by name.
    allow_runtime_lora_updating: bool

    @property
    def name(self) -> str:
        return self.served_model_name or self.model
