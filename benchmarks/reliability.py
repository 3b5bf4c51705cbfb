"""Reliability scenarios against the Ray Serve app, each bounded in time and request count, on loopback::

    python benchmarks/reliability.py overload                # 10x the sustainable rate for 60 s
    python benchmarks/reliability.py streams_cut             # 100 streams cut at random points
    python benchmarks/reliability.py kill_controller kill_router
    python benchmarks/reliability.py multinode               # its own Ray cluster of 3 nodes
    python benchmarks/reliability.py soak --duration 1800    # steady ~70% load: RSS, files, pages flat

Each scenario deploys its own app (opt-tiny with random weights unless ``--model``), prints a table and
writes ``docs/benchmarks/reliability/<scenario>.json``. Outcomes per request are those of
``reliability_load.py`` (completed / cut / rejected / failed / lost / bad_rejection); the promises are
no ``lost`` and no ``bad_rejection``, every page free afterwards, and the service back to full
attainment. The fast variants run in CI (tests/serve/test_serve_reliability.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.reliability_load import (Sampler, Tally, make_client, one_request, open_files,  # noqa: E402
                                         pages_state, request_body, rss_by_role, rss_bytes, wait_until_idle)

OUT_DIR = Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "reliability"
PROMPT_LEN, MAX_TOKENS = 32, 64


def app_args(model: str, **overrides) -> dict:
    """The scenarios' app: small pages pool and admission line, so overload shows within seconds."""
    return {"model": model, "num_replicas": 1, "num_pages": 256, "max_num_seqs": 16, "num_threads": 1,
            "num_cpus_per_replica": 0.5, "max_queued_requests": 32, "control_interval_s": 0.2,
            "retry_after_s": 1, "routing_stats_period_s": 0.5, "health_check_period_s": 1, **overrides}


@dataclass
class Target:
    base_url: str
    app: str
    model: str  # the served model name
    num_replicas: int = 1
    headers: dict = field(default_factory=dict)
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    max_tokens: int = MAX_TOKENS  # of every request the scenario sends

    def body(self, max_tokens: int | None = None) -> dict:
        return request_body(self.model, PROMPT_LEN, max_tokens or self.max_tokens, self.rng)


async def sustainable_rate(target: Target, concurrency: int = 16, num_requests: int = 48) -> float:
    """Completed requests per second with ``concurrency`` requests always in flight (saturation)."""
    tally, queue = Tally(), list(range(num_requests))
    async with make_client(target.base_url, target.headers) as client:
        async def worker():
            while queue:
                queue.pop()
                tally.add(await one_request(client, target.body()))
        start = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return tally.counts()["completed"] / (time.monotonic() - start)


async def _send(client, target: Target, rate: float, duration_s: float, tally: Tally, max_requests: int,
                timeout_s: float = 120.0) -> list[asyncio.Task]:
    """Poisson arrivals at ``rate``/s for ``duration_s``; returns the requests' tasks once sending stops."""
    tasks, deadline = [], time.monotonic() + duration_s

    async def run(body):
        tally.add(await one_request(client, body, timeout_s))

    while time.monotonic() < deadline and len(tasks) < max_requests:
        tasks.append(asyncio.create_task(run(target.body())))
        await asyncio.sleep(target.rng.expovariate(rate))
    return tasks


async def time_to_attainment(target: Target, rate: float, ttft_slo_s: float, window: int = 5,
                             timeout_s: float = 120.0) -> float | None:
    """Seconds until ``window`` probes in a row (sent at ``rate``/s) complete with TTFT within the SLO."""
    start, in_a_row = time.monotonic(), 0
    async with make_client(target.base_url, target.headers) as client:
        while time.monotonic() - start < timeout_s:
            result = await one_request(client, target.body(max_tokens=8), timeout_s=30)
            ok = result.outcome == "completed" and result.ttft_s is not None and result.ttft_s <= ttft_slo_s
            in_a_row = in_a_row + 1 if ok else 0
            if in_a_row >= window:
                return time.monotonic() - start
            await asyncio.sleep(1.0 / rate)
    return None


async def overload(target: Target, duration_s: float = 60.0, factor: float = 10.0, ttft_slo_s: float = 2.0,
                   calibration_requests: int = 48, bursts: int = 2) -> dict:
    """``factor`` x the sustainable rate for ``duration_s``, ``bursts`` times: what is refused, what
    completes, memory after each burst (flat from one to the next: nothing leaks), recovery."""
    rate = await sustainable_rate(target, num_requests=calibration_requests)
    await wait_until_idle(target.app, target.base_url, target.headers, target.num_replicas)
    rss_before, tally, rss_after, recoveries, idles, peak = rss_bytes(target.app), Tally(), [], [], [], 0
    roles = [rss_by_role(target.app)]
    for _ in range(bursts):
        async with make_client(target.base_url, target.headers) as client, Sampler(target.app) as sampler:
            tasks = await _send(client, target, factor * rate, duration_s, tally, int(factor * rate * duration_s * 1.5))
            recovery = asyncio.create_task(time_to_attainment(target, rate / 2, ttft_slo_s))
            await asyncio.gather(*tasks)
            recoveries.append(_round(await recovery))
            idle_s = await wait_until_idle(target.app, target.base_url, target.headers, target.num_replicas)
            idles.append(_round(idle_s))
        await asyncio.sleep(2.0)
        rss_after.append(_mib(rss_bytes(target.app)))
        roles.append(rss_by_role(target.app))
        peak = max(peak, sampler.peak)
    pages = await asyncio.to_thread(pages_state, target.app)
    return {"sustainable_rate_per_s": round(rate, 2), "offered_rate_per_s": round(factor * rate, 2),
            "sent_rate_per_s": round(len(tally.results) / (duration_s * bursts), 2),  # the client's CPU caps it
            "duration_s": duration_s, "bursts": bursts, **tally.counts(),
            "rejected_by_code": _by_code(tally, "rejected"), "lost_by_code": _by_code(tally, "lost"),
            "rejection_latency_s": _percentiles([r.latency_s for r in tally.results if r.outcome == "rejected"]),
            "rss_before_mib": _mib(rss_before), "rss_peak_mib": _mib(peak), "rss_after_each_burst_mib": rss_after,
            "rss_by_role_mib": roles,
            "recovery_s": recoveries, "pages_free_after_s": idles,
            "pages_free": pages["num_free_pages"], "pages": pages["num_pages"]}


async def streams_cut(target: Target, num_streams: int = 100, concurrency: int = 16,
                      max_tokens: int = 400) -> dict:
    """Streams closed by the client at random points (before the first token too); then every page
    must come back and no slot stay held."""
    tally, rng = Tally(), random.Random(1)
    aborted_before = await _num_aborted(target.app)
    semaphore = asyncio.Semaphore(concurrency)
    async with make_client(target.base_url, target.headers) as client:
        async def one(i: int):
            async with semaphore:
                if i % 10 == 0:  # cut while waiting for the answer's headers
                    result = await one_request(client, target.body(max_tokens), timeout_s=rng.uniform(0.01, 0.3))
                    result.outcome = "cut" if result.outcome == "lost" else result.outcome
                else:
                    result = await one_request(client, target.body(max_tokens), cut_after_chunks=rng.randint(1, 60))
                tally.add(result)
        await asyncio.gather(*(one(i) for i in range(num_streams)))
    idle_s = await wait_until_idle(target.app, target.base_url, target.headers, target.num_replicas)
    pages = await asyncio.to_thread(pages_state, target.app)
    return {"streams": num_streams, **tally.counts(), "pages_free_after_s": _round(idle_s),
            "pages_free": pages["num_free_pages"], "pages": pages["num_pages"],
            "aborted_in_engines": await _num_aborted(target.app) - aborted_before}


async def kill_during_load(target: Target, deployment: str, rate: float = 4.0, duration_s: float = 20.0,
                           kill_at_s: float = 5.0) -> dict:
    """Steady load while one replica of ``deployment`` (Controller or Router) is killed; Serve replaces it.
    Requests of ``target.max_tokens``: longer ones keep more in flight through the victim."""
    import ray

    before = _replica_actor_names(target.app, deployment)
    victim, tally = before[0], Tally()
    async with make_client(target.base_url, target.headers) as client:
        sending = asyncio.create_task(_send(client, target, rate, duration_s, tally, int(rate * duration_s * 2)))
        await asyncio.sleep(kill_at_s)
        killed = time.monotonic()
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        replaced_s = await _time_until_replaced(target.app, deployment, victim, len(before), killed)
        await asyncio.gather(*(await sending))
    idle_s = await wait_until_idle(target.app, target.base_url, target.headers, target.num_replicas)
    return {"killed": deployment, "rate_per_s": rate, "duration_s": duration_s, **tally.counts(),
            **in_flight_at(tally, killed), "failed_by_code": _by_code(tally, "failed"),
            "lost_by_code": _by_code(tally, "lost"), "replaced_after_s": _round(replaced_s),
            "pages_free_after_s": _round(idle_s)}


async def soak(target: Target, rate: float, duration_s: float, sample_every_s: float = 10.0,
               ttft_slo_s: float = 2.0) -> dict:
    """Steady load at ``rate`` for ``duration_s``: RSS, open files and pages sampled along the way, and
    TTFT attainment in the first and the second half (steady: about equal)."""
    tally, samples = Tally(), []
    async with make_client(target.base_url, target.headers) as client:
        sending = asyncio.create_task(_send(client, target, rate, duration_s, tally, int(rate * duration_s * 2)))
        start = time.monotonic()
        while not sending.done():
            pages = await asyncio.to_thread(pages_state, target.app)
            done = tally.counts()
            samples.append({"t_s": round(time.monotonic() - start, 1), "rss_mib": _mib(rss_bytes(target.app)),
                            "open_files": open_files(target.app),
                            "pages_used": pages["num_pages"] - pages["num_free_pages"],
                            "completed": done["completed"], "sent": done["sent"]})
            await asyncio.sleep(sample_every_s)
        await asyncio.gather(*(await sending))
    idle_s = await wait_until_idle(target.app, target.base_url, target.headers, target.num_replicas)
    halves = [[r for r in tally.results if (r.sent - start < duration_s / 2) == first] for first in (True, False)]
    attainment = [round(sum(r.outcome == "completed" and r.ttft_s is not None and r.ttft_s <= ttft_slo_s
                            for r in half) / max(1, len(half)), 3) for half in halves]
    return {"rate_per_s": round(rate, 2), "duration_s": duration_s, **tally.counts(),
            "ttft_attainment_halves": attainment, "pages_free_after_s": _round(idle_s),
            "rss_first_mib": samples[0]["rss_mib"], "rss_last_mib": _mib(rss_bytes(target.app)),
            "open_files_first": samples[0]["open_files"], "open_files_last": open_files(target.app),
            "samples": samples}


# Helpers ------------------------------------------------------------------------------------------
def _loads(app: str):
    from benchmarks.reliability_load import controller_state

    return controller_state(app).replicas.values()


def _replica_actor_names(app: str, deployment: str) -> list[str]:
    import ray

    prefix = f"SERVE_REPLICA::{app}#{deployment}#"
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix))


def in_flight_at(tally: Tally, moment: float) -> dict:
    """How many requests were in flight at ``moment`` (a kill), and how each of them ended."""
    hit = [r for r in tally.results if r.sent < moment < r.sent + r.latency_s]
    return {"in_flight_at_kill": len(hit),
            "in_flight_at_kill_outcomes": {o: sum(r.outcome == o for r in hit)
                                           for o in sorted({r.outcome for r in hit})}}


async def _time_until_replaced(app: str, deployment: str, victim: str, want: int, since: float,
                               timeout_s: float = 90.0):
    """Seconds from the kill until ``want`` replicas of ``deployment`` run again, none the victim."""
    from ray import serve


    def is_replaced() -> bool:
        names = _replica_actor_names(app, deployment)
        running = serve.status().applications[app].deployments[deployment].replica_states.get("RUNNING", 0)
        if victim in names or len(names) < want or running < want:
            return False
        return deployment != "Controller" or bool(_loads(app))  # the new controller hears the engines

    while time.monotonic() - since < timeout_s:
        try:
            if await asyncio.to_thread(is_replaced):
                return time.monotonic() - since
        except Exception:  # noqa: BLE001 - asked while it is being replaced
            pass
        await asyncio.sleep(0.25)
    return None


async def _num_aborted(app: str) -> int:
    return sum(r.num_aborted for r in await asyncio.to_thread(_loads, app))


def _by_code(tally: Tally, outcome: str) -> dict:
    codes: dict[str, int] = {}
    for r in tally.results:
        if r.outcome == outcome:
            codes[str(r.code)] = codes.get(str(r.code), 0) + 1
    return codes


def _percentiles(values: list[float]) -> dict:
    values = sorted(values)
    pick = (lambda q: round(values[min(len(values) - 1, int(q * len(values)))], 3)) if values else (lambda q: None)
    return {"p50": pick(0.5), "p99": pick(0.99), "max": round(values[-1], 3) if values else None}


def _mib(num_bytes: int) -> float:
    return round(num_bytes / 2**20, 1)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def print_table(name: str, result: dict) -> None:
    print(f"\n== {name}")
    for key, value in result.items():
        if key != "samples":
            print(f"  {key:<24} {value}")


# Entry point --------------------------------------------------------------------------------------
SCENARIOS = ("overload", "streams_cut", "kill_controller", "kill_router", "multinode", "soak")


def deploy(name: str, model: str, **overrides) -> Target:
    """Deploy the scenario's app on the running Serve instance; returns where to reach it."""
    from ray import serve

    from deployments.app import build_app

    args = app_args(model, **overrides)
    serve.run(build_app(args), name=name, route_prefix="/")
    target = Target(f"http://127.0.0.1:{serve_port()}", name, model, args["num_replicas"])
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if pages_state(name)["num_replicas"] == target.num_replicas:
                return target
        except Exception:  # noqa: BLE001 - still starting
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{name}: the engine replicas did not report within 120 s")


_PORT: list[int] = []


def serve_port() -> int:
    return _PORT[0]


def start_serve(address: str | None, num_cpus: int | None) -> None:
    import os
    import socket

    import ray
    from ray import serve

    root = str(Path(__file__).resolve().parents[1])
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    ray.init(address=address or "local", num_cpus=None if address else num_cpus, include_dashboard=False,
             log_to_driver=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        _PORT.append(s.getsockname()[1])
    serve.start(http_options={"host": "127.0.0.1", "port": serve_port()})


def default_model() -> str:
    import tempfile

    from apt_serve_ray.models.checkpoints import make_random_checkpoint

    return make_random_checkpoint(Path(tempfile.gettempdir()) / "apt-reliability" / "opt-tiny", "opt-tiny")


def run_scenario(name: str, args) -> dict:
    from ray import serve

    model = args.model or default_model()
    if name == "multinode":
        from benchmarks.reliability_multinode import multinode

        return multinode(model, duration_s=args.duration or 30.0)
    overrides = {"num_routers": 2} if name == "kill_router" else {}
    target = deploy(f"rel-{name.replace('_', '-')}", model, **overrides)
    try:
        if name == "overload":
            return asyncio.run(overload(target, duration_s=args.duration or 60.0, factor=args.factor))
        if name == "streams_cut":
            return asyncio.run(streams_cut(target, num_streams=args.num_streams))
        if name in ("kill_controller", "kill_router"):
            target.max_tokens = 256
            deployment = "Controller" if name == "kill_controller" else "Router"
            return asyncio.run(kill_during_load(target, deployment, duration_s=args.duration or 20.0))
        rate = 0.7 * asyncio.run(sustainable_rate(target))
        return asyncio.run(soak(target, rate, args.duration or 1800.0))
    finally:
        serve.delete(target.app)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenarios", nargs="+", choices=SCENARIOS)
    parser.add_argument("--model", help="model to serve (default: opt-tiny with random weights)")
    parser.add_argument("--duration", type=float, help="seconds of load (default per scenario)")
    parser.add_argument("--factor", type=float, default=10.0, help="overload: x the sustainable rate")
    parser.add_argument("--num-streams", type=int, default=100, help="streams_cut: streams to cut")
    parser.add_argument("--address", help="an existing Ray cluster (default: a local one)")
    parser.add_argument("--num-cpus", type=int, default=2)
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR)
    args = parser.parse_args(argv)
    single_node = [s for s in args.scenarios if s != "multinode"]
    if single_node:
        start_serve(args.address, args.num_cpus)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name in args.scenarios:
        if name == "multinode" and single_node:
            import ray
            from ray import serve

            serve.shutdown()
            ray.shutdown()  # multinode builds a cluster of its own
        started = time.monotonic()
        result = {"scenario": name, "command": " ".join(["python", "benchmarks/reliability.py", *sys.argv[1:]]),
                  **run_scenario(name, args), "wall_s": None}
        result["wall_s"] = round(time.monotonic() - started, 1)
        print_table(name, result)
        (args.out_dir / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
