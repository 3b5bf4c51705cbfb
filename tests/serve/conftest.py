"""Ray fixtures: one local Ray instance for the test session, and Ray Serve on it."""

from __future__ import annotations

import os

import pytest


# Ray --------------------------------------------------------------------------------------------
def _remove_stale_ray_pointer() -> None:
    """A ``ray_current_cluster`` file left by a dead cluster makes the next start hang: drop it
    unless its address still answers."""
    import socket
    import tempfile

    path = os.path.join(os.environ.get("RAY_TMPDIR", tempfile.gettempdir()), "ray", "ray_current_cluster")
    try:
        host, _, port = open(path).read().strip().rpartition(":")
    except OSError:
        return
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
    except (OSError, ValueError):
        os.remove(path)


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance for the whole test session (2 CPUs, no dashboard), shut down at the end."""
    ray = pytest.importorskip("ray")
    _remove_stale_ray_pointer()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def serve_url(ray_session) -> str:
    """Ray Serve on this session's Ray instance, HTTP on a free local port; returns its base URL."""
    import socket

    from ray import serve

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return f"http://127.0.0.1:{port}"
