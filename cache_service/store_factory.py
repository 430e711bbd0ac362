"""make_store: the one place that picks the cluster-wide tier's backend from the config."""

from __future__ import annotations

from cache_service.config import CacheConfig
from cache_service.redis_tier import RedisTier
from cache_service.stats import CacheStats
from cache_service.store import FeatureStore


def make_store(config: CacheConfig, stats: CacheStats) -> FeatureStore | None:
    """The store `config` names, counting its trouble in `stats`; None: no cluster-wide tier
    (the cache runs in process only)."""
    if config.redis_url is None:
        return None
    return RedisTier(config, stats)
