"""Plots of a serving benchmark (matplotlib, Agg backend: files only, no display needed).

* ``plot_attainment``: SLO attainment vs request rate, one line per policy, with the 90% / 60% targets.
* ``plot_latency_cdfs``: CDFs of TTFT and of every inter-token gap, one line per policy, SLOs marked.

Each function writes one PNG and returns its path. A run's memory timeline is drawn by
``CacheTracker``'s plot (``RunResult.plot_memory_timeline``).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from apt_serve_ray.bench.slo_metrics import RequestTimeline, inter_token_gaps_ms, ttft_ms  # noqa: E402


def _save(fig, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_attainment(points: dict[str, list[tuple[float, float]]], path, *, title: str = "",
                    targets: tuple[float, ...] = (0.9, 0.6)) -> Path:
    """``points``: policy -> [(rate req/s, attainment in [0, 1])]."""
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for policy, pts in points.items():
        pts = sorted(pts)
        ax.plot([r for r, _ in pts], [100 * a for _, a in pts], marker="o", label=policy)
    for target in targets:
        ax.axhline(100 * target, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(-3, 103)
    ax.set_title(title or "SLO attainment vs rate")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def _cdf(ax, values: list[float], label: str) -> None:
    if not values:
        return
    x = np.sort(np.asarray(values, dtype=float))
    ax.plot(x, np.arange(1, x.size + 1) / x.size, label=label)


def plot_latency_cdfs(runs: dict[str, list[RequestTimeline]], path, *, title: str = "",
                      ttft_slo_ms: float | None = None, tbt_slo_ms: float | None = None) -> Path:
    """``runs``: policy -> the timelines of one run (same trace for all). Unfinished requests have
    no TTFT sample; their share is visible as the CDF ending below 1."""
    fig, (a_ttft, a_gap) = plt.subplots(1, 2, figsize=(10, 4))
    for policy, timelines in runs.items():
        n = max(1, len(timelines))
        ttfts = sorted(v for v in map(ttft_ms, timelines) if v is not None)
        if ttfts:  # scale so the curve tops out at the finished share
            a_ttft.plot(ttfts, np.arange(1, len(ttfts) + 1) / n, label=policy)
        _cdf(a_gap, [g for t in timelines for g in inter_token_gaps_ms(t)], policy)
    for ax, slo, name in ((a_ttft, ttft_slo_ms, "TTFT"), (a_gap, tbt_slo_ms, "inter-token gap")):
        if slo is not None:
            ax.axvline(slo, color="grey", linestyle=":", linewidth=1, label=f"SLO {slo:.0f} ms")
        ax.set_xscale("log")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("share of requests" if ax is a_ttft else "share of gaps")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.suptitle(title or "latency CDFs")
    return _save(fig, path)
