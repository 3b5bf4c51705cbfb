"""Observability without ray: engine observers, the memory timeline, request logs, metrics, traces.

The engine calls its observers (``engine.add_observer``) at request events and after every step.
Metric *definitions* live here and record into a pluggable backend (in memory for tests and offline
runs, ``ray.util.metrics`` in the Ray Serve deployments).
"""

from apt_serve_ray.observability.observer import EngineObserver, RequestEvent
from apt_serve_ray.observability.tracker import CacheTracker

__all__ = ["EngineObserver", "RequestEvent", "CacheTracker"]
