"""The fleet simulator's figures: replicas behind one router (``scale``) and autoscaling ahead of peaks
(``autoscale``), every engine OPT-13B on a simulated A100-80GB (``bench/gpu_cost.py``).

    python benchmarks/fleet_sim.py scale [--replicas 1 4 16 64 256] [--json docs/benchmarks/fleet/scale.json]
    python benchmarks/fleet_sim.py autoscale [--json docs/benchmarks/fleet/autoscale.json]
    python benchmarks/fleet_sim.py router [--replicas 16 64 256 1024] [--json docs/benchmarks/fleet/router.json]

Both run ``deployments/fleet.py``: the real engines (``apt`` or ``fcfs``), ``FitAwareRequestRouter``, the
router's admission line and ``ClusterControl`` on one simulated clock; wall time per routing decision is
measured on this machine. ``scale``: ``--rate-per-replica`` x N req/s of ShareGPT-like requests for
``--duration-s``, per N: attainment, goodput, router milliseconds per request (mean, P99), wall seconds.
``autoscale``: on/off and diurnal traces; replicas start ``--startup-s`` after they are asked for; Ray
Serve's default policy and ours (``deployments/autoscaling.py``), each run the way Ray's controller runs
it (``deployments/fleet_scaling.py``: its wrapper and delays, metrics 6-16 s late), at several
``target_ongoing_requests``; per run replica-hours, attainment over all requests and over those arriving
at the peaks; ours against the default's interpolated at the same replica-hours. SLOs: TTFT
``--ttft-slo-ms``, P99 gap ``--tbt-slo-ms`` for every request. ``router``: the request router alone,
``FitAwareRequestRouter.choose_replicas`` for 2,000 requests over N replicas' snapshots (free pages and
sequences at random), with Serve's queue-length cache filled for every replica (as ``enable_strict_max_
ongoing_requests``, on by default, fills it on every send) and empty; CPU milliseconds a request.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np

from apt_serve_ray.bench import gpu_cost
from apt_serve_ray.bench.report import stamp, write_json
from apt_serve_ray.bench.slo_metrics import attainment, goodput, passes_slo
from apt_serve_ray.bench.rate_shapes import Diurnal, OnOff, make_shaped_trace
from apt_serve_ray.bench.workloads import fresh_token_ids, make_trace
from apt_serve_ray.config import EngineConfig
from deployments.autoscaling import AutoscalingOptions
from deployments.cluster_control import ControlSettings
from deployments.fleet import FleetSettings, FleetSimulator
from deployments.fleet_scaling import RayAutoscaler

REPO = Path(__file__).resolve().parents[1]
CONTROL = ControlSettings(light=0.7, heavy=0.95, max_ratio=0.5, ratio_step=0.1)  # the app's defaults


def engines(policy: str, cost, max_model_len: int = 2048):
    """``make_engine`` for the fleet: ``policy`` engines on ``cost``, apt's costs measured once."""
    config = EngineConfig(policy=policy, calibrate_rho=False, enable_watermarks=False,
                          max_num_batched_tokens=512 if policy == "sarathi" else 2048)
    costs = None
    if policy == "apt":
        probe = gpu_cost.gpu_engine(config.replace(policy="fcfs"), cost, max_model_len=max_model_len)
        costs = gpu_cost.step_costs(probe.runner, cost, kinds=config.cache_kinds)
    return (lambda: gpu_cost.gpu_engine(config, cost, max_model_len=max_model_len, costs=costs)), config


def with_slo(trace, args):
    return [dataclasses.replace(r, ttft_slo_ms=args.ttft_slo_ms, tbt_slo_ms=args.tbt_slo_ms) for r in trace]


def scale(args, cost) -> dict:
    rows = []
    for policy in args.policies:
        make, _ = engines(policy, cost)
        for n in args.replicas:
            if policy != "apt" and n > args.max_baseline_replicas:
                continue
            rate = args.rate_per_replica * n
            num = max(50, round(rate * args.duration_s))
            trace = with_slo(fresh_token_ids(make_trace("sharegpt", num, rate, seed=args.seed, max_model_len=2048),
                                             cost.shape.vocab_size, args.seed, rate), args)
            t = time.perf_counter()
            res = FleetSimulator(make, FleetSettings(num_replicas=n, max_replicas=max(n, 1)), CONTROL).run(trace)
            wall = time.perf_counter() - t
            router_ms = np.array(res.router_s) * 1000
            arrivals = trace[-1].arrival_s
            row = {"policy": policy, "replicas": n, "rate": rate, "num_requests": num, "sim_s": res.duration_s,
                   "attainment": attainment(res.timelines), "goodput": goodput(res.timelines, arrivals),
                   "router_ms_mean": float(router_ms.mean()), "router_ms_p50": float(np.median(router_ms)),
                   "router_ms_p99": float(np.percentile(router_ms, 99)), "wall_s": wall,
                   "errors": sum(1 for x in res.timelines if x.error)}
            rows.append(row)
            print(f"  {policy:5s} {n:4d} replicas {rate:7.1f} req/s  attain {100 * row['attainment']:5.1f}%  "
                  f"goodput {row['goodput']:7.1f}/s  router {row['router_ms_mean']:.3f} ms (p99 "
                  f"{row['router_ms_p99']:.3f})  wall {wall:5.0f}s for {res.duration_s:.0f} s simulated", flush=True)
    _plot_scale(rows, args.out_dir / "fleet_scale.png")
    return {"rows": rows}


def router(args) -> dict:
    import random
    from types import SimpleNamespace

    from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID

    from apt_serve_ray.sampling.params import SamplingParams
    from deployments.fleet import _run
    from deployments.prefix_affinity import PrefixIndex
    from deployments.request_router import FitAwareRequestRouter
    from deployments.wire import EngineRequest, LoadReport

    deployment, rng, rows = DeploymentID(name="EngineReplica", app_name="bench"), random.Random(args.seed), []
    for n in args.replicas:
        for filled in (True, False):
            now = [1000.0]
            r = FitAwareRequestRouter(deployment, DeploymentHandleSource.UNKNOWN, get_curr_time_s=lambda: now[0])
            r.initialize_state()
            r.prefixes = PrefixIndex()
            views = []
            for i in range(n):
                report = LoadReport(
                    replica_id=f"r{i}", actor_name="a", model="m", time=999.0, num_pages=3775,
                    num_free_pages=rng.randint(100, 3000), num_pending_pages=0, tokens_per_kv_page=16,
                    hidden_allowed=True, cache_ratio=0.0, num_running=rng.randint(0, 100), num_waiting=0,
                    max_num_seqs=256, max_model_len=2048, step_time_ms=30.0, seed=0, num_requests=0, num_aborted=0,
                    received=())
                views.append(SimpleNamespace(replica_id=ReplicaID(unique_id=f"r{i}", deployment_id=deployment),
                                             routing_stats=report.to_dict()))
                r._replicas[views[-1].replica_id] = views[-1]
                if filled:
                    r.replica_queue_len_cache.update(views[-1].replica_id, rng.randint(0, 50))
            cpu = []
            for k in range(2000):
                request = EngineRequest([k + 1] + [7] * rng.randint(50, 600), SamplingParams(max_tokens=200),
                                        request_id=f"q{k}")
                pending = SimpleNamespace(args=(request,), kwargs={}, routing_context=SimpleNamespace(should_backoff=False),
                                          metadata=SimpleNamespace(call_method="generate", internal_request_id=f"q{k}"))
                t = time.thread_time()
                _run(r.choose_replicas(views, pending))
                cpu.append(time.thread_time() - t)
                now[0] += 0.001
            ms = np.array(cpu) * 1000
            rows.append({"replicas": n, "queue_lengths": "filled" if filled else "empty", "mean_ms": float(ms.mean()),
                         "p50_ms": float(np.median(ms)), "p99_ms": float(np.percentile(ms, 99))})
            print(f"  {n:5d} replicas, queue lengths {rows[-1]['queue_lengths']:6s}: {rows[-1]['mean_ms']:.3f} ms CPU "
                  f"a request (p50 {rows[-1]['p50_ms']:.3f}, p99 {rows[-1]['p99_ms']:.3f})", flush=True)
    return {"rows": rows}


def _peak_mask(trace, shape) -> np.ndarray:
    arrivals = np.array([r.arrival_s for r in trace])
    rates = shape.rate(arrivals)
    top = shape.high if isinstance(shape, OnOff) else shape.mean * (1 + shape.amplitude / 2)
    return rates >= top


def autoscale(args, cost) -> dict:
    make, config = engines("apt", cost)
    shapes = {"onoff": OnOff(low=args.low_rate, high=args.high_rate, period_s=args.period_s, duty=0.3),
              "diurnal": Diurnal(mean=(args.low_rate + args.high_rate) / 2,
                                 amplitude=(args.high_rate - args.low_rate) / (args.high_rate + args.low_rate),
                                 period_s=args.period_s)}
    out = {}
    for name, shape in shapes.items():
        num = round(shape.mean_rate * args.period_s * args.periods)
        trace = make_shaped_trace("sharegpt", num, shape, seed=args.seed, max_model_len=2048)
        trace = with_slo(fresh_token_ids(trace, cost.shape.vocab_size, args.seed, shape.mean_rate, name), args)
        peak = _peak_mask(trace, shape)
        runs = []
        for policy in ("default", "forecast"):
            for target in (args.targets if policy == "default" else args.forecast_targets or args.targets):
                options = AutoscalingOptions(policy=policy, min_replicas=1, max_replicas=args.max_replicas,
                                             target_ongoing_requests=target, startup_s=args.startup_s,
                                             history_s=args.periods * args.period_s)
                scaler = RayAutoscaler(options, config.max_num_seqs)
                settings = FleetSettings(num_replicas=1, startup_s=args.startup_s, max_replicas=args.max_replicas)
                t = time.perf_counter()
                res = FleetSimulator(make, settings, CONTROL, autoscaler=scaler).run(trace)
                passed = np.array([passes_slo(x) for x in res.timelines])
                run = {"policy": policy, "target_ongoing_requests": target,
                       "replica_hours": res.replica_seconds / 3600, "attainment": float(passed.mean()),
                       "peak_attainment": float(passed[peak].mean()), "replicas": res.replicas,
                       "wall_s": time.perf_counter() - t}
                runs.append(run)
                print(f"  {name:7s} {policy:8s} target {target:5.1f}  replica-hours {run['replica_hours']:6.2f}  "
                      f"attain {100 * run['attainment']:5.1f}%  at peaks {100 * run['peak_attainment']:5.1f}%  "
                      f"wall {run['wall_s']:4.0f}s", flush=True)
        out[name] = {"shape": dataclasses.asdict(shape), "num_requests": num, "runs": runs,
                     "forecast_minus_default_at_equal_hours": _equal_hours(runs)}
        _plot_replicas(name, shape, runs, args.out_dir / f"fleet_autoscale_{name}.png")
    return out


def _equal_hours(runs) -> list[dict]:
    """Ours at each target against the default's peak attainment interpolated at the same replica-hours
    (None where ours used fewer or more hours than any default run)."""
    base = sorted((r["replica_hours"], r["peak_attainment"], r["attainment"]) for r in runs if r["policy"] == "default")
    hours = [h for h, _, _ in base]
    rows = []
    for r in (r for r in runs if r["policy"] == "forecast"):
        inside = hours[0] <= r["replica_hours"] <= hours[-1] if hours else False
        peak = float(np.interp(r["replica_hours"], hours, [p for _, p, _ in base])) if inside else None
        overall = float(np.interp(r["replica_hours"], hours, [a for _, _, a in base])) if inside else None
        rows.append({"target": r["target_ongoing_requests"], "replica_hours": r["replica_hours"],
                     "peak_points": None if peak is None else 100 * (r["peak_attainment"] - peak),
                     "overall_points": None if overall is None else 100 * (r["attainment"] - overall)})
    return rows


def _plot_scale(rows, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for policy in sorted({r["policy"] for r in rows}):
        rs = [r for r in rows if r["policy"] == policy]
        n = [r["replicas"] for r in rs]
        axes[0].plot(n, [100 * r["attainment"] for r in rs], "o-", label=policy)
        axes[1].plot(n, [r["goodput"] for r in rs], "o-", label=policy)
        axes[2].plot(n, [r["router_ms_mean"] for r in rs], "o-", label=f"{policy} mean")
    for ax, label in zip(axes, ("attainment %", "goodput (req/s)", "router ms / request (this CPU)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("replicas (OPT-13B, simulated A100-80GB)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_replicas(name, shape, runs, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 3.8))
    end = max(r["replicas"][-1][0] for r in runs)
    t = np.linspace(0, end, 600)
    ax2 = ax.twinx()
    ax2.plot(t, shape.rate(t), color="0.7", lw=1)
    ax2.set_ylabel("arrival rate (req/s)")
    for r in runs:
        if r["target_ongoing_requests"] != runs[len(runs) // 4]["target_ongoing_requests"]:
            continue
        times, held = [x[0] for x in r["replicas"]], [x[2] for x in r["replicas"]]
        ax.step(times, held, where="post", label=f"{r['policy']}: serving replicas")
    ax.set_xlabel("seconds")
    ax.set_ylabel("replicas serving")
    ax.legend(loc="upper left")
    ax.set_title(f"{name}: replicas over time against arrivals (simulated)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["scale", "autoscale", "router"])
    ap.add_argument("--device", default="a100-80gb", choices=gpu_cost.devices())
    ap.add_argument("--model", default="opt-13b", choices=gpu_cost.models())
    ap.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    ap.add_argument("--tbt-slo-ms", type=float, default=150.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    ap.add_argument("--policies", nargs="+", default=["apt", "fcfs"])
    ap.add_argument("--max-baseline-replicas", type=int, default=64, help="fcfs runs up to this many (time)")
    ap.add_argument("--rate-per-replica", type=float, default=3.0)
    ap.add_argument("--duration-s", type=float, default=30.0)
    ap.add_argument("--low-rate", type=float, default=2.0)
    ap.add_argument("--high-rate", type=float, default=12.0)
    ap.add_argument("--period-s", type=float, default=240.0)
    ap.add_argument("--periods", type=int, default=3)
    ap.add_argument("--startup-s", type=float, default=60.0)
    ap.add_argument("--max-replicas", type=int, default=8)
    ap.add_argument("--targets", type=float, nargs="+", default=[10.0, 16.0, 24.0],
                    help="target_ongoing_requests per replica, each policy (Ray's default: 2; engines batch more)")
    ap.add_argument("--forecast-targets", type=float, nargs="+", default=[16.0, 24.0],
                    help="ours' (default --targets): it asks for more replicas at one target, so its hours fall "
                         "between the default's at lower targets")
    ap.add_argument("--out-dir", type=Path, default=REPO / "docs" / "benchmarks" / "fleet")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    cost = gpu_cost.GpuCostModel(gpu_cost.device(args.device), gpu_cost.model_shape(args.model))
    result = {"scale": lambda: scale(args, cost), "autoscale": lambda: autoscale(args, cost),
              "router": lambda: router(args)}[args.what]()
    if args.json:
        header = stamp(threads=1, dtype="bfloat16", model=f"{args.model} (cost model)", simulated=True,
                       device=args.device, what=args.what)
        print("wrote", write_json(args.json, {"args": {k: str(v) for k, v in vars(args).items()}, **result}, header))
    return 0


if __name__ == "__main__":
    sys.exit(main())
