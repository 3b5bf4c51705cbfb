"""The engine replicas' autoscaling in the real app on this CPU: one to two replicas ahead of a peak.

    python benchmarks/autoscale_serve.py [--policies forecast default] [--json docs/benchmarks/fleet/autoscale_serve.json]

Serve in this process (``bench.servers.local_serve``), the app with ``autoscaling`` (``deployments/autoscaling.py``)
between 1 and 2 engine replicas (random-weight OPT-125m shape, float32, one thread each), on/off traffic
(``--low`` / ``--high`` req/s, ``--period-s``, a third of each period on) for ``--periods`` periods, per
policy. Every second the deployment's replicas are read from ``serve.status()`` (running, and the target
Ray's controller set); per run: the replicas over time beside the arrival rate, when the second replica
was asked for and when it served, relative to each peak's start, attainment over all requests and at the
peaks. Ray's own metric lags apply (replica metrics every 6-10 s), as in a cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np

from apt_serve_ray.bench import workloads
from apt_serve_ray.bench.engine_args import random_checkpoint
from apt_serve_ray.bench.http_client import ClientOptions, replay
from apt_serve_ray.bench.report import stamp, write_json
from apt_serve_ray.bench.servers import local_serve
from apt_serve_ray.bench.slo_metrics import passes_slo

REPO = Path(__file__).resolve().parents[1]
APP = "autoscale-demo"


def replicas_now(serve) -> tuple[int, int]:
    """(running, asked for: running or starting) engine replicas of the app, from ``serve.status()``."""
    status = serve.status().applications.get(APP)
    if status is None or "EngineReplica" not in status.deployments:
        return 0, 0
    states = {str(getattr(k, "value", k)): v for k, v in status.deployments["EngineReplica"].replica_states.items()}
    return states.get("RUNNING", 0), sum(v for k, v in states.items() if k != "STOPPING")


async def run(url: str, model: str, trace, a, serve) -> tuple[list, float, list]:
    samples = []

    async def poll(t0: float) -> None:
        while True:
            running, target = replicas_now(serve)
            samples.append((time.perf_counter() - t0, running, target))
            await asyncio.sleep(1.0)

    slos = {"ttft_slo_ms": a.ttft_slo_ms, "tbt_slo_ms": a.tbt_slo_ms}
    timelines, duration = await replay(trace, url, model, ClientOptions(timeout=600.0, disable_tqdm=True), slos,
                                       during=poll)
    return timelines, duration, samples


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", nargs="+", default=["forecast", "default"], choices=["forecast", "default"])
    ap.add_argument("--low", type=float, default=0.3)
    ap.add_argument("--high", type=float, default=4.0)
    ap.add_argument("--period-s", type=float, default=90.0)
    ap.add_argument("--periods", type=int, default=4)
    ap.add_argument("--startup-s", type=float, default=45.0,
                    help="a CPU replica: its actor, engine process, load, calibration (38-48 s measured here)")
    ap.add_argument("--target", type=float, default=4.0, help="target_ongoing_requests per replica")
    ap.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    ap.add_argument("--tbt-slo-ms", type=float, default=500.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", type=Path, default=REPO / "docs" / "benchmarks" / "fleet")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    from ray import serve

    from deployments.app import build_app

    model = random_checkpoint("opt-125m", dtype="float32")
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model).vocab_size  # the checkpoint's (our tokenizer's), not OPT's
    shape = workloads.OnOff(a.low, a.high, a.period_s, duty=1 / 3)
    n = max(8, int(shape.mean_rate * a.period_s * a.periods))
    base = workloads.make_shaped_trace("humaneval", n, shape, seed=a.seed, max_output_len=64, max_model_len=1024)
    results = {"shape": dataclasses.asdict(shape), "args": {k: str(v) for k, v in vars(a).items()}, "runs": {}}
    with local_serve(2) as port:
        url = f"http://127.0.0.1:{port}/v1/completions"
        for policy in a.policies:
            trace = workloads.fresh_ids(base, vocab, a.seed, shape.mean_rate, run=policy)
            args = {"model": model, "num_threads": 1, "num_cpus_per_replica": 0.5, "dtype": "float32",
                    "max_num_seqs": 16, "control_interval_s": 0.5, "routing_stats_period_s": 0.5,
                    "autoscaling": {"policy": policy, "min_replicas": 1, "max_replicas": 2,
                                    "target_ongoing_requests": a.target, "startup_s": a.startup_s, "lead_s": 15,
                                    "downscale_delay_s": a.period_s, "season_s": a.period_s,
                                    "history_s": a.period_s * a.periods}}
            started = time.perf_counter()
            serve.run(build_app(args), name=APP, route_prefix="/")
            print(f"[{policy}] app up in {time.perf_counter() - started:.0f} s", flush=True)
            timelines, duration, samples = asyncio.run(run(url, model, trace, a, serve))
            passed = np.array([passes_slo(t) for t in timelines])
            arrivals = np.array([r.arrival_s for r in trace])
            peak = shape.rate(arrivals) >= shape.high
            starts = [k * a.period_s + a.period_s * (1 - shape.duty) for k in range(a.periods)]
            asked = [t for t, _, target in samples if target >= 2]
            served = [t for t, running, _ in samples if running >= 2]
            lead = [{"peak_start_s": s,
                     "asked_before_s": s - next((t for t in asked if t > s - a.period_s * (1 - shape.duty)), np.nan),
                     "serving_before_s": s - next((t for t in served if t > s - a.period_s * (1 - shape.duty)), np.nan)}
                    for s in starts]
            row = {"attainment": float(passed.mean()), "peak_attainment": float(passed[peak].mean()),
                   "samples": samples, "peaks": lead, "duration_s": duration}
            results["runs"][policy] = row
            print(f"[{policy}] attainment {row['attainment']:.1%} (peaks {row['peak_attainment']:.1%}); second "
                  "replica serving before each peak (s; negative: after it started): "
                  + ", ".join(f"{p['serving_before_s']:.0f}" for p in lead), flush=True)
            serve.delete(APP)
            time.sleep(5)
    if a.json:
        header = stamp(threads=1, dtype="float32", model="opt-125m (random weights)", simulated=False)
        print("wrote", write_json(a.json, results, header))
    return 0


if __name__ == "__main__":
    sys.exit(main())
