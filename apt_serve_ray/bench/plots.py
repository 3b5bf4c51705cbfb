"""Plots of a serving benchmark (matplotlib, Agg backend: files only, no display needed).

* ``plot_attainment``: SLO attainment vs request rate, one line per policy, with the 90% / 60% targets
  (``plot_attainment_panels``: several side by side, e.g. one per service class).
* ``plot_latency_cdfs``: CDFs of TTFT and of every inter-token gap, one line per policy, SLOs marked.
* ``plot_forecast``, ``plot_phases``: an on/off trace's forecast against its arrivals, attainment by phase.

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
    return plot_attainment_panels({title or "SLO attainment vs rate": points}, path, targets=targets)


def plot_attainment_panels(panels: dict[str, dict[str, list[tuple[float, float]]]], path, *,
                           targets: tuple[float, ...] = (0.9, 0.6)) -> Path:
    """One panel per ``panels`` entry (title -> policy -> [(rate, attainment)]), side by side, one y axis."""
    fig, axes = plt.subplots(1, len(panels), figsize=(6.4 if len(panels) == 1 else 4.4 * len(panels), 4.2),
                             sharey=True, squeeze=False)
    for ax, (title, points) in zip(axes[0], panels.items()):
        for policy, pts in points.items():
            pts = sorted(pts)
            ax.plot([r for r, _ in pts], [100 * a for _, a in pts], marker="o", label=policy)
        for target in targets:
            ax.axhline(100 * target, color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylim(-3, 103)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("SLO attainment (%)")
    axes[0][0].legend(fontsize=8 if len(panels) > 1 else None)
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


def plot_forecast(run: dict, trace, shape, horizon: float, path) -> Path:
    """predictive_control.py's on/off run: arrivals per second, the trace's rate, the controller's
    forecast (mean over the next ``horizon`` s, drawn mid-horizon) with its band, and its actions."""
    from apt_serve_ray.bench.rate_shapes import arrival_rates

    rates = arrival_rates(trace, 1.0)
    fig, ax = plt.subplots(figsize=(10, 4.2))
    ax.step(np.arange(len(rates)), rates, where="post", color="#999999", lw=0.8, label="arrivals / s")
    t_grid = np.arange(0, len(rates))
    ax.plot(t_grid, shape.rate(t_grid + 0.5), color="black", lw=0.8, ls=":", label="trace rate")
    f = run["forecasts"]
    if f:
        t = np.array([x["t"] for x in f])
        ax.plot(t + horizon / 2, [x["rate"] for x in f], color="#4c72b0", lw=1.4,
                label=f"forecast mean over next {horizon:g} s (drawn mid-horizon)")
        ax.fill_between(t + horizon / 2, [x["low"] for x in f], [x["high"] for x in f], color="#4c72b0",
                        alpha=0.2, label="forecast band")
    colors = {"raise_hidden_target": "#dd8452", "tighten_admission": "#c44e52", "pressure_replica": "#8172b3",
              "lower_hidden_target": "#55a868", "relax_admission": "#55a868", "unpressure_replica": "#55a868",
              "close_admission": "black", "open_admission": "black"}
    labelled = set()
    for d in run["decisions"]:
        for action in d["actions"]:
            label = action if action not in labelled else None
            labelled.add(action)
            ax.axvline(d["t"], color=colors.get(action, "grey"), lw=0.7, alpha=0.7, label=label,
                       ls="-" if d["replica"] is None else "--")
    ax.set_xlabel("seconds since the trace started")
    ax.set_ylabel("requests / s")
    ax.set_title("on/off trace, predictive control: forecast vs actual arrivals; actions (dashed: one replica)")
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    return _save(fig, path)


def attainment_by_phase(requests: list[dict], shape, bin_s: float = 1.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(bin edges in seconds into the period, share of the requests arriving in each bin that passed,
    how many arrived there), over every period of the trace."""
    arrivals = np.array([r["arrival_s"] for r in requests])
    passed = np.array([r["passed"] for r in requests], dtype=float)
    edges = np.arange(0.0, shape.period_s + bin_s / 2, bin_s)
    which = np.clip(np.digitize(np.mod(arrivals, shape.period_s), edges) - 1, 0, len(edges) - 2)
    count = np.bincount(which, minlength=len(edges) - 1)
    share = np.bincount(which, weights=passed, minlength=len(edges) - 1) / np.maximum(count, 1)
    return edges, np.where(count > 0, share, np.nan), count


def plot_phases(results: dict, shape, path) -> Path:
    """Attainment by the second of the on/off period a request arrived in, one line per mode: whether
    requests miss at a peak's onset (where acting ahead could help) or later in it."""
    fig, ax = plt.subplots(figsize=(8, 3.6))
    high_from = shape.period_s * (1 - shape.duty)
    ax.axvspan(high_from, shape.period_s, color="#f2d7d5", alpha=0.6, label=f"high phase ({shape.high:g} req/s)")
    for mode, runs in results["runs"].items():
        row = runs.get("on/off")
        if row is None:
            continue
        edges, share, _ = attainment_by_phase(row["requests"], shape)
        ax.stairs(share, edges, lw=1.4, label=f"{mode} ({row['attainment']:.0%} overall)")
    ax.set_xlim(0, shape.period_s)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel(f"second of the {shape.period_s:g}-s period the request arrived in")
    ax.set_ylabel("SLO attainment")
    ax.set_title("on/off trace: attainment by arrival phase, all periods pooled")
    ax.legend(fontsize=7, loc="lower left")
    return _save(fig, path)


def plot_longest_waits(runs: dict, classes, path, *, title: str = "") -> Path:
    """priority_classes.py's runs (policy -> rate -> point with per-class ``max_pending_s``): the
    longest pending time per class vs rate, one line per policy, apt's ``max_wait_time`` dotted."""
    fig, axes = plt.subplots(1, len(classes), figsize=(5.2 * len(classes), 4), squeeze=False)
    for ax, c in zip(axes[0], classes):
        for name, by_rate in runs.items():
            pts = sorted((float(r), p["classes"][c.name]["max_pending_s"]) for r, p in by_rate.items())
            ax.plot([r for r, _ in pts], [w for _, w in pts], marker="o", label=name)
        bound = next(iter(runs.get("apt", {}).values()), {}).get("max_wait_time_s")
        if bound:
            ax.axhline(bound, color="grey", linestyle=":", linewidth=1, label=f"apt max_wait_time {bound:g} s")
        ax.set_yscale("log")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("longest pending time (s)")
        ax.set_title(f"class {c.name}")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.suptitle(title or "longest wait for a first token or between two tokens")
    return _save(fig, path)
