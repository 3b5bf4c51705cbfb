"""Token streams across Ray: merge what piled up while the transport was busy.

A Ray streaming call costs a few milliseconds per item, more than one decode step of a small model,
so a stream of one item per token falls further and further behind the engine (measured here: 2,000
tokens took 12 s to arrive through two hops while the engine made them in 2 s). ``coalesced``
reads its source in a task and yields, each time the consumer asks, everything that arrived since
the last item, merged into one: one token per item while the consumer keeps up, a few per item when
it does not, so a client is never more than about one transport delay behind the engine. (Token
streams merge with ``deployments.wire.StreamItem.merge``.)
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import AsyncIterator, Callable, TypeVar

T = TypeVar("T")


@dataclass
class _Failed:
    error: BaseException


_END = object()


async def coalesced(source: AsyncIterator[T], merge: Callable[[list[T]], T]) -> AsyncIterator[T]:
    """Items of ``source``, each yield merging all that arrived since the previous one. An error
    in ``source`` is raised after the items before it; closing this generator cancels ``source``."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump() -> None:
        try:
            async for item in source:
                queue.put_nowait(item)
            queue.put_nowait(_END)
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, in order
            queue.put_nowait(_Failed(exc))

    task = asyncio.create_task(pump())
    try:
        while True:
            batch = [await queue.get()]
            while not queue.empty():
                batch.append(queue.get_nowait())
            end = next((i for i, x in enumerate(batch) if x is _END or isinstance(x, _Failed)), len(batch))
            if end:
                yield merge(batch[:end])
            if end < len(batch):
                if isinstance(batch[end], _Failed):
                    raise batch[end].error
                return
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

