"""Reliability scenarios against the Ray Serve app (``benchmarks/reliability.py`` runs them by name;
``tests/serve/test_serve_reliability.py`` runs their fast variants), bounded in time and request
count, on loopback. A request's outcome is read by ``bench/outcomes.py``, the app's processes and
state by ``bench/app_probe.py``.

Every request ends in exactly one outcome, as the client sees it:

- ``completed``: 200 and the whole answer (a final ``finish_reason``; a stream ends with ``[DONE]``);
- ``cut``: the client closed the stream on purpose (``streams_cut``);
- ``rejected``: 429 or 503 *with* ``Retry-After`` and an OpenAI error body (a refusal the server
  promises; one without them is ``bad_rejection``);
- ``failed``: any other explicit error: a 4xx/5xx status, or a stream's error event;
- ``dropped``: the connection broke (a stream cut off without ``[DONE]``, a reset): the client
  knows at once that it failed, but gets no error body (Serve's proxy does this when the router
  replica holding the stream dies);
- ``lost``: no answer before the client's timeout: a hang. The promise is zero of these.

The promises: no ``lost`` and no ``bad_rejection``, every page free afterwards, and the service back
to full attainment.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

from apt_serve_ray.bench.app_probe import (Sampler, app_processes, controller_state, open_files, pages_state,
                                           rss_by_role, rss_bytes, wait_until_idle)
from apt_serve_ray.bench.http_client import closed_loop
from apt_serve_ray.bench.outcomes import MAX_TOKENS, PROMPT_LEN, Tally, make_client, one_request, request_body
from apt_serve_ray.bench.servers import free_port

__all__ = ["Target", "app_args", "deploy", "overload", "streams_cut", "kill_during_load", "soak", "multinode",
           "sustainable_rate", "time_to_attainment", "pages_state", "wait_until_idle", "rss_by_role", "open_files"]


# Scenarios ------------------------------------------------------------------------------------------
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


def deploy(name: str, model: str, port: int, **overrides) -> Target:
    """Deploy the scenario's app on the running Serve instance; returns where to reach it."""
    from ray import serve

    from deployments.app import build_app

    args = app_args(model, **overrides)
    serve.run(build_app(args), name=name, route_prefix="/")
    target = Target(f"http://127.0.0.1:{port}", name, model, args["num_replicas"])
    if wait_for(lambda: pages_state(name)["num_replicas"] == target.num_replicas, 120) is None:
        raise RuntimeError(f"{name}: the engine replicas did not report within 120 s")
    return target


def wait_for(check, timeout_s: float, since: float | None = None, interval_s: float = 0.5) -> float | None:
    """Seconds from ``since`` (default: now) until ``check()`` is true; None after ``timeout_s``."""
    start = time.monotonic() if since is None else since
    while time.monotonic() - start < timeout_s:
        try:
            if check():
                return time.monotonic() - start
        except Exception:  # noqa: BLE001 - asked while something starts or is being replaced
            pass
        time.sleep(interval_s)
    return None


async def sustainable_rate(target: Target, concurrency: int = 16, num_requests: int = 48) -> float:
    """Completed requests per second with ``concurrency`` requests always in flight (saturation)."""
    tally = Tally()
    async with make_client(target.base_url, target.headers) as client:
        async def send(_):
            tally.add(await one_request(client, target.body()))
        start = time.monotonic()
        await closed_loop(num_requests, concurrency, send)
    return tally.counts()["completed"] / (time.monotonic() - start)


async def send_poisson(client, target: Target, rate: float, duration_s: float, tally: Tally, max_requests: int,
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
            tasks = await send_poisson(client, target, factor * rate, duration_s, tally,
                                       int(factor * rate * duration_s * 1.5))
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
            "rejected_by_code": by_code(tally, "rejected"), "lost_by_code": by_code(tally, "lost"),
            "rejection_latency_s": _percentiles([r.latency_s for r in tally.results if r.outcome == "rejected"]),
            "rss_before_mib": _mib(rss_before), "rss_peak_mib": _mib(peak), "rss_after_each_burst_mib": rss_after,
            "rss_by_role_mib": roles,
            "recovery_s": recoveries, "pages_free_after_s": idles,
            "pages_free": pages["num_free_pages"], "pages": pages["num_pages"]}


async def streams_cut(target: Target, num_streams: int = 100, concurrency: int = 16,
                      max_tokens: int = 400) -> dict:
    """Streams closed by the client at random points (before the first token too); then every page
    must come back and no slot stay held."""
    tally, in_stream, rng = Tally(), Tally(), random.Random(1)
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
                    in_stream.add(result)
                tally.add(result)
        await asyncio.gather(*(one(i) for i in range(num_streams)))
    idle_s = await wait_until_idle(target.app, target.base_url, target.headers, target.num_replicas)
    pages = await asyncio.to_thread(pages_state, target.app)
    return {"streams": num_streams, **tally.counts(), "pages_free_after_s": _round(idle_s),
            "pages_free": pages["num_free_pages"], "pages": pages["num_pages"],
            "cut_in_stream": in_stream.counts()["cut"],
            "aborted_in_engines": await _num_aborted(target.app) - aborted_before}


async def kill_during_load(target: Target, deployment: str, rate: float = 4.0, duration_s: float = 20.0,
                           kill_at_s: float = 5.0) -> dict:
    """Steady load while one replica of ``deployment`` (Controller or Router) is killed; Serve replaces it.
    Requests of ``target.max_tokens``: longer ones keep more in flight through the victim."""
    import ray

    before = _replica_actor_names(target.app, deployment)
    victim, tally = before[0], Tally()
    async with make_client(target.base_url, target.headers) as client:
        sending = asyncio.create_task(send_poisson(client, target, rate, duration_s, tally,
                                                   int(rate * duration_s * 2)))
        await asyncio.sleep(kill_at_s)
        killed = time.monotonic()
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        replaced_s = await _time_until_replaced(target.app, deployment, victim, len(before), killed)
        await asyncio.gather(*(await sending))
    idle_s = await wait_until_idle(target.app, target.base_url, target.headers, target.num_replicas)
    return {"killed": deployment, "rate_per_s": rate, "duration_s": duration_s, **tally.counts(),
            **in_flight_at(tally, killed), "failed_by_code": by_code(tally, "failed"),
            "lost_by_code": by_code(tally, "lost"), "replaced_after_s": _round(replaced_s),
            "pages_free_after_s": _round(idle_s)}


async def soak(target: Target, rate: float, duration_s: float, sample_every_s: float = 10.0,
               ttft_slo_s: float = 2.0) -> dict:
    """Steady load at ``rate`` for ``duration_s``: RSS, open files and pages sampled along the way, and
    TTFT attainment in the first and the second half (steady: about equal)."""
    tally, samples = Tally(), []
    async with make_client(target.base_url, target.headers) as client:
        sending = asyncio.create_task(send_poisson(client, target, rate, duration_s, tally,
                                                   int(rate * duration_s * 2)))
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


# Multinode ------------------------------------------------------------------------------------------
MULTINODE_APP = "rel-multinode"


def multinode(model: str, duration_s: float = 30.0, rate: float = 3.0, kill_at_s: float = 8.0) -> dict:
    """The app on a Ray cluster of several nodes on this machine (``ray.cluster_utils.Cluster``: a head
    that runs no engine, and three workers of one CPU each, so the two engine replicas land on
    different workers and a third is spare), steady load, and one engine replica's worker node removed
    (its raylet and every process on it killed) mid-load.

    Reported: every request's outcome (none may hang), how long after the kill requests kept failing
    (``failing_for_s``: the last failed request's send time after the kill; the promise is under 30 s),
    and when the controller saw two live replicas again (``replaced_after_s``). It builds and tears
    down its own cluster, so it never shares a Ray instance."""
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from deployments.app import build_app

    app = MULTINODE_APP
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    workers = [cluster.add_node(num_cpus=1) for _ in range(3)]
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        port = free_port()
        # One proxy, on the head: the fake nodes share this machine's ports.
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(app_args(model, num_replicas=2, num_cpus_per_replica=1, pin_cpus=False)),
                  name=app, route_prefix="/")
        target = Target(f"http://127.0.0.1:{port}", app, model, num_replicas=2, max_tokens=256)
        if wait_for(lambda: pages_state(app)["num_replicas"] == 2, 120) is None:
            raise RuntimeError("timed out waiting until two engine replicas report")
        nodes_of_engines = len(_raylets_hosting(app, "EngineReplica"))
        before = set(controller_state(app).replicas)
        result = asyncio.run(_load_and_kill(target, cluster, workers, duration_s, rate, kill_at_s))
        # Two replicas reporting again, one of them new: the dead one dropped and its replacement up.
        replaced_s = wait_for(lambda: len(r := sorted(controller_state(app).replicas)) == 2 and bool(set(r) - before),
                              120, since=result.pop("killed_at"))
        idle_s = asyncio.run(wait_until_idle(app, target.base_url, {}, 2, timeout_s=60))
        tally = result.pop("tally")
        return {"nodes": 1 + len(workers), "engine_replicas": 2, "worker_nodes_hosting_engines": nodes_of_engines,
                "rate_per_s": rate, "duration_s": duration_s, **tally.counts(),
                "failed_by_code": by_code(tally, "failed"), "lost_by_code": by_code(tally, "lost"), **result,
                "replaced_after_s": _round(replaced_s), "pages_free_after_s": _round(idle_s)}
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


def _raylets_hosting(app: str, deployment: str) -> set[int]:
    """The raylet pids (a Ray worker process is its raylet's child) of ``deployment``'s replicas."""
    return {p.ppid() for p in app_processes(app) if p.cmdline()[0].startswith(f"ray::ServeReplica:{app}:{deployment}")}


async def _load_and_kill(target: Target, cluster, workers, duration_s, rate, kill_at_s) -> dict:
    tally = Tally()
    async with make_client(target.base_url) as client:
        sending = asyncio.create_task(send_poisson(client, target, rate, duration_s, tally, int(rate * duration_s * 2)))
        await asyncio.sleep(kill_at_s)
        # A worker with an engine replica, one without the router if there is one: the scenario is the
        # loss of an engine; a router lost with it is the kill_router scenario too.
        engines, routers = _raylets_hosting(target.app, "EngineReplica"), _raylets_hosting(target.app, "Router")
        hosting = [(i, n) for i, n in enumerate(workers) if n.all_processes["raylet"][0].process.pid in engines]
        if not hosting:
            raise RuntimeError("no worker node hosts an engine replica")
        alone = [(i, n) for i, n in hosting if n.all_processes["raylet"][0].process.pid not in routers]
        index, victim = (alone or hosting)[0]
        killed_at = time.monotonic()
        await asyncio.to_thread(cluster.remove_node, victim)
        await asyncio.gather(*(await sending))
    after = [r for r in tally.results if r.sent >= killed_at]
    failing = [r.sent - killed_at for r in after if r.outcome != "completed"]
    return {"tally": tally, "killed_at": killed_at, "killed_worker": index, **in_flight_at(tally, killed_at),
            "sent_after_kill": len(after), "failing_for_s": round(max(failing, default=0.0), 2)}


# Helpers --------------------------------------------------------------------------------------------
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
        return deployment != "Controller" or bool(controller_state(app).replicas)  # the new controller hears the engines

    while time.monotonic() - since < timeout_s:
        try:
            if await asyncio.to_thread(is_replaced):
                return time.monotonic() - since
        except Exception:  # noqa: BLE001 - asked while it is being replaced
            pass
        await asyncio.sleep(0.25)
    return None


async def _num_aborted(app: str) -> int:
    return sum(r.num_aborted for r in (await asyncio.to_thread(controller_state, app)).replicas.values())


def by_code(tally: Tally, outcome: str) -> dict:
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
