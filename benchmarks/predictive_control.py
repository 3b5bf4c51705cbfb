"""Predictive vs reactive vs no memory control, through Ray Serve with two engine replicas (issue 14).

    python benchmarks/predictive_control.py --quick        # ~10 min on 2 shared cores: on/off + CV 4
    python benchmarks/predictive_control.py                # every trace, longer

The same traces (Gamma arrivals at ``--rate`` with CV ``--cvs``, and an on/off square wave) go over
HTTP to the app deployed once per mode (``app_args``: ``predictive``, ``reactive``, ``none``; on
request ``*-refuse`` and ``reactive-noratio``). Reported per mode and trace: SLO attainment (on/off:
also in the peaks), goodput, and the forecast's MAPE / WAPE, live and offline; writes
``predictive_control[_quick].json`` and plots in ``--out-dir``. Setup and results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import time
from pathlib import Path

import numpy as np

from apt_serve_ray.bench import plots, rate_shapes, workloads
from apt_serve_ray.bench.engine_args import Default, add_engine_args, engine_kwargs, random_checkpoint
from apt_serve_ray.bench.http_client import ClientOptions, replay
from apt_serve_ray.bench.report import stamp, write_json
from apt_serve_ray.bench.servers import REPO, local_serve
from apt_serve_ray.bench.slo_metrics import passes_slo, summarize
from apt_serve_ray.scheduler.predictor import TrafficPredictor, mape

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

APP = "predictive-bench"
MODES = ("predictive", "reactive", "none")
ALL_MODES = MODES + ("predictive-refuse", "reactive-refuse", "reactive-noratio")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="opt-tiny", choices=["opt-tiny", "opt-125m"], help="random checkpoint")
    p.add_argument("--workload", default="humaneval", choices=sorted(workloads.WORKLOADS))
    p.add_argument("--max-output-len", type=int, default=128)
    add_engine_args(p, "num_pages", "policy", "cache_kinds",
                    num_pages=Default(96, "per replica: a pool small enough that the traffic's peaks bind"),
                    cache_kinds=Default(("hidden", "kv-int8"), "serve_config.yaml's kinds"))
    p.add_argument("--rate", type=float, default=3.0, help="mean req/s of the Gamma traces")
    p.add_argument("--low", type=float, default=1.0)
    p.add_argument("--high", type=float, default=6.0)
    p.add_argument("--period", type=float, default=20.0)
    p.add_argument("--duration", type=float, default=120.0, help="seconds of each trace")
    p.add_argument("--cvs", default="1,4,8")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--horizon", type=float, default=5.0, help="forecast_horizon_s")
    p.add_argument("--admission-share", type=float, default=1.0, help="predictive_admission_share (1: never tighten)")
    p.add_argument("--ttft-slo-ms", type=float, default=3000.0)
    p.add_argument("--tbt-slo-ms", type=float, default=1000.0)
    p.add_argument("--stream-interval", type=float, default=0.05,
                   help="the app's stream_interval_s (0: one stream item per decode step)")
    p.add_argument("--stream-items-per-s", type=float, default=50.0,
                   help="the app's stream_items_per_s per replica (0: no bound, stream_interval_s alone)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-cpus", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="on/off and CV 4 only, 80 s each")
    p.add_argument("--tag", default=None, help="suffix of the output files (default: _quick with --quick)")
    p.add_argument("--out-dir", default=str(REPO / "docs" / "benchmarks" / "predictive"))
    a = p.parse_args()
    if a.quick:
        a.cvs, a.duration = "4", 80.0
    unknown = set(a.modes.split(",")) - set(ALL_MODES)
    if unknown:
        p.error(f"--modes: unknown {sorted(unknown)}; choose from {ALL_MODES}")
    return a


# Traces -----------------------------------------------------------------------------------------
def traces(a, vocab: int) -> dict[str, tuple[list, object]]:
    """name -> (trace, shape or None); on/off first, so the predictor's history starts with it."""
    onoff = rate_shapes.OnOff(a.low, a.high, a.period)
    out = {}
    n = max(4, int(onoff.mean_rate * a.duration))
    out["on/off"] = (rate_shapes.make_shaped_trace(a.workload, n, onoff, seed=a.seed, vocab_size=vocab,
                                                 max_output_len=a.max_output_len), onoff)
    for cv in (float(c) for c in a.cvs.split(",") if c):
        trace = workloads.make_trace(a.workload, max(4, int(a.rate * a.duration)), a.rate, cv, a.seed,
                                     vocab_size=vocab, max_output_len=a.max_output_len)
        out[f"gamma cv{cv:g}"] = (trace, None)
    # One app serves every trace of a mode: each trace's prompts its own (the traces share a seed).
    return {name: (workloads.fresh_ids(trace, vocab, a.seed, a.rate, run=name), shape)
            for name, (trace, shape) in out.items()}


def wape(forecast, actual) -> float:
    """Sum of absolute errors over the sum of what came: MAPE's companion that quiet windows (one
    arrival forecast as three: 200%) do not dominate."""
    forecast, actual = np.asarray(forecast, float), np.asarray(actual, float)
    return float(np.abs(forecast - actual).sum() / actual.sum()) if actual.sum() > 0 else float("nan")


def offline_errors(trace, horizon: float) -> dict:
    """The predictor on the trace's own arrivals, one forecast a second: MAPE and WAPE."""
    times = np.array([r.arrival_s for r in trace])
    p, forecasts, actual = TrafficPredictor(300), [], []
    end = times.max()
    for t in np.arange(1.0, end - horizon, 1.0):
        for x in times[(times >= t - 1) & (times < t)]:
            p.observe(float(x))
        p.observe(float(t) - 1e-6, 0)
        forecasts.append(p.forecast(horizon, now=float(t)).arrival_rate)
        actual.append(np.sum((times >= t) & (times < t + horizon)) / horizon)
    return {"mape": mape(forecasts, actual), "wape": wape(forecasts, actual)}


# The app ----------------------------------------------------------------------------------------
def app_args(a, model: str, mode: str) -> dict:
    args = {"model": model, "num_replicas": 2, "num_threads": 1, "max_num_seqs": 16, **engine_kwargs(a),
            "num_cpus_per_replica": 0.5, "control_interval_s": 0.25, "routing_stats_period_s": 0.5, "dtype": "float32",
            "stream_interval_s": a.stream_interval, "stream_items_per_s": a.stream_items_per_s}
    if mode.endswith("-refuse"):
        args["heavy_watermark_action"] = "refuse"
    if mode.startswith("predictive"):
        args.update(predictive_control=True, forecast_horizon_s=a.horizon,
                    predictive_admission_share=a.admission_share)
    elif mode == "none":
        args.update(light_watermark=1.0, heavy_watermark=1.0)
    elif mode == "reactive-noratio":
        args["max_hidden_ratio"] = 0.0
    return args


async def run_trace(url: str, model: str, trace, a, controller) -> tuple[list, float, list, list]:
    """Replay over HTTP while polling the controller: (timelines, duration, forecasts, decisions)."""
    forecasts, decisions, seen = [], [], set()

    async def poll(t0: float) -> None:
        wall0 = time.time() - (time.perf_counter() - t0)
        while True:
            state = await controller.get_state.remote()
            t = time.perf_counter() - t0
            if state.forecast is not None:
                f = state.forecast
                forecasts.append({"t": t, "rate": f.arrival_rate, "low": f.arrival_rate_low,
                                  "high": f.arrival_rate_high, "model": f.model,
                                  "forecast_usage": state.forecast_usage, "usage": state.usage})
            for d in state.decisions:
                key = (d.time, d.replica_id, d.reason)
                if d.time >= wall0 and key not in seen:
                    seen.add(key)
                    decisions.append({"t": d.time - wall0, "replica": d.replica_id, "actions": list(d.actions),
                                      "reason": d.reason})
            await asyncio.sleep(0.5)

    slos = {"ttft_slo_ms": a.ttft_slo_ms, "tbt_slo_ms": a.tbt_slo_ms}
    timelines, duration = await replay(trace, url, model, ClientOptions(timeout=600.0), slos, during=poll)
    return timelines, duration, forecasts, decisions


def live_errors(forecasts: list[dict], trace, horizon: float) -> dict:
    times = np.array([r.arrival_s for r in trace])
    end = times.max()
    pairs = [(f["rate"], np.sum((times >= f["t"]) & (times < f["t"] + horizon)) / horizon)
             for f in forecasts if f["t"] + horizon <= end]
    if not pairs:
        return {"mape": float("nan"), "wape": float("nan")}
    f, x = [p for p, _ in pairs], [x for _, x in pairs]
    return {"mape": mape(f, x), "wape": wape(f, x)}


def wait_idle(controller, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        loads = controller.get_state.remote().result().replicas.values()
        if len(loads) == 2 and all(r.num_free_pages == r.num_pages and r.num_running == 0 for r in loads):
            return
        time.sleep(0.5)


# Report -----------------------------------------------------------------------------------------
def summarize_run(timelines, duration: float, trace, shape) -> dict:
    s = summarize(timelines, duration)
    out = {"attainment": s["slo_attainment"], "goodput": s["request_goodput"], "completed": s["completed"],
           "failed": s["failed"], "p99_ttft_ms": s["p99_ttft_ms"], "preemptions": s["total_preemptions"]}
    if shape is not None:
        peak = [t for t, r in zip(timelines, trace) if shape.rate(np.array([r.arrival_s]))[0] == shape.high]
        out["peak_attainment"] = sum(passes_slo(t) for t in peak) / max(1, len(peak))
    # Per request (arrival in the trace, TTFT, passed, error), to see *when* requests miss: at a peak's
    # onset (the controller's lag) or all through it (capacity).
    out["requests"] = [{"arrival_s": round(r.arrival_s, 3), "passed": passes_slo(t), "error": t.error,
                        "ttft_s": None if t.first_token_s is None else round(t.first_token_s - t.arrival_s, 3)}
                       for t, r in zip(timelines, trace)]
    return out


def main() -> None:
    a = parse_args()
    from ray import serve

    from deployments.app import build_app

    model = random_checkpoint(a.shape, dtype="float32")
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model).vocab_size
    runs = traces(a, vocab)
    header = stamp(threads=1, dtype="float32", model=f"{a.shape} (random weights)", simulated=False)
    results: dict = {"args": vars(a), "cpu": os.cpu_count(), "offline_errors": {}, "runs": {}}
    for name, (trace, _) in runs.items():
        results["offline_errors"][name] = offline_errors(trace, a.horizon)

    with local_serve(a.num_cpus) as port:
        url = f"http://127.0.0.1:{port}/v1/completions"
        for mode in a.modes.split(","):
            started = time.perf_counter()
            serve.run(build_app(app_args(a, model, mode)), name=APP, route_prefix="/")
            controller = serve.get_deployment_handle("Controller", APP)
            while len(controller.get_state.remote().result().replicas) < 2:
                time.sleep(0.5)
            print(f"[{mode}] app up in {time.perf_counter() - started:.0f} s", flush=True)
            for name, (trace, shape) in runs.items():
                timelines, duration, forecasts, decisions = asyncio.run(run_trace(url, model, trace, a, controller))
                row = summarize_run(timelines, duration, trace, shape)
                row.update(forecasts=forecasts, decisions=decisions,
                           live_errors=live_errors(forecasts, trace, a.horizon) if forecasts else None)
                results["runs"].setdefault(mode, {})[name] = row
                print(f"[{mode}] {name}: attainment {row['attainment']:.1%}"
                      + (f" (peak {row['peak_attainment']:.1%})" if "peak_attainment" in row else "")
                      + f", goodput {row['goodput']:.2f} req/s, {len(decisions)} decisions", flush=True)
                wait_idle(controller)
            serve.delete(APP)

    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    suffix = a.tag if a.tag is not None else ("_quick" if a.quick else "")
    if "predictive" in results["runs"]:
        trace, shape = runs["on/off"]
        plots.plot_forecast(results["runs"]["predictive"]["on/off"], trace, shape, a.horizon,
                            out / f"forecast_onoff{suffix}.png")
    plots.plot_phases(results, runs["on/off"][1], out / f"phases_onoff{suffix}.png")
    write_json(out / f"predictive_control{suffix}.json", results, header, indent=None)
    print_table(results, runs)


def print_table(results: dict, runs: dict) -> None:
    modes = list(results["runs"])
    print(f"\n{'trace':<14}" + "".join(f"{m + ' att':>18}{'goodput':>9}" for m in modes)
          + f"{'MAPE/WAPE live':>16}{'offline':>13}")
    for name in runs:
        line = f"{name:<14}"
        for m in modes:
            r = results["runs"][m][name]
            att = f"{r['attainment']:.1%}" + (f" ({r['peak_attainment']:.0%})" if "peak_attainment" in r else "")
            line += f"{att:>18}{r['goodput']:>9.2f}"
        live = results["runs"].get("predictive", {}).get(name, {}).get("live_errors")
        line += f"{_pair(live):>16}{_pair(results['offline_errors'][name]):>13}"
        print(line)
    print("attainment: share of requests meeting TTFT and P99-gap SLOs (on/off: in brackets, within the high "
          "phases); goodput: req/s meeting them; MAPE of the forecast mean rate over the horizon")


def _pair(errors: dict | None) -> str:
    if not errors or math.isnan(errors["mape"]):
        return "-"
    return f"{errors['mape']:.0%}/{errors['wape']:.0%}"


if __name__ == "__main__":
    main()
