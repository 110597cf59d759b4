"""Concurrent requests gathered into one decode, the batch formed when the decoder is free.

What it is for: a replica's constrained beam search is compute-bound on CPU (seconds per call).
Ray Serve's `@serve.batch` forms a batch when its first request arrives even while the previous
batch is still decoding, so under load the batches queue up small, one behind the other
(bench/serve/RESULTS.md, "gti serve on an idle machine"). `Gatherer` forms the next batch only
when the decoder is free: everything queued by then, up to `max_batch_size`, goes into one call.

What it does not know: Serve, models, what an item is. One decode at a time per Gatherer, in a
worker thread (the event loop keeps taking requests meanwhile).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class Gatherer(Generic[T, R]):
    """`await gatherer(item)` -> `fn([..., item, ...])[its index]`; `fn` maps a list of items
    to a list of results of the same length and runs in a worker thread. A batch holds items of
    at most `max_batch_size` in all, each counted `size(item)` (default 1; a replica: the
    histories of a request, so 16 requests of 64 histories are not one batch of 1,024). An item
    is never split, and one larger than `max_batch_size` alone goes into a batch of its own.
    Items are taken in arrival order: the batch ends at the first one that does not fit. A
    batch waits at most `wait_s` to fill (no wait once it is full)."""

    def __init__(self, fn: Callable[[list[T]], Sequence[R]], max_batch_size: int, wait_s: float,
                 size: Callable[[T], int] | None = None) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.fn, self.max_batch_size, self.wait_s = fn, int(max_batch_size), max(float(wait_s), 0.0)
        self.size = size or (lambda item: 1)
        self._queue: list[tuple[T, asyncio.Future, int]] = []
        self._queued = 0  # the queue's total size
        self._worker: asyncio.Task | None = None
        self._full: asyncio.Event | None = None  # set when the queue reaches max_batch_size

    async def __call__(self, item: T) -> R:
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        n = max(1, int(self.size(item)))
        self._queue.append((item, fut, n))
        self._queued += n
        if self._full is not None and self._queued >= self.max_batch_size:
            self._full.set()
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._drain())
        return await fut

    async def _drain(self) -> None:
        """Decode batches until the queue is empty (a new request then starts a new drain)."""
        while self._queue:
            if self._queued < self.max_batch_size and self.wait_s > 0:
                await self._fill()
            batch = [(item, fut) for item, fut in self._take() if not fut.cancelled()]
            if batch:
                await self._decode(batch)

    def _take(self) -> list[tuple[T, asyncio.Future]]:
        """The next batch off the queue: items in arrival order while their sizes fit in
        `max_batch_size` (the first item always: a larger one goes alone)."""
        n = total = 0
        for _, _, size in self._queue:
            if n and total + size > self.max_batch_size:
                break
            n, total = n + 1, total + size
        batch = [(item, fut) for item, fut, _ in self._queue[:n]]
        del self._queue[:n]
        self._queued -= total
        return batch

    async def _fill(self) -> None:
        """Let requests arriving together join: wait `wait_s`, or less if the batch fills."""
        self._full = asyncio.Event()
        try:
            await asyncio.wait_for(self._full.wait(), self.wait_s)
        except asyncio.TimeoutError:
            pass
        finally:
            self._full = None

    async def _decode(self, batch: list[tuple[T, asyncio.Future]]) -> None:
        try:
            results: Any = await asyncio.to_thread(self.fn, [item for item, _ in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"decode returned {len(results)} results for {len(batch)} requests")
        except Exception as err:  # noqa: BLE001 - every request of the batch gets the error
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(err)
            return
        for (_, fut), res in zip(batch, results):
            if not fut.done():
                fut.set_result(res)
