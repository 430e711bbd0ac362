"""Stale, misplaced or forged Redis entries never reach a model (real Redis, no Ray).

A value that passes the checksum but is wrong for the model (another model's
fingerprint, wrong dtype, shape or token count) is rejected like a corrupt one:
counted, deleted, a miss, and recomputed by get_or_compute_many.
"""

from __future__ import annotations

import pytest
import torch

from cache_service.codec import encode
from cache_service.config import CacheConfig
from cache_service.feature_cache import FeatureCache
from cache_service.features import Features
from cache_service.keys import content_key, fingerprint_of, uuid_key
from cache_service.validation import FINGERPRINT_META, ValueCheck, stamp_fingerprint
from tests.cache_fixtures import SHARED_REDIS_URL, assert_same_features

FP_OLD, FP_NEW = "0ddf00d0", "0e1f2a3b"
TOKENS, HIDDEN = 16, 32


def expectation(features: Features) -> str | None:
    """A stand-in for a family's feature_problem: bf16 [16, 32] embeddings, 16 tokens."""
    t = features.tensors.get("image_embeds")
    if t is None or t.dtype != torch.bfloat16 or list(t.shape) != [TOKENS, HIDDEN]:
        return "wrong embeddings"
    if features.meta.get("num_tokens") != TOKENS:
        return "wrong token count"
    return None


def good(
    fp: str,
    seed: int = 0,
    tokens: int = TOKENS,
    hidden: int = HIDDEN,
    dtype=torch.bfloat16,
    num_tokens: int | None = None,
) -> Features:
    g = torch.Generator().manual_seed(seed)
    embeds = torch.randn(tokens, hidden, generator=g).to(dtype)
    return Features(
        {"image_embeds": embeds}, {"num_tokens": tokens if num_tokens is None else num_tokens, FINGERPRINT_META: fp}
    )


def checked_cache(namespace, caches):
    cache = FeatureCache(CacheConfig(redis_url=SHARED_REDIS_URL, namespace=namespace), check=ValueCheck(expectation))
    caches.append(cache)
    return cache


@pytest.fixture
async def caches():
    made: list[FeatureCache] = []
    yield made
    for cache in made:
        await cache.close()


FORGERIES = {
    "wrong_shape": lambda: good(FP_NEW, tokens=8),
    "wrong_hidden": lambda: good(FP_NEW, hidden=64),
    "wrong_dtype": lambda: good(FP_NEW, dtype=torch.float32),
    "wrong_token_count": lambda: good(FP_NEW, num_tokens=4096),
    "wrong_fingerprint": lambda: good(FP_OLD),
    "no_fingerprint": lambda: Features({"image_embeds": good(FP_NEW).tensors["image_embeds"]}, {"num_tokens": TOKENS}),
}


@pytest.mark.parametrize("forgery", sorted(FORGERIES))
async def test_forged_value_is_rejected_deleted_and_recomputed(namespace, raw_redis, caches, forgery):
    key = content_key(FP_NEW, b"some image", namespace)
    raw_redis.set(key, bytes(encode(FORGERIES[forgery]())))  # a valid codec value: the checksum passes
    cache = checked_cache(namespace, caches)

    assert await cache.get_many([key]) == [None]
    assert raw_redis.exists(key) == 0  # deleted, so the next reader recomputes
    stats = cache.stats()
    assert stats["rejected"] == 1 and stats["l2_hits"] == 0 and stats["l1_entries"] == 0

    raw_redis.set(key, bytes(encode(FORGERIES[forgery]())))  # forged again, now on the compute path
    fresh = good(FP_NEW, seed=7)

    async def compute(indexes):
        return [fresh for _ in indexes]

    (result,) = await cache.get_or_compute_many([key], compute)
    assert result.computed
    assert_same_features(result.features, fresh)
    assert cache.stats()["rejected"] == 2
    # What is now in Redis is the recomputed value, and a fresh reader accepts it.
    assert_same_features((await checked_cache(namespace, caches).get_many([key]))[0], fresh)


async def test_forged_value_under_uuid_key_is_a_miss(namespace, raw_redis, caches):
    """Upload-free requests turn this miss into 409 mm_cache_miss; nothing wrong is served."""
    key = uuid_key(FP_NEW, "tenant-a", "img-1", namespace)
    raw_redis.set(key, bytes(encode(good(FP_NEW, tokens=3))))
    cache = checked_cache(namespace, caches)
    assert await cache.contains_many([key]) == [True]  # presence is cheap and unchecked ...
    assert await cache.get_many([key]) == [None]  # ... but the read that feeds vLLM is checked
    assert await cache.contains_many([key]) == [False]


async def test_correct_value_is_accepted(namespace, caches):
    key = content_key(FP_NEW, b"fine", namespace)
    writer, reader = checked_cache(namespace, caches), checked_cache(namespace, caches)
    value = good(FP_NEW, seed=3)
    assert await writer.put_many([(key, value)]) == [True]
    assert_same_features((await reader.get_many([key]))[0], value)
    assert reader.stats()["rejected"] == 0


async def test_two_fingerprints_never_see_each_others_entries(namespace, raw_redis, caches):
    """A rolling update: old and new weights write the same image side by side."""
    image = b"the same image bytes"
    old_key, new_key = content_key(FP_OLD, image, namespace), content_key(FP_NEW, image, namespace)
    assert old_key != new_key and fingerprint_of(old_key) == FP_OLD and fingerprint_of(new_key) == FP_NEW
    old_replica, new_replica = checked_cache(namespace, caches), checked_cache(namespace, caches)
    await old_replica.put_many([(old_key, good(FP_OLD, seed=1))])
    assert await new_replica.get_many([new_key]) == [None]  # different key: a miss
    # Even copied under the new model's key, the old value is refused by its stamp.
    raw_redis.set(new_key, raw_redis.get(old_key))
    assert await new_replica.get_many([new_key]) == [None]
    assert new_replica.stats()["rejected"] == 1
    # And the new model's entry does not satisfy the old model either.
    await new_replica.put_many([(new_key, good(FP_NEW, seed=2))])
    raw_redis.set(old_key, raw_redis.get(new_key))
    fresh = checked_cache(namespace, caches)
    assert await fresh.get_many([old_key]) == [None]


def test_value_check_without_expectation_and_odd_keys():
    check = ValueCheck()
    assert check.problem(content_key(FP_NEW, b"x"), stamp_fingerprint(good(FP_OLD), FP_NEW)) is None
    assert "fingerprint" in check.problem("not-an-iris-key", good(FP_NEW))
    assert fingerprint_of("iris:v1:abc:c:" + "0" * 64) == "abc"
    assert fingerprint_of("iris:v2:abc:c:x") is None


def test_expectation_that_raises_is_a_rejection_not_a_crash():
    def broken(features):
        raise IndexError("boom")

    problem = ValueCheck(broken).problem(content_key(FP_NEW, b"x"), good(FP_NEW))
    assert problem and "boom" in problem
