"""Arrival rates that change over time (peaks), over ``workloads``' requests.

``make_shaped_trace`` gives the same requests arriving at a rate that changes over time: ``OnOff`` (a
square wave: ``low`` req/s, then ``high`` req/s for ``duty`` of each ``period_s``, starting low, so a
trace begins with a rise ahead) or ``Diurnal`` (a sine around ``mean`` req/s, ``amplitude`` as a share
of it, starting at the trough). The gaps are the same Gamma draws of mean 1 and coefficient of
variation ``cv``, laid on the shape's cumulative rate (time rescaling: arrival ``i`` comes when
``integral of rate(t) dt`` reaches the ``i``-th cumulative gap), so ``cv`` keeps its meaning within a
phase and the trace stays deterministic by seed.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from apt_serve_ray.bench.workloads import _STREAM_GAPS, TraceRequest, _check_arrivals, _stream, make_trace


@dataclass(frozen=True)
class OnOff:
    """A square wave of arrival rates: ``low`` req/s, then ``high`` for ``duty`` of each period."""

    low: float
    high: float
    period_s: float
    duty: float = 0.5

    def __post_init__(self) -> None:
        if not (0 <= self.low and 0 < self.high and math.isfinite(self.high)):
            raise ValueError(f"low/high: rates must be >= 0 and > 0 req/s, got {self.low}, {self.high}")
        if not self.period_s > 0:
            raise ValueError(f"period_s: must be > 0, got {self.period_s}")
        if not 0 < self.duty < 1:
            raise ValueError(f"duty: must be in (0, 1), got {self.duty}")

    def rate(self, t: np.ndarray) -> np.ndarray:
        phase = np.mod(t, self.period_s) / self.period_s
        return np.where(phase >= 1 - self.duty, self.high, self.low)

    @property
    def mean_rate(self) -> float:
        return self.low * (1 - self.duty) + self.high * self.duty


@dataclass(frozen=True)
class Diurnal:
    """A sine of arrival rates around ``mean`` req/s, ``amplitude`` a share of it, from its trough."""

    mean: float
    amplitude: float
    period_s: float

    def __post_init__(self) -> None:
        if not (self.mean > 0 and math.isfinite(self.mean)):
            raise ValueError(f"mean: must be a finite rate > 0 req/s, got {self.mean}")
        if not 0 <= self.amplitude <= 1:
            raise ValueError(f"amplitude: must be in [0, 1], got {self.amplitude}")
        if not self.period_s > 0:
            raise ValueError(f"period_s: must be > 0, got {self.period_s}")

    def rate(self, t: np.ndarray) -> np.ndarray:
        return self.mean * (1 - self.amplitude * np.cos(2 * np.pi * np.asarray(t) / self.period_s))

    @property
    def mean_rate(self) -> float:
        return self.mean


def make_shaped_trace(workload: str, num_requests: int, shape: OnOff | Diurnal, cv: float = 1.0, seed: int = 0,
                      max_model_len: int = 2048, vocab_size: int | None = None,
                      max_output_len: int | None = None) -> list[TraceRequest]:
    """``make_trace``'s requests (the same lengths for the same seed) arriving on ``shape``'s rate."""
    trace = make_trace(workload, num_requests, shape.mean_rate, cv, seed, max_model_len, vocab_size, max_output_len)
    return with_shape(trace, shape, cv, seed)


def with_shape(trace: list[TraceRequest], shape: OnOff | Diurnal, cv: float = 1.0,
               seed: int = 0) -> list[TraceRequest]:
    """The same requests re-timed on ``shape`` (see the module's docstring)."""
    _check_arrivals(len(trace), shape.mean_rate, cv)
    arrivals = _shaped_arrival_times(len(trace), shape, cv, _stream(seed, _STREAM_GAPS))
    return [dataclasses.replace(r, arrival_s=float(t)) for r, t in zip(trace, arrivals)]


def arrival_rates(trace: list[TraceRequest], bin_s: float = 1.0) -> np.ndarray:
    """Arrivals per second in consecutive bins of ``bin_s`` from 0 (for plots and forecast errors)."""
    times = np.array([r.arrival_s for r in trace])
    edges = np.arange(0.0, times.max() + bin_s + 1e-9, bin_s)
    return np.histogram(times, edges)[0] / bin_s


def _shaped_arrival_times(n: int, shape, cv: float, rng: np.random.Generator) -> np.ndarray:
    k = 1.0 / cv**2
    targets = np.concatenate([[0.0], np.cumsum(rng.standard_gamma(k, n - 1) / k)])  # cumulative rate reached
    dt = shape.period_s / 2000
    t = np.arange(0.0, targets[-1] / shape.mean_rate * 1.5 + shape.period_s + dt, dt)
    cum = np.concatenate([[0.0], np.cumsum(shape.rate(t[:-1] + dt / 2) * dt)])  # midpoint rule
    while cum[-1] < targets[-1]:  # a slow tail: extend by whole periods
        extra = np.arange(1, 2001) * dt + t[-1]
        cum = np.concatenate([cum, cum[-1] + np.cumsum(shape.rate(extra - dt / 2) * dt)])
        t = np.concatenate([t, extra])
    # First crossing of each target (a zero-rate phase leaves cum flat: arrivals wait for the next rise).
    idx = np.searchsorted(cum, targets, side="left").clip(1, len(t) - 1)
    lo, hi = cum[idx - 1], cum[idx]
    frac = np.where(hi > lo, (targets - lo) / np.where(hi > lo, hi - lo, 1.0), 0.0)
    out = t[idx - 1] + frac * dt
    out[0] = 0.0
    return out
