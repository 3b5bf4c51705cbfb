"""What the reliability scenarios read of the app beside its answers: its processes (RSS by role, open
files, a background RSS sampler) and the cluster's state (pages and requests over the engine
replicas, from the controller's last reports)."""

from __future__ import annotations

import asyncio
import time

from apt_serve_ray.bench.outcomes import make_client

# The app's processes --------------------------------------------------------------------------------
def app_processes(app: str, with_proxy: bool = False) -> list:
    """The app's Serve replica processes (router, controller, engine replicas: ``ray::ServeReplica:<app>:``)
    and their children (each engine replica's engine process); with ``with_proxy`` Serve's HTTP proxies."""
    import psutil

    found, prefixes = [], (f"ray::ServeReplica:{app}:",) + (("ray::ProxyActor",) if with_proxy else ())
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info.get("cmdline") or []
        if cmdline and cmdline[0].startswith(prefixes):
            found.append(proc)
            found.extend(proc.children(recursive=True))
    return found


def rss_bytes(app: str) -> int:
    """RSS of the app's processes and the HTTP proxy (which buffers what the routers refuse too)."""
    total = 0
    for proc in app_processes(app, with_proxy=True):
        try:
            total += proc.memory_info().rss
        except Exception:  # noqa: BLE001 - a process that ended between the listing and the read
            pass
    return total


def rss_by_role(app: str) -> dict[str, float]:
    """MiB per role: each deployment's replicas, their children (the engine processes) and the proxy."""
    roles: dict[str, float] = {}
    for proc in app_processes(app, with_proxy=True):
        try:
            name = proc.cmdline()[0]
            role = "proxy" if name.startswith("ray::ProxyActor") else (
                name.split(":")[4].split(".")[0] if name.startswith("ray::ServeReplica:") else "engine_process")
            roles[role] = round(roles.get(role, 0.0) + proc.memory_info().rss / 2**20, 1)
        except Exception:  # noqa: BLE001 - a process that ended between the listing and the read
            pass
    return roles


def open_files(app: str) -> int:
    total = 0
    for proc in app_processes(app):
        try:
            total += proc.num_fds()
        except Exception:  # noqa: BLE001
            pass
    return total


class Sampler:
    """RSS of the app's processes every ``interval_s`` in the background: peak and the series."""

    def __init__(self, app: str, interval_s: float = 0.5) -> None:
        self.app, self.interval_s, self.series = app, interval_s, []
        self._task: asyncio.Task | None = None

    async def __aenter__(self):
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc):
        self._task.cancel()

    async def _run(self) -> None:
        start = time.monotonic()
        while True:
            rss = await asyncio.to_thread(rss_bytes, self.app)
            self.series.append((round(time.monotonic() - start, 2), rss))
            await asyncio.sleep(self.interval_s)

    @property
    def peak(self) -> int:
        return max((rss for _, rss in self.series), default=0)


# The cluster's state --------------------------------------------------------------------------------
def controller_state(app: str):
    from ray import serve

    return serve.get_deployment_handle("Controller", app).get_state.remote().result(timeout_s=10)


def pages_state(app: str) -> dict:
    """Free / total pages and running requests over the engine replicas (their last reports)."""
    loads = controller_state(app).replicas.values()
    return {"num_replicas": len(loads), "num_pages": sum(r.num_pages for r in loads),
            "num_free_pages": sum(r.num_free_pages for r in loads), "num_running": sum(r.num_running for r in loads),
            "num_waiting": sum(r.num_waiting for r in loads)}


async def wait_until_idle(app: str, base_url: str, headers: dict | None, num_replicas: int,
                          timeout_s: float = 60.0) -> float | None:
    """Seconds until every page is free, nothing runs and the router holds no slot; None on timeout."""
    start = time.monotonic()
    async with make_client(base_url, headers) as client:
        while time.monotonic() - start < timeout_s:
            try:
                pages = await asyncio.to_thread(pages_state, app)
                health = (await client.get("/health")).json()
                if (pages["num_replicas"] == num_replicas and pages["num_free_pages"] == pages["num_pages"]
                        and pages["num_running"] == pages["num_waiting"] == 0
                        and health.get("requests_in_flight") == 0 and health.get("requests_waiting") == 0):
                    return time.monotonic() - start
            except Exception:  # noqa: BLE001 - a controller or router being replaced: ask again
                pass
            await asyncio.sleep(0.25)
    return None
