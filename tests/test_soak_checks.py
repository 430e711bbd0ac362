"""bench/soak.py's checks on synthetic samples and a real Redis namespace: each one can fail."""

import json

from bench.harness.client import RequestRecord
from bench.soak import documented_failure, latency_over_time, redis_key_checks, rss_growth, verdict

MiB = 2**20


def _samples(name: str, start_mb: float, end_mb: float, seconds: int = 300, pid: int = 1, born: int = 0) -> list[dict]:
    # Warm-up spike, then a linear ramp from start_mb to end_mb.
    out = [{"t": t, "name": name, "pid": pid, "rss": int(3 * start_mb * MiB)} for t in range(born, born + 60, 5)]
    out += [
        {
            "t": t,
            "name": name,
            "pid": pid,
            "rss": int((start_mb + (end_mb - start_mb) * (t - born - 60) / (seconds - born - 60)) * MiB),
        }
        for t in range(born + 60, seconds + 1, 5)
    ]
    return out


def test_rss_growth_ignores_warmup_and_flags_a_leak():
    growth = rss_growth(_samples("steady", 1000, 1020) + _samples("leaky", 1000, 1400, pid=2), warmup_s=60, window_s=30)
    steady, leaky = growth["steady (pid 1)"], growth["leaky (pid 2)"]
    assert steady["growth"] < 0.10 < leaky["growth"]
    assert 1000 <= steady["start_mb"] < 1010  # the warm-up spike (3x) is not the baseline
    keys = {"keys_without_ttl": [], "locks_beyond_expiry": []}
    assert verdict({"steady": steady}, 0, keys, 0) == {
        "rss": True,
        "errors": True,
        "hung": True,
        "ttl": True,
        "locks": True,
    }
    assert not verdict(growth, 0, keys, 0)["rss"]
    assert not verdict({}, 1, keys, 0)["errors"] and not verdict({}, 0, keys, 1)["locks"]
    assert not verdict({}, 0, keys, 0, late=1)["hung"]


def test_shared_pages_are_not_judged_private_memory_is():
    """Ray's object store and vLLM's shared-memory caches, mapped in, fill to their configured sizes:
    a process whose shared pages grow passes; the same RSS curve in private memory fails."""
    rss = _samples("decode", 1000, 1400)
    shared = [{**s, "shared": s["rss"] - 1000 * MiB} for s in rss]  # all growth in shared pages
    assert rss_growth(shared, warmup_s=60, window_s=30)["decode (pid 1)"]["growth"] == 0
    assert rss_growth(rss, warmup_s=60, window_s=30)["decode (pid 1)"]["growth"] > 0.10


def test_a_replacement_warms_up_from_its_own_start_and_a_short_life_is_not_judged():
    """A replica that replaced a killed one: its start-up spike is not its baseline; one killed
    soon after warm-up (too few samples to judge) is left out rather than judged on noise."""
    samples = (
        _samples("encoder", 1000, 1010, seconds=130, pid=1)  # killed at 130 s: too short to judge
        + _samples("encoder", 1000, 1020, seconds=600, pid=2, born=130)  # its replacement
        + _samples("leaky", 1000, 1400, seconds=600, pid=3, born=130)
    )
    growth = rss_growth(samples, warmup_s=60, window_s=30)
    assert set(growth) == {"encoder (pid 2)", "leaky (pid 3)"}
    assert 1000 <= growth["encoder (pid 2)"]["start_mb"] < 1010 and growth["encoder (pid 2)"]["growth"] < 0.10
    assert growth["leaky (pid 3)"]["growth"] > 0.10


def test_only_documented_failures_pass():
    def failed(status, error):
        return RequestRecord(0, 0, 1.0, ok=False, status=status, error=json.dumps(error))

    error = {"message": "m", "type": "server_error", "param": None}
    assert documented_failure(failed(503, {"error": {**error, "code": "replica_unavailable"}}))
    assert documented_failure(failed(504, {"error": {**error, "code": "timeout"}}))
    assert documented_failure(failed(200, {**error, "code": "replica_unavailable"}))  # in-band, mid-stream
    assert not documented_failure(failed(500, {"error": {**error, "code": "internal_error"}}))
    assert not documented_failure(failed(503, {"error": {**error, "code": "timeout"}}))  # code and status disagree
    assert not documented_failure(failed(503, "upstream connect error"))  # not OpenAI's shape
    assert not documented_failure(RequestRecord(0, 0, 1.0, ok=False, error="TimeoutError: "))  # hung: no answer


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
