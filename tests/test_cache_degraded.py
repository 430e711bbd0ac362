"""Degraded mode: a dead or frozen Redis never fails a cache call; the cache recovers."""

import asyncio
import logging
import signal
import time

from bench.harness.redis_servers import RedisProcess
from cache_service.keys import content_key
from tests.cache_fixtures import (
    FINGERPRINT,
    assert_same_features,
    free_port,
    make_features,
)

FAST_BACKOFF = {"backoff_initial_s": 0.05, "backoff_max_s": 0.2, "redis_timeout_s": 0.25}


async def wait_until(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_redis_killed_then_restarted(make_cache, namespace, redis_process, caplog):
    keys = [content_key(FINGERPRINT, bytes([i]), namespace) for i in range(3)]
    cache = make_cache(redis_url=redis_process.url, **FAST_BACKOFF)
    assert await cache.put_many([(keys[0], make_features(0))]) == [True]

    redis_process.kill()
    caplog.set_level(logging.WARNING, logger="cache_service")
    started = time.monotonic()
    # No call raises; L1 still serves what it holds.
    [hit, miss] = await cache.get_many([keys[0], keys[1]])
    assert hit is not None and hit.meta["seed"] == 0 and miss is None
    assert not cache.redis_available
    assert await cache.put_many([(keys[1], make_features(1))]) == [False]
    assert await cache.contains_many([keys[1], keys[2]]) == [True, False]  # L1 only
    results = await cache.get_or_compute_many([keys[2]], lambda idx: _compute(idx, 2))
    assert results[0].computed and not results[0].shared
    assert time.monotonic() - started < 1.0  # failing fast, not waiting on the dead server
    stats = cache.stats()
    assert stats["degraded_transitions"] == 1 and stats["degraded"] == 1
    assert stats["l2_skipped"] >= 1
    warnings = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(warnings) == 1  # logged once, not per call

    redis_process.start()  # same port
    await wait_until(lambda: cache.redis_available)
    assert await cache.put_many([(keys[2], make_features(2))]) == [True]
    fresh = make_cache(redis_url=redis_process.url)
    [got] = await fresh.get_many([keys[2]])
    assert_same_features(make_features(2), got)
    stats = cache.stats()
    assert stats["reconnects"] == 1 and stats["degraded"] == 0 and stats["degraded_transitions"] == 1


async def _compute(indexes, seed):
    return [make_features(seed) for _ in indexes]


async def test_frozen_redis_times_out_into_degraded_mode(make_cache, namespace, redis_process):
    key = content_key(FINGERPRINT, b"frozen", namespace)
    cache = make_cache(redis_url=redis_process.url, **FAST_BACKOFF)
    assert await cache.put_many([(key, make_features(7))]) == [True]
    cache_reader = make_cache(redis_url=redis_process.url, **FAST_BACKOFF)
    redis_process.proc.send_signal(signal.SIGSTOP)  # accepts connections, never answers
    try:
        # Each read is a miss within its timeout; once the timeouts have gone on for twice the
        # timeout (no reply in between), Redis is down and reads stop waiting on it.
        for _ in range(4):
            started = time.monotonic()
            assert await cache_reader.get_many([key]) == [None]
            assert time.monotonic() - started < 0.6
        assert cache_reader.stats()["degraded_transitions"] == 1 and not cache_reader.redis_available
        started = time.monotonic()
        assert await cache_reader.get_many([key]) == [None]
        assert time.monotonic() - started < 0.05
    finally:
        redis_process.proc.send_signal(signal.SIGCONT)
    await wait_until(lambda: cache_reader.redis_available)
    [got] = await cache_reader.get_many([key])
    assert got is not None and got.meta["seed"] == 7


async def test_unreachable_from_the_start(make_cache, namespace):
    cache = make_cache(redis_url=f"redis://127.0.0.1:{free_port()}/0", **FAST_BACKOFF)
    key = content_key(FINGERPRINT, b"x", namespace)
    assert await cache.get_many([key]) == [None]
    assert await cache.put_many([(key, make_features())]) == [False]
    assert (await cache.get_many([key]))[0] is not None
    assert cache.stats()["degraded"] == 1


async def test_full_redis_fails_writes_without_degrading(make_cache, namespace, caplog):
    # maxmemory with the default noeviction policy: every write is refused (OOM).
    server = RedisProcess(free_port(), "--maxmemory", "1mb")
    server.start()
    try:
        cache = make_cache(redis_url=server.url)
        caplog.set_level(logging.WARNING, logger="cache_service")
        keys = [content_key(FINGERPRINT, bytes([i]), namespace) for i in range(3)]
        for key in keys:
            assert await cache.put_many([(key, make_features(tokens=1024, hidden=512))]) == [False]
        stats = cache.stats()
        assert stats["l2_errors"] == 3 and stats["degraded_transitions"] == 0
        assert cache.redis_available
        assert all(f is not None for f in await cache.get_many(keys))  # L1 still serves
        assert len([r for r in caplog.records if "maxmemory" in r.getMessage()]) == 1  # rate-limited
    finally:
        server.kill()


async def test_ping_reports_reachability():
    from cache_service.config import CacheConfig
    from cache_service.feature_cache import FeatureCache

    down = FeatureCache(CacheConfig(redis_url=f"redis://127.0.0.1:{free_port()}/0"))
    assert await down.ping() is False
    assert down.stats()["degraded"] == 1
    await down.close()
    up = FeatureCache(CacheConfig())
    assert await up.ping() is True
    await up.close()
