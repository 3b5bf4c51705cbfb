"""Keep a Serve process (router, controller) off the CPUs the engine replicas compute on."""

from __future__ import annotations

import logging

from apt_serve_ray.worker import cpu_affinity

logger = logging.getLogger("ray.serve")


def keep_off_engine_cpus(engines: dict | None) -> None:
    """``engines``: ``{"num_engine_replicas": R, "num_threads": T}`` as the app deploys them, or None."""
    if not engines:
        return
    rest = cpu_affinity.other_cpus(engines["num_engine_replicas"], engines["num_threads"])
    if rest:
        cpu_affinity.pin_process_threads(rest)
        logger.info("pinned to CPUs %s (the engines compute on the others)", rest)
