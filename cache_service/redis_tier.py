"""RedisTier: the FeatureStore (store.py) on Redis, one server or a Redis Cluster, with
degraded mode per shard when one is unreachable.

Every method handles all the keys it is given in pipelines, one per shard, run
concurrently (one round trip each, or a few for large values: see set_many). One
Redis is one shard; in a Redis Cluster (`redis_cluster: true`) a shard is a master,
and a pipeline carries one command per key, so keys of different hash slots on one
master can share it. Nothing raises when Redis cannot be used: the cache is an
optimisation, so a Redis failure turns into a miss, never into a failed request.
A method returns None when no shard could be asked, else per key the answer, or the
"miss" answer (None, False) for keys of a shard that is down.

Degraded mode, per shard: a connection error marks the shard down, and so do replies (one
value's, for values) that take longer than `redis_timeout_s` when they go on with no reply in
between (`Outage` in redis_client.py); one slow reply is a miss of its own keys only. Its keys are misses at
once (no waiting on a dead server per request), one warning is logged, and a background
task pings it with exponential backoff (`backoff_initial_s` doubling up to
`backoff_max_s`) until it answers; in a cluster it first reloads the slot map, so a
master that failed over is replaced by its promoted replica. The other shards keep
serving hits meanwhile.

A Redis Cluster must run with `cluster-require-full-coverage no`, else every master
refuses all keys while one master's slots are uncovered (docs/operations.md).

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
- Any recent Redis (the commands used are GET, SET NX PX, EXISTS, DEL, PEXPIRE, EVAL,
  PING; CLUSTER SLOTS in cluster mode); tested on 7.0.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from redis.asyncio import ConnectionPool, RedisCluster
from redis.exceptions import RedisError

from cache_service.config import CacheConfig
from cache_service.redis_client import REDIS_ERRORS, UNREACHABLE, Backoff, Outage, connect
from cache_service.stats import CacheStats
from cache_service.store import Buffer

logger = logging.getLogger(__name__)

T = TypeVar("T")
# Values are SET in pipelines of at most this many bytes: redis-py sends a whole
# pipeline under one socket timeout, so one pipeline of many large values could
# time out under CPU load although Redis is healthy.
PIPELINE_BYTES = 10 << 20

# Deletes a lock that still holds our token; a lock that expired and was taken
# by another replica meanwhile is left alone. One key per call: a cluster runs a
# script only on keys of one slot.
_RELEASE_LOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

_ERROR_LOG_INTERVAL_S = 60.0  # e.g. OOM under noeviction fails every write: log it once a minute


def lock_key(key: str) -> str:
    # keys.py escapes ':' inside fields, so a ":lock" suffix (one field more
    # than any value key) cannot equal a value key.
    return f"{key}:lock"


# The shard of every key of a single Redis, and of a cluster whose slot map cannot be loaded.
WHOLE = "redis"


class RedisTier:
    def __init__(self, config: CacheConfig, stats: CacheStats):
        assert config.redis_url is not None
        self._config = config
        self._stats = stats
        self._client = connect(config, "iris-feature-cache", max_connections=config.redis_pool_size)
        self._pool: ConnectionPool | None = None if config.redis_cluster else self._client.connection_pool
        # Commands queue here rather than exceed the pool, which would raise.
        self._slots = asyncio.Semaphore(config.redis_pool_size)
        self._down: dict[str, asyncio.Task] = {}  # shard -> its reconnect task
        self._outages: dict[str, Outage] = {}  # shard -> its recent timeouts
        self._closed = False
        self._last_error_log: dict[str, float] = {}

    @property
    def available(self) -> bool:
        """False while Redis as a whole cannot be asked (one Redis down; no cluster slot map)."""
        return WHOLE not in self._down and not self._closed

    @property
    def shards_down(self) -> list[str]:
        return sorted(self._down)

    # -- values ---------------------------------------------------------------

    async def get_many(self, keys: Sequence[str]) -> list[Buffer | None] | None:
        # A pipeline of GETs rather than one MGET: redis-py's reply timeout
        # then applies per value, so a batch of large values cannot trip it.
        return await self._per_shard("GET", keys, lambda pipe, key: pipe.get(key), None)

    async def set_many(self, items: Sequence[tuple[str, Buffer]], ttl_ms: int) -> list[bool] | None:
        values = dict(items)

        async def command(keys: list[str]) -> list[bool]:
            replies: list = []
            for group in groups_by_size([memoryview(values[k]).nbytes for k in keys], PIPELINE_BYTES):
                async with self._client.pipeline(transaction=False) as pipe:
                    for i in group:
                        pipe.set(keys[i], values[keys[i]], px=ttl_ms)
                    replies += await pipe.execute(raise_on_error=False)
            failed = [r for r in replies if isinstance(r, Exception)]
            if failed:
                self._stats.l2_errors += len(failed)
                self._log_error("SET", f"{len(failed)} of {len(keys)} values failed: {failed[0]}")
            return [r is True for r in replies]

        return await self._per_shard("SET", [k for k, _ in items], None, False, command)

    async def exists_many(self, keys: Sequence[str]) -> list[bool] | None:
        found = await self._per_shard("EXISTS", keys, lambda pipe, key: pipe.exists(key), 0)
        return None if found is None else [bool(n) for n in found]

    async def ping(self) -> bool:
        """True when every shard answers. One Redis that does not starts degraded mode, like any
        command; a cluster master that does not is left to the commands on its keys."""
        if not self.available:
            return False
        if isinstance(self._client, RedisCluster):
            try:
                return bool(await self._client.ping(target_nodes=RedisCluster.PRIMARIES))
            except REDIS_ERRORS:
                return False
        return bool(await self._run("PING", WHOLE, self._client.ping))

    async def delete_many(self, keys: Sequence[str]) -> None:
        # One DEL per key: a cluster refuses a DEL whose keys are in different slots.
        await self._per_shard("DEL", keys, lambda pipe, key: pipe.delete(key), None)

    async def expire_many(self, keys: Sequence[str], ttl_ms: int) -> None:
        await self._per_shard("PEXPIRE", keys, lambda pipe, key: pipe.pexpire(key, ttl_ms), None)

    # -- single-flight locks --------------------------------------------------

    async def claim_many(self, keys: Sequence[str], token: str, ttl_ms: int) -> list[tuple[bool, bool]] | None:
        """Try to lock each key for computing it; per key (we hold the lock, value present).
        A key of a shard that is down counts as held and absent: computed here, as without Redis.

        The value's presence is read in the same round trip, after the SET NX:
        a replica that finished between our miss and this call has already
        written its value (values are written before locks are released), so
        we see it and do not compute again. Comparing the lock to our token,
        rather than trusting SET's reply, keeps a retried pipeline from
        mistaking our own lock for another's. A key and its lock may live on
        different masters of a cluster: each has its own pipeline.
        """
        owner = token.encode()
        locks = await self._per_shard(
            "claim",
            [lock_key(k) for k in keys],
            lambda pipe, lock: (pipe.set(lock, token, nx=True, px=ttl_ms), pipe.get(lock)),
            [None, owner],
            replies_per_key=2,
        )
        present = await self.exists_many(keys)
        if locks is None or present is None:
            return None
        return [(lock[1] == owner, exists) for lock, exists in zip(locks, present)]

    async def release_many(self, keys: Sequence[str], token: str) -> None:
        await self._per_shard(
            "release", [lock_key(k) for k in keys], lambda pipe, lock: pipe.eval(_RELEASE_LOCK, 1, lock, token), None
        )

    async def poll_many(self, keys: Sequence[str]) -> list[tuple[bool, bool]] | None:
        """Per key: (value present, lock present), without transferring values."""
        values, locks = await asyncio.gather(self.exists_many(keys), self.exists_many([lock_key(k) for k in keys]))
        if values is None or locks is None:
            return None
        return list(zip(values, locks))

    # -- shards ---------------------------------------------------------------

    async def _per_shard(
        self,
        what: str,
        keys: Sequence[str],
        add: Callable | None,
        failed: object,
        command: Callable[[list[str]], Awaitable[list]] | None = None,
        replies_per_key: int = 1,
    ) -> list | None:
        """Per key the reply of `add(pipe, key)`'s command(s), one pipeline per shard, the shards
        concurrently (or `command(keys of a shard)` in place of the pipeline); `failed` for keys
        of a shard that is down or fails. None when no shard answered."""
        if not keys or not self.available:
            return None if keys else []
        try:
            shards = await self._shards(keys)
        except UNREACHABLE as exc:
            self._stats.l2_errors += 1
            self._shard_down(WHOLE, what, exc)
            return None
        except Exception as exc:  # e.g. a slot no master covers: these keys are misses this time
            self._stats.l2_errors += 1
            self._log_error(what, exc)
            return None

        async def pipeline(shard_keys: list[str]) -> list:
            async with self._client.pipeline(transaction=False) as pipe:
                for key in shard_keys:
                    add(pipe, key)
                replies = await pipe.execute()
            n = replies_per_key
            return replies if n == 1 else [replies[i : i + n] for i in range(0, len(replies), n)]

        results: list = [failed] * len(keys)
        answered = await asyncio.gather(
            *(
                self._run_shard(what, shard, [keys[i] for i in indexes], command or pipeline, indexes, results)
                for shard, indexes in shards.items()
            )
        )
        return results if any(answered) else None

    async def _run_shard(
        self, what: str, shard: str, shard_keys: list[str], command: Callable, indexes: list[int], results: list
    ) -> bool:
        if shard in self._down:
            return False
        replies = await self._run(what, shard, lambda: command(shard_keys))
        if replies is None:
            return False
        for i, reply in zip(indexes, replies):
            results[i] = reply
        return True

    async def _shards(self, keys: Sequence[str]) -> dict[str, list[int]]:
        """Indexes into keys by the shard that holds each key."""
        if not isinstance(self._client, RedisCluster):
            return {WHOLE: list(range(len(keys)))}
        await self._client.initialize()  # loads the slot map the first time; a no-op after
        shards: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            shards.setdefault(self._client.get_node_from_key(key).name, []).append(i)
        return shards

    # -- availability ---------------------------------------------------------

    async def close(self) -> None:
        self._closed = True
        tasks = list(self._down.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        try:
            await self._client.aclose()
            if self._pool is not None:
                await self._pool.disconnect()
        except Exception:  # closing a client of a dead server must not raise
            pass

    async def _run(self, what: str, shard: str, command: Callable[[], Awaitable[T]]) -> T | None:
        outage = self._outages.get(shard) or self._outages.setdefault(shard, Outage(self._config))
        try:
            async with self._slots:
                reply = await command()
            outage.answered()
            return reply
        except UNREACHABLE as exc:
            self._stats.l2_errors += 1
            if outage.is_down_after(exc):
                self._shard_down(shard, what, exc)
            else:
                self._log_error(what, f"{exc!r} (a slow reply: its keys are misses this time)")
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

    def _shard_down(self, shard: str, what: str, exc: BaseException) -> None:
        if shard in self._down or self._closed:
            return
        self._down[shard] = asyncio.get_running_loop().create_task(self._reconnect(shard))
        self._stats.degraded = len(self._down)
        self._stats.degraded_transitions += 1
        where = "redis" if shard == WHOLE else f"redis cluster master {shard}"
        logger.warning(
            "%s unreachable (%s: %r); its keys are misses, served from process memory only, reconnecting with backoff",
            where,
            what,
            exc,
        )

    async def _reconnect(self, shard: str) -> None:
        backoff = Backoff(self._config)
        while not self._closed:
            await asyncio.sleep(backoff.failed())
            try:
                if await self._answers(shard):
                    break
            except Exception as exc:
                logger.debug("redis %s still unreachable (%r); next try in %.1f s", shard, exc, backoff.delay_s)
        else:
            return
        del self._down[shard]
        self._outages.pop(shard, None)
        self._stats.degraded = len(self._down)
        self._stats.reconnects += 1
        logger.warning("redis %s reachable again; its keys are shared again", shard)

    async def _answers(self, shard: str) -> bool:
        """Whether `shard`'s keys can be served again (raises while not)."""
        if not isinstance(self._client, RedisCluster):
            # Connections pooled before the outage point at a dead socket.
            try:
                await self._pool.disconnect(inuse_connections=False)
            except Exception:
                pass  # closing a dead socket may complain; the ping decides
            return bool(await self._client.ping())
        await self._client.nodes_manager.initialize()  # after a failover the slots belong to the promoted replica
        if shard == WHOLE:
            return True
        node = self._client.get_node(node_name=shard)
        if node is None or node not in self._client.get_primaries():
            return True  # no longer a master: its slots moved elsewhere
        return bool(await self._client.ping(target_nodes=node))


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
