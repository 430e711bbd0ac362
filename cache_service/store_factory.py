"""The one place that picks the cluster-wide tier's backend from the config: `make_store` for the
cache, `blocking_reader` for code outside an event loop (the EC connector in a vLLM engine)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from cache_service.config import CacheConfig
from cache_service.redis_tier import RedisTier
from cache_service.stats import CacheStats
from cache_service.store import FeatureStore

logger = logging.getLogger(__name__)


def make_store(config: CacheConfig, stats: CacheStats) -> FeatureStore | None:
    """The store `config` names, counting its trouble in `stats`; None: no cluster-wide tier
    (the cache runs in process only)."""
    if config.redis_url is None:
        return None
    return RedisTier(config, stats)


def blocking_reader(config: CacheConfig, client_name: str) -> Callable[[str], bytes | None]:
    """`read(key)`: the stored value of `key`, blocking; None when absent or when the store
    cannot be asked, as a miss. Bounded, since it runs in vLLM's scheduler: one try per read
    (no retries inside redis-py), each within `redis_timeout_s`; once the store is known down
    (a connection error, or timeouts going on: redis_client.Outage) no read asks it until the
    backoff has passed (`backoff_initial_s` doubling up to `backoff_max_s`), so a dead Redis
    costs the scheduler one timeout per backoff, not one per item."""
    from cache_service.redis_client import REDIS_ERRORS, UNREACHABLE, Backoff, Outage, connect_blocking

    client = connect_blocking(config, client_name)
    backoff, outage = Backoff(config), Outage(config)

    def read(key: str) -> bytes | None:
        if backoff.waiting:
            return None
        try:
            value = client.get(key)
        except UNREACHABLE as err:
            if outage.is_down_after(err):
                delay = backoff.failed()
                logger.warning("feature store unreachable (%r); reads are misses, next try in %.1f s", err, delay)
            return None
        except REDIS_ERRORS as err:
            logger.warning("feature store read of %s failed: %s", key, err)
            return None
        if backoff.failing:
            logger.warning("feature store reachable again")
        backoff.answered()
        outage.answered()
        return value

    return read
