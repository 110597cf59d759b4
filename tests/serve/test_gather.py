"""gti.serve.gather.Gatherer: requests that arrive while a decode runs are gathered into the next
single call, up to max_batch_size; results reach their callers; an error reaches its batch only."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from gti.serve.gather import Gatherer


class SlowDecode:
    """fn for a Gatherer: records each call's items, sleeps `secs` (a decode), doubles them."""

    def __init__(self, secs: float = 0.2, fail_on: int | None = None) -> None:
        self.calls: list[list[int]] = []
        self.secs, self.fail_on = secs, fail_on
        self.threads: set[int] = set()

    def __call__(self, items: list[int]) -> list[int]:
        self.calls.append(list(items))
        self.threads.add(threading.get_ident())
        time.sleep(self.secs)
        if self.fail_on is not None and self.fail_on in items:
            raise ValueError(f"bad item {self.fail_on}")
        return [2 * i for i in items]


def test_requests_arriving_during_a_decode_share_the_next_one():
    fn = SlowDecode()

    async def main():
        g = Gatherer(fn, max_batch_size=16, wait_s=0.0)
        first = asyncio.create_task(g(0))
        await asyncio.sleep(0.05)  # the first decode is running
        rest = [asyncio.create_task(g(i)) for i in range(1, 9)]
        return await asyncio.gather(first, *rest)

    out = asyncio.run(main())
    assert out == [2 * i for i in range(9)]  # each caller gets its own result
    assert fn.calls == [[0], list(range(1, 9))]  # one decode for the 8 that queued meanwhile
    assert threading.get_ident() not in fn.threads  # decodes run off the event loop


def test_batches_are_capped_at_max_batch_size_in_arrival_order():
    fn = SlowDecode(secs=0.05)

    async def main():
        g = Gatherer(fn, max_batch_size=3, wait_s=0.0)
        return await asyncio.gather(*(g(i) for i in range(7)))

    assert asyncio.run(main()) == [2 * i for i in range(7)]
    assert fn.calls == [[0, 1, 2], [3, 4, 5], [6]]


def test_wait_lets_requests_arriving_together_join_the_first_batch():
    fn = SlowDecode(secs=0.01)

    async def main(wait_s):
        g = Gatherer(fn, max_batch_size=8, wait_s=wait_s)

        async def late(i):
            await asyncio.sleep(0.02)
            return await g(i)
        return await asyncio.gather(g(0), late(1), late(2))

    asyncio.run(main(0.2))
    assert fn.calls == [[0, 1, 2]]
    fn.calls.clear()
    asyncio.run(main(0.0))
    assert fn.calls[0] == [0] and sum(len(c) for c in fn.calls) == 3


def test_a_full_batch_does_not_wait_out_the_timeout():
    fn = SlowDecode(secs=0.0)

    async def main():
        g = Gatherer(fn, max_batch_size=3, wait_s=30.0)

        async def late(i):
            await asyncio.sleep(0.02)
            return await g(i)
        t = time.perf_counter()
        out = await asyncio.gather(g(0), late(1), late(2))
        return out, time.perf_counter() - t

    out, secs = asyncio.run(main())
    assert out == [0, 2, 4] and fn.calls == [[0, 1, 2]]
    assert secs < 5.0  # the third request filled the batch: no 30 s wait


def test_an_error_reaches_its_batch_only_and_the_next_batch_is_decoded():
    fn = SlowDecode(secs=0.1, fail_on=2)

    async def main():
        g = Gatherer(fn, max_batch_size=2, wait_s=0.0)
        res = await asyncio.gather(*(g(i) for i in range(5)), return_exceptions=True)
        return res, await g(10)

    res, later = asyncio.run(main())
    assert res[:2] == [0, 2] and res[4] == 8
    assert all(isinstance(r, ValueError) and "bad item 2" in str(r) for r in res[2:4])
    assert later == 20


def test_max_batch_size_must_be_positive():
    with pytest.raises(ValueError, match="max_batch_size"):
        Gatherer(SlowDecode(), max_batch_size=0, wait_s=0.0)


def test_a_batch_counts_sizes_not_items_and_never_splits_one():
    """Items of several units (a request's histories): a batch holds at most max_batch_size
    units in arrival order; an item larger than that goes alone, whole."""
    fn = SlowDecode(secs=0.05)

    async def main():
        g = Gatherer(fn, max_batch_size=4, wait_s=0.0, size=lambda i: i)
        return await asyncio.gather(*(g(i) for i in (1, 2, 3, 9, 1, 1, 2)))

    assert asyncio.run(main()) == [2, 4, 6, 18, 2, 2, 4]
    assert fn.calls == [[1, 2], [3], [9], [1, 1, 2]]
    assert all(sum(c) <= 4 for c in fn.calls if len(c) > 1)


def test_the_wait_ends_when_the_sizes_fill_the_batch():
    fn = SlowDecode(secs=0.0)

    async def main():
        g = Gatherer(fn, max_batch_size=6, wait_s=30.0, size=lambda i: 3)

        async def late(i):
            await asyncio.sleep(0.02)
            return await g(i)
        t = time.perf_counter()
        out = await asyncio.gather(g(0), late(1))
        return out, time.perf_counter() - t

    out, secs = asyncio.run(main())
    assert out == [0, 2] and fn.calls == [[0, 1]] and secs < 5.0  # two items of 3 fill 6: no 30 s wait
