"""L2: Redis as the cluster-wide tier, with degraded mode when it is unreachable.

Every method handles all the keys it is given in pipelines (one round trip,
or a few for large values: see set_many), and returns None instead of
raising when Redis cannot be used: the cache is an optimisation, so a Redis
failure turns into a miss, never into a failed request.

Degraded mode: a connection error, or a reply (one value's, for values) that
takes longer than `redis_timeout_s`, marks Redis unavailable. Then every method returns None at once (no waiting
on a dead server per request), one warning is logged, and a background task
pings Redis with exponential backoff (`backoff_initial_s` doubling up to
`backoff_max_s`) until it answers; the tier then becomes available again.

Redis settings a deployment should use, and why:
- `maxmemory <bytes>`: the cache must be bounded; size it for the working set
  (e.g. LLaVA-1.5-7B: 576 × 4096 bf16 values = 4.7 MB an image, 47 GB for 10k).
- `maxmemory-policy allkeys-lru`: a full cache evicts the least recently used
  features. With the default `noeviction`, writes fail once memory is full
  (they are counted as l2_errors and the cache keeps working from L1, but
  nothing new gets shared). `volatile-lru` works too, since every entry (and
  every single-flight lock) carries a TTL.
- No persistence needed (`save ""`, `appendonly no`): every value can be
  recomputed, and fork-based snapshots of a large cache cost memory and latency.
- `proto-max-bulk-len` (default 512 MB) must exceed `max_value_bytes`.
- Any recent Redis (the commands used are GET, SET NX PX, EXISTS, STRLEN,
  DEL, EVAL, PING); tested on 7.0.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from cache_service.config import CacheConfig
from cache_service.stats import CacheStats

logger = logging.getLogger(__name__)

T = TypeVar("T")
Buffer = bytes | bytearray | memoryview | mmap.mmap
# Values are SET in pipelines of at most this many bytes: redis-py sends a whole
# pipeline under one socket timeout, so one pipeline of many large values could
# time out under CPU load although Redis is healthy.
PIPELINE_BYTES = 10 << 20

# Errors that mean "Redis is unreachable or too slow": they switch to degraded
# mode. Other RedisErrors (e.g. OOM under noeviction) fail one command only.
# OSError covers the builtin TimeoutError, which asyncio raises.
_UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError)

# Deletes each lock that still holds our token; a lock that expired and was
# taken by another replica meanwhile is left alone.
_RELEASE_LOCKS = """
local n = 0
for i, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[1] then n = n + redis.call('DEL', key) end
end
return n
"""

_ERROR_LOG_INTERVAL_S = 60.0  # e.g. OOM under noeviction fails every write: log it once a minute


def lock_key(key: str) -> str:
    # keys.py escapes ':' inside fields, so a ":lock" suffix (one field more
    # than any value key) cannot equal a value key.
    return f"{key}:lock"


class RedisTier:
    def __init__(self, config: CacheConfig, stats: CacheStats):
        assert config.redis_url is not None
        self._config = config
        self._stats = stats
        url = config.connect_url()
        self._pool = ConnectionPool.from_url(
            url,
            max_connections=config.redis_pool_size,
            socket_timeout=config.redis_timeout_s,
            socket_connect_timeout=config.redis_connect_timeout_s,
            # One immediate retry on a connection error covers a pooled
            # connection that died with a restarted server; timeouts are not
            # retried, since a slow Redis should fail fast into degraded mode.
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
            client_name="iris-feature-cache",
        )
        self._client = Redis(connection_pool=self._pool)
        # Commands queue here rather than exceed the pool, which would raise.
        self._slots = asyncio.Semaphore(config.redis_pool_size)
        self._available = True
        self._closed = False
        self._reconnect_task: asyncio.Task | None = None
        self._last_error_log: dict[str, float] = {}

    @property
    def available(self) -> bool:
        return self._available and not self._closed

    # -- values ---------------------------------------------------------------

    async def get_many(self, keys: Sequence[str]) -> list[Buffer | None] | None:
        # A pipeline of GETs rather than one MGET: redis-py's reply timeout
        # then applies per value, so a batch of large values cannot trip it.
        async def command() -> list[bytes | None]:
            async with self._client.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.get(key)
                return await pipe.execute()

        return await self._run("GET", command)

    async def set_many(self, items: Sequence[tuple[str, Buffer]], ttl_ms: int) -> list[bool] | None:
        async def command() -> list[bool]:
            replies: list = []
            for group in groups_by_size([memoryview(v).nbytes for _, v in items], PIPELINE_BYTES):
                async with self._client.pipeline(transaction=False) as pipe:
                    for i in group:
                        pipe.set(items[i][0], items[i][1], px=ttl_ms)
                    replies += await pipe.execute(raise_on_error=False)
            failed = [r for r in replies if isinstance(r, Exception)]
            if failed:
                self._stats.l2_errors += len(failed)
                self._log_error("SET", f"{len(failed)} of {len(items)} values failed: {failed[0]}")
            return [r is True for r in replies]

        return await self._run("SET", command)

    async def exists_many(self, keys: Sequence[str]) -> list[bool] | None:
        async def command() -> list[bool]:
            async with self._client.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.exists(key)
                return [bool(n) for n in await pipe.execute()]

        return await self._run("EXISTS", command)

    async def ping(self) -> bool:
        return bool(await self._run("PING", self._client.ping))

    async def delete_many(self, keys: Sequence[str]) -> None:
        await self._run("DEL", lambda: self._client.delete(*keys))

    # -- single-flight locks --------------------------------------------------

    async def claim_many(self, keys: Sequence[str], token: str, ttl_ms: int) -> list[tuple[bool, bool]] | None:
        """Try to lock each key for computing it; per key (we hold the lock, value present).

        The value's presence is read in the same round trip, after the SET NX:
        a replica that finished between our miss and this call has already
        written its value (values are written before locks are released), so
        we see it and do not compute again. Comparing the lock to our token,
        rather than trusting SET's reply, keeps a retried pipeline from
        mistaking our own lock for another's.
        """

        async def command() -> list[tuple[bool, bool]]:
            async with self._client.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.set(lock_key(key), token, nx=True, px=ttl_ms)
                    pipe.get(lock_key(key))
                    pipe.exists(key)
                replies = await pipe.execute()
            owner = token.encode()
            return [(replies[3 * i + 1] == owner, bool(replies[3 * i + 2])) for i in range(len(keys))]

        return await self._run("claim", command)

    async def release_many(self, keys: Sequence[str], token: str) -> None:
        if keys:
            locks = [lock_key(k) for k in keys]
            await self._run("release", lambda: self._client.eval(_RELEASE_LOCKS, len(locks), *locks, token))

    async def poll_many(self, keys: Sequence[str]) -> list[tuple[bool, bool]] | None:
        """Per key: (value present, lock present), without transferring values."""

        async def command() -> list[tuple[bool, bool]]:
            async with self._client.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.exists(key)
                    pipe.exists(lock_key(key))
                replies = await pipe.execute()
            return [(bool(replies[2 * i]), bool(replies[2 * i + 1])) for i in range(len(keys))]

        return await self._run("poll", command)

    # -- availability ---------------------------------------------------------

    async def close(self) -> None:
        self._closed = True
        if self._reconnect_task is not None:
            self._reconnect_task.cancel()
            try:
                await self._reconnect_task
            except (asyncio.CancelledError, Exception):
                pass
        try:
            await self._client.aclose()
            await self._pool.disconnect()
        except Exception:  # closing a client of a dead server must not raise
            pass

    async def _run(self, what: str, command: Callable[[], Awaitable[T]]) -> T | None:
        if not self.available:
            return None
        try:
            async with self._slots:
                return await command()
        except _UNREACHABLE as exc:
            self._stats.l2_errors += 1
            self._go_degraded(what, exc)
        except RedisError as exc:
            self._stats.l2_errors += 1
            self._log_error(what, exc)
        except Exception:
            # A bug here must not fail the request that happened to use the cache.
            self._stats.l2_errors += 1
            logger.exception("unexpected error in redis %s", what)
        return None

    def _log_error(self, what: str, error: object) -> None:
        now = time.monotonic()
        if now - self._last_error_log.get(what, -_ERROR_LOG_INTERVAL_S) >= _ERROR_LOG_INTERVAL_S:
            self._last_error_log[what] = now
            logger.warning("redis %s failed: %s (counted in l2_errors; logged at most once a minute)", what, error)

    def _go_degraded(self, what: str, exc: BaseException) -> None:
        if not self._available or self._closed:
            return
        self._available = False
        self._stats.degraded = 1
        self._stats.degraded_transitions += 1
        logger.warning(
            "redis unreachable (%s: %r); serving features from process memory only, "
            "reconnecting with backoff",
            what,
            exc,
        )
        self._reconnect_task = asyncio.get_running_loop().create_task(self._reconnect())

    async def _reconnect(self) -> None:
        delay = self._config.backoff_initial_s
        while not self._closed:
            await asyncio.sleep(delay)
            # Connections pooled before the outage point at a dead socket.
            try:
                await self._pool.disconnect(inuse_connections=False)
            except Exception:
                pass  # closing a dead socket may complain; the ping decides
            try:
                await self._client.ping()
            except Exception as exc:
                logger.debug("redis still unreachable (%r); next try in %.1f s", exc, delay)
                delay = min(2 * delay, self._config.backoff_max_s)
                continue
            self._available = True
            self._stats.degraded = 0
            self._stats.reconnects += 1
            logger.warning("redis reachable again; shared feature cache restored")
            return


def groups_by_size(sizes: Sequence[int], budget: int) -> list[list[int]]:
    """Indexes into sizes, in order, grouped so each group adds up to at most budget (or is one item)."""
    groups: list[list[int]] = []
    total = budget + 1
    for i, size in enumerate(sizes):
        if total + size > budget:
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += size
    return groups
