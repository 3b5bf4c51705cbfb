"""Helpers shared by the Ray Serve test modules."""

from __future__ import annotations

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
