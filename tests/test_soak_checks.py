"""bench/soak.py's checks on synthetic samples and a real Redis namespace: each one can fail."""

from bench.harness.client import RequestRecord
from bench.soak import latency_over_time, redis_key_checks, rss_growth, verdict

MiB = 2**20


def _samples(name: str, start_mb: float, end_mb: float, seconds: int = 300) -> list[dict]:
    # Warm-up spike, then a linear ramp from start_mb to end_mb.
    out = [{"t": t, "name": name, "pid": 1, "rss": int(3 * start_mb * MiB)} for t in range(0, 60, 5)]
    out += [
        {"t": t, "name": name, "pid": 1, "rss": int((start_mb + (end_mb - start_mb) * (t - 60) / (seconds - 60)) * MiB)}
        for t in range(60, seconds + 1, 5)
    ]
    return out


def test_rss_growth_ignores_warmup_and_flags_a_leak():
    growth = rss_growth(_samples("steady", 1000, 1020) + _samples("leaky", 1000, 1400), warmup_s=60, window_s=30)
    assert growth["steady"]["growth"] < 0.10 < growth["leaky"]["growth"]
    assert 1000 <= growth["steady"]["start_mb"] < 1010  # the warm-up spike (3x) is not the baseline
    keys = {"keys_without_ttl": [], "locks_beyond_expiry": []}
    assert verdict({"steady": growth["steady"]}, 0, keys, 0) == {
        "rss": True,
        "errors": True,
        "ttl": True,
        "locks": True,
    }
    assert not verdict(growth, 0, keys, 0)["rss"]
    assert not verdict({}, 1, keys, 0)["errors"] and not verdict({}, 0, keys, 1)["locks"]


def test_latency_over_time_bins_and_counts_errors():
    records = [RequestRecord(0, 0, t, ok=True, ttft_s=0.1 * t, latency_s=0.2 * t) for t in (1, 2, 3, 11)]
    records.append(RequestRecord(1, 0, 12, ok=False, error="boom"))
    bins = latency_over_time(records, bin_s=10)
    assert [(b["t"], b["requests"], b["errors"]) for b in bins] == [(0, 3, 0), (10, 2, 1)]
    assert bins[0]["latency_p50"] == 0.4 and bins[1]["ttft_p95"] == 0.1 * 11


def test_redis_checks_find_keys_without_ttl_and_overlong_locks(raw_redis, namespace):
    raw_redis.set(f"{namespace}:a", b"x", px=60_000)
    raw_redis.set(f"{namespace}:b", b"x")  # no TTL
    raw_redis.set(f"{namespace}:a:lock", b"t", px=20_000)
    raw_redis.set(f"{namespace}:c:lock", b"t", px=90_000)  # longer than the lock TTL
    checks = redis_key_checks(raw_redis, namespace, lock_ttl_s=30)
    assert checks["keys"] == 4
    assert checks["keys_without_ttl"] == [f"{namespace}:b"]
    assert [lock["key"] for lock in checks["locks_beyond_expiry"]] == [f"{namespace}:c:lock"]
