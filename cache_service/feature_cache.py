"""FeatureCache: L1 in process + L2 in Redis, with single-flight computation.

Reads go L1 first, then one batched Redis read for the L1 misses; L2 hits are
promoted into L1. Writes go to both. `get_or_compute_many` adds single-flight:
when several callers miss on the same key at once, in this process or on any
replica, the features are computed once:

- in process, the first caller owns one future per key and later callers
  await it;
- across replicas, the owner takes a Redis lock per key (SET NX PX, expiring
  after `lock_ttl_s` in case the replica dies); a caller that finds the lock
  taken polls Redis until the value appears, and computes itself when
  `single_flight_wait_s` runs out (counted) or when the lock disappears
  without a value (the holder failed; the waiter takes the lock over).

A failed or cancelled computation makes the callers that joined it compute
for themselves, so each request only ever sees its own compute's errors.

With `write_behind=True` a computed value is returned as soon as it is in L1;
its Redis write and the lock release follow in a background task (in that
order, so a waiting replica still sees the value before the lock goes). The
serving path uses it: the request that computed the features gets them
directly and should not wait on a multi-megabyte SET.

Never raises because of Redis: when it is unreachable the cache serves L1 only
(see redis_tier.py). Everything runs in one asyncio event loop; nothing here is
thread-safe. Returned Features are shared with the cache: treat them as
read-only (see codec.py).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from cache_service.codec import CorruptValue, Features, decode, encode
from cache_service.config import CacheConfig
from cache_service.l1 import L1Cache
from cache_service.redis_tier import RedisTier
from cache_service.stats import CacheStats
from cache_service.validation import ValueCheck

logger = logging.getLogger(__name__)

Compute = Callable[[list[int]], Awaitable[list[Features]]]


@dataclass
class ComputeResult:
    features: Features
    computed: bool  # computed by this call (not found in a tier, not computed by another caller)
    shared: bool  # present in L2, visible to other replicas


class _Abandoned(Exception):
    """The caller computing a key failed or was cancelled; joiners compute themselves."""


class FeatureCache:
    def __init__(self, config: CacheConfig | None = None, check: ValueCheck | None = None):
        """`check`: what values read from Redis must satisfy beyond the checksum
        (model fingerprint, the family's shapes); None accepts any decodable value."""
        self.config = config or CacheConfig()
        self._check = check
        self._stats = CacheStats()
        self._l1 = L1Cache(self.config.l1_max_bytes)
        self._l2 = RedisTier(self.config, self._stats) if self.config.redis_url else None
        self._ttl_ms = max(1, round(self.config.ttl_s * 1000))
        self._lock_ttl_ms = max(1, round(self.config.lock_ttl_s * 1000))
        # key -> future of (Features, shared) for keys being computed by a call in this process.
        self._inflight: dict[str, asyncio.Future[tuple[Features, bool]]] = {}
        # Lock releases left running after a failed or cancelled call (strong refs).
        self._background: set[asyncio.Task] = set()

    @property
    def redis_available(self) -> bool:
        return self._l2 is not None and self._l2.available

    async def ping(self) -> bool:
        """True when Redis answers now (a failure starts degraded mode, like any command)."""
        return self._l2 is not None and await self._l2.ping()

    def stats(self) -> dict[str, int | float]:
        self._stats.l1_evictions = self._l1.evictions
        snapshot = self._stats.snapshot()
        snapshot["l1_bytes"] = self._l1.nbytes
        snapshot["l1_entries"] = len(self._l1)
        return snapshot

    async def close(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        if self._l2 is not None:
            await self._l2.close()

    # -- reads and writes -----------------------------------------------------

    async def get_many(self, keys: list[str]) -> list[Features | None]:
        return [None if hit is None else hit[0] for hit in await self._lookup(keys)]

    async def contains_many(self, keys: list[str]) -> list[bool]:
        present = [key in self._l1 for key in keys]
        missing = [i for i, p in enumerate(present) if not p]
        if missing and self.redis_available:
            in_l2 = await self._l2.exists_many([keys[i] for i in missing])
            for i, exists in zip(missing, in_l2 or []):
                present[i] = exists
        return present

    def remember(self, key: str, features: Features) -> None:
        """Keep features in L1 only: they were handed over directly and whoever
        computed them writes L2."""
        self._l1.put(key, features.cpu(), in_l2=False)

    async def put_many(self, items: list[tuple[str, Features]]) -> list[bool]:
        """Store in L1 and L2; True where the value is now in L2."""
        stored = [False] * len(items)
        writes: list[tuple[int, str, bytearray, Features]] = []
        for i, (key, features) in enumerate(items):
            features = features.cpu()  # L1 holds host memory, never device memory
            self._stats.puts += 1
            # L1 first, so concurrent readers hit while the Redis write is in flight.
            self._l1.put(key, features, in_l2=False)
            if not self.redis_available:
                continue  # no encoding work while degraded
            try:
                value = encode(features)
            except Exception:
                self._stats.encode_errors += 1
                logger.exception("cannot serialise features for %s; kept in process memory only", key)
                continue
            if len(value) > self.config.max_value_bytes:
                self._stats.oversize += 1
                continue
            writes.append((i, key, value, features))
        if writes:
            ok = await self._l2.set_many([(key, value) for _, key, value, _ in writes], self._ttl_ms)
            for (i, key, value, features), written in zip(writes, ok or [False] * len(writes)):
                if written:
                    stored[i] = True
                    self._stats.l2_bytes_written += len(value)
                    entry = self._l1.get(key)
                    if entry is not None and entry.features is features:
                        entry.in_l2 = True
        return stored

    async def _lookup(self, keys: list[str]) -> list[tuple[Features, bool] | None]:
        """Per key (features, known to be in L2) or None; L1, then one batched L2 read."""
        found: list[tuple[Features, bool] | None] = [None] * len(keys)
        missing: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            entry = self._l1.get(key)
            if entry is not None:
                self._stats.l1_hits += 1
                found[i] = (entry.features, entry.in_l2)
            else:
                self._stats.l1_misses += 1
                missing.setdefault(key, []).append(i)
        if not missing:
            return found
        values = await self._l2.get_many(list(missing)) if self.redis_available else None
        if values is None:
            if self._l2 is not None:
                self._stats.l2_skipped += len(missing)
            return found
        corrupt = []
        for (key, indexes), value in zip(missing.items(), values):
            features = self._accept_l2_value(key, value, corrupt)
            if features is None:
                self._stats.l2_misses += 1
                continue
            self._stats.l2_hits += 1
            for i in indexes:
                found[i] = (features, True)
        await self._delete_corrupt(corrupt)
        return found

    def _accept_l2_value(self, key: str, value: bytes | None, corrupt: list[str]) -> Features | None:
        """Decode a value read from Redis and promote it into L1; None if absent or corrupt."""
        if value is None:
            return None
        self._stats.l2_bytes_read += len(value)
        try:
            features = decode(value)
        except CorruptValue as exc:
            self._stats.corrupt += 1
            corrupt.append(key)
            logger.warning("corrupt cache value at %s (%s); deleted, treated as a miss", key, exc)
            return None
        problem = self._check.problem(key, features) if self._check is not None else None
        if problem is not None:
            # Well-formed but wrong for this model: stale, misplaced or forged.
            self._stats.rejected += 1
            corrupt.append(key)
            logger.warning("rejected cache value at %s (%s); deleted, treated as a miss", key, problem)
            return None
        self._l1.put(key, features, in_l2=True)
        return features

    async def _delete_corrupt(self, keys: list[str]) -> None:
        if keys:
            await self._l2.delete_many(keys)

    def _spawn(self, work: Awaitable) -> None:
        """Run `work` in the background, strongly referenced until done (close() awaits it)."""
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- single-flight --------------------------------------------------------

    async def get_or_compute_many(
        self, keys: list[str], compute: Compute, write_behind: bool = False
    ) -> list[ComputeResult]:
        """Features for every key, computing the missing ones once cluster-wide.

        `compute(indexes)` gets indexes into `keys` (the first index of a key
        that appears more than once) and returns one Features per index. It is
        called at most twice: once for the keys this call locked, and again for
        keys whose wait on another caller timed out or whose computing caller
        failed. Its exceptions propagate to the caller. With `write_behind`,
        computed results have shared=False: their Redis write is still running.
        """
        results: list[ComputeResult | None] = [None] * len(keys)
        positions: dict[str, list[int]] = {}  # key -> its indexes in keys, for misses
        for i, hit in enumerate(await self._lookup(keys)):
            if hit is not None:
                results[i] = ComputeResult(hit[0], computed=False, shared=hit[1])
            else:
                positions.setdefault(keys[i], []).append(i)
        if not positions:
            return results  # type: ignore[return-value]

        flight = _Flight(self, positions, results, compute, write_behind)
        try:
            await flight.run()
        finally:
            flight.finish()
        return results  # type: ignore[return-value]


class _Flight:
    """The single-flight state of one get_or_compute_many call over its missed keys."""

    def __init__(
        self,
        cache: FeatureCache,
        positions: dict[str, list[int]],
        results: list[ComputeResult | None],
        compute: Compute,
        write_behind: bool = False,
    ):
        self.cache = cache
        self.write_behind = write_behind
        self.stats = cache._stats
        self.l2 = cache._l2
        self.positions = positions
        self.results = results
        self.compute = compute
        self.token = uuid.uuid4().hex  # identifies our Redis locks
        self.owned: dict[str, asyncio.Future[tuple[Features, bool]]] = {}
        self.joined: dict[str, asyncio.Future[tuple[Features, bool]]] = {}
        self.locked: set[str] = set()  # keys whose Redis lock we hold

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for key in self.positions:
            future = self.cache._inflight.get(key)
            if future is not None:
                self.joined[key] = future
                self.stats.single_flight_local_waits += 1
            else:
                future = loop.create_future()
                self.cache._inflight[key] = future
                self.owned[key] = future

        compute_now, wait_for = await self._claim(list(self.owned))
        tasks = []
        if compute_now:
            tasks.append(asyncio.ensure_future(self._compute(compute_now)))
        if wait_for:
            tasks.append(asyncio.ensure_future(self._wait_for_other_replicas(wait_for)))
        if self.joined:
            tasks.append(asyncio.ensure_future(self._join_local()))
        try:
            outcomes = await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()  # no-op for finished tasks; stops the rest after an error
        # The second (and last) compute: waits that timed out, locks taken over
        # from a failed holder, and joins whose owner failed.
        again = [key for outcome in outcomes if outcome for key in outcome]
        if again:
            await self._compute(again)

    def finish(self) -> None:
        """Settle every future we own and release our locks, whatever happened."""
        for key, future in self.owned.items():
            if self.cache._inflight.get(key) is future:
                del self.cache._inflight[key]
            if not future.done():
                future.set_exception(_Abandoned())
                future.exception()  # mark retrieved: nobody may be waiting on it
        if self.locked and self.l2 is not None:
            # Only after an error or a cancellation; released in the background
            # so a cancelled caller returns at once. The lock TTL is the backstop.
            self.cache._spawn(self.l2.release_many(list(self.locked), self.token))
            self.locked.clear()

    def _resolve(
        self, key: str, features: Features, computed: bool, shared: bool, for_joiners: Features | None = None
    ) -> None:
        for i in self.positions[key]:
            self.results[i] = ComputeResult(features, computed=computed, shared=shared)
        future = self.owned.get(key)
        if future is not None and not future.done():
            future.set_result((features if for_joiners is None else for_joiners, shared))

    async def _claim(self, keys: list[str]) -> tuple[list[str], list[str]]:
        """Lock keys in Redis; returns (keys to compute now, keys another replica computes)."""
        if not keys:
            return [], []
        claims = await self.l2.claim_many(keys, self.token, self.cache._lock_ttl_ms) if self.cache.redis_available else None
        if claims is None:
            return keys, []  # no Redis: nothing to coordinate with, compute here
        held = {key for key, (is_holder, _) in zip(keys, claims) if is_holder}
        self.locked |= held
        # Values that another replica finished between our miss and the claim.
        done = await self._take_values([key for key, (_, exists) in zip(keys, claims) if exists])
        await self._release([k for k in done if k in held])
        compute_now = [k for k in keys if k in held and k not in done]
        wait_for = [k for k in keys if k not in held and k not in done]
        return compute_now, wait_for

    async def _take_values(self, keys: list[str]) -> set[str]:
        """Read keys' values from Redis and resolve those found; returns the keys resolved."""
        if not keys:
            return set()
        values = await self.l2.get_many(keys)
        corrupt: list[str] = []
        resolved = set()
        for key, value in zip(keys, values or [None] * len(keys)):
            features = self.cache._accept_l2_value(key, value, corrupt)
            if features is not None:
                self.stats.l2_hits += 1
                self._resolve(key, features, computed=False, shared=True)
                resolved.add(key)
        await self.cache._delete_corrupt(corrupt)
        return resolved

    async def _release(self, keys: list[str]) -> None:
        if keys:
            self.locked.difference_update(keys)
            await self.l2.release_many(keys, self.token)

    async def _compute(self, keys: list[str]) -> None:
        indexes = [self.positions[key][0] for key in keys]
        self.stats.compute_calls += 1
        features = await self.compute(indexes)
        if not isinstance(features, list) or len(features) != len(indexes):
            raise ValueError(f"compute returned {type(features).__name__} for {len(indexes)} indexes; need a list of that length")
        if not all(isinstance(f, Features) for f in features):
            raise TypeError("compute must return Features")
        self.stats.computations += len(keys)
        # The caller gets back what its compute returned (on its device); the
        # cache and other callers in this process get host copies.
        on_host = [f.cpu() for f in features]
        if self.write_behind:
            for key, host in zip(keys, on_host):
                self.cache._l1.put(key, host, in_l2=False)  # local readers hit at once
            locked = [k for k in keys if k in self.locked]
            self.locked.difference_update(locked)  # the background task releases them
            self.cache._spawn(self._store_then_release(list(zip(keys, on_host)), locked))
            for key, f, host in zip(keys, features, on_host):
                self._resolve(key, f, computed=True, shared=False, for_joiners=host)
            return
        # Write the values before releasing the locks: a waiter that sees the
        # lock gone without a value takes over and computes again.
        shared = await self.cache.put_many(list(zip(keys, on_host)))
        for key, f, host, in_l2 in zip(keys, features, on_host, shared):
            self._resolve(key, f, computed=True, shared=in_l2, for_joiners=host)
        await self._release([k for k in keys if k in self.locked])

    async def _store_then_release(self, items: list[tuple[str, Features]], locked: list[str]) -> None:
        try:
            await self.cache.put_many(items)
        finally:
            if locked:
                await self.l2.release_many(locked, self.token)

    async def _wait_for_other_replicas(self, keys: list[str]) -> list[str]:
        """Poll until another replica's values appear; returns keys to compute ourselves."""
        config = self.cache.config
        self.stats.single_flight_waits += len(keys)
        deadline = asyncio.get_running_loop().time() + config.single_flight_wait_s
        pending = list(keys)
        ours: list[str] = []
        while pending:
            await asyncio.sleep(config.single_flight_poll_s)
            states = await self.l2.poll_many(pending) if self.cache.redis_available else None
            if states is None:
                return ours + pending  # Redis gone: nobody can hand us the value
            ready = [k for k, (has_value, _) in zip(pending, states) if has_value]
            orphaned = [k for k, (has_value, has_lock) in zip(pending, states) if not has_value and not has_lock]
            if ready:
                resolved = await self._take_values(ready)
                orphaned += [k for k in ready if k not in resolved]  # evicted or corrupt since the poll
            if orphaned:
                # The holder failed (released or lock expired) without a value: take over.
                compute_now, _ = await self._claim(orphaned)
                ours.extend(compute_now)
            pending = [k for k in pending if self.results[self.positions[k][0]] is None and k not in ours]
            if pending and asyncio.get_running_loop().time() >= deadline:
                self.stats.single_flight_wait_timeouts += len(pending)
                logger.info("gave up waiting for %d keys computed elsewhere; computing here", len(pending))
                return ours + pending
        return ours

    async def _join_local(self) -> list[str]:
        """Await computations of other calls in this process; returns keys whose owner failed."""
        failed = []
        for key, future in self.joined.items():
            try:
                features, shared = await asyncio.shield(future)
            except _Abandoned:
                failed.append(key)
                continue
            self._resolve(key, features, computed=False, shared=shared)
        return failed
