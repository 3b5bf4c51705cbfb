"""Controller (one replica): the memory rules, per replica and cluster-wide, from replica heartbeats.

Every engine replica reports its load here each interval (a ``LoadReport``); the heartbeat's reply
(``Knobs``) carries that replica's knobs back: its cache ratio and whether it is pressured (which
its next load report passes on to the request router). Routers poll ``get_state`` and send along
how many requests they received since (``ArrivalCount``), which feeds the ``TrafficPredictor`` when
``predictive_control`` is on. Every interval the decision logic (``cluster_control.ClusterControl``,
no Ray there, where the rules are written down) runs once; each decision is logged with the forecast
that caused it, counted, and kept for ``get_state``. A replica that stops reporting (killed,
restarted) is dropped after a few intervals and its replacement joins with its first report,
receiving the cluster's ratio at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections import deque
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat
from ray import serve

from apt_serve_ray.config import EngineConfig
from deployments.affinity import keep_off_engine_cpus
from deployments.cluster_control import ClusterControl, ControlSettings, describe
from deployments.metrics import ControllerMetrics, make_backend, snapshot
from deployments.wire import ArrivalCount, ControllerDecision, ControllerState, Knobs, LoadReport

logger = logging.getLogger("ray.serve")

RATIO_DWELL_S = 2.0  # a ratio falls only after its signal has stayed low this long (ControlSettings)


class ControllerOptions(BaseModel):
    """The controller's settings besides the replicas' ``EngineConfig``, validated once (``app.py`` builds
    them from the app's arguments, where their defaults are). ``interval_s``: how often it decides;
    ``retry_after_s``: the Retry-After of a 503 while admission is closed; ``engine_cpus``: CPUs kept for
    the engines (``affinity.keep_off_engine_cpus``); ``prediction``: ``{"horizon_s", "history_s",
    "admission_share"}`` turns predictive control on (None: reactive only)."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    interval_s: PositiveFloat
    retry_after_s: PositiveFloat
    model: str
    mirror_metrics: bool
    engine_cpus: Optional[dict]
    prediction: Optional[dict[str, float]] = Field(...)


@serve.deployment(num_replicas=1, max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0},
                  logging_config={"enable_access_log": False})  # heartbeats would flood the log
class Controller:
    async def __init__(self, engine_config: EngineConfig, options: ControllerOptions) -> None:
        """``engine_config``: the replicas' config; its watermark fields (and ``cache_ratio``, the base
        the ratio falls back to) are the controller's."""
        keep_off_engine_cpus(options.engine_cpus)
        c, interval_s, prediction = engine_config, options.interval_s, options.prediction
        self.control = ClusterControl(ControlSettings(
            c.light_watermark, c.heavy_watermark, c.max_hidden_ratio, c.hidden_ratio_step, base_ratio=c.cache_ratio,
            stale_after_s=max(2.0, 5 * interval_s), ratio_dwell=max(1, math.ceil(RATIO_DWELL_S / interval_s)),
            predictive=prediction is not None, **(prediction or {})))
        self.interval_s, self.retry_after_s = interval_s, options.retry_after_s
        self.decisions: deque[ControllerDecision] = deque(maxlen=200)
        self.adapters: dict[str, str] = {}  # LoRA adapters loaded at run time: {name: path}
        self._backend = make_backend({"model": options.model}, options.mirror_metrics)
        self.metrics = ControllerMetrics(self._backend)
        self._loop = asyncio.create_task(self._control_loop())

    @property
    def replicas(self) -> dict[str, LoadReport]:
        return self.control.replicas

    # Called by engine replicas and routers --------------------------------------------------------
    async def report(self, load: LoadReport) -> Knobs:
        if load.replica_id not in self.control.replicas:
            logger.info("controller: engine replica %s joined (%d pages)", load.replica_id, load.num_pages)
        return dataclasses.replace(self.control.report(load, time.monotonic()), adapters=dict(self.adapters))

    async def set_adapter(self, name: str, path: str) -> None:
        """A LoRA adapter loaded at run time (``/v1/load_lora_adapter``): every router lets requests name it,
        every replica loads it on its first request for it."""
        self.adapters[name] = path
        logger.info("controller: LoRA adapter %s loaded from %s", name, path)

    async def remove_adapter(self, name: str) -> bool:
        """Forget a LoRA adapter loaded at run time; replicas unload it at their next heartbeat."""
        removed = self.adapters.pop(name, None) is not None
        if removed:
            logger.info("controller: LoRA adapter %s unloaded", name)
        return removed

    async def get_state(self, arrivals: ArrivalCount | None = None) -> ControllerState:
        if arrivals is not None:
            self.control.observe_arrivals(arrivals, time.monotonic())
        return ControllerState(retry_after_s=self.retry_after_s, replicas=dict(self.control.replicas),
                               decisions=tuple(self.decisions), adapters=dict(self.adapters),
                               **self.control.state_fields())

    def metrics_snapshot(self) -> dict:
        """The metric values kept in memory (``mirror_metrics``; {} otherwise), for tests."""
        return snapshot(self._backend)

    # The control loop -----------------------------------------------------------------------------
    async def _control_loop(self) -> None:
        while True:
            try:
                self.step()
            except Exception:  # noqa: BLE001 - one bad report must not stop the controller
                logger.exception("controller: step failed")
            await asyncio.sleep(self.interval_s)

    def step(self) -> None:
        control = self.control
        before = set(control.replicas)
        decisions = control.step(time.monotonic())
        for replica_id in sorted(before - set(control.replicas)):
            logger.warning("controller: engine replica %s stopped reporting; dropped", replica_id)
        for decision in decisions:
            logger.info("controller: %s", describe(decision))
            self.decisions.append(decision)
            for action in decision.actions:
                self.metrics.actions.inc(1, {"action": action})
        self.metrics.record(control)
