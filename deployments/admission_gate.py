"""A router's admission under the controller: what the controller's state does to the admission line,
and the waits and refusals a request meets there before it reaches an engine replica.

``steer`` is the one rule for both the server's router and the fleet simulator (``fleet.py``): the
in-flight slots are ``max_in_flight`` scaled by the controller's ``admission_limit``; while the
controller has closed admission (heavy watermark) the line is held, except for arrivals more
important than the least important request running on any replica, since its replica may displace
that request for them.

``AdmissionGate`` is the router's side of it: it polls the controller (``ControllerLink``), and for
each request refuses at once what would be refused anyway (503 with admission closed and
``heavy_watermark_action`` "refuse", 429 with the line full), or waits for a slot: while held at most
until the request's TTFT target has passed, then 503 + ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Callable, Iterable, Literal

from deployments import openai_protocol as oai
from deployments.admission import AdmissionQueue, QueueFull
from deployments.controller_link import ControllerLink


def steer(admission: AdmissionQueue, max_in_flight: int, admission_limit: float | None, held: bool,
          running_priorities: Iterable[float | None]) -> None:
    """Apply the controller's state to ``admission``: ``admission_limit`` (None: leave the slots as
    they are) of ``max_in_flight`` slots, held or not, and the priority value an arrival must beat to
    pass a hold (the largest value running on any replica; -inf: none running)."""
    if admission_limit is not None:
        limit = max(1, round(max_in_flight * admission_limit))
        if limit != admission.max_in_flight:
            admission.resize(limit)
    values = [p for p in running_priorities if p is not None]
    pass_below = float(max(values)) if values else -math.inf
    if (held, pass_below) != (admission.held, admission.pass_below):
        admission.hold(held, pass_below)


class AdmissionGate:
    """The router's admission line steered by the controller's state (see the module's docstring)."""

    def __init__(self, admission: AdmissionQueue, link: ControllerLink, max_in_flight: int,
                 heavy_watermark_action: Literal["hold", "refuse"], poll_interval_s: float,
                 on_rejected: Callable[[], None]) -> None:
        self.admission, self.link = admission, link
        self.max_in_flight, self.action, self.poll_interval_s = max_in_flight, heavy_watermark_action, poll_interval_s
        self.on_rejected = on_rejected  # counts a refusal (the router's metrics)

    async def poll(self, on_state: Callable[[object], None]) -> None:
        """Forever: read the controller's state and steer the line by it; ``on_state(state)`` for the
        rest of what the state carries (the adapters)."""
        while True:
            state = await self.link.poll()
            if state is not None:
                on_state(state)
            held = self.holds_when_closed and not self.link.is_admission_open()  # a silent controller: not held
            known = self.link.state  # the last state that came, when this poll failed
            replicas = known.replicas.values() if known is not None else ()
            steer(self.admission, self.max_in_flight, state.admission_limit if state is not None else None, held,
                  (r.max_running_priority for r in replicas))
            await asyncio.sleep(self.poll_interval_s)

    @property
    def holds_when_closed(self) -> bool:
        return self.action == "hold"

    def refuses_at_once(self) -> bool:
        """Admission is closed and this router answers 503 at once ("refuse") instead of holding."""
        return not self.holds_when_closed and not self.link.is_admission_open()

    def closed(self) -> oai.APIError:
        return oai.APIError("the server is at its memory limit and admits no new requests; retry later",
                            status=503, type="server_overloaded", code="admission_closed",
                            retry_after_s=self.link.retry_after_s())

    def queue_full(self, why: str) -> oai.APIError:
        return oai.APIError(f"too many requests are waiting: {why}; retry later", status=429,
                            type="rate_limit_exceeded", code="queue_full", retry_after_s=self.link.retry_after_s())

    def refuse_if_saturated(self) -> None:
        """Refuse an HTTP request before its body is read, parsed and tokenised when it would be refused
        anyway: under overload the router's CPU then goes to the requests it can take, and a refusal
        comes back at once instead of after the backlog (measured: docs/benchmarks.md, "Reliability")."""
        error = self.closed() if self.refuses_at_once() else (
            self.queue_full(f"{self.admission.num_waiting} requests are already waiting for admission")
            if self.admission.is_full else None)
        if error is not None:
            self.link.count_arrival()  # demand for the controller's predictor too
            self.on_rejected()
            raise error

    async def acquire(self, ticket) -> None:
        """An in-flight slot. While admission is held (closed by the controller), wait at most until the
        request's TTFT target has passed: it has missed that target by then, and a 503 with
        ``Retry-After`` tells its client more than a late answer would."""
        try:
            while self.admission.is_held(ticket):
                remaining = ticket.deadline - time.monotonic()
                if remaining <= 0:
                    raise self.closed()
                try:
                    await asyncio.wait_for(self.admission.acquire(ticket), remaining)
                    return
                except TimeoutError:
                    continue  # still held: refused above; reopened just now: waits as usual below
            await self.admission.acquire(ticket)
        except QueueFull as exc:
            raise self.queue_full(str(exc)) from None
