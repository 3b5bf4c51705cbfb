"""Helpers shared by the Ray Serve test modules."""

from __future__ import annotations

import json
import time


def wait_until(check, what: str, timeout: float = 30.0, interval: float = 0.1):
    """Poll ``check()`` until it returns something truthy; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting until {what}")


def load_report(**fields):
    """A replica's ``LoadReport`` with plausible values for the fields a test does not care about."""
    from deployments.wire import LoadReport

    defaults = dict(replica_id="r", actor_name="SERVE_REPLICA::r", model="m", time=time.time(), num_pages=128,
                    num_free_pages=128, num_pending_pages=0, tokens_per_kv_page=16, hidden_allowed=True,
                    cache_ratio=0.0, num_running=0, num_waiting=0, max_num_seqs=16, max_model_len=2048,
                    step_time_ms=0.0, seed=0, num_requests=0, num_aborted=0)
    return LoadReport(**{**defaults, **fields})


def sse_payloads_from(lines) -> list:
    """The ``data:`` payloads of server-sent event lines (JSON decoded, ``[DONE]`` as is)."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def sse_payloads(response) -> list:
    """The payloads of an ``httpx`` streaming response."""
    return sse_payloads_from(response.iter_lines())


def assert_openai_error(response, status: int | None = None) -> dict:
    """An OpenAI error body (``{"error": {message, type, param, code}}``) with a 4xx/5xx status."""
    assert 400 <= response.status_code < 600, response.text
    if status is not None:
        assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error
