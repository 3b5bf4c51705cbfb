"""SLO metrics on request timelines, defined as the Apt-Serve paper and ``vllm bench serve`` define them.

All times of one timeline are seconds on one clock; ``token_times_s`` holds the time of every output
token (or streamed chunk) including the first, so ``token_times_s[0] == first_token_s``.

- TTFT: first token - arrival. TPOT (vLLM): ``(e2el - ttft) / (num_output_tokens - 1)``, only for
  requests with more than one output token. ITL (vLLM): every gap between consecutive tokens of every
  request, pooled. E2EL: finish - arrival.
- A request passes its SLOs if it finished without error, TTFT < ``ttft_slo_ms`` and the P99 of its
  own inter-token gaps (first token's TTFT excluded) < ``tbt_slo_ms``; an SLO left ``None`` is not
  checked. The optional ``tpot_slo_ms`` / ``e2el_slo_ms`` carry ``vllm bench serve --goodput``'s other
  SLOs (vLLM counts ``metric <= slo`` as met; we use ``<`` throughout, which differs only on ties).
- Percentiles are ``numpy.percentile`` with linear interpolation, as vLLM computes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_METRICS = ("ttft", "tpot", "itl", "e2el")
_METRIC_TITLES = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}


@dataclass
class RequestTimeline:
    request_id: str
    arrival_s: float
    first_token_s: float | None
    token_times_s: list[float]
    finish_s: float | None
    num_prompt_tokens: int
    num_output_tokens: int
    ttft_slo_ms: float | None = None
    tbt_slo_ms: float | None = None
    error: str | None = None
    num_preemptions: int = 0
    tpot_slo_ms: float | None = None
    e2el_slo_ms: float | None = None

    @property
    def is_finished(self) -> bool:
        return self.error is None and self.finish_s is not None


def ttft_ms(t: RequestTimeline) -> float | None:
    return None if t.first_token_s is None else (t.first_token_s - t.arrival_s) * 1000.0


def e2el_ms(t: RequestTimeline) -> float | None:
    return None if t.finish_s is None else (t.finish_s - t.arrival_s) * 1000.0


def tpot_ms(t: RequestTimeline) -> float | None:
    """vLLM's TPOT; None for requests with fewer than two output tokens or without a first token."""
    ttft, e2el = ttft_ms(t), e2el_ms(t)
    if ttft is None or e2el is None or t.num_output_tokens < 2:
        return None
    return (e2el - ttft) / (t.num_output_tokens - 1)


def inter_token_gaps_ms(t: RequestTimeline) -> list[float]:
    """Gaps between consecutive tokens; the first token's TTFT is not a gap."""
    return (np.diff(np.asarray(t.token_times_s, dtype=float)) * 1000.0).tolist()


def p99_gap_ms(t: RequestTimeline) -> float:
    gaps = inter_token_gaps_ms(t)
    return float(np.percentile(gaps, 99)) if gaps else 0.0


def passes_slo(t: RequestTimeline) -> bool:
    if not t.is_finished or t.first_token_s is None:
        return False
    checks = (
        (t.ttft_slo_ms, ttft_ms),
        (t.tbt_slo_ms, p99_gap_ms),
        (t.tpot_slo_ms, lambda t: tpot_ms(t) or 0.0),
        (t.e2el_slo_ms, e2el_ms),
    )
    return all(slo is None or metric(t) < slo for slo, metric in checks)


def attainment(timelines: list[RequestTimeline]) -> float:
    """Share of requests that pass their SLOs (unfinished and failed ones count as misses); 0 if none."""
    if not timelines:
        return 0.0
    return sum(passes_slo(t) for t in timelines) / len(timelines)


def goodput(timelines: list[RequestTimeline], duration_s: float) -> float:
    """Requests per second that pass their SLOs."""
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    return sum(passes_slo(t) for t in timelines) / duration_s


def summarize(timelines: list[RequestTimeline], duration_s: float) -> dict:
    """The figures ``vllm bench serve`` reports (same key names), plus SLO attainment and goodput.

    Latency and token figures are over completed requests only, as in vLLM; a metric with no
    samples reports 0.0.
    """
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    done = [t for t in timelines if t.is_finished]
    samples = {
        "ttft": [v for v in map(ttft_ms, done) if v is not None],
        "tpot": [v for v in map(tpot_ms, done) if v is not None],
        "itl": [g for t in done for g in inter_token_gaps_ms(t)],
        "e2el": [v for v in map(e2el_ms, done) if v is not None],
    }
    total_input = sum(t.num_prompt_tokens for t in done)
    total_output = sum(t.num_output_tokens for t in done)
    summary = {
        "completed": len(done),
        "failed": len(timelines) - len(done),
        "duration": duration_s,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration_s,
        "request_goodput": goodput(timelines, duration_s),
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "slo_attainment": attainment(timelines),
        "total_preemptions": sum(t.num_preemptions for t in timelines),
    }
    for name, values in samples.items():
        summary[f"mean_{name}_ms"] = float(np.mean(values)) if values else 0.0
        summary[f"median_{name}_ms"] = float(np.median(values)) if values else 0.0
        summary[f"p99_{name}_ms"] = float(np.percentile(values, 99)) if values else 0.0
    return summary


def effective_throughput(points: list[tuple[float, float]], target: float) -> float:
    """The highest request rate at which SLO attainment stays >= ``target``, from a rate sweep.

    Rule: sort the ``(rate, attainment)`` points by rate and walk up to the first point that misses
    the target (a later recovery is taken as noise). Interpolate linearly between the point before
    it, which meets the target, and that miss, returning the rate where the line crosses ``target``.
    If the lowest rate already misses, the point before it is ``(0, 1.0)``. If every point meets the
    target, return the highest rate measured (the sweep did not find the limit).
    """
    if not points:
        raise ValueError("points must hold at least one (rate, attainment) pair")
    if not 0.0 < target <= 1.0:
        raise ValueError(f"target must be in (0, 1], got {target}")
    for rate, value in points:
        if not (rate > 0 and 0.0 <= value <= 1.0):
            raise ValueError(f"points: need rate > 0 and attainment in [0, 1], got ({rate}, {value})")
    prev_rate, prev_value = 0.0, 1.0
    for rate, value in sorted(points):
        if value < target:
            return prev_rate + (prev_value - target) * (rate - prev_rate) / (prev_value - value)
        prev_rate, prev_value = rate, value
    return prev_rate


def mean_by_rate(runs: list[dict], value) -> list[tuple[float, float]]:
    """``[(rate, mean of value(run))]`` by rate, over runs (dicts with a ``rate``) at the same rate:
    repeats or seeds of a sweep."""
    by_rate: dict[float, list[float]] = {}
    for run in runs:
        by_rate.setdefault(run["rate"], []).append(value(run))
    return [(rate, float(np.mean(v))) for rate, v in sorted(by_rate.items())]


def effective_at(points: list[tuple[float, float]], targets: tuple[int, ...] = (90, 60)) -> dict[str, float]:
    """``{"90": ..., "60": ...}``: effective throughput at each target attainment (percent)."""
    return {str(t): effective_throughput(points, t / 100) for t in targets}


def format_ratio(a: float, b: float) -> str:
    """``a / b`` as "1.23x" for tables of effective throughput ("n/a" where ``b`` is 0)."""
    if b > 0:
        return f"{a / b:.2f}x"
    return "n/a (baseline 0)" if a > 0 else "n/a"


def format_summary(summary: dict, metrics: tuple[str, ...] | list[str] = _METRICS) -> str:
    """A block like ``vllm bench serve``'s result table; ``metrics`` picks the latency sections."""
    unknown = set(metrics) - set(_METRICS)
    if unknown:
        raise ValueError(f"metrics must be among {list(_METRICS)}, got {sorted(unknown)}")
    lines = ["{:=^50}".format(" Serving Benchmark Result ")]

    def row(label: str, value: float | int) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{label:<40} {text:<10}")

    row("Successful requests:", summary["completed"])
    row("Failed requests:", summary["failed"])
    row("Benchmark duration (s):", float(summary["duration"]))
    row("Total input tokens:", summary["total_input_tokens"])
    row("Total generated tokens:", summary["total_output_tokens"])
    row("Request throughput (req/s):", summary["request_throughput"])
    row("Request goodput (req/s):", summary["request_goodput"])
    row("SLO attainment (%):", 100.0 * summary["slo_attainment"])
    row("Output token throughput (tok/s):", summary["output_throughput"])
    row("Total Token throughput (tok/s):", summary["total_token_throughput"])
    row("Preemptions:", summary["total_preemptions"])
    for name in metrics:
        title, short = _METRIC_TITLES[name]
        lines.append("{:-^50}".format(title))
        row(f"Mean {short} (ms):", summary[f"mean_{name}_ms"])
        row(f"Median {short} (ms):", summary[f"median_{name}_ms"])
        row(f"P99 {short} (ms):", summary[f"p99_{name}_ms"])
    lines.append("=" * 50)
    return "\n".join(lines)


GOODPUT_KEYS = {"ttft": "ttft_slo_ms", "tpot": "tpot_slo_ms", "e2el": "e2el_slo_ms",
                "itl": "tbt_slo_ms", "tbt": "tbt_slo_ms"}


def parse_goodput(items: list[str]) -> dict[str, float]:
    """SLO flags as ``vllm bench serve --goodput`` takes them:
    ``["ttft:4000", "tbt:500"]`` -> ``{"ttft_slo_ms": 4000.0, "tbt_slo_ms": 500.0}``."""
    slos = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in GOODPUT_KEYS:
            raise ValueError(f"--goodput: {name!r} is not one of {sorted(GOODPUT_KEYS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput: {item!r} is not NAME:MILLISECONDS") from None
        if not ms > 0:
            raise ValueError(f"--goodput: {item!r} needs a value > 0")
        slos[GOODPUT_KEYS[name]] = ms
    return slos
