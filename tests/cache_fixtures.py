"""Fixtures and helpers shared by the tests/test_cache_*.py files.

The shared Redis at 127.0.0.1:6379 is never flushed: each test gets its own
namespace and deletes its own keys afterwards. Tests that kill Redis start
their own `redis-server` on a free port.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import redis
import torch

from bench.harness.redis_servers import RedisProcess
from cache_service.config import CacheConfig
from cache_service.feature_cache import FeatureCache
from cache_service.features import Features
from tests.support.namespaces import (  # noqa: F401  (SHARED_REDIS_URL: re-exported)
    SHARED_REDIS_URL,
    delete_namespace,
    new_namespace,
)

FINGERPRINT = "0123abcd"


def make_features(seed: int = 0, tokens: int = 16, hidden: int = 32, dtype=torch.bfloat16) -> Features:
    g = torch.Generator().manual_seed(seed)
    return Features(
        {
            "image_embeds": torch.randn(tokens, hidden, generator=g).to(dtype),
            "image_grid_thw": torch.tensor([[1, 4, tokens // 4 * 4]], dtype=torch.int64),
        },
        {"num_tokens": tokens, "seed": seed},
    )


def assert_same_features(a: Features, b: Features) -> None:
    assert a.meta == b.meta
    assert a.tensors.keys() == b.tensors.keys()
    for name, tensor in a.tensors.items():
        other = b.tensors[name]
        assert other.dtype == tensor.dtype, name
        assert other.shape == tensor.shape, name
        assert torch.equal(other, tensor), name


@pytest.fixture
def namespace():
    """A namespace private to this test; its keys are deleted afterwards."""
    ns = new_namespace("iristest")
    yield ns
    delete_namespace(ns)


@pytest.fixture
def raw_redis():
    """A plain synchronous client of the shared Redis, to inspect or tamper with values."""
    client = redis.Redis.from_url(SHARED_REDIS_URL)
    yield client
    client.close()


@pytest.fixture
async def make_cache(namespace):
    """Factory of FeatureCaches in this test's namespace; all closed at teardown."""
    caches: list[FeatureCache] = []

    def make(**overrides) -> FeatureCache:
        settings = {"redis_url": SHARED_REDIS_URL, "namespace": namespace, "l1_max_bytes": 64 << 20}
        settings.update(overrides)
        cache = FeatureCache(CacheConfig(**settings))
        caches.append(cache)
        return cache

    yield make
    for cache in caches:
        await cache.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def private_redis(*extra_args: str) -> Iterator[RedisProcess]:
    """A redis-server of its own on a free port (`extra_args` added to its command line), killed on exit."""
    server = RedisProcess(free_port(), *extra_args)
    server.start()
    try:
        yield server
    finally:
        if server.proc is not None:
            server.proc.send_signal(signal.SIGCONT)  # in case a test left it stopped
        server.kill()


@pytest.fixture
def redis_process():
    if shutil.which("redis-server") is None and not os.path.exists("/usr/bin/redis-server"):
        pytest.skip("redis-server binary not available")
    with private_redis() as server:
        yield server
