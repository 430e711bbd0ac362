"""The feature plane: one Redis against a Redis Cluster, bytes per image, a capacity model.

    python -m bench feature-plane [--rounds 3] [--seconds 5] [--clients 8]

Starts a private `redis-server` with a replica and a private Redis Cluster (3 masters with a
replica each; bench/harness/redis_servers.py), and measures on each, in alternating rounds, the feature
cache's PUT and GET throughput (FeatureCache.put_many / get_many of one LLaVA-1.5-7B-sized
value per call, `--clients` concurrent callers, L1 off so every read is a Redis GET plus
the checksum and decode). Reports per round cluster ÷ one Redis and the median with its
range; the encoded bytes of one image's features in bf16 and in fp32; and, from the
measured GET rate, the images per second one shard carries for each family at real model
sizes (FAMILY_SIZES below). Writes bench/results/feature_plane.{json,md}.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from pathlib import Path

import torch

from bench.harness import results
from bench.harness.redis_servers import (
    RedisClusterProcesses,
    RedisProcess,
    free_node_port,
)
from bench.harness.stats import median_and_range, percentile
from cache_service.codec import encode
from cache_service.config import CacheConfig
from cache_service.feature_cache import FeatureCache
from cache_service.features import Features

# Features of one image at real model sizes: (image tokens, values per token), from the
# checkpoints' config.json (hidden_size of the language model, or the projector's output)
# and the family's token rule in vLLM. Not downloadable here; the arithmetic is below.
FAMILY_SIZES = {
    # 336 px / 14 px patches = 24 x 24 tokens; text hidden_size 4096.
    "LLaVA-1.5-7B": (24 * 24, 4096),
    # Same tower, text hidden_size 5120.
    "LLaVA-1.5-13B": (24 * 24, 5120),
    # A 1024 x 1024 image resized to 1036 x 1036 (multiples of 28 = patch 14 x merge 2):
    # 37 x 37 tokens; out_hidden_size 3584.
    "Qwen2.5-VL-7B, 1024x1024 image": (37 * 37, 3584),
    # 448 x 448: 16 x 16 tokens.
    "Qwen2.5-VL-7B, 448x448 image": (16 * 16, 3584),
    # Patch 16 x merge 2 = 32 px per token: 32 x 32 tokens; vLLM's Qwen3-VL features carry the
    # 3 deepstack levels beside the main one: out_hidden_size 4096 x 4.
    "Qwen3-VL-8B, 1024x1024 image": (32 * 32, 4096 * 4),
    # 256 tokens per image (mm_tokens_per_image); text hidden_size 2560.
    "Gemma-3-4B": (256, 2560),
    # 256 tokens per 448 px tile; a 448 x 448 image is one tile (larger ones: up to 12 tiles
    # and a thumbnail, each 256 tokens); hidden_size 3584.
    "InternVL3-8B, 448x448 image": (256, 3584),
}
BENCH_TOKENS, BENCH_HIDDEN = FAMILY_SIZES["LLaVA-1.5-7B"]
KEYS = 32  # distinct values read back, written in the PUT phase


def llava_features(dtype: torch.dtype) -> Features:
    return Features({"image_embeds": torch.randn(BENCH_TOKENS, BENCH_HIDDEN).to(dtype)}, {"num_tokens": BENCH_TOKENS})


async def throughput(url: str, cluster: bool, features: Features, clients: int, seconds: float) -> dict:
    """PUT then GET values per second through FeatureCache, `clients` concurrent callers."""
    config = CacheConfig(
        redis_url=url,
        redis_cluster=cluster,
        namespace="bench",
        l1_max_bytes=0,
        redis_timeout_s=5.0,
        redis_connect_timeout_s=5.0,
        redis_pool_size=max(16, clients),
    )
    cache = FeatureCache(config)
    keys = [f"bench:plane:{i}" for i in range(KEYS)]
    value_bytes = len(encode(features))

    async def run(call) -> float:
        done = 0
        deadline = time.perf_counter() + seconds

        async def caller(n: int) -> None:
            nonlocal done
            rng = random.Random(n)
            while time.perf_counter() < deadline:
                await call(rng)
                done += 1

        start = time.perf_counter()
        await asyncio.gather(*(caller(n) for n in range(clients)))
        return done / (time.perf_counter() - start)

    async def put(rng):
        assert await cache.put_many([(rng.choice(keys), features)]) == [True], "a PUT failed"

    async def get(rng):
        [got] = await cache.get_many([rng.choice(keys)])
        assert got is not None, "a GET missed"

    try:
        assert all(await cache.put_many([(k, features) for k in keys]))
        puts = await run(put)
        gets = await run(get)
        assert cache.stats()["degraded_transitions"] == 0, "Redis went degraded during the benchmark"
    finally:
        await cache.close()
    return {
        "put_per_s": round(puts, 1),
        "get_per_s": round(gets, 1),
        "put_MBps": round(puts * value_bytes / 1e6, 1),
        "get_MBps": round(gets * value_bytes / 1e6, 1),
    }


def capacity(get_per_s: float, bench_value_bytes: int) -> list[dict]:
    """Images per second one shard serves per family, from the measured GET rate in bytes."""
    shard_bytes_per_s = get_per_s * bench_value_bytes
    rows = []
    for family, (tokens, width) in FAMILY_SIZES.items():
        nbytes = tokens * width * 2  # bf16
        rows.append(
            {
                "family": family,
                "tokens": tokens,
                "values_per_token": width,
                "MB_per_image": round(nbytes / 1e6, 2),
                "images_per_s_per_shard": round(shard_bytes_per_s / nbytes, 1),
            }
        )
    return rows


async def measure(args) -> dict:
    torch.manual_seed(0)
    bf16, fp32 = llava_features(torch.bfloat16), llava_features(torch.float32)
    # One Redis with a replica against 3 masters with a replica each: both copy every write once.
    single = RedisProcess(free_node_port(set()))
    single.start()
    replica = RedisProcess(free_node_port({single.port}), "--replicaof", "127.0.0.1", str(single.port))
    replica.start()
    cluster = RedisClusterProcesses().start()
    rounds = []
    try:
        for r in range(args.rounds):
            order = ["single", "cluster"] if r % 2 == 0 else ["cluster", "single"]
            got = {}
            for target in order:
                url, is_cluster = (single.url, False) if target == "single" else (cluster.url, True)
                got[target] = await throughput(url, is_cluster, bf16, args.clients, args.seconds)
                print(f"round {r + 1} {target:<8} {got[target]}")
            rounds.append(got)
        fp32_single = await throughput(single.url, False, fp32, args.clients, args.seconds)
    finally:
        single.kill()
        replica.kill()
        cluster.stop()
    ratios = {
        op: median_and_range([g["cluster"][op] / g["single"][op] for g in rounds]) for op in ("put_per_s", "get_per_s")
    }
    single_get = percentile([g["single"]["get_per_s"] for g in rounds], 50)
    bf16_bytes, fp32_bytes = len(encode(bf16)), len(encode(fp32))
    return {
        "rounds": rounds,
        "cluster_over_single": ratios,
        "fp32_single": fp32_single,
        "value_bytes": {"bf16": bf16_bytes, "fp32": fp32_bytes, "fp32_over_bf16": round(fp32_bytes / bf16_bytes, 3)},
        "capacity": capacity(single_get, bf16_bytes),
        "settings": {
            "clients": args.clients,
            "seconds": args.seconds,
            "keys": KEYS,
            "features": f"{BENCH_TOKENS}x{BENCH_HIDDEN}",
        },
    }


def markdown(run: dict) -> str:
    lines = [
        "# Feature plane: one Redis and a 3-master Redis Cluster\n",
        f"Commit `{run['commit']}`; {run['machine']['description']}; {run['started']}.\n",
        f"    {run['command']}\n",
        "Values per second through the feature cache (LLaVA-1.5-7B-sized bf16 features, "
        f"{run['value_bytes']['bf16'] / 1e6:.2f} MB encoded; {run['settings']['clients']} concurrent callers "
        "in one process; L1 off).\n",
        "| round | one Redis PUT/s | cluster PUT/s | one Redis GET/s | cluster GET/s |",
        "|---|---|---|---|---|",
    ]
    for i, r in enumerate(run["rounds"], 1):
        lines.append(
            f"| {i} | {r['single']['put_per_s']} | {r['cluster']['put_per_s']} | "
            f"{r['single']['get_per_s']} | {r['cluster']['get_per_s']} |"
        )
    c = run["cluster_over_single"]
    lines += [
        "",
        f"Cluster ÷ one Redis, median (range): PUT {c['put_per_s']['median']} "
        f"({c['put_per_s']['min']}–{c['put_per_s']['max']}), GET {c['get_per_s']['median']} "
        f"({c['get_per_s']['min']}–{c['get_per_s']['max']}).",
        "",
        f"Bytes per LLaVA-1.5-7B image: bf16 {run['value_bytes']['bf16']}, fp32 {run['value_bytes']['fp32']} "
        f"(×{run['value_bytes']['fp32_over_bf16']}); fp32 on one Redis: {run['fp32_single']}.",
        "",
        "Images per second one shard serves at the GET rate measured here (bytes per second ÷ bytes per image):",
        "",
        "| family | tokens | values per token | MB per image (bf16) | images/s per shard |",
        "|---|---|---|---|---|",
    ]
    for row in run["capacity"]:
        lines.append(
            f"| {row['family']} | {row['tokens']} | {row['values_per_token']} | {row['MB_per_image']} | "
            f"{row['images_per_s_per_shard']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    parser = results.parser("feature-plane", __doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0, help="per phase (PUT, GET) and target")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--out", type=Path, default=results.RESULTS_DIR / "feature_plane.json")
    args = parser.parse_args(argv)
    record = results.provenance(results.command_line("feature-plane", argv))
    run = {**record, **asyncio.run(measure(args))}
    text = markdown(run)
    results.save(run, args.out, text)
    print(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit("run it as: python -m bench feature-plane [options]")
