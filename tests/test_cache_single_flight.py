"""Single-flight: concurrent misses on one key compute once, across processes' caches too."""

import asyncio
import contextlib
import time

import pytest

from cache_service.keys import content_key
from tests.cache_fixtures import FINGERPRINT, assert_same_features, make_features


class CountingCompute:
    """A compute callback that records its calls and takes `delay` seconds."""

    def __init__(self, delay=0.2, fail=False):
        self.delay = delay
        self.fail = fail
        self.calls: list[list[int]] = []

    async def __call__(self, indexes):
        self.calls.append(list(indexes))
        await asyncio.sleep(self.delay)
        if self.fail:
            raise RuntimeError("compute failed")
        return [make_features(42) for _ in indexes]


async def test_eight_replicas_compute_once(make_cache, namespace):
    key = content_key(FINGERPRINT, b"popular image", namespace)
    caches = [make_cache() for _ in range(8)]  # separate instances, as on separate replicas
    compute = CountingCompute(delay=0.2)
    results = await asyncio.gather(*(c.get_or_compute_many([key], compute) for c in caches))
    assert len(compute.calls) == 1
    assert sum(r[0].computed for r in results) == 1
    assert all(r[0].shared for r in results)
    for [r] in results:
        assert_same_features(make_features(42), r.features)
    stats = [c.stats() for c in caches]
    assert sum(s["computations"] for s in stats) == 1
    assert sum(s["single_flight_waits"] for s in stats) == 7
    assert sum(s["single_flight_wait_timeouts"] for s in stats) == 0


async def test_concurrent_calls_in_one_process_compute_once(make_cache, namespace):
    key = content_key(FINGERPRINT, b"in-process", namespace)
    cache = make_cache()
    compute = CountingCompute(delay=0.1)
    results = await asyncio.gather(*(cache.get_or_compute_many([key], compute) for _ in range(8)))
    assert len(compute.calls) == 1
    assert [r[0].computed for r in results].count(True) == 1
    assert cache.stats()["single_flight_local_waits"] == 7
    assert cache.stats()["single_flight_waits"] == 0  # no Redis polling for our own computation


async def test_wait_timeout_computes_itself(make_cache, namespace, raw_redis):
    keys = [content_key(FINGERPRINT, bytes([i]), namespace) for i in range(2)]
    # A holder that never finishes: its lock on keys[1] stays for a minute.
    raw_redis.set(keys[1] + ":lock", "someone-else", px=60_000)
    cache = make_cache(single_flight_wait_s=0.3, single_flight_poll_s=0.02)
    compute = CountingCompute(delay=0.01)
    started = time.monotonic()
    results = await cache.get_or_compute_many(keys, compute)
    elapsed = time.monotonic() - started
    # First call for the key we locked, second for the one whose wait ran out.
    assert compute.calls == [[0], [1]]
    assert 0.3 <= elapsed < 2.0
    assert all(r.computed and r.shared for r in results)
    stats = cache.stats()
    assert stats["single_flight_waits"] == 1 and stats["single_flight_wait_timeouts"] == 1
    assert raw_redis.get(keys[1] + ":lock") == b"someone-else"  # not ours to release


async def test_failed_holder_hands_over_to_a_waiting_replica(make_cache, namespace):
    key = content_key(FINGERPRINT, b"flaky", namespace)
    holder, waiter = make_cache(), make_cache(single_flight_wait_s=5)
    failing = CountingCompute(delay=0.2, fail=True)
    working = CountingCompute(delay=0.01)
    holder_call = asyncio.ensure_future(holder.get_or_compute_many([key], failing))
    await asyncio.sleep(0.05)  # the holder has its lock by now
    started = time.monotonic()
    [result] = await waiter.get_or_compute_many([key], working)
    with pytest.raises(RuntimeError, match="compute failed"):
        await holder_call
    assert len(failing.calls) == 1 and len(working.calls) == 1
    assert result.computed
    assert time.monotonic() - started < 2.0  # took over on release, not after the 5 s wait
    assert waiter.stats()["single_flight_wait_timeouts"] == 0


async def test_joiners_compute_themselves_when_the_owner_fails(make_cache, namespace):
    key = content_key(FINGERPRINT, b"owner fails", namespace)
    cache = make_cache()
    failing = CountingCompute(delay=0.1, fail=True)
    working = CountingCompute(delay=0.01)
    owner = asyncio.ensure_future(cache.get_or_compute_many([key], failing))
    await asyncio.sleep(0.02)
    [result] = await cache.get_or_compute_many([key], working)
    with pytest.raises(RuntimeError):
        await owner
    assert result.computed and len(working.calls) == 1
    assert cache.stats()["single_flight_local_waits"] == 1


async def test_cancelled_owner_does_not_strand_joiners(make_cache, namespace, raw_redis):
    key = content_key(FINGERPRINT, b"cancelled", namespace)
    cache = make_cache()
    owner = asyncio.ensure_future(cache.get_or_compute_many([key], CountingCompute(delay=10)))
    await asyncio.sleep(0.05)
    joiner = asyncio.ensure_future(cache.get_or_compute_many([key], CountingCompute(delay=0.01)))
    await asyncio.sleep(0.02)
    owner.cancel()
    [result] = await asyncio.wait_for(joiner, 2)
    assert result.computed
    await cache.close()
    assert raw_redis.get(key + ":lock") is None


async def test_value_written_between_miss_and_claim_is_used(make_cache, namespace, raw_redis):
    key = content_key(FINGERPRINT, b"race", namespace)
    await make_cache().put_many([(key, make_features(7))])
    cache = make_cache()

    async def stale_lookup(keys):  # the miss happened just before another replica's write
        return [None] * len(keys)

    cache._lookup = stale_lookup
    compute = CountingCompute(delay=0.01)
    [result] = await cache.get_or_compute_many([key], compute)
    assert compute.calls == [] and not result.computed and result.shared
    assert result.features.meta["seed"] == 7
    assert raw_redis.exists(key + ":lock") == 0  # the lock taken by the claim was released


async def test_write_behind_returns_before_redis_and_replicas_still_compute_once(make_cache, namespace, raw_redis):
    key = content_key(FINGERPRINT, b"write behind", namespace)
    caches = [make_cache() for _ in range(4)]
    compute = CountingCompute(delay=0.2)
    results = await asyncio.gather(*(c.get_or_compute_many([key], compute, write_behind=True) for c in caches))
    assert len(compute.calls) == 1
    [owner] = [r for [r] in results if r.computed]
    assert not owner.shared  # its Redis write was still running when it returned
    for [r] in results:
        assert_same_features(make_features(42), r.features)
    for c in caches:
        await c.close()  # waits for the background write and lock release
    assert raw_redis.exists(key) and not raw_redis.exists(key + ":lock")


class Backlog:
    """A replica's queue of work (the encoder's fair gate) as `admit`: one caller at a time, and the
    test can hold the turn (`hold`) for a while, as other items ahead in the queue would."""

    def __init__(self):
        self.turn = asyncio.Semaphore(1)
        self.entered = 0

    @contextlib.asynccontextmanager
    async def admit(self):
        async with self.turn:
            self.entered += 1
            yield

    async def hold(self, seconds: float) -> None:
        async with self.turn:
            await asyncio.sleep(seconds)


async def test_lock_covers_the_computation_not_the_queue_before_it(make_cache, namespace, raw_redis):
    """A replica with a backlog longer than the single-flight wait and the lock TTL: it takes the key's
    lock only when its turn comes, so another replica computes meanwhile and the first finds the value."""
    key = content_key(FINGERPRINT, b"queued behind a backlog", namespace)
    settings = {"single_flight_wait_s": 0.3, "single_flight_poll_s": 0.02, "lock_ttl_s": 0.5}
    busy, idle = make_cache(**settings), make_cache(**settings)
    backlog = Backlog()
    holding = asyncio.ensure_future(backlog.hold(1.2))  # longer than the wait and the lock's TTL
    await asyncio.sleep(0)
    compute = CountingCompute(delay=0.1)
    queued = asyncio.ensure_future(busy.get_or_compute_many([key], compute, admit=backlog.admit))
    await asyncio.sleep(0.05)
    assert not raw_redis.exists(key + ":lock")  # waiting for its turn holds no lock
    [computed] = await idle.get_or_compute_many([key], compute, admit=Backlog().admit)
    [found] = await queued
    await holding
    assert len(compute.calls) == 1
    assert computed.computed and not found.computed and found.shared
    assert_same_features(computed.features, found.features)
    assert busy.stats()["single_flight_wait_timeouts"] == idle.stats()["single_flight_wait_timeouts"] == 0


async def test_no_turn_taken_to_join_a_computation_in_this_process(make_cache, namespace):
    key = content_key(FINGERPRINT, b"joined", namespace)
    cache = make_cache()
    backlog = Backlog()
    compute = CountingCompute(delay=0.3)
    first = asyncio.ensure_future(cache.get_or_compute_many([key], compute, admit=backlog.admit))
    while not compute.calls:  # until it computes, in its turn
        await asyncio.sleep(0.01)
    holding = asyncio.ensure_future(backlog.hold(2.0))  # the queue is long now
    started = time.monotonic()
    [joined] = await cache.get_or_compute_many([key], compute, admit=backlog.admit)
    assert time.monotonic() - started < 1.0  # the computation's end, not the queue's
    await first
    assert len(compute.calls) == 1 and backlog.entered == 1 and not joined.computed
    holding.cancel()


async def test_write_behind_says_when_the_value_is_stored(make_cache, namespace, raw_redis):
    key = content_key(FINGERPRINT, b"stored later", namespace)
    [result] = await make_cache().get_or_compute_many([key], CountingCompute(delay=0.01), write_behind=True)
    assert result.computed and not result.shared
    assert await asyncio.wait_for(result.stored, 5) is True
    assert raw_redis.exists(key)
    unreachable = make_cache(redis_url="redis://127.0.0.1:1")
    [result] = await unreachable.get_or_compute_many([key + "x"], CountingCompute(delay=0.01), write_behind=True)
    assert await asyncio.wait_for(result.stored, 5) is False
