"""``from apt_serve.monitor import CacheTracker``: ``apt_serve_ray.observability.tracker``'s."""

from apt_serve_ray.observability.tracker import CacheTracker, plot_memory_timeline

__all__ = ["CacheTracker", "plot_memory_timeline"]
