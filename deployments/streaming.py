"""Token streams across Ray: merge what piled up while the transport was busy.

A Ray streaming call costs a few milliseconds per item, more than one decode step of a small model,
so a stream of one item per token falls further and further behind the engine (measured here: 2,000
tokens took 12 s to arrive through two hops while the engine made them in 2 s). ``coalesced``
reads its source in a task and yields, each time the consumer asks, everything that arrived since
the last item, merged into one: one token per item while the consumer keeps up, a few per item when
it does not, so a client is never more than about one transport delay behind the engine. (Token
streams merge with ``deployments.wire.StreamItem.merge``.)

``min_interval_s`` paces the items as well (like vLLM's ``stream_interval``, but in time): after an
item, the next waits until that much time has passed, so that a fast consumer too gets the tokens of
several engine steps per item. Each Ray item costs CPU in the replica, the router and the proxy
alike; on a 2-core machine, streaming one item per decode step took more CPU than the two engines
(docs/benchmarks.md, issue 14). The end of the stream and an error are never held back. The interval
may be a function, asked again before every item (the replica widens it with the number of streams
it is serving: ``EngineReplica._interval_s``).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, TypeVar

T = TypeVar("T")


@dataclass
class _Failed:
    error: BaseException


_END = object()


async def coalesced(source: AsyncIterator[T], merge: Callable[[list[T]], T],
                    min_interval_s: float | Callable[[], float] = 0.0) -> AsyncIterator[T]:
    """Items of ``source``, each yield merging all that arrived since the previous one, at most one
    per ``min_interval_s`` (counted from the call, then from each yield; a callable is asked before
    each item) unless the source ends. An error in ``source`` is raised after the items before it;
    closing this generator cancels ``source``."""
    interval = min_interval_s if callable(min_interval_s) else (lambda: min_interval_s)
    if interval() < 0:
        raise ValueError(f"min_interval_s: must be >= 0, got {interval()}")
    queue: asyncio.Queue = asyncio.Queue()
    ended = asyncio.Event()

    async def pump() -> None:
        try:
            async for item in source:
                queue.put_nowait(item)
            queue.put_nowait(_END)
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, in order
            queue.put_nowait(_Failed(exc))
        ended.set()

    task = asyncio.create_task(pump())
    last = time.monotonic()
    try:
        while True:
            batch = [await queue.get()]
            wait_s = last + interval() - time.monotonic()
            if wait_s > 0 and not ended.is_set():
                try:  # let more pile up, but not past the end of the stream
                    await asyncio.wait_for(ended.wait(), wait_s)
                except asyncio.TimeoutError:
                    pass
            while not queue.empty():
                batch.append(queue.get_nowait())
            end = next((i for i, x in enumerate(batch) if x is _END or isinstance(x, _Failed)), len(batch))
            if end:
                yield merge(batch[:end])
                last = time.monotonic()
            if end < len(batch):
                if isinstance(batch[end], _Failed):
                    raise batch[end].error
                return
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def stream_interval(base_s: float, num_streams: int, items_per_s: float | None, tbt_slo_ms: float) -> float:
    """Seconds a stream item waits for more tokens: ``base_s``, or ``num_streams / items_per_s`` when
    that is longer (the replica's streams together send at most ``items_per_s`` items a second), and
    never more than a quarter of the request's TBT target, so pacing alone cannot cost it that target.

    Measured on 2 cores (docs/benchmarks.md, issue 14): with ``base_s`` 0.05 s alone, on/off 1 <-> 14
    req/s passed 31-98% over five runs (once a backlog formed, the Serve path's items took the engines'
    CPU and it stayed); with 50 items a second per replica, 98% in all three."""
    interval = base_s if items_per_s is None else max(base_s, num_streams / items_per_s)
    return min(interval, 0.25e-3 * tbt_slo_ms)
