"""The FeatureStore seam (cache_service/store.py): FeatureCache and its single-flight need
nothing of L2 beyond the protocol, shown with a store in this process's memory; make_store
picks the backend; cache_service's modules import each other without a circle. Redis only for
the blocking reader."""

from __future__ import annotations

import ast
import asyncio
import time
from collections.abc import Sequence
from pathlib import Path

from cache_service.config import CacheConfig
from cache_service.feature_cache import FeatureCache
from cache_service.features import Features
from cache_service.redis_tier import RedisTier
from cache_service.stats import CacheStats
from cache_service.store import Buffer
from cache_service.store_factory import make_store
from tests.cache_fixtures import assert_same_features, make_features

ROOT = Path(__file__).resolve().parent.parent


class MemoryStore:
    """A FeatureStore shared by the caches of one test, standing for the cluster-wide tier."""

    def __init__(self):
        self.values: dict[str, bytes] = {}
        self.locks: dict[str, tuple[str, float]] = {}  # key -> (token, monotonic expiry)
        self.available = True

    def _lock(self, key: str) -> str | None:
        token, expires = self.locks.get(key, (None, 0.0))
        return token if expires > time.monotonic() else None

    async def ping(self) -> bool:
        return self.available

    async def close(self) -> None:
        pass

    async def get_many(self, keys: Sequence[str]) -> list[Buffer | None] | None:
        return [self.values.get(k) for k in keys] if self.available else None

    async def set_many(self, items: Sequence[tuple[str, Buffer]], ttl_ms: int) -> list[bool] | None:
        self.values.update((k, bytes(v)) for k, v in items)
        return [True] * len(items)

    async def exists_many(self, keys: Sequence[str]) -> list[bool] | None:
        return [k in self.values for k in keys]

    async def delete_many(self, keys: Sequence[str]) -> None:
        for key in keys:
            self.values.pop(key, None)

    async def expire_many(self, keys: Sequence[str], ttl_ms: int) -> None:
        pass  # no TTLs here

    async def claim_many(self, keys: Sequence[str], token: str, ttl_ms: int) -> list[tuple[bool, bool]] | None:
        for key in keys:
            if self._lock(key) is None:
                self.locks[key] = (token, time.monotonic() + ttl_ms / 1000)
        return [(self._lock(k) == token, k in self.values) for k in keys]

    async def release_many(self, keys: Sequence[str], token: str) -> None:
        for key in keys:
            if self._lock(key) == token:
                del self.locks[key]

    async def poll_many(self, keys: Sequence[str]) -> list[tuple[bool, bool]] | None:
        return [(k in self.values, self._lock(k) is not None) for k in keys]


def _caches(monkeypatch, store: MemoryStore, n: int, **settings) -> list[FeatureCache]:
    monkeypatch.setattr("cache_service.feature_cache.make_store", lambda config, stats: store)
    return [FeatureCache(CacheConfig(redis_url=None, namespace="memory", **settings)) for _ in range(n)]


async def test_caches_share_values_through_any_store(monkeypatch):
    store = MemoryStore()
    writer, reader = _caches(monkeypatch, store, 2)
    assert await writer.put_many([("k", make_features(3))]) == [True]
    [got] = await reader.get_many(["k"])
    assert_same_features(make_features(3), got)
    assert reader.stats()["l2_hits"] == 1 and await reader.ping()
    store.values["bad"] = b"not a value"
    assert await reader.get_many(["bad"]) == [None] and "bad" not in store.values  # corrupt: deleted


async def test_single_flight_across_caches_through_any_store(monkeypatch):
    store = MemoryStore()
    caches = _caches(monkeypatch, store, 4, single_flight_poll_s=0.01)
    calls: list[int] = []

    async def compute(indexes: list[int]) -> list[Features]:
        calls.append(len(indexes))
        await asyncio.sleep(0.05)
        return [make_features(9) for _ in indexes]

    results = await asyncio.gather(*(c.get_or_compute_many(["a", "b"], compute, write_behind=True) for c in caches))
    assert calls == [2]  # one caller computed both keys, the others waited on its locks
    assert sum(c.stats()["single_flight_waits"] for c in caches) == 6
    for result in results:
        for r in result:
            assert_same_features(make_features(9), r.features)
    for cache in caches:
        await cache.close()  # the write-behind and the lock release have run
    assert set(store.values) == {"a", "b"} and store.locks == {}


async def test_make_store_picks_the_backend():
    assert make_store(CacheConfig(redis_url=None), CacheStats()) is None
    store = make_store(CacheConfig(), CacheStats())
    assert isinstance(store, RedisTier)
    await store.close()


def test_cache_service_imports_no_circle():
    modules = {p.stem: p for p in (ROOT / "cache_service").glob("*.py")}
    imports = {
        name: {
            node.module.split(".")[1]
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("cache_service.")
        }
        for name, path in modules.items()
    }

    def visit(name: str, path: list[str]) -> None:
        assert name not in path, " -> ".join(path + [name])
        for other in imports[name]:
            visit(other, path + [name])

    for name in modules:
        visit(name, [])


def test_blocking_reader_reads_values_and_misses_when_the_store_cannot_be_asked():
    """The EC connector's reader (a vLLM engine has no event loop of Iris's): a value, a miss, and
    a store that does not answer, which is a miss too, never an exception in vLLM's scheduler."""
    import uuid

    import redis

    from cache_service.store_factory import blocking_reader

    key = f"iris-test-blocking-reader:{uuid.uuid4().hex}"
    direct = redis.Redis(host="127.0.0.1", port=6379)
    direct.set(key, b"value", ex=60)
    try:
        read = blocking_reader(CacheConfig(redis_url="redis://127.0.0.1:6379"), "iris-test")
        assert read(key) == b"value"
        assert read(key + ":absent") is None
    finally:
        direct.delete(key)
    nobody = blocking_reader(
        CacheConfig(redis_url="redis://127.0.0.1:1", redis_timeout_s=0.2, redis_connect_timeout_s=0.2), "iris-test"
    )
    assert nobody(key) is None
