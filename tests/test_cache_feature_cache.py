"""FeatureCache against the real Redis at 127.0.0.1:6379: tiers, isolation, TTL, corruption."""

import asyncio
import signal
import time

import pytest
import redis
import torch

from cache_service.codec import encode
from cache_service.config import CacheConfig
from cache_service.feature_cache import FeatureCache
from cache_service.features import Features
from cache_service.keys import content_key, uuid_key
from tests.cache_fixtures import FINGERPRINT, assert_same_features, make_features, private_redis


async def test_round_trip_through_redis(make_cache, namespace):
    g = torch.Generator().manual_seed(3)
    features = Features(
        {
            "bf16": torch.randn(24, 64, generator=g).to(torch.bfloat16),
            "fp16": torch.randn(2, 24, 64, generator=g).to(torch.float16),
            "fp32": torch.randn(24, 64, generator=g),
            "image_grid_thw": torch.tensor([[1, 4, 6]]),
        },
        {"num_tokens": 24, "family": "qwen2_vl"},
    )
    key = content_key(FINGERPRINT, b"image-1", namespace)
    writer, reader = make_cache(), make_cache()
    assert await writer.put_many([(key, features)]) == [True]

    [got] = await reader.get_many([key])  # fresh instance: empty L1, so from Redis
    assert_same_features(features, got)
    stats = reader.stats()
    assert (stats["l1_misses"], stats["l2_hits"], stats["l2_misses"]) == (1, 1, 0)
    assert stats["l2_bytes_read"] == writer.stats()["l2_bytes_written"] > features.nbytes

    [again] = await reader.get_many([key])  # promoted into L1
    assert again is got
    assert reader.stats()["l1_hits"] == 1 and reader.stats()["l2_hits"] == 1


async def test_batched_get_keeps_order_and_counts(make_cache, namespace):
    keys = [content_key(FINGERPRINT, bytes([i]), namespace) for i in range(5)]
    cache = make_cache()
    await cache.put_many([(keys[1], make_features(1)), (keys[3], make_features(3))])
    reader = make_cache()
    got = await reader.get_many(keys + [keys[1]])
    assert [g is not None for g in got] == [False, True, False, True, False, True]
    assert got[1].meta["seed"] == 1 and got[3].meta["seed"] == 3
    stats = reader.stats()
    assert stats["l2_hits"] == 2 and stats["l2_misses"] == 3  # duplicate key read once
    assert await reader.contains_many(keys) == [False, True, False, True, False]


async def test_contains_many_does_not_transfer_values(make_cache, namespace):
    key = content_key(FINGERPRINT, b"c", namespace)
    await make_cache().put_many([(key, make_features())])
    reader = make_cache()
    assert await reader.contains_many([key, key + "x"]) == [True, False]
    assert reader.stats()["l2_bytes_read"] == 0
    assert reader.stats()["l1_entries"] == 0


async def test_model_fingerprint_isolates_features(make_cache, namespace):
    data = b"the same uploaded image"
    cache = make_cache()
    await cache.put_many([(content_key("aaaa", data, namespace), make_features(1))])
    other = make_cache()
    assert await other.get_many([content_key("bbbb", data, namespace)]) == [None]
    [hit] = await other.get_many([content_key("aaaa", data, namespace)])
    assert hit.meta["seed"] == 1


async def test_uuid_keys_isolated_by_tenant_content_keys_shared(make_cache, namespace):
    cache = make_cache()
    await cache.put_many(
        [
            (uuid_key(FINGERPRINT, "tenant-a", "img-1", namespace), make_features(1)),
            (content_key(FINGERPRINT, b"public", namespace), make_features(2)),
            # ':' in tenant or uuid must not let these two meet.
            (uuid_key(FINGERPRINT, "a:b", "c", namespace), make_features(3)),
        ]
    )
    other = make_cache()
    got = await other.get_many(
        [
            uuid_key(FINGERPRINT, "tenant-b", "img-1", namespace),
            uuid_key(FINGERPRINT, None, "img-1", namespace),
            uuid_key(FINGERPRINT, "tenant-a", "img-1", namespace),
            content_key(FINGERPRINT, b"public", namespace),
            uuid_key(FINGERPRINT, "a", "b:c", namespace),
            uuid_key(FINGERPRINT, "a:b", "c", namespace),
        ]
    )
    assert [None if g is None else g.meta["seed"] for g in got] == [None, None, 1, 2, None, 3]


async def test_entries_get_the_configured_ttl(make_cache, namespace, raw_redis):
    key = content_key(FINGERPRINT, b"ttl", namespace)
    cache = make_cache(ttl_s=120)
    await cache.put_many([(key, make_features())])
    pttl = raw_redis.pttl(key)
    assert 115_000 < pttl <= 120_000


@pytest.mark.parametrize("damage", ["garbage", "truncated", "flipped"])
async def test_corrupt_value_is_a_miss_deleted_and_counted(make_cache, namespace, raw_redis, damage):
    key = content_key(FINGERPRINT, b"corrupt", namespace)
    value = bytes(encode(make_features(tokens=64)))
    tampered = {
        "garbage": b"\x00garbage" * 10,
        "truncated": value[: len(value) - 7],
        "flipped": value[:-5] + bytes([value[-5] ^ 0xFF]) + value[-4:],
    }[damage]
    raw_redis.set(key, tampered)
    cache = make_cache()
    assert await cache.get_many([key]) == [None]
    assert raw_redis.exists(key) == 0
    stats = cache.stats()
    assert stats["corrupt"] == 1 and stats["l2_misses"] == 1 and stats["l2_hits"] == 0
    assert stats["l1_entries"] == 0


async def test_oversize_value_stays_out_of_redis(make_cache, namespace, raw_redis):
    small_key = content_key(FINGERPRINT, b"small", namespace)
    big_key = content_key(FINGERPRINT, b"big", namespace)
    cache = make_cache(max_value_bytes=4096)
    stored = await cache.put_many([(small_key, make_features(tokens=8)), (big_key, make_features(tokens=256))])
    assert stored == [True, False]
    assert raw_redis.exists(big_key) == 0 and raw_redis.exists(small_key) == 1
    assert cache.stats()["oversize"] == 1
    [hit] = await cache.get_many([big_key])  # still served from L1
    assert hit is not None and cache.stats()["l1_hits"] == 1


async def test_l1_byte_bound_and_lru_order(namespace):
    one = make_features(tokens=16, hidden=32).nbytes
    cache = FeatureCache(CacheConfig(redis_url=None, namespace=namespace, l1_max_bytes=3 * one))
    keys = [f"{namespace}:k{i}" for i in range(5)]
    await cache.put_many([(keys[i], make_features(i)) for i in range(3)])
    await cache.get_many([keys[0]])  # k0 is now the most recently used
    await cache.put_many([(keys[3], make_features(3))])  # evicts k1, the least recently used
    assert [g is not None for g in await cache.get_many(keys[:4])] == [True, False, True, True]
    stats = cache.stats()
    assert stats["l1_evictions"] == 1 and stats["l1_bytes"] == 3 * one and stats["l1_entries"] == 3
    # An entry larger than the whole tier is not stored and evicts nothing.
    await cache.put_many([(keys[4], make_features(4, tokens=64))])
    assert await cache.get_many([keys[4]]) == [None]
    assert cache.stats()["l1_evictions"] == 1
    assert not cache.redis_available
    await cache.close()


async def test_compute_results_say_where_features_came_from(make_cache, namespace):
    keys = [content_key(FINGERPRINT, bytes([i]), namespace) for i in range(3)]
    cache = make_cache()
    await cache.put_many([(keys[0], make_features(0))])
    calls = []

    async def compute(indexes):
        calls.append(list(indexes))
        return [make_features(100 + i) for i in indexes]

    results = await cache.get_or_compute_many(keys + [keys[2]], compute)
    assert calls == [[1, 2]]  # the duplicate key is computed once
    assert [(r.computed, r.shared) for r in results] == [(False, True), (True, True), (True, True), (True, True)]
    assert [r.features.meta["seed"] for r in results] == [0, 101, 102, 102]
    assert cache.stats()["computations"] == 2 and cache.stats()["compute_calls"] == 1

    # Another replica finds them in Redis and computes nothing.
    other = make_cache()
    results = await other.get_or_compute_many(keys, compute)
    assert calls == [[1, 2]]
    assert all(not r.computed and r.shared for r in results)


async def test_compute_errors_reach_the_caller_and_leave_no_lock(make_cache, namespace, raw_redis):
    key = content_key(FINGERPRINT, b"bad image", namespace)
    cache = make_cache()

    async def broken(indexes):
        raise RuntimeError("encoder failed")

    with pytest.raises(RuntimeError, match="encoder failed"):
        await cache.get_or_compute_many([key], broken)
    await cache.close()  # waits for the background lock release
    assert raw_redis.exists(key + ":lock") == 0

    async def wrong_count(indexes):
        return []

    with pytest.raises(ValueError):
        await make_cache().get_or_compute_many([key], wrong_count)


async def test_batch_of_large_values_with_default_timeouts(make_cache, namespace):
    # ~22 MB in one put_many and one get_many: larger than one write pipeline,
    # and it must neither time out nor switch the cache to degraded mode.
    keys = [content_key(FINGERPRINT, bytes([i]), namespace) for i in range(3)]
    big = [make_features(i, tokens=1024, hidden=3584) for i in range(3)]
    writer = make_cache()
    assert await writer.put_many(list(zip(keys, big))) == [True, True, True]
    reader = make_cache()
    got = await reader.get_many(keys)
    for want, have in zip(big, got):
        assert_same_features(want, have)
    assert writer.stats()["degraded_transitions"] == 0 and reader.stats()["degraded_transitions"] == 0
    assert reader.stats()["l2_hits"] == 3


async def test_hits_slide_the_ttl_at_most_once_per_refresh_interval(make_cache, namespace, raw_redis):
    """A value in use does not expire: an L1 hit (value known to be in Redis) or an L2 hit resets
    its TTL, in the background, once per ttl_refresh_s per key and process; a write counts as one."""
    import asyncio

    key = content_key(FINGERPRINT, b"hot", namespace)
    writer, reader = make_cache(ttl_s=120, ttl_refresh_s=0.3), make_cache(ttl_s=120, ttl_refresh_s=0.3)
    assert await writer.put_many([(key, make_features(5))]) == [True]
    raw_redis.pexpire(key, 5_000)  # as if most of its TTL had run out

    async def pttl_after(cache) -> int:
        assert (await cache.get_many([key]))[0] is not None
        await asyncio.sleep(0.05)  # the refresh runs behind the hit
        return raw_redis.pttl(key)

    assert await pttl_after(writer) <= 5_000  # just written: no refresh yet
    assert await pttl_after(reader) > 100_000  # an L2 hit in another process slides it
    assert reader.stats()["ttl_refreshes"] == 1
    raw_redis.pexpire(key, 5_000)
    assert await pttl_after(reader) <= 5_000  # an L1 hit within the interval: no second PEXPIRE
    await asyncio.sleep(0.3)
    assert await pttl_after(reader) > 100_000  # the interval passed: the L1 hit slides it
    assert await pttl_after(writer) > 100_000 and writer.stats()["ttl_refreshes"] == 1
    assert reader.stats()["ttl_refreshes"] == 2

    absent = content_key(FINGERPRINT, b"never written", namespace)
    assert await reader.contains_many([absent]) == [False]
    assert raw_redis.exists(absent) == 0  # PEXPIRE never creates a key


async def test_close_flushes_write_behind_within_its_timeout(make_cache, namespace, raw_redis):
    """A replica shutting down: close(timeout_s) finishes the Redis writes still running behind
    responses, and gives up on what a stuck Redis does not take in time."""
    key = content_key(FINGERPRINT, b"pending at shutdown", namespace)
    with private_redis("--enable-debug-command", "yes") as slow:
        cache = make_cache(redis_url=slow.url, redis_timeout_s=5)
        assert await cache.ping()
        sleeping = asyncio.ensure_future(
            asyncio.to_thread(lambda: redis.Redis.from_url(slow.url).execute_command("DEBUG", "SLEEP", "0.5"))
        )
        await asyncio.sleep(0.1)  # Redis busy: the write waits for it
        [result] = await cache.get_or_compute_many([key], _computed, write_behind=True)
        assert not result.stored.done()
        await cache.close(timeout_s=5)
        assert redis.Redis.from_url(slow.url).exists(key)
        await sleeping

        stuck = make_cache(redis_url=slow.url, redis_timeout_s=5)
        assert await stuck.ping()

        async def computed_as_redis_freezes(indexes):
            slow.proc.send_signal(signal.SIGSTOP)  # after the lookup and the lock: the write hangs
            return await _computed(indexes)

        try:
            [result] = await stuck.get_or_compute_many([key + "2"], computed_as_redis_freezes, write_behind=True)
            started = time.monotonic()
            await stuck.close(timeout_s=0.3)
            assert time.monotonic() - started < 1.5
        finally:
            slow.proc.send_signal(signal.SIGCONT)
        assert stuck.stats()["writes_dropped"] == 1
        assert result.stored.result() is False


async def _computed(indexes):
    return [make_features(7) for _ in indexes]
