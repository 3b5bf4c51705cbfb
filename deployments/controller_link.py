"""A router's link to the controller: the controller's last state, how fresh it is, and the arrivals
the router has received since its last poll (``ArrivalCount``, which the controller's traffic predictor
learns from). Counted before admission: a refused request is demand too. A controller gone silent does
not stop traffic: its last word on admission counts only while fresh."""

from __future__ import annotations

import asyncio
import logging
import time

from deployments.wire import ArrivalCount, ControllerState, EngineRequest

logger = logging.getLogger("ray.serve")

RETRY_AFTER_S = 2.0  # what a 429 suggests before the controller's state (with its own value) arrives


class ControllerLink:
    def __init__(self, controller, replica_id: str, poll_interval_s: float, output_horizon_tokens: int) -> None:
        self.controller, self.replica_id = controller, replica_id
        self.poll_interval_s, self.output_horizon_tokens = poll_interval_s, output_horizon_tokens
        self.state: ControllerState | None = None
        self.state_time = 0.0
        self._arrivals = [0, 0, 0]  # requests, prompt tokens, output tokens (capped at the horizon)

    def count_arrival(self, request: EngineRequest | None = None) -> None:
        """One request received; None: refused before its body was read (its tokens are not known)."""
        self._arrivals[0] += 1
        if request is not None:
            horizon = self.output_horizon_tokens
            self._arrivals[1] += request.num_prompt_tokens or 0
            self._arrivals[2] += min(request.max_tokens or horizon, horizon)

    async def poll(self) -> ControllerState | None:
        """Send the arrivals since the last poll and take the controller's state; None when the call
        failed (the arrivals then go with the next poll, and the last state stands)."""
        counts, self._arrivals = self._arrivals, [0, 0, 0]
        try:
            arrivals = ArrivalCount(self.replica_id, *counts) if counts[0] else None
            self.state = await asyncio.wait_for(self.controller.get_state.remote(arrivals), timeout=5)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - keep serving on the last known state
            self._arrivals = [a + b for a, b in zip(self._arrivals, counts)]
            logger.warning("router: controller poll failed: %r", exc)
            return None
        self.state_time = time.monotonic()
        return self.state

    def is_admission_open(self) -> bool:
        """Closed only on the controller's word; a controller gone silent does not stop traffic."""
        fresh = time.monotonic() - self.state_time < max(5.0, 20 * self.poll_interval_s)
        return not fresh or self.state is None or self.state.admission_open

    def known_replicas(self) -> list[str]:
        return sorted(self.state.replicas) if self.state is not None else []

    def retry_after_s(self) -> float:
        return self.state.retry_after_s if self.state is not None else RETRY_AFTER_S
