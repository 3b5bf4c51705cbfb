"""``from apt_serve.predictor import TrafficPredictor``: ``apt_serve_ray.scheduler.predictor``'s."""

from apt_serve_ray.scheduler.predictor import Forecast, TrafficPredictor

__all__ = ["Forecast", "TrafficPredictor"]
