"""Throughput and latency of the feature cache, per tier, for VLM-sized features.

    python -m bench cache [--iters 60] [--redis-url redis://127.0.0.1:6379/0]

Measures, for LLaVA-1.5 features (576x4096 bf16, 4.7 MB) and Qwen2-VL ones
(1024x3584 bf16 + image_grid_thw int64[1,3], 7.3 MB):
- codec: encode, decode (zero-copy, the cache's path) and decode with copy;
- L1: put_many / get_many of one entry (Redis off);
- L2: put_many / get_many of one entry with L1 disabled, so every get is a
  Redis GET + checksum + decode; also a batch of 8 entries per get_many;
- the bare redis-py GET of the same value, to separate client from codec.
Prints a table and writes bench/results/cache_bench.json. Writes only keys
under a private namespace, deleted at the end (never flushes Redis).
"""

from __future__ import annotations

import asyncio
import sys
import uuid
from pathlib import Path

import redis
import redis.asyncio as aredis
import torch
from redis.utils import HIREDIS_AVAILABLE

from bench.harness import results
from bench.harness.stats import distribution, timed, timed_async
from bench.harness.systems import delete_namespace
from cache_service.codec import decode, encode
from cache_service.config import CacheConfig
from cache_service.feature_cache import FeatureCache
from cache_service.features import Features


def llava_features() -> Features:
    return Features({"image_embeds": torch.randn(576, 4096).to(torch.bfloat16)}, {"num_tokens": 576})


def qwen2_vl_features() -> Features:
    return Features(
        {
            "image_embeds": torch.randn(1024, 3584).to(torch.bfloat16),
            "image_grid_thw": torch.tensor([[1, 64, 64]], dtype=torch.int64),
        },
        {"num_tokens": 1024},
    )


def summarise(name: str, nbytes: int, seconds: list[float]) -> dict:
    ms = distribution(seconds, 1e3, qs=(50, 99))
    row = {
        "op": name,
        "bytes": nbytes,
        "iters": len(seconds),
        "p50_ms": round(ms["p50"], 3),
        "p99_ms": round(ms["p99"], 3),
        "mean_ms": round(ms["mean"], 3),
        # Throughput of the median call, and of the whole run.
        "p50_MBps": round(nbytes / ms["p50"] / 1e3, 1),
        "mean_MBps": round(nbytes * len(seconds) / sum(seconds) / 1e6, 1),
    }
    print(
        f"{name:<34} {nbytes / 1e6:8.2f} MB  p50 {row['p50_ms']:8.3f} ms  p99 {row['p99_ms']:8.3f} ms"
        f"  {row['p50_MBps']:9.1f} MB/s (p50)  {row['mean_MBps']:9.1f} MB/s (mean)"
    )
    return row


async def bench_family(label: str, features: Features, args, namespace: str) -> list[dict]:
    rows = []
    nbytes = features.nbytes
    value = encode(features)
    value_bytes = bytes(value)

    # -- codec
    rows.append(summarise(f"{label} codec encode", nbytes, timed(lambda: encode(features), args.iters)))
    rows.append(summarise(f"{label} codec decode (zero-copy)", nbytes, timed(lambda: decode(value_bytes), args.iters)))
    rows.append(
        summarise(f"{label} codec decode (copy)", nbytes, timed(lambda: decode(value_bytes, copy=True), args.iters))
    )

    # -- L1 only
    l1 = FeatureCache(CacheConfig(redis_url=None, namespace=namespace, l1_max_bytes=1 << 30))
    key = f"{namespace}:{label}:0"
    rows.append(
        summarise(f"{label} L1 put", nbytes, await timed_async(lambda: l1.put_many([(key, features)]), args.iters))
    )
    rows.append(summarise(f"{label} L1 get", nbytes, await timed_async(lambda: l1.get_many([key]), args.iters)))
    await l1.close()

    # -- L2 with L1 disabled: every get goes to Redis
    l2 = FeatureCache(CacheConfig(redis_url=args.redis_url, namespace=namespace, l1_max_bytes=0, redis_timeout_s=2.0))
    rows.append(
        summarise(f"{label} L2 put", nbytes, await timed_async(lambda: l2.put_many([(key, features)]), args.iters))
    )

    async def l2_get():
        [got] = await l2.get_many([key])
        assert got is not None

    rows.append(summarise(f"{label} L2 get", nbytes, await timed_async(l2_get, args.iters)))

    batch_keys = [f"{namespace}:{label}:b{i}" for i in range(8)]
    await l2.put_many([(k, features) for k in batch_keys])

    async def l2_get_batch():
        got = await l2.get_many(batch_keys)
        assert all(g is not None for g in got)

    rows.append(
        summarise(f"{label} L2 get batch of 8", 8 * nbytes, await timed_async(l2_get_batch, max(10, args.iters // 4)))
    )

    stats = l2.stats()
    assert stats["degraded_transitions"] == 0, "Redis went degraded during the benchmark"
    await l2.close()

    # Realistic L2 hits: each value read once and kept (promoted into L1), so
    # every read lands in fresh memory instead of reusing the last buffer.
    distinct = [f"{namespace}:{label}:d{i}" for i in range(min(args.iters, 40))]
    writer = FeatureCache(
        CacheConfig(redis_url=args.redis_url, namespace=namespace, l1_max_bytes=0, redis_timeout_s=2.0)
    )
    await writer.put_many([(k, features) for k in distinct])
    await writer.close()
    reader = FeatureCache(
        CacheConfig(redis_url=args.redis_url, namespace=namespace, l1_max_bytes=1 << 30, redis_timeout_s=2.0)
    )
    todo = iter(distinct)

    async def l2_get_promoted():
        [got] = await reader.get_many([next(todo)])
        assert got is not None

    rows.append(
        summarise(f"{label} L2 get, kept in L1", nbytes, await timed_async(l2_get_promoted, len(distinct), warmup=0))
    )
    assert reader.stats()["l2_hits"] == len(distinct)
    await reader.close()

    # -- bare redis-py GET of the encoded value (the client's share of an L2 get)
    client = aredis.Redis.from_url(args.redis_url)
    await client.set(key, value_bytes)
    rows.append(
        summarise(
            f"{label} redis-py GET only", len(value_bytes), await timed_async(lambda: client.get(key), args.iters)
        )
    )
    await client.aclose()
    return rows


def main(argv: list[str]) -> None:
    parser = results.parser("cache", __doc__)
    parser.add_argument("--iters", type=int, default=60)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--out", type=Path, default=results.RESULTS_DIR / "cache_bench.json")
    args = parser.parse_args(argv)
    record = results.provenance(results.command_line("cache", argv))
    rows, versions = asyncio.run(run(args))
    results.save({**record, "versions": versions, "rows": rows}, args.out)
    print(f"wrote {args.out}")


async def run(args) -> tuple[list[dict], dict]:
    namespace = f"irisbench-{uuid.uuid4().hex[:8]}"
    torch.manual_seed(0)

    sync_client = redis.Redis.from_url(args.redis_url)
    server = sync_client.info("server")
    print(
        f"redis {server['redis_version']}, redis-py {redis.__version__}, hiredis parser: {HIREDIS_AVAILABLE}, "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads)"
    )
    rows = []
    try:
        rows += await bench_family("llava", llava_features(), args, namespace)
        rows += await bench_family("qwen2vl", qwen2_vl_features(), args, namespace)
    finally:
        delete_namespace(sync_client, namespace)
        sync_client.close()
    versions = {
        "redis_server": server["redis_version"],
        "redis_py": redis.__version__,
        "hiredis": HIREDIS_AVAILABLE,
        "torch": torch.__version__,
    }
    return rows, versions


if __name__ == "__main__":
    sys.exit("run it as: python -m bench cache [options]")
