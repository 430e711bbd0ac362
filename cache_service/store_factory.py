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
    cannot be asked (logged), as a miss."""
    from cache_service.redis_client import REDIS_ERRORS, connect_blocking

    client = connect_blocking(config, client_name)

    def read(key: str) -> bytes | None:
        try:
            return client.get(key)
        except REDIS_ERRORS as err:
            logger.warning("feature store read of %s failed: %s", key, err)
            return None

    return read
