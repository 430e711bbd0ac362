"""deployments/media_features.py all_or_none, how a request waits for its fetches and encodes: the
first error ends the others (cancelled and awaited) and is the answer; tests/test_serving.py
checks it through the app (a slow fetch closed after another image's 400)."""

from __future__ import annotations

import asyncio
import time

import pytest

from deployments.media_features import all_or_none
from pipeline.errors import IrisError, bad_request


def test_the_first_error_cancels_the_others_at_once():
    stopped = []

    async def slow(i):
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            stopped.append(i)
            raise

    async def bad(delay, name):
        await asyncio.sleep(delay)
        raise bad_request(name)

    async def main():
        started = time.monotonic()
        with pytest.raises(IrisError, match="first"):
            await all_or_none([slow(0), bad(0.01, "first"), bad(0.5, "second"), slow(1)])
        return time.monotonic() - started

    assert asyncio.run(main()) < 1 and sorted(stopped) == [0, 1]


def test_results_in_order_and_a_cancelled_waiter_cancels_them_all():
    stopped = []

    async def value(i, delay):
        try:
            await asyncio.sleep(delay)
        except asyncio.CancelledError:
            stopped.append(i)
            raise
        return i

    async def main():
        assert await all_or_none([value(0, 0.02), value(1, 0), value(2, 0.01)]) == [0, 1, 2]
        assert await all_or_none([]) == []
        waiter = asyncio.ensure_future(all_or_none([value(3, 30), value(4, 30)]))
        await asyncio.sleep(0.01)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter

    asyncio.run(main())
    assert sorted(stopped) == [3, 4]
