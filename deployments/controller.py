"""Controller (one replica): applies the two memory watermarks cluster-wide.

Every engine replica reports its load here each interval (the heartbeat's reply carries the hidden
target ratio back); every interval the controller computes the cluster's memory pressure (pages in
use / pages, over every replica that reported recently), feeds it to the same ``Watermarks`` rule an
engine uses alone, logs and counts each decision, and publishes the admission state the routers
poll. A replica that stops reporting (killed, restarted) is dropped after a few intervals and its
replacement joins with its first report, receiving the current target at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

from ray import serve

from apt_serve_ray.scheduler.watermarks import Watermarks
from deployments.affinity import keep_off_engine_cpus
from deployments.metrics import ControllerMetrics, make_backend, snapshot

logger = logging.getLogger("ray.serve")


@serve.deployment(num_replicas=1, max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0},
                  logging_config={"enable_access_log": False})  # heartbeats would flood the log
class Controller:
    async def __init__(self, light_watermark: float = 0.7, heavy_watermark: float = 0.9,
                       max_hidden_ratio: float = 0.7, hidden_ratio_step: float = 0.1, base_cache_ratio: float = 0.0,
                       interval_s: float = 0.5, retry_after_s: float = 2.0, model: str = "",
                       mirror_metrics: bool = False, engine_cpus: dict | None = None) -> None:
        keep_off_engine_cpus(engine_cpus)
        self.watermarks = Watermarks(light_watermark, heavy_watermark, max_hidden_ratio, hidden_ratio_step,
                                     base=base_cache_ratio)
        self.interval_s, self.retry_after_s = interval_s, retry_after_s
        self.stale_after_s = max(2.0, 5 * interval_s)
        self.replicas: dict[str, dict] = {}  # replica id -> its last report, plus "received" (monotonic)
        self.usage = 0.0
        self.decisions: deque[dict] = deque(maxlen=200)
        self._backend = make_backend({"model": model}, mirror_metrics)
        self.metrics = ControllerMetrics(self._backend)
        self._loop = asyncio.create_task(self._control_loop())

    # Called by engine replicas and routers --------------------------------------------------------
    async def report(self, load: dict) -> dict:
        replica_id = load["replica_id"]
        if replica_id not in self.replicas:
            logger.info("controller: engine replica %s joined (%d pages)", replica_id, load.get("num_pages", 0))
        self.replicas[replica_id] = {**load, "received": time.monotonic()}
        return {"cache_ratio": self.watermarks.ratio}

    async def get_state(self) -> dict:
        return {"admission_open": self.watermarks.admit, "cache_ratio": self.watermarks.ratio, "usage": self.usage,
                "retry_after_s": self.retry_after_s, "replicas": dict(self.replicas),
                "decisions": list(self.decisions)}

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
        for replica_id in [r for r, load in self.replicas.items() if now - load["received"] > self.stale_after_s]:
            logger.warning("controller: engine replica %s stopped reporting; dropped", replica_id)
            del self.replicas[replica_id]
        self.metrics.replicas.set(len(self.replicas))
        total = sum(load["num_pages"] for load in self.replicas.values())
        if total == 0:
            return
        self.usage = sum(load["num_pages"] - load["num_free_pages"] for load in self.replicas.values()) / total
        before = (self.watermarks.ratio, self.watermarks.admit)
        decision = self.watermarks.observe(self.usage)
        if decision.changed:
            note = "" if any(load.get("hidden_allowed") for load in self.replicas.values()) else (
                " (hidden cache off for this model: the ratio has no effect)")
            logger.info("controller: %s%s", decision.reason, note)
            self.decisions.append({"time": time.time(), "usage": self.usage, "cache_ratio": decision.cache_ratio,
                                   "admission_open": decision.admit, "reason": decision.reason + note})
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
