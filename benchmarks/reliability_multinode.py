"""The ``multinode`` scenario of ``benchmarks/reliability.py``: the app on a Ray cluster of several nodes
on this machine (``ray.cluster_utils.Cluster``: a head that runs no engine, and three workers of one
CPU each, so the two engine replicas land on different workers and a third is spare), steady load,
and one engine replica's worker node removed (its raylet and every process on it killed) mid-load.

Reported: every request's outcome (none may hang: each ends finished or with an explicit error),
how long after the kill requests kept failing (``failing_for_s``: the last failed request's send time
after the kill; the promise is under 30 s), and when the controller saw two live replicas again
(``replaced_after_s``). It builds and tears down its own cluster, so it never shares a Ray instance.
"""

from __future__ import annotations

import asyncio
import socket
import time

from benchmarks.reliability_load import Tally, app_processes, make_client, pages_state, wait_until_idle

APP = "rel-multinode"


def _raylets_hosting(deployment: str) -> set[int]:
    """The raylet pids (a Ray worker process is its raylet's child) of ``deployment``'s replicas."""
    return {p.ppid() for p in app_processes(APP) if p.cmdline()[0].startswith(f"ray::ServeReplica:{APP}:{deployment}")}


def _worker_hosting_an_engine(workers: list) -> tuple[int, object]:
    """A worker node with an engine replica, one without the router if there is one: the scenario is
    the loss of an engine; a router lost with it is the kill_router scenario too."""
    engines, routers = _raylets_hosting("EngineReplica"), _raylets_hosting("Router")
    hosting = [(i, n) for i, n in enumerate(workers) if n.all_processes["raylet"][0].process.pid in engines]
    if not hosting:
        raise RuntimeError("no worker node hosts an engine replica")
    alone = [(i, n) for i, n in hosting if n.all_processes["raylet"][0].process.pid not in routers]
    return (alone or hosting)[0]


def multinode(model: str, duration_s: float = 30.0, rate: float = 3.0, kill_at_s: float = 8.0) -> dict:
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from benchmarks.reliability import Target, _by_code, _round, _send, app_args
    from deployments.app import build_app

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    workers = [cluster.add_node(num_cpus=1) for _ in range(3)]
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        # One proxy, on the head: the fake nodes share this machine's ports.
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(app_args(model, num_replicas=2, num_cpus_per_replica=1, pin_cpus=False)),
                  name=APP, route_prefix="/")
        target = Target(f"http://127.0.0.1:{port}", APP, model, num_replicas=2, max_tokens=256)
        _wait(lambda: pages_state(APP)["num_replicas"] == 2, 120, "two engine replicas report")
        nodes_of_engines = len(_raylets_hosting("EngineReplica"))
        before = set(_controller_replicas())
        result = asyncio.run(_load_and_kill(target, cluster, workers, duration_s, rate, kill_at_s, _send))
        # Two replicas reporting again, one of them new: the dead one dropped and its replacement up.
        replaced_s = _wait(lambda: len(r := _controller_replicas()) == 2 and bool(set(r) - before),
                           120, "a replacement replica reports", since=result.pop("killed_at"))
        idle_s = asyncio.run(wait_until_idle(APP, target.base_url, {}, 2, timeout_s=60))
        tally = result.pop("tally")
        return {"nodes": 1 + len(workers), "engine_replicas": 2, "worker_nodes_hosting_engines": nodes_of_engines,
                "rate_per_s": rate, "duration_s": duration_s, **tally.counts(),
                "failed_by_code": _by_code(tally, "failed"), "lost_by_code": _by_code(tally, "lost"), **result,
                "replaced_after_s": _round(replaced_s), "pages_free_after_s": _round(idle_s)}
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


async def _load_and_kill(target, cluster, workers, duration_s, rate, kill_at_s, send) -> dict:
    from benchmarks.reliability import in_flight_at

    tally = Tally()
    async with make_client(target.base_url) as client:
        sending = asyncio.create_task(send(client, target, rate, duration_s, tally, int(rate * duration_s * 2)))
        await asyncio.sleep(kill_at_s)
        index, victim = _worker_hosting_an_engine(workers)
        killed_at = time.monotonic()
        await asyncio.to_thread(cluster.remove_node, victim)
        await asyncio.gather(*(await sending))
    after = [r for r in tally.results if r.sent >= killed_at]
    failing = [r.sent - killed_at for r in after if r.outcome != "completed"]
    return {"tally": tally, "killed_at": killed_at, "killed_worker": index, **in_flight_at(tally, killed_at),
            "sent_after_kill": len(after), "failing_for_s": round(max(failing, default=0.0), 2)}


def _controller_replicas() -> list[str]:
    from benchmarks.reliability_load import controller_state

    return sorted(controller_state(APP).replicas)


def _wait(check, timeout_s: float, what: str, since: float | None = None) -> float | None:
    """Seconds from ``since`` (default: now) until ``check()``; None after ``timeout_s`` when timed from
    an event, an error when waiting for the set-up."""
    start = time.monotonic() if since is None else since
    while time.monotonic() - start < timeout_s:
        try:
            if check():
                return time.monotonic() - start
        except Exception:  # noqa: BLE001 - asked while something is being replaced
            pass
        time.sleep(0.5)
    if since is None:
        raise RuntimeError(f"timed out waiting until {what}")
    return None
