"""Controller (one replica): applies the two memory watermarks cluster-wide.

Every engine replica reports its load here each interval (a ``LoadReport``; the heartbeat's reply,
``Knobs``, carries the hidden target ratio back); every interval the controller computes the
cluster's memory pressure (pages in use / pages, over every replica that reported recently), feeds it
to the same ``Watermarks`` rule an engine uses alone, logs and counts each decision, and publishes the
state the routers poll (``ControllerState``). A replica that stops reporting (killed, restarted) is
dropped after a few intervals and its replacement joins with its first report, receiving the current
target at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

from ray import serve

from apt_serve_ray.config import EngineConfig
from apt_serve_ray.scheduler.watermarks import Watermarks
from deployments.affinity import keep_off_engine_cpus
from deployments.metrics import ControllerMetrics, make_backend, snapshot
from deployments.wire import ControllerDecision, ControllerState, Knobs, LoadReport

logger = logging.getLogger("ray.serve")


@serve.deployment(num_replicas=1, max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0},
                  logging_config={"enable_access_log": False})  # heartbeats would flood the log
class Controller:
    async def __init__(self, engine_config: EngineConfig, interval_s: float, retry_after_s: float, model: str = "",
                       mirror_metrics: bool = False, engine_cpus: dict | None = None) -> None:
        """``engine_config``: the replicas' config; its watermark fields (and ``cache_ratio``, the base
        the hidden target falls back to) are the cluster's."""
        keep_off_engine_cpus(engine_cpus)
        c = engine_config
        self.watermarks = Watermarks(c.light_watermark, c.heavy_watermark, c.max_hidden_ratio, c.hidden_ratio_step,
                                     base=c.cache_ratio)
        self.interval_s, self.retry_after_s = interval_s, retry_after_s
        self.stale_after_s = max(2.0, 5 * interval_s)
        self.replicas: dict[str, LoadReport] = {}  # replica id -> its last report
        self.last_heard: dict[str, float] = {}  # replica id -> when its last report came (monotonic)
        self.usage = 0.0
        self.decisions: deque[ControllerDecision] = deque(maxlen=200)
        self._backend = make_backend({"model": model}, mirror_metrics)
        self.metrics = ControllerMetrics(self._backend)
        self._loop = asyncio.create_task(self._control_loop())

    # Called by engine replicas and routers --------------------------------------------------------
    async def report(self, load: LoadReport) -> Knobs:
        if load.replica_id not in self.replicas:
            logger.info("controller: engine replica %s joined (%d pages)", load.replica_id, load.num_pages)
        self.replicas[load.replica_id] = load
        self.last_heard[load.replica_id] = time.monotonic()
        return Knobs(cache_ratio=self.watermarks.ratio)

    async def get_state(self) -> ControllerState:
        return ControllerState(admission_open=self.watermarks.admit, cache_ratio=self.watermarks.ratio,
                               usage=self.usage, retry_after_s=self.retry_after_s, replicas=dict(self.replicas),
                               decisions=tuple(self.decisions))

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
        now = time.monotonic()
        for replica_id in [r for r, heard in self.last_heard.items() if now - heard > self.stale_after_s]:
            logger.warning("controller: engine replica %s stopped reporting; dropped", replica_id)
            del self.replicas[replica_id], self.last_heard[replica_id]
        self.metrics.replicas.set(len(self.replicas))
        total = sum(load.num_pages for load in self.replicas.values())
        if total == 0:
            return
        self.usage = sum(load.num_used_pages for load in self.replicas.values()) / total
        before = (self.watermarks.ratio, self.watermarks.admit)
        decision = self.watermarks.observe(self.usage)
        if decision.changed:
            note = "" if any(load.hidden_allowed for load in self.replicas.values()) else (
                " (hidden cache off for this model: the ratio has no effect)")
            logger.info("controller: %s%s", decision.reason, note)
            self.decisions.append(ControllerDecision(time=time.time(), usage=self.usage,
                                                     cache_ratio=decision.cache_ratio, admission_open=decision.admit,
                                                     reason=decision.reason + note))
            if decision.cache_ratio != before[0]:
                action = "raise_hidden_target" if decision.cache_ratio > before[0] else "lower_hidden_target"
                self.metrics.actions.inc(1, {"action": action})
            if decision.admit != before[1]:
                self.metrics.actions.inc(1, {"action": "open_admission" if decision.admit else "close_admission"})
        self.metrics.usage.set(self.usage)
        self.metrics.target.set(self.watermarks.ratio)
        self.metrics.admission.set(1 if self.watermarks.admit else 0)
        band = ("below_light" if self.usage <= self.watermarks.light else
                "between" if self.usage <= self.watermarks.heavy else "above_heavy")
        for state in ("below_light", "between", "above_heavy"):
            self.metrics.watermark.set(1 if state == band else 0, {"state": state})
