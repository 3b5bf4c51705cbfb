"""``CacheTracker(llm)``: the cache-memory timeline by kind, target ratio, usage and watermark crossings."""

from __future__ import annotations

from pathlib import Path

from apt_serve_ray.observability.observer import EngineObserver


class CacheTracker(EngineObserver):
    """Records one sample per engine step (at most one per ``min_interval_s``), from the step's
    ``CacheStats``. Times are seconds on the engine's clock since ``start`` (default: now)."""

    def __init__(self, llm, *, min_interval_s: float = 0.0, max_samples: int = 200_000,
                 start: float | None = None) -> None:
        self.engine = getattr(llm, "llm_engine", llm)
        cfg = self.engine.config
        self.light, self.heavy = cfg.light_watermark, cfg.heavy_watermark
        self.min_interval_s = min_interval_s
        self.max_samples = max_samples
        self.start = self.engine.clock() if start is None else start
        self.samples: list[dict] = []
        self.crossings: list[dict] = []  # {"t", "watermark": "light"|"heavy", "direction": "up"|"down"}
        self._last_t = -1e9
        self.engine.add_observer(self)

    def detach(self) -> None:
        self.engine.remove_observer(self)

    def on_step(self, engine, stats, now) -> None:
        if now - self._last_t < self.min_interval_s or len(self.samples) >= self.max_samples:
            return
        self._last_t = now
        c = stats.cache
        sample = {
            "t": now - self.start, "kv": c.num_kv_pages, "hidden": c.num_hidden_pages,
            "kv-int8": (c.pages_by_kind or {}).get("kv-int8", 0),
            "hidden-int8": (c.pages_by_kind or {}).get("hidden-int8", 0), "free": c.num_free_pages,
            "swapped": c.num_used_swap_slots, "swap_slots": c.num_swap_slots,
            "cached": c.num_cached_pages,  # kept for prefix hits, held by no request (part of free)
            "tier_cached": c.num_tier_cached_pages,  # demoted to the tier below memory
            "prefix_hit_rate": round(c.prefix_hit_rate, 4),
            "compressed_share": c.compressed_share,
            "num_pages": c.num_pages, "usage": c.usage, "cache_ratio": c.cache_ratio, "hidden_share": c.hidden_share,
            "admit": c.admission_open, "running": c.num_running, "waiting": c.num_waiting,
            "clock": now,  # the engine's clock (time.monotonic in a server): to line steps up with a client's
            **stats.as_record(),
        }
        if self.samples:
            prev = self.samples[-1]["usage"]
            for name, level in (("light", self.light), ("heavy", self.heavy)):
                if prev <= level < c.usage:
                    self.crossings.append({"t": sample["t"], "watermark": name, "direction": "up"})
                elif c.usage <= level < prev:
                    self.crossings.append({"t": sample["t"], "watermark": name, "direction": "down"})
        self.samples.append(sample)

    def series(self) -> dict[str, list]:
        keys = self.samples[0].keys() if self.samples else ()
        return {k: [s[k] for s in self.samples] for k in keys}

    def timeline(self) -> dict:
        """Series, crossings and watermarks: what ``plot_memory_timeline`` draws (plain data, to send)."""
        return {"series": self.series(), "crossings": list(self.crossings), "light_watermark": self.light,
                "heavy_watermark": self.heavy}

    def plot_memory_timeline(self, path="memory_timeline.png", title: str | None = None) -> str:
        """Stacked pages by kind (in memory, above zero; in the swap tier, below), usage and the
        compressed ceiling over time, watermarks and their crossings; written to ``path`` (by default
        ``memory_timeline.png`` in the working directory), which is returned."""
        return plot_memory_timeline(self.series(), self.crossings, path, light=self.light, heavy=self.heavy,
                                    title=title or "cache memory by kind")


def plot_memory_timeline(series: dict, crossings: list[dict], path, *, light: float, heavy: float, title: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True, height_ratios=[2, 1])
    t = series.get("t", [])
    if t:
        kinds = [(k, label, color) for k, label, color in (
            ("kv", "KV pages", "#4c72b0"), ("kv-int8", "KV-int8 pages", "#55a868"),
            ("hidden", "hidden pages", "#dd8452"), ("hidden-int8", "hidden-int8 pages", "#8172b3"))
            if k in series and (k in ("kv", "hidden") or any(series[k]))]
        ax.stackplot(t, *[series[k] for k, _, _ in kinds], labels=[label for _, label, _ in kinds],
                     colors=[color for _, _, color in kinds], step="post")
        ax.axhline(series["num_pages"][0], color="black", lw=0.8, ls=":", label="pool")
        if any(series.get("swapped", ())):  # the tier below memory, drawn below the axis
            ax.fill_between(t, [-x for x in series["swapped"]], 0, step="post", color="#937860", alpha=0.8,
                            label="pages in the swap tier (below 0)")
            ax.axhline(0, color="black", lw=0.6)
        ax2.plot(t, series["usage"], color="black", lw=1.2, label="usage", drawstyle="steps-post")
        ax2.plot(t, series["cache_ratio"], color="#dd8452", lw=1.2, label="cache_ratio (compressed ceiling)",
                 drawstyle="steps-post")
        if "compressed_share" in series:
            ax2.plot(t, series["compressed_share"], color="#55a868", lw=0.8, ls="--", label="compressed share",
                     drawstyle="steps-post")
        ax2.plot(t, series["hidden_share"], color="#dd8452", lw=0.8, ls="--", label="hidden share", drawstyle="steps-post")
    ax2.axhline(light, color="#c44e52", lw=0.8, ls="--", label=f"light {light}")
    ax2.axhline(heavy, color="#c44e52", lw=1.2, ls="-", label=f"heavy {heavy}")
    for c in crossings:
        ax2.axvline(c["t"], color="#c44e52", alpha=0.25, lw=0.8)
    ax.set_ylabel("pages")
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize=8)
    ax2.set_ylim(0, 1.05)
    ax2.set_ylabel("share")
    ax2.set_xlabel("time (s)")
    ax2.legend(loc="upper left", fontsize=7, ncol=3)
    fig.tight_layout()
    if isinstance(path, (str, Path)):  # else a file object (the replica draws into a buffer)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
