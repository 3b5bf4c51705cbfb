"""Why requests missed their SLOs: each request's outcome (ok, a late first token, a broken gap,
both, unfinished), attainment and goodput per service class, and, where the engine's step records
are at hand (``driver.step_record``: in process, or ``server_steps`` from our server's memory
timeline), the steps behind each miss (those in the gap it broke, or those its first token waited
through) and how well the step-time model predicted them."""

from __future__ import annotations

import json
import urllib.request

import numpy as np

from apt_serve_ray.bench.slo_metrics import (RequestTimeline, inter_token_gaps_ms, p99_gap_ms, passes_slo,
                                             summarize, ttft_ms)


def classify(t: RequestTimeline) -> str:
    """Why a request failed: "ok", "ttft", "gap", "ttft+gap" or "unfinished"."""
    if not t.is_finished:
        return "unfinished"
    late = t.ttft_slo_ms is not None and (ttft_ms(t) or 0.0) >= t.ttft_slo_ms
    gap = t.tbt_slo_ms is not None and p99_gap_ms(t) >= t.tbt_slo_ms
    return {(False, False): "ok", (True, False): "ttft", (False, True): "gap"}.get((late, gap), "ttft+gap")


def _longest_gap(t: RequestTimeline) -> tuple[float, float, float]:
    """(gap ms, start, end) of the request's longest inter-token gap (0, 0, 0 without one)."""
    times = np.asarray(t.token_times_s, dtype=float)
    if times.size < 2:
        return 0.0, 0.0, 0.0
    i = int(np.argmax(np.diff(times)))
    return float((times[i + 1] - times[i]) * 1000.0), float(times[i]), float(times[i + 1])


def explain(t: RequestTimeline, steps: list[dict], start_s: float) -> dict | None:
    """The steps behind a miss: for a broken gap, those that ended within the request's longest gap
    (the request waited through all but the last); for a late first token, those between its
    arrival and its first token. Their composition and measured vs predicted seconds."""
    why = classify(t)
    if why in ("ok",) or not steps:
        return None
    if "gap" in why:
        _, lo, hi = _longest_gap(t)
    else:
        lo = t.arrival_s
        hi = t.first_token_s if t.first_token_s is not None else lo + 1e9
    lo, hi = lo - start_s, hi - start_s
    inside = [s for s in steps if lo < s["end_s"] <= hi + 0.002]
    if not inside:
        return None
    longest = max(inside, key=lambda s: s["step_s"])
    return {
        "window_s": round(hi - lo, 4), "num_steps": len(inside),
        "prefill_tokens": sum(s["prefill_tokens"] for s in inside),
        "max_decodes": max(s["decodes"] for s in inside),
        "compressions": sum(s["compressions"] for s in inside), "upgrades": sum(s["upgrades"] for s in inside),
        "swap_outs": sum(s["swap_outs"] for s in inside), "swap_ins": sum(s["swap_ins"] for s in inside),
        "preemptions": sum(s["preemptions"] for s in inside),
        "longest_step": {k: longest[k] for k in ("step_s", "predicted_s", "decodes", "prefill_tokens",
                                                  "compressions", "upgrades", "swap_ins", "swap_outs")},
    }


def analyze(timelines: list[RequestTimeline], classes: dict[str, str], duration_s: float,
            steps: list[dict] | None = None, start_s: float = 0.0) -> dict:
    """Attainment, goodput and misses, over all requests and per class (``classes``: id -> class).
    ``goodput``: requests that passed per second of the run; ``goodput_arrivals``: per second of the
    arrival window (first to last arrival), the same for every server on one trace, so that a server
    that drains its backlog sooner does not look better for it."""
    arrivals = [t.arrival_s for t in timelines]
    window = max(arrivals) - min(arrivals) if len(arrivals) > 1 else duration_s
    out = {"all": _group(timelines, duration_s, window)}
    for name in sorted(set(classes.values())):
        out[name] = _group([t for t in timelines if classes[t.request_id] == name], duration_s, window)
    out["summary"] = summarize(timelines, duration_s)
    out["requests"] = [_request(t, classes[t.request_id], steps, start_s) for t in timelines]
    return out


def _group(timelines: list[RequestTimeline], duration_s: float, window_s: float) -> dict:
    causes = [classify(t) for t in timelines]
    longest = [_longest_gap(t)[0] for t in timelines if t.is_finished and len(t.token_times_s) > 1]
    return {
        "num": len(timelines), "attainment": sum(map(passes_slo, timelines)) / max(1, len(timelines)),
        "goodput": sum(map(passes_slo, timelines)) / duration_s,
        "goodput_arrivals": sum(map(passes_slo, timelines)) / max(window_s, 1e-9),
        "ttft_misses": sum("ttft" in c for c in causes), "gap_misses": sum("gap" in c for c in causes),
        "unfinished": causes.count("unfinished"),
        "median_longest_gap_ms": float(np.median(longest)) if longest else 0.0,
        "median_ttft_ms": float(np.median([ttft_ms(t) for t in timelines if t.first_token_s is not None] or [0.0])),
    }


def _request(t: RequestTimeline, cls: str, steps, start_s) -> dict:
    gaps = inter_token_gaps_ms(t)
    rec = {"id": t.request_id, "class": cls, "arrival_s": round(t.arrival_s - start_s, 4), "outcome": classify(t),
           "ttft_ms": None if t.first_token_s is None else round(ttft_ms(t), 1),
           "p99_gap_ms": round(p99_gap_ms(t), 1) if gaps else None,
           "max_gap_ms": round(max(gaps), 1) if gaps else None, "num_chunks": len(t.token_times_s),
           "num_output_tokens": t.num_output_tokens, "prompt_len": t.num_prompt_tokens,
           "preemptions": t.num_preemptions, "error": t.error}
    if steps:
        rec["why"] = explain(t, steps, start_s)
    return rec


def prediction_table(steps: list[dict]) -> dict:
    """Measured / predicted step seconds by kind of step (decode-only, prefill-only, mixed)."""
    rows = {}
    for kind, keep in (("decode", lambda s: s["prefill_tokens"] == 0),
                       ("prefill", lambda s: s["decodes"] == 0 and s["prefill_tokens"] > 0),
                       ("mixed", lambda s: s["decodes"] > 0 and s["prefill_tokens"] > 0)):
        sel = [s for s in steps if keep(s) and s["predicted_s"]]
        if not sel:
            continue
        ratio = np.array([s["step_s"] / s["predicted_s"] for s in sel])
        rows[kind] = {"num": len(sel), "median_ratio": float(np.median(ratio)),
                      "p10_ratio": float(np.percentile(ratio, 10)), "p90_ratio": float(np.percentile(ratio, 90)),
                      "median_s": float(np.median([s["step_s"] for s in sel]))}
    return rows


def server_steps(port: int, origin: float, duration_s: float) -> list[dict] | None:
    """Our server's steps during a run, from its memory timeline (one sample per step, at most one
    per 0.1 s: the long steps, which explain gaps, are all there), as engine-mode step records with
    ``end_s`` on the client's clock (both read CLOCK_MONOTONIC)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/debug/memory_timeline?format=json",
                                    timeout=60) as resp:
            series = json.loads(resp.read())["series"]
    except (OSError, ValueError, KeyError):
        return None
    keys = [k for k in ("step_s", "predicted_s", "decodes", "prefill_tokens", "seqs", "upgrades", "compressions",
                        "swap_outs", "swap_ins", "preemptions", "running", "waiting", "usage", "cache_ratio")
            if k in series]
    if "clock" not in series or "step_s" not in keys:
        return None
    steps = []
    for i, clock in enumerate(series["clock"]):
        end = clock - origin
        if 0.0 <= end <= duration_s + 1.0:
            steps.append({"end_s": round(end, 6), **{k: series[k][i] for k in keys}})
    return steps


def report_tables(runs: dict, baseline: str | None) -> str:
    """Markdown tables of ``runs`` (``"mode:name"`` -> a run of mixed_traffic.py's JSON, ``results``
    each ``analyze``'s with ``rate`` and ``seed``): per rate, each server or policy's
    attainment (all / chat / documents), goodput (and its ratio to ``baseline``'s), misses by cause
    and class, and the median longest gap per class; then effective throughput; then how well the
    step-time model predicted ours (measured / predicted, by kind of step)."""
    names = list(runs)
    base = next((n for n in names if baseline and n.split(":", 1)[1] == baseline), None)
    rows = {}
    for name in names:
        for a in runs[name]["results"]:
            rows.setdefault((a["seed"], a["rate"]), {})[name] = a
    lines = ["| seed | rate | server | attainment all / chat / documents | goodput (req/s) | TTFT misses chat / doc "
             "| gap misses chat / doc | longest gap chat / doc (median, s) |", "|---|---|---|---|---|---|---|---|"]
    for (seed, rate), by in sorted(rows.items()):
        ref = by.get(base)
        for name in names:
            a = by.get(name)
            if a is None:
                continue
            al, ch, dc = a["all"], a["chat"], a["document"]
            ratio = (f" ({al['goodput'] / ref['all']['goodput']:.2f}x)" if ref is not None and name != base
                     and ref["all"]["goodput"] > 0 else "")
            lines.append(f"| {seed} | {rate:g} | {name.split(':', 1)[1]} | {al['attainment']:.1%} / {ch['attainment']:.1%} / "
                         f"{dc['attainment']:.1%} | {al['goodput']:.3f}{ratio} | {ch['ttft_misses']}/{ch['num']} / "
                         f"{dc['ttft_misses']}/{dc['num']} | {ch['gap_misses']} / {dc['gap_misses']} | "
                         f"{ch['median_longest_gap_ms'] / 1000:.2f} / {dc['median_longest_gap_ms'] / 1000:.2f} |")
    # Over seeds: each class's attainment, mean and range, and goodput over the arrival window against
    # the baseline's on the same seed (the ratio's mean and range).
    seeds = sorted({seed for seed, _ in rows})
    if len(seeds) > 1:
        lines += ["", f"Over seeds {', '.join(map(str, seeds))}: attainment mean (min-max), goodput over the arrival "
                  f"window as a ratio to {baseline or 'the baseline'} on the same seed, mean (min-max)", "",
                  "| rate | server | all | chat | documents | goodput ratio |", "|---|---|---|---|---|---|"]
        spread = lambda v: f"{np.mean(v):.1%} ({min(v):.0%}-{max(v):.0%})"  # noqa: E731
        for rate in sorted({r for _, r in rows}):
            for name in names:
                runs_at = [rows[(seed, rate)][name] for seed in seeds if name in rows.get((seed, rate), {})]
                if not runs_at:
                    continue
                cells = [spread([a[g]["attainment"] for a in runs_at]) for g in ("all", "chat", "document")]
                ratios = []
                for seed in seeds:
                    by = rows.get((seed, rate), {})
                    if name in by and base in by and name != base:
                        key = "goodput_arrivals" if "goodput_arrivals" in by[base]["all"] else "goodput"
                        ref = by[base]["all"][key]
                        if ref > 0:
                            ratios.append(by[name]["all"][key] / ref)
                ratio = f"{np.mean(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})" if ratios else "-"
                if name == base and all(a["all"]["attainment"] > 0 for a in runs_at):
                    # Over one arrival window a ratio to the baseline is at most 1 / its attainment (every
                    # request met): where the baseline meets 55%, no server can reach 2x.
                    bound = [1.0 / a["all"]["attainment"] for a in runs_at]
                    ratio = f"- (at most {np.mean(bound):.2f}x: {min(bound):.2f}-{max(bound):.2f})"
                lines.append(f"| {rate:g} | {name.split(':', 1)[1]} | " + " | ".join(cells) + f" | {ratio} |")
    lines += ["", "| server | effective throughput at 90% / 60%: all | chat | documents (req/s) |", "|---|---|"]
    for name in names:
        e = runs[name]["effective_throughput"]
        lines.append(f"| {name.split(':', 1)[1]} | " + " \\| ".join(
            f"{e[g]['90']:.3f} / {e[g]['60']:.3f}" for g in ("all", "chat", "document")) + " |")
    pred = [(name, a["rate"], a["prediction"]) for name in names for a in runs[name]["results"] if a.get("prediction")]
    if pred:
        lines += ["", "| server | rate | decode steps: n, measured / predicted median, P90 | prefill | mixed |",
                  "|---|---|---|---|---|"]
        for name, rate, p in pred:
            cell = lambda k: (f"{p[k]['num']}, {p[k]['median_ratio']:.2f}, {p[k]['p90_ratio']:.2f}"  # noqa: E731
                              if k in p else "-")
            lines.append(f"| {name.split(':', 1)[1]} | {rate:g} | {cell('decode')} | {cell('prefill')} | {cell('mixed')} |")
    machines = {json.dumps(runs[n]["machine"], sort_keys=True) for n in names}
    lines += ["", "Machine(s): " + "; ".join(machines)]
    return "\n".join(lines)
