"""A password-protected Redis (as on the cluster, password from a Secret via an
environment variable): `${NAME}` in redis_url is expanded where Iris connects."""

import pytest

from cache_service.config import CacheConfig
from cache_service.feature_cache import FeatureCache
from tests.cache_fixtures import assert_same_features, make_features, private_redis

PASSWORD = "s3cret/with:odd@chars%"  # needs URL quoting


@pytest.fixture
def protected_redis():
    with private_redis("--requirepass", PASSWORD) as server:
        yield server


async def test_password_from_environment_reaches_both_clients(protected_redis, monkeypatch):
    monkeypatch.setenv("IRIS_TEST_REDIS_PASSWORD", PASSWORD)
    url = f"redis://:${{IRIS_TEST_REDIS_PASSWORD}}@127.0.0.1:{protected_redis.port}/0"
    writer = FeatureCache(CacheConfig(redis_url=url, l1_max_bytes=0))
    reader = FeatureCache(CacheConfig(redis_url=url, l1_max_bytes=0))
    try:
        assert await writer.ping()
        features = make_features(seed=3, tokens=64, hidden=256)
        assert await writer.put_many([("k1", features)]) == [True]
        (got,) = await reader.get_many(["k1"])  # L1 off: this came through Redis
        assert got is not None
        assert_same_features(got, features)
        assert writer.config.redis_url == url  # the config itself never holds the password
    finally:
        await writer.close()
        await reader.close()


async def test_without_the_password_redis_refuses(protected_redis):
    cache = FeatureCache(CacheConfig(redis_url=protected_redis.url, l1_max_bytes=0))
    try:
        assert not await cache.ping()
    finally:
        await cache.close()


def test_unset_variable_is_named(monkeypatch):
    monkeypatch.delenv("IRIS_NOT_SET", raising=False)
    config = CacheConfig(redis_url="redis://:${IRIS_NOT_SET}@iris-redis:6379/0")
    with pytest.raises(ValueError, match="IRIS_NOT_SET"):
        config.connect_url()
    assert CacheConfig(redis_url="redis://h:6379/0").connect_url() == "redis://h:6379/0"
