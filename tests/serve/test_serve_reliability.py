"""Reliability through Ray Serve, the fast variants of the scenarios of
``apt_serve_ray/bench/reliability.py`` (``benchmarks/reliability.py`` runs them whole): overload
(10x the sustainable rate), streams cut at random points, the controller and a router replica killed
under load. The promises: the excess is refused with 429/503, ``Retry-After`` and an OpenAI error
body; every accepted request completes; no request hangs (a stream the killed router held ends with
its connection broken); every page comes back; a killed replica is replaced while the others keep
serving.

One app for the module (one engine replica, two routers); each test waits until it is idle again.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from serve_helpers import wait_until

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

APP = "apt-reliability"


@pytest.fixture(scope="module")
def target(serve_url, opt_tiny):
    from ray import serve

    from apt_serve_ray.bench.reliability import Target, app_args, pages_state
    from deployments.app import build_app

    serve.run(build_app(app_args(opt_tiny, num_routers=2)), name=APP, route_prefix="/")
    wait_until(lambda: pages_state(APP)["num_replicas"] == 1, "the engine replica reports", timeout=60)
    yield Target(serve_url, APP, opt_tiny)
    serve.delete(APP)


def idle(target) -> None:
    from apt_serve_ray.bench.reliability import wait_until_idle

    assert asyncio.run(wait_until_idle(target.app, target.base_url, target.headers, 1, timeout_s=60)) is not None


def test_overload_refuses_the_excess_and_every_accepted_request_completes(target):
    from apt_serve_ray.bench.reliability import overload

    result = asyncio.run(overload(target, duration_s=5.0, factor=10.0, calibration_requests=24, bursts=2))
    assert result["rejected"] > 0 and result["completed"] > 0, result
    assert result["lost"] == result["dropped"] == result["bad_rejection"] == result["failed"] == 0, result
    assert result["completed"] == result["accepted"], result
    assert set(result["rejected_by_code"]) <= {"queue_full", "admission_closed"}, result
    assert result["pages_free"] == result["pages"] and None not in result["pages_free_after_s"], result
    assert None not in result["recovery_s"], result
    # Memory is bounded by the queues, not by the offered load: a second burst adds little to it (the
    # allocators keep some of what a burst took; measured +0.5% and +7% over 60-s bursts, a leak of
    # the refused requests would be far more).
    first, second = result["rss_after_each_burst_mib"]
    assert second <= first * 1.10, result


def test_streams_cut_at_random_points_leave_no_page_or_slot_held(target):
    from apt_serve_ray.bench.reliability import streams_cut

    idle(target)
    result = asyncio.run(streams_cut(target, num_streams=100))
    assert result["cut"] + result["completed"] == 100 and result["lost"] == result["dropped"] == 0, result
    assert result["pages_free"] == result["pages"] and result["pages_free_after_s"] is not None, result
    # A stream cut after its first event was admitted, so its engine must abort it; a few finish in the
    # engine before the abort arrives (an event can carry several tokens; CI saw 73 aborts of 74). Those
    # cut while waiting for the headers may never have reached an engine, so they are not counted.
    assert result["aborted_in_engines"] >= 0.9 * result["cut_in_stream"] > 0, result


def test_killed_controller_routers_keep_serving_and_it_is_replaced(target):
    from apt_serve_ray.bench.reliability import kill_during_load

    idle(target)
    long = dataclasses.replace(target, max_tokens=256)  # more requests in flight at the kill
    result = asyncio.run(kill_during_load(long, "Controller", rate=3.0, duration_s=10.0, kill_at_s=3.0))
    assert result["completed"] == result["sent"] > 0, result  # the routers serve on the last state
    assert result["replaced_after_s"] is not None, result


def test_killed_router_replica_is_replaced_and_no_request_hangs(target):
    from apt_serve_ray.bench.reliability import kill_during_load

    idle(target)
    long = dataclasses.replace(target, max_tokens=256)  # more requests in flight at the kill
    result = asyncio.run(kill_during_load(long, "Router", rate=3.0, duration_s=10.0, kill_at_s=3.0))
    assert result["lost"] == 0, result  # every request ended: completed, or its connection broke at once
    # Only streams the victim held at the kill may fail; Serve's proxy then drops the connection.
    assert result["sent"] - result["in_flight_at_kill"] <= result["completed"], result
    assert result["replaced_after_s"] is not None, result
    idle(target)
