"""How Iris's Redis clients tell an outage from a slow reply, and how the blocking reader (the
EC connector's, inside vLLM's scheduler) stays bounded while Redis is down. Private
redis-servers that the tests kill, freeze and slow down; no mocks."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import pytest
import redis

from cache_service.config import CacheConfig
from cache_service.keys import content_key
from cache_service.redis_client import connect_blocking, redacted
from cache_service.store_factory import blocking_reader
from tests.cache_fixtures import FINGERPRINT, make_features, private_redis

FAST = {"redis_timeout_s": 0.2, "redis_connect_timeout_s": 0.2, "backoff_initial_s": 0.5, "backoff_max_s": 1.0}


def timed(call):
    started = time.monotonic()
    result = call()
    return result, time.monotonic() - started


def test_blocking_reader_backs_off_once_redis_is_killed():
    with private_redis() as server:
        redis.Redis.from_url(server.url).set("k", b"v")
        read = blocking_reader(CacheConfig(redis_url=server.url, **FAST), "iris-test")
        assert read("k") == b"v"
        server.kill()
        assert timed(lambda: read("k"))[0] is None  # a connection error: down at once
        # Known down: no read asks Redis (each would cost a connect) until the backoff passes.
        results, elapsed = timed(lambda: [read("k") for _ in range(200)])
        assert results == [None] * 200 and elapsed < 0.05
        server.start()
        redis.Redis.from_url(server.url).set("k", b"again")
        assert read("k") is None  # still backing off
        time.sleep(0.55)
        assert read("k") == b"again"


def test_blocking_reader_takes_a_frozen_redis_for_down_after_repeated_timeouts():
    with private_redis() as server:
        redis.Redis.from_url(server.url).set("k", b"v")
        read = blocking_reader(CacheConfig(redis_url=server.url, **FAST), "iris-test")
        assert read("k") == b"v"
        server.proc.send_signal(signal.SIGSTOP)
        try:
            for _ in range(3):  # each a timeout, bounded by redis_timeout_s (no retries inside redis-py)
                value, elapsed = timed(lambda: read("k"))
                assert value is None and elapsed < 0.35
            results, elapsed = timed(lambda: [read("k") for _ in range(50)])
            assert results == [None] * 50 and elapsed < 0.05  # down: backing off
        finally:
            server.proc.send_signal(signal.SIGCONT)
        time.sleep(0.55)
        assert read("k") == b"v"


def test_blocking_single_node_client_never_retries_inside_redis_py():
    """The caller backs off instead (the cluster client: tests/test_cache_redis_cluster.py)."""
    single = connect_blocking(CacheConfig(redis_url="redis://127.0.0.1:1"), "iris-test")
    assert single.get_connection_kwargs()["retry"].get_retries() == 0


async def test_one_slow_reply_does_not_mark_redis_down(make_cache, namespace):
    """A reply slower than redis_timeout_s (here the server busy for 0.4 s, as under a large
    video value) makes that read a miss, not the whole cache degraded until the backoff ends."""
    key = content_key(FINGERPRINT, b"slow", namespace)
    with private_redis("--enable-debug-command", "yes") as server:
        cache = make_cache(redis_url=server.url, redis_timeout_s=0.25, backoff_initial_s=5, backoff_max_s=5)
        assert await cache.put_many([(key, make_features(1))]) == [True]
        reader = make_cache(redis_url=server.url, redis_timeout_s=0.25, backoff_initial_s=5, backoff_max_s=5)
        assert await reader.ping()
        busy = threading.Thread(
            target=lambda: redis.Redis.from_url(server.url).execute_command("DEBUG", "SLEEP", "0.4")
        )
        busy.start()
        await asyncio.sleep(0.05)
        assert await reader.get_many([key]) == [None]  # timed out
        busy.join()
        assert reader.redis_available and reader.stats()["degraded_transitions"] == 0
        [got] = await reader.get_many([key])
        assert got is not None and got.meta["seed"] == 1


@pytest.mark.parametrize(
    "url, shown",
    [
        ("redis://:s3cret@host:6379/0", "redis://:***@host:6379/0"),
        ("rediss://iris:s3cret@host:6380/1", "rediss://iris:***@host:6380/1"),
        ("redis://host:6379/0", "redis://host:6379/0"),
        ("redis://iris@host/0", "redis://iris@host/0"),
        ("unix:///run/redis.sock", "unix:///run/redis.sock"),
        ("redis://:${IRIS_REDIS_PASSWORD}@host/0", "redis://:***@host/0"),
    ],
)
def test_redacted_urls_keep_everything_but_the_password(url, shown):
    assert redacted(url) == shown


def test_a_password_in_the_url_is_not_in_the_configs_repr_or_errors():
    config = CacheConfig(redis_url="redis://:s3cret@host:6379/0")
    assert "s3cret" not in repr(config) and "s3cret" not in str(config)
    with pytest.raises(ValueError) as err:
        CacheConfig(redis_url="http://:s3cret@host:6379/0")
    assert "s3cret" not in str(err.value)
