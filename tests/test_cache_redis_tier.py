"""RedisTier's value path through redis-py (with hiredis): large values in size-bounded
pipelines, TTLs, auth and database from the URL, per-item refusals, and a restart."""

import os

import redis

from bench.harness.redis_servers import RedisProcess
from cache_service.config import CacheConfig
from cache_service.redis_tier import PIPELINE_BYTES, RedisTier, groups_by_size
from cache_service.stats import CacheStats
from tests.cache_fixtures import SHARED_REDIS_URL, free_port


def _tier(url: str, timeout_s: float = 1.0) -> RedisTier:
    return RedisTier(
        CacheConfig(redis_url=url, redis_timeout_s=timeout_s, redis_connect_timeout_s=timeout_s), CacheStats()
    )


def test_groups_by_size():
    assert groups_by_size([], 10) == []
    assert groups_by_size([4, 4, 4, 20, 1, 9], 10) == [[0, 1], [2], [3], [4, 5]]


def test_hiredis_parser_is_used():
    from redis.utils import HIREDIS_AVAILABLE

    assert HIREDIS_AVAILABLE  # redis[hiredis] is a dependency: the C parser reads the values


async def test_set_and_get_many_round_trip_with_ttl(raw_redis, namespace):
    sizes = [10, 200_000, 6 << 20, 6 << 20, 12 << 20]  # spans several SET pipelines
    assert sum(sizes) > 2 * PIPELINE_BYTES
    items = [(f"{namespace}:s{i}", bytearray(os.urandom(n))) for i, n in enumerate(sizes)]
    tier = _tier(SHARED_REDIS_URL)
    try:
        assert await tier.set_many(items, 30_000) == [True] * len(items)
        for key, value in items:
            assert raw_redis.get(key) == bytes(value)
            assert 25_000 < raw_redis.pttl(key) <= 30_000
        order = [3, 0, 5, 1, 2, 4]  # index 5 is absent
        got = await tier.get_many([items[i][0] if i < len(items) else f"{namespace}:missing" for i in order])
        for i, reply in zip(order, got):
            assert (reply is None) if i == 5 else bytes(reply) == bytes(items[i][1])
    finally:
        await tier.close()


async def test_auth_and_database_from_url():
    server = RedisProcess(free_port(), "--requirepass", "s3cret")
    server.start()
    try:
        writer = redis.Redis(port=server.port, db=3, password="s3cret")
        writer.set("k", b"in db 3")
        writer.close()
        good = _tier(f"redis://:s3cret@127.0.0.1:{server.port}/3")
        assert [bytes(v) for v in await good.get_many(["k"])] == [b"in db 3"]
        await good.close()
        bad = _tier(f"redis://:wrong@127.0.0.1:{server.port}/3")
        assert await bad.get_many(["k"]) is None  # refused: a miss, never an exception
        await bad.close()
    finally:
        server.kill()


async def test_set_many_reports_refused_writes_per_item():
    server = RedisProcess(free_port(), "--maxmemory", "2mb")
    server.start()
    stats = CacheStats()
    tier = RedisTier(CacheConfig(redis_url=server.url, redis_timeout_s=1.0), stats)
    try:
        replies = await tier.set_many([("small", b"x" * 100), ("big", bytes(4 << 20)), ("small2", b"y")], 10_000)
        assert replies[0] is True and replies[1] is False
        assert stats.l2_errors >= 1
        assert tier.available  # a full Redis is not a dead one
        assert [bytes(v) for v in await tier.get_many(["small"])] == [b"x" * 100]
    finally:
        await tier.close()
        server.kill()


async def test_restart_reuses_the_pool(redis_process):
    writer = redis.Redis(port=redis_process.port)
    writer.set("k", b"v1")
    tier = _tier(redis_process.url, 0.5)
    try:
        assert [bytes(v) for v in await tier.get_many(["k"])] == [b"v1"]
        redis_process.kill()
        redis_process.start()
        writer.set("k", b"v2")
        # The pooled connection died with the server: retried once on a fresh one.
        assert [bytes(v) for v in await tier.get_many(["k"])] == [b"v2"]
        assert tier.available
    finally:
        await tier.close()
        writer.close()
