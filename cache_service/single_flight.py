"""Single-flight for FeatureCache.get_or_compute_many: the keys one call missed are
computed once, in this process and across replicas (see feature_cache.py's docstring)."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cache_service.codec import Features

if TYPE_CHECKING:
    from cache_service.feature_cache import FeatureCache

logger = logging.getLogger(__name__)

Compute = Callable[[list[int]], Awaitable[list[Features]]]


@dataclass
class ComputeResult:
    features: Features
    computed: bool  # computed by this call (not found in a tier, not computed by another caller)
    shared: bool  # present in L2, visible to other replicas


class Abandoned(Exception):
    """The caller computing a key failed or was cancelled; joiners compute themselves."""


class Flight:
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
        self.stats = cache.counters
        self.l2 = cache.l2
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
            future = self.cache.flights.get(key)
            if future is not None:
                self.joined[key] = future
                self.stats.single_flight_local_waits += 1
            else:
                future = loop.create_future()
                self.cache.flights[key] = future
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
            if self.cache.flights.get(key) is future:
                del self.cache.flights[key]
            if not future.done():
                future.set_exception(Abandoned())
                future.exception()  # mark retrieved: nobody may be waiting on it
        if self.locked and self.l2 is not None:
            # Only after an error or a cancellation; released in the background
            # so a cancelled caller returns at once. The lock TTL is the backstop.
            self.cache.in_background(self.l2.release_many(list(self.locked), self.token))
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
        claims = await self.l2.claim_many(keys, self.token, self.cache.lock_ttl_ms) if self.cache.redis_available else None
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
        values = await self.cache.read_l2(keys)
        resolved = set()
        for key, features in zip(keys, values or [None] * len(keys)):
            if features is not None:
                self._resolve(key, features, computed=False, shared=True)
                resolved.add(key)
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
                self.cache.remember(key, host)  # local readers hit at once
            locked = [k for k in keys if k in self.locked]
            self.locked.difference_update(locked)  # the background task releases them
            self.cache.in_background(self._store_then_release(list(zip(keys, on_host)), locked))
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
            except Abandoned:
                failed.append(key)
                continue
            self._resolve(key, features, computed=False, shared=shared)
        return failed
