"""The Redis clients Iris's Redis users share (the cache's Redis tier, the tenant limits; and,
blocking, the start-up check and the EC connector in a vLLM engine), and the backoff with which
they try an unreachable Redis again.

Both users fall back to their own memory when Redis fails, so a client must fail fast: short
timeouts, no sleeping retries inside redis-py, and Redis asked again only after a backoff.
What counts as "down" (`Outage`): a connection error at once, timeouts only when they go on
for longer than one slow reply could (a large video value under load is not an outage).

URLs are logged, put in errors and stats only through `redacted(url)`: a password in
`redis_url` (after ${NAME} expansion, or written in clear) must not reach a log.
"""

from __future__ import annotations

import time
from urllib.parse import urlsplit, urlunsplit

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
# A reply that did not come in time (asyncio's and the socket's timeouts are the builtin one).
TIMEOUTS = (RedisTimeoutError, TimeoutError)


def redacted(url: str | None) -> str | None:
    """`url` without its password (user names stay: they help, and are no secret)."""
    if not url or "@" not in url:
        return url
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        user = parts.username or ""
        host = parts.netloc.rsplit("@", 1)[1]
        return urlunsplit((parts.scheme, f"{user}:***@{host}", parts.path, parts.query, parts.fragment))
    except ValueError:  # not parseable: keep nothing that might be the secret
        return url.split("://", 1)[0] + "://***"


def connect(config: CacheConfig, client_name: str, **pool) -> Redis | RedisCluster:
    """A client of `config`'s Redis or Redis Cluster (`pool`: e.g. max_connections); redis-py
    uses hiredis to parse replies when it is installed (a dependency)."""
    settings = dict(
        socket_timeout=config.redis_timeout_s,
        socket_connect_timeout=config.redis_connect_timeout_s,
        client_name=client_name,
        **pool,
    )
    if config.redis_cluster:
        # No retries inside redis-py: its retry closes every master's connections and
        # sleeps; a failing shard is its user's to mark down (the others keep serving).
        # MOVED/ASK are still followed.
        return RedisCluster.from_url(
            config.connect_url(), retry=Retry(NoBackoff(), 0), require_full_coverage=False, **settings
        )
    # One immediate retry on a connection error covers a pooled connection that died with a
    # restarted server; timeouts are not retried, since a slow Redis should fail fast.
    return Redis.from_url(
        config.connect_url(), retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)), **settings
    )


def connect_blocking(config: CacheConfig, client_name: str):
    """A blocking client of `config`'s Redis or Redis Cluster, for code outside an event loop
    (a start-up check, vLLM's scheduler): the same timeouts, no retries."""
    import redis
    from redis.cluster import RedisCluster as BlockingCluster

    settings = dict(
        socket_timeout=config.redis_timeout_s,
        socket_connect_timeout=config.redis_connect_timeout_s,
        client_name=client_name,
    )
    from redis.backoff import NoBackoff
    from redis.retry import Retry as BlockingRetry

    if config.redis_cluster:
        # Without retry= redis-py's cluster client retries 3 times with backoff per command,
        # stalling vLLM's scheduler while a master is down; the caller backs off instead.
        return BlockingCluster.from_url(
            config.connect_url(), require_full_coverage=False, retry=BlockingRetry(NoBackoff(), 0), **settings
        )
    return redis.Redis.from_url(config.connect_url(), retry=BlockingRetry(NoBackoff(), 0), **settings)


class Outage:
    """Whether failures of one Redis (or one cluster master) mean it is down: any connection
    error does; timeouts only once they have gone on, with no reply in between, for
    `2 × redis_timeout_s` past the first (a frozen or dead-but-connected server), so a burst of
    commands behind one slow reply does not make every later key a miss until the backoff ends."""

    def __init__(self, config: CacheConfig):
        self.window_s = 2 * config.redis_timeout_s
        self._first_timeout: float | None = None

    def is_down_after(self, error: BaseException) -> bool:
        if not isinstance(error, TIMEOUTS):
            return True
        now = time.monotonic()
        if self._first_timeout is None:
            self._first_timeout = now
        return now - self._first_timeout >= self.window_s

    def answered(self) -> None:
        self._first_timeout = None


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
