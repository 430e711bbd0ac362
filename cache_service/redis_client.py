"""The Redis client Iris's Redis users share (the cache's Redis tier, the tenant limits; and,
blocking, the start-up check and the EC connector in a vLLM engine), and the backoff with which
they try an unreachable Redis again.

Both users fall back to their own memory when Redis fails, so a client must fail fast: short
timeouts, no sleeping retries inside redis-py, and Redis asked again only after a backoff.
"""

from __future__ import annotations

import time

from redis.asyncio import Redis, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from cache_service.config import CacheConfig

# Redis is unreachable or too slow: the user falls back until a backoff has passed. Other
# RedisErrors (e.g. OOM under noeviction) fail one command only. OSError covers the builtin
# TimeoutError, which asyncio raises.
UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError)
# Anything a command may raise because of Redis.
REDIS_ERRORS = (RedisError, OSError)


def connect(config: CacheConfig, client_name: str, **pool) -> Redis | RedisCluster:
    """A client of `config`'s Redis or Redis Cluster (`pool`: e.g. max_connections); redis-py
    uses hiredis to parse replies when it is installed (a dependency)."""
    settings = dict(socket_timeout=config.redis_timeout_s, socket_connect_timeout=config.redis_connect_timeout_s,
                    client_name=client_name, **pool)
    if config.redis_cluster:
        # No retries inside redis-py: its retry closes every master's connections and
        # sleeps; a failing shard is its user's to mark down (the others keep serving).
        # MOVED/ASK are still followed.
        return RedisCluster.from_url(config.connect_url(), retry=Retry(NoBackoff(), 0), require_full_coverage=False,
                                     **settings)
    # One immediate retry on a connection error covers a pooled connection that died with a
    # restarted server; timeouts are not retried, since a slow Redis should fail fast.
    return Redis.from_url(config.connect_url(), retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
                          **settings)


def connect_blocking(config: CacheConfig, client_name: str):
    """A blocking client of `config`'s Redis or Redis Cluster, for code outside an event loop
    (a start-up check, vLLM's scheduler): the same timeouts, no retries."""
    import redis
    from redis.cluster import RedisCluster as BlockingCluster

    settings = dict(socket_timeout=config.redis_timeout_s, socket_connect_timeout=config.redis_connect_timeout_s,
                    client_name=client_name)
    if config.redis_cluster:
        return BlockingCluster.from_url(config.connect_url(), require_full_coverage=False, **settings)
    return redis.Redis.from_url(config.connect_url(), **settings)


class Backoff:
    """When to try an unreachable Redis again: `backoff_initial_s` after the first failure,
    doubling per failure up to `backoff_max_s`; reset once it answers."""

    def __init__(self, config: CacheConfig):
        self.initial_s, self.max_s = config.backoff_initial_s, config.backoff_max_s
        self.delay_s = 0.0  # 0 while Redis answers
        self.retry_at = 0.0  # monotonic time before which Redis is not asked

    @property
    def failing(self) -> bool:
        return self.delay_s > 0

    @property
    def waiting(self) -> bool:
        return time.monotonic() < self.retry_at

    def failed(self) -> float:
        """Count a failure; returns the delay before the next try."""
        self.delay_s = min(self.max_s, max(self.initial_s, self.delay_s * 2))
        self.retry_at = time.monotonic() + self.delay_s
        return self.delay_s

    def answered(self) -> None:
        self.delay_s = self.retry_at = 0.0
