"""Soak: Iris under a mixed workload at saturation for several minutes, then checks.

    python -m bench soak --minutes 5            # writes bench/results/soak.json and soak.png

Starts Iris as the benchmark does (serve_config.yaml, a private Ray cluster, the shared
Redis with a namespace of its own), runs a closed loop of new, repeated, multi-turn,
upload-free and text-only conversations, and samples every serving process's RSS
(Serve replicas and vLLM's engine processes) over time. Afterwards it checks:

    rss         after warm-up, no process's RSS grows by more than 10% (median of the
                first and of the last minute after warm-up)
    ttl         every Redis key Iris wrote (its namespace) has a TTL
    locks       no single-flight lock outlives its expiry: each lock key left has a TTL
                no longer than cache.lock_ttl_s, and none is left lock_ttl_s after the load
                drained (a release that timed out under load leaves its lock to the TTL)
    errors      zero failed requests
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import psutil

from bench.harness import results, systems
from bench.harness.client import LoadClient, RequestRecord
from bench.harness.profiler import serving_processes
from bench.harness.stats import percentile
from bench.harness.workloads import WorkloadFactory

RSS_GROWTH_LIMIT = 0.10
WINDOW_S = 60.0  # RSS compared as medians over the first and the last window after warm-up


def mixed_conversations(seed: int):
    """Endless (index, conversation): each round of 48 mixes every kind, with new images each round."""
    index = itertools.count()
    for round_ in itertools.count():
        factory = WorkloadFactory(seed=seed * 100_000 + round_, small_px=128)
        round_convs = (
            factory.unique(8).conversations
            + factory.zipf(16).conversations
            + factory.multiturn(9).conversations
            + factory.upload_free(8).conversations
            + factory.text(8).conversations
        )
        random.Random(round_).shuffle(round_convs)
        for conv in round_convs:
            yield next(index), conv


# ----------------------------------------------------------------------------- analysis
def rss_growth(samples: list[dict], warmup_s: float, window_s: float = WINDOW_S) -> dict[str, dict]:
    """Per process: median RSS over the first and the last `window_s` after warm-up, and the growth."""
    by_name: dict[str, list[tuple[float, int]]] = {}
    for s in samples:
        if s["t"] >= warmup_s:
            by_name.setdefault(s["name"], []).append((s["t"], s["rss"]))
    out = {}
    for name, points in sorted(by_name.items()):
        end = points[-1][0]
        first = [r for t, r in points if t <= warmup_s + window_s]
        last = [r for t, r in points if t >= end - window_s]
        start_mb, end_mb = percentile(first, 50) / 2**20, percentile(last, 50) / 2**20
        out[name] = {
            "start_mb": round(start_mb, 1),
            "end_mb": round(end_mb, 1),
            "growth": round(end_mb / start_mb - 1, 4),
            "samples": len(points),
        }
    return out


def latency_over_time(records: list[RequestRecord], bin_s: float) -> list[dict]:
    """Per bin of request start times: requests, failures, TTFT and latency p50/p95 (ok requests)."""
    bins: dict[int, list[RequestRecord]] = {}
    for r in records:
        bins.setdefault(int(r.start_s // bin_s), []).append(r)
    out = []
    for b in sorted(bins):
        ok = [r for r in bins[b] if r.ok]
        lat = [r.latency_s for r in ok]
        ttft = [r.ttft_s for r in ok]
        out.append(
            {
                "t": b * bin_s,
                "requests": len(bins[b]),
                "errors": len(bins[b]) - len(ok),
                "latency_p50": percentile(lat, 50),
                "latency_p95": percentile(lat, 95),
                "ttft_p50": percentile(ttft, 50),
                "ttft_p95": percentile(ttft, 95),
            }
        )
    return out


def redis_key_checks(client, namespace: str, lock_ttl_s: float) -> dict:
    """TTLs of every key in Iris's namespace; lock keys separately (see cache_service/redis_tier.py)."""
    no_ttl, locks, keys = [], [], 0
    for key in client.scan_iter(match=f"{namespace}:*", count=1000):
        keys += 1
        pttl = client.pttl(key)
        if pttl == -1:
            no_ttl.append(key.decode(errors="replace"))
        if key.endswith(b":lock"):
            locks.append({"key": key.decode(errors="replace"), "pttl_ms": pttl})
    too_long = [lock for lock in locks if lock["pttl_ms"] == -1 or lock["pttl_ms"] > lock_ttl_s * 1000]
    return {"keys": keys, "keys_without_ttl": no_ttl, "lock_keys": locks, "locks_beyond_expiry": too_long}


def verdict(growth: dict, errors: int, keys: dict, locks_after_drain: int) -> dict:
    return {
        "rss": all(g["growth"] <= RSS_GROWTH_LIMIT for g in growth.values()),
        "errors": errors == 0,
        "ttl": not keys["keys_without_ttl"],
        "locks": not keys["locks_beyond_expiry"] and locks_after_drain == 0,
    }


# ----------------------------------------------------------------------------- run
async def _run(system, minutes: float, concurrency: int, sample_s: float, seed: int):
    roots = system.root_pids
    samples: list[dict] = []
    deadline = time.monotonic() + minutes * 60
    client = LoadClient(system.base_urls, systems.SERVED_NAME, timeout_s=300)
    load = asyncio.ensure_future(
        client.closed_loop_until(mixed_conversations(seed), 16, concurrency, lambda: time.monotonic() >= deadline)
    )
    t0 = time.perf_counter()
    while not load.done():
        t = time.perf_counter() - t0
        for name, pid in serving_processes(roots).items():
            try:
                rss = psutil.Process(pid).memory_info().rss
                samples.append({"t": round(t, 2), "name": name, "pid": pid, "rss": rss})
            except psutil.Error:
                pass
        await asyncio.wait([load], timeout=sample_s)
    records, duration = await load
    return records, duration, samples


def plot(path: Path, samples: list[dict], latency: list[dict], warmup_s: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 8), sharex=True)
    for name in sorted({s["name"] for s in samples}):
        pts = [(s["t"], s["rss"] / 2**20) for s in samples if s["name"] == name]
        ax1.plot([p[0] for p in pts], [p[1] for p in pts], label=name)
    ax1.axvline(warmup_s, color="grey", linestyle="--", label="end of warm-up")
    ax1.set_ylabel("RSS (MiB)")
    ax1.set_title("RSS of every serving process")
    ax1.legend(fontsize=7, ncol=2)
    for key, style in (("latency_p50", "-"), ("latency_p95", "--"), ("ttft_p50", "-"), ("ttft_p95", "--")):
        pts = [(b["t"], b[key]) for b in latency if b[key] is not None]
        ax2.plot([p[0] for p in pts], [p[1] for p in pts], style, label=key)
    ax2.set_xlabel("seconds since the load started")
    ax2.set_ylabel("seconds")
    ax2.set_title("Latency over time (requests binned by start time)")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    parser = results.parser("soak", __doc__)
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--warmup-s", type=float, default=None, help="default: a fifth of the run")
    parser.add_argument("--concurrency", type=int, default=8, help="closed-loop clients")
    parser.add_argument("--sample-s", type=float, default=2.0, help="RSS sampling interval")
    parser.add_argument("--model", default="builtin:tiny-llava")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(results.RESULTS_DIR / "soak.json"))
    args = parser.parse_args(argv)

    from pipeline.model.source import checkpoint_dtype, resolve_model

    record = results.provenance(results.command_line("soak", argv))
    checkpoint = resolve_model(args.model)
    dtype = checkpoint_dtype(checkpoint)
    warmup_s = args.warmup_s if args.warmup_s is not None else args.minutes * 60 / 5
    system = systems.start(
        "iris", 1, systems.EngineSettings(checkpoint, dtype), Path(tempfile.mkdtemp(prefix="iris-soak-logs-"))
    )
    try:
        records, duration, samples = asyncio.run(_run(system, args.minutes, args.concurrency, args.sample_s, args.seed))
        import redis

        cache = system.meta["config"]["applications"][0]["args"]["cache"]
        lock_ttl_s = cache.get("lock_ttl_s", 30.0)
        client = redis.Redis(host="127.0.0.1", port=6379)
        keys = redis_key_checks(client, system.namespace, lock_ttl_s)
        time.sleep(2)  # write-behind and lock releases of the last requests

        def count_locks() -> int:
            return sum(1 for _ in client.scan_iter(match=f"{system.namespace}:*:lock", count=1000))

        # A release that timed out under load leaves its lock to the TTL, the designed
        # backstop; what must not happen is a lock that outlives it.
        locks_2s_after_drain = count_locks()
        time.sleep(lock_ttl_s)
        locks_after_drain = count_locks()
    finally:
        system.stop()
    errors = [r.to_dict() for r in records if not r.ok]
    growth = rss_growth(samples, warmup_s, min(WINDOW_S, (duration - warmup_s) / 3))
    latency = latency_over_time(records, bin_s=10.0)
    checks = verdict(growth, len(errors), keys, locks_after_drain)
    out = Path(args.out)
    result = {
        **record,
        "model": args.model,
        "concurrency": args.concurrency,
        "duration_s": round(duration, 1),
        "warmup_s": warmup_s,
        "requests": len(records),
        "errors": len(errors),
        "error_samples": errors[:5],
        "checks": checks,
        "passed": all(checks.values()),
        "rss_growth": growth,
        "redis": {
            **keys,
            "lock_keys": keys["lock_keys"][:20],
            "keys_without_ttl": keys["keys_without_ttl"][:20],
            "locks_2s_after_drain": locks_2s_after_drain,
            "locks_after_drain": locks_after_drain,
        },
        "latency_over_time": latency,
        "rss_samples": samples,
    }
    results.save(result, out)
    plot(out.with_suffix(".png"), samples, latency, warmup_s)
    print(json.dumps({k: result[k] for k in ("duration_s", "requests", "errors", "checks", "passed")}))
    for name, g in growth.items():
        print(f"  {name:40s} {g['start_mb']:8.1f} -> {g['end_mb']:8.1f} MiB ({g['growth']:+.1%})")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit("run it as: python -m bench soak [options]")
