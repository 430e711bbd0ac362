"""CacheConfig defaults and validation."""

import pytest
from pydantic import ValidationError

from cache_service.config import CacheConfig


def test_defaults():
    config = CacheConfig()
    assert config.redis_url == "redis://127.0.0.1:6379/0"
    assert config.namespace == "iris"
    assert config.l1_max_bytes == 1 << 30
    assert config.ttl_s == 86400
    assert config.max_value_bytes == 64 << 20
    assert config.redis_timeout_s == 0.25
    assert CacheConfig(redis_url=None).redis_url is None
    assert all(field.description for field in CacheConfig.model_fields.values())


@pytest.mark.parametrize(
    "bad",
    [
        {"ttl_s": 0},
        {"l1_max_bytes": -1},
        {"max_value_bytes": 0},
        {"redis_timeout_s": -0.1},
        {"redis_pool_size": 0},
        {"backoff_initial_s": 2, "backoff_max_s": 1},
        {"single_flight_poll_s": 5, "single_flight_wait_s": 1},
        {"namespace": "has:colon"},
        {"redis_url": "http://127.0.0.1:6379"},
        {"no_such_setting": 1},
    ],
)
def test_invalid_settings_are_rejected(bad):
    with pytest.raises(ValidationError):
        CacheConfig(**bad)
