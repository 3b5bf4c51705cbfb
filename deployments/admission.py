"""Admission order at the router: while the engines are saturated, requests wait here and are let
through in the order of the adaptive score, not first-come-first-served.

A request's score is the density of the value model the adaptive policy uses
(``apt_serve_ray/scheduler/value.py``), with the time it has waited here as its pending time::

    value   = time_weight * waited_s + slo_weight * urgency + priority_weight * importance
    density = value / pages ** memory_weight

``urgency`` rises from 0 to 1 over the last ``slack_s`` seconds before the request's TTFT deadline
(by default its whole TTFT target, as in the engine: ``Candidates.gather``);
``importance`` is how many priority levels it is ahead of the least important waiting request
(lower ``priority`` = more important, as in vLLM). Ties go to the earliest arrival, and a request
that has waited ``max_wait_s`` goes before every scored one, so a large request cannot starve.

A request that can no longer meet its TTFT target keeps ``fairness_penalty`` of its value, as in the
engine (``value.py``): here "can no longer" means it would pass its deadline even if let through now,
``now + expected_ttft_s > deadline``, where ``expected_ttft_s`` is what an admitted request has been
taking to its first token (a moving average; the router reports each one, ``observe_ttft``). Without it,
the oldest request went first, and under a backlog longer than the TTFT target the oldest have
missed already: FIFO served only requests that had missed while the ones that could still pass
waited until they had missed too, and attainment collapsed at every peak the engines could not keep
up with (docs/benchmarks.md, issue 14). They still go through when nobody who can pass is waiting,
or once they have waited ``max_wait_s``.
The weights and ``max_wait_s`` default to the engine's (``ValueWeights()``, ``MAX_WAIT_S``: the ``apt``
policy's defaults), so the router and the engines order requests by one value model; the app passes
the policy's weights when the operator sets them (``deployments/app.py``).

"Saturated" means this router already has ``max_in_flight`` requests on the engines (by default
every replica's ``max_num_seqs``): more would only queue inside an engine, where the router could
no longer choose the order. While the queue is *held* (the controller closed admission over the
heavy watermark and the app holds rather than refuses) no slot is granted at all: new requests wait
in the same line, and when the hold ends they go through in score order. No Ray here, so it is
tested without a cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from apt_serve_ray.scheduler.value import FAIRNESS_PENALTY, MAX_WAIT_S, ValueWeights, importance, urgency

ADMISSION_WEIGHTS = ValueWeights()  # the engine's value model's defaults
TTFT_SMOOTHING = 0.1  # weight of the newest sample in ``expected_ttft_s``


@dataclass
class Ticket:
    """What the admission order needs to know about one request."""

    num_pages: int
    ttft_slo_s: float
    priority: int = 0
    arrival: float = field(default_factory=time.monotonic)
    # A replica probably holds its prompt's leading pages and has free pages for the rest: the hold
    # over the heavy watermark does not keep it (it needs few new pages; refused, it would come back
    # and compute them all again).
    passes_hold: bool = False

    @property
    def deadline(self) -> float:
        return self.arrival + self.ttft_slo_s


class QueueFull(Exception):
    pass


class AdmissionQueue:
    def __init__(self, max_in_flight: int, max_queued: int, weights: ValueWeights = ADMISSION_WEIGHTS,
                 slack_s: float | None = None, max_wait_s: float = MAX_WAIT_S,
                 fairness_penalty: float = FAIRNESS_PENALTY, clock: Callable[[], float] = time.monotonic) -> None:
        if max_in_flight < 1 or max_queued < 0:
            raise ValueError(f"max_in_flight must be >= 1 and max_queued >= 0, got {max_in_flight}, {max_queued}")
        if not 0.0 < fairness_penalty <= 1.0:
            raise ValueError(f"fairness_penalty: must be in (0, 1], got {fairness_penalty!r}")
        self.max_in_flight, self.max_queued = max_in_flight, max_queued
        self.weights, self.slack_s, self.max_wait_s = weights, slack_s, max_wait_s
        self.fairness_penalty = fairness_penalty
        self.clock = clock  # the tickets' arrivals are on it (the fleet simulator's is simulated)
        self.expected_ttft_s = 0.0  # from admission to first token; the router keeps it current
        self.num_in_flight = 0
        self.held = False  # no slot is granted while held (``hold``) ...
        self.pass_below = -math.inf  # ... but to a request of a priority value below this (``hold``)
        # Arrival order; each with the call that grants it its slot (False: its caller has gone).
        self._waiting: list[tuple[Ticket, Callable[[], bool]]] = []

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def is_full(self) -> bool:
        """A new request would get ``QueueFull`` now."""
        return len(self._waiting) >= self.max_queued and (
            self.held or self.num_in_flight >= self.max_in_flight or bool(self._waiting))

    @contextlib.asynccontextmanager
    async def slot(self, ticket: Ticket):
        """Hold one in-flight slot for the body of the ``async with``; raises QueueFull at once when
        the waiting line is full."""
        await self.acquire(ticket)
        try:
            yield
        finally:
            self.release()

    def is_held(self, ticket: Ticket) -> bool:
        """Whether the hold keeps ``ticket`` waiting (a more important one than any running passes)."""
        return self.held and not ticket.priority < self.pass_below and not ticket.passes_hold

    async def acquire(self, ticket: Ticket) -> None:
        future = asyncio.get_running_loop().create_future()

        def grant() -> bool:
            if future.done():
                return False
            future.set_result(None)
            return True

        if self.offer(ticket, grant):
            return
        try:
            await future
        except asyncio.CancelledError:
            entry = next((e for e in self._waiting if e[1] is grant), None)
            if entry is not None:
                self._waiting.remove(entry)
            elif future.done() and not future.cancelled():
                self.release()  # granted just before the caller went away: pass the slot on
            raise

    def offer(self, ticket: Ticket, grant: Callable[[], bool]) -> bool:
        """``acquire`` without asyncio: True when the slot is taken now; else ``ticket`` waits in line
        (QueueFull when the line is full) and ``grant()`` is called when it gets its slot (returning
        False when its caller has gone, and the slot passes on). The fleet simulator calls this."""
        if (not self.is_held(ticket) and self.num_in_flight < self.max_in_flight
                and not any(not self.is_held(t) for t, _ in self._waiting)):
            self.num_in_flight += 1
            return True
        if len(self._waiting) >= self.max_queued:
            raise QueueFull(f"{len(self._waiting)} requests are already waiting for admission")
        self._waiting.append((ticket, grant))
        return False

    def release(self) -> None:
        self.num_in_flight -= 1
        self._grant()

    def resize(self, max_in_flight: int) -> None:
        """A new in-flight limit (the controller tightens it before a forecast peak): lowering it lets
        the requests in flight finish and holds new ones; raising it lets waiting ones through at once."""
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight: must be >= 1, got {max_in_flight}")
        self.max_in_flight = max_in_flight
        self._grant()

    def hold(self, held: bool, pass_below: float = -math.inf) -> None:
        """Hold new slots (the requests in flight go on), or let the line move again. While held, a
        request of a priority value below ``pass_below`` (more important than the least important one
        running) still goes through: the engine may displace a less important request for it (apt's
        priority preemption), which it cannot do for a request the router holds back."""
        self.held, self.pass_below = held, pass_below
        self._grant()

    def observe_ttft(self, seconds: float) -> None:
        """One admitted request's time from admission to its first token: a moving average of these is
        ``expected_ttft_s``."""
        self.expected_ttft_s += TTFT_SMOOTHING * (seconds - self.expected_ttft_s)

    def _grant(self) -> None:
        while self._waiting and self.num_in_flight < self.max_in_flight:
            eligible = [i for i, (t, _) in enumerate(self._waiting) if not self.is_held(t)]
            if not eligible:
                return
            now = self.clock()
            if now - self._waiting[eligible[0]][0].arrival >= self.max_wait_s:
                best = eligible[0]
            else:
                scores = self.scores(now)
                best = eligible[int(np.argmax(scores[eligible]))]  # argmax takes the first of equals: the earliest
            _, grant = self._waiting.pop(best)
            self.num_in_flight += 1
            if not grant():
                self.num_in_flight -= 1

    def scores(self, now: float | None = None) -> np.ndarray:
        """Density of every waiting request, in arrival order."""
        now = self.clock() if now is None else now
        tickets = [t for t, _ in self._waiting]
        w = self.weights
        waited = np.array([max(0.0, now - t.arrival) for t in tickets], dtype=np.float64)
        urg = None
        if w.slo_weight:
            slack = [t.ttft_slo_s for t in tickets] if self.slack_s is None else self.slack_s
            urg = urgency(now, [t.deadline for t in tickets], slack)
        imp = importance([t.priority for t in tickets]) if w.priority_weight else None
        missed = np.array([now + self.expected_ttft_s > t.deadline for t in tickets])
        value = w.value(waited, urg, imp, missed=missed, fairness_penalty=self.fairness_penalty)
        return w.density(value, np.array([t.num_pages for t in tickets], dtype=np.int64))
