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
from ray.serve.metrics import Counter, Gauge

from apt_serve_ray.scheduler.watermarks import Watermarks

logger = logging.getLogger("ray.serve")


@serve.deployment(num_replicas=1, max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0},
                  logging_config={"enable_access_log": False})  # heartbeats would flood the log
class Controller:
    async def __init__(self, light_watermark: float = 0.7, heavy_watermark: float = 0.9,
                       max_hidden_ratio: float = 0.7, hidden_ratio_step: float = 0.1, base_cache_ratio: float = 0.0,
                       interval_s: float = 0.5, retry_after_s: float = 2.0) -> None:
        self.watermarks = Watermarks(light_watermark, heavy_watermark, max_hidden_ratio, hidden_ratio_step,
                                     base=base_cache_ratio)
        self.interval_s, self.retry_after_s = interval_s, retry_after_s
        self.stale_after_s = max(2.0, 5 * interval_s)
        self.replicas: dict[str, dict] = {}  # replica id -> its last report, plus "received" (monotonic)
        self.usage = 0.0
        self.decisions: deque[dict] = deque(maxlen=200)
        self._usage_gauge = Gauge("apt_cluster_cache_usage", description="Share of cache pages in use, cluster-wide")
        self._ratio_gauge = Gauge("apt_hidden_target_ratio", description="Hidden-cache target ratio set on replicas")
        self._admit_gauge = Gauge("apt_admission_open", description="1 while routers admit new requests")
        self._replicas_gauge = Gauge("apt_engine_replicas_reporting", description="Engine replicas reporting")
        self._decisions = Counter("apt_watermark_decisions", description="Watermark decisions that changed a knob",
                                  tag_keys=("knob",))
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
        self._replicas_gauge.set(len(self.replicas))
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
                self._decisions.inc(tags={"knob": "cache_ratio"})
            if decision.admit != before[1]:
                self._decisions.inc(tags={"knob": "admission"})
        self._usage_gauge.set(self.usage)
        self._ratio_gauge.set(self.watermarks.ratio)
        self._admit_gauge.set(1 if self.watermarks.admit else 0)
