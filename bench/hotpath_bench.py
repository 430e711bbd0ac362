"""One Iris node's hot path: sequential TTFT for a new image, a repeated image, an
upload-free image and a text-only prompt of the same token count; streaming TPOT;
4 clients at 80% image reuse. Optionally py-spy profiles every Iris replica
while the sequential scenarios run.

    .venv/bin/python bench/hotpath_bench.py [--model builtin:bench-llava] [--requests 20] [--profile TAG]

Writes bench/results/hotpath_<TAG or 'run'>.json and, with --profile, one
py-spy summary per replica and scenario in bench/results/profile_<TAG>_*.txt.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"
TEXT = "Describe this picture in detail, please."
DEPLOYMENTS = ("Ingress", "Preprocess", "VisionEncoder", "LLMDecode")


def _jpeg(seed: int) -> str:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (480, 640, 3), dtype=np.uint8)).save(buf, format="JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def _body(url: str | None, uid: str | None = None, text: str = TEXT, max_tokens: int = 1, stream=False) -> dict:
    content: list[dict] = []
    if url or uid:
        part = {"type": "image_url", "image_url": {"url": url} if url else None}
        if uid:
            part["uuid"] = uid
        content.append(part)
    content.append({"type": "text", "text": text})
    body = {"model": "bench", "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": content}]}
    if stream:
        body["stream"] = True
    return body


async def _timed(client: httpx.AsyncClient, base: str, body: dict) -> tuple[float, dict]:
    start = time.perf_counter()
    r = await client.post(f"{base}/v1/chat/completions", json=body, timeout=300)
    r.raise_for_status()
    return (time.perf_counter() - start) * 1000, r.json()


async def _stream(client: httpx.AsyncClient, base: str, body: dict) -> tuple[float, float, int, int]:
    """(ttft ms, total ms, content chunks, completion tokens)."""
    start = time.perf_counter()
    ttft, chunks, tokens = None, 0, 0
    async with client.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=300) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            choices = event.get("choices") or [{}]
            if choices[0].get("delta", {}).get("content"):
                ttft = ttft or (time.perf_counter() - start) * 1000
                chunks += 1
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return ttft or 0.0, (time.perf_counter() - start) * 1000, chunks, tokens


def _summary(ms: list[float]) -> dict:
    ms = sorted(ms)
    return {"n": len(ms), "mean_ms": round(statistics.fmean(ms), 2), "p50_ms": round(ms[len(ms) // 2], 2),
            "p90_ms": round(ms[min(len(ms) - 1, int(len(ms) * 0.9))], 2)}


class Profiler:
    """py-spy on every Iris replica while a scenario runs; summarised as text."""

    def __init__(self, tag: str | None):
        self.tag = tag
        self.procs: list[tuple[str, subprocess.Popen, Path]] = []

    def start(self, scenario: str) -> None:
        if not self.tag:
            return
        from ray.util.state import list_actors

        for actor in list_actors(filters=[("state", "=", "ALIVE")]):
            name = next((d for d in DEPLOYMENTS if d in actor.class_name), None)
            if name is None or not actor.pid:
                continue
            raw = RESULTS / f".pyspy_{self.tag}_{scenario}_{name}.txt"
            proc = subprocess.Popen(
                [str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(actor.pid), "--rate", "100",
                 "--format", "raw", "--output", str(raw), "--nonblocking"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                # A background job's children ignore SIGINT, which py-spy needs to write its output.
                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
            self.procs.append((f"{scenario}_{name}", proc, raw))
        time.sleep(1.0)

    def stop(self) -> None:
        for label, proc, raw in self.procs:
            proc.send_signal(2)
            proc.wait(30)
            if raw.exists():
                out = RESULTS / f"profile_{self.tag}_{label}.txt"
                out.write_text(_summarise(raw.read_text()))
                raw.unlink()
        self.procs = []


def _summarise(collapsed: str, top: int = 25) -> str:
    """Self and inclusive sample counts per function from py-spy's collapsed stacks (idle frames excluded)."""
    own, incl, total = Counter(), Counter(), 0
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        frames = stack.split(";")
        n = int(count)
        total += n
        own[frames[-1]] += n
        for f in set(frames):
            incl[f] += n
    lines = [f"samples (100 Hz, active only): {total}", "", "self %  function"]
    lines += [f"{100 * n / max(total, 1):5.1f}  {f}" for f, n in own.most_common(top)]
    lines += ["", "inclusive %  function"]
    lines += [f"{100 * n / max(total, 1):5.1f}  {f}" for f, n in incl.most_common(top * 2)]
    return "\n".join(lines) + "\n"


async def run(base: str, n: int, profiler: Profiler) -> dict:
    out: dict = {}
    async with httpx.AsyncClient() as client:
        for i in range(3):
            await _timed(client, base, _body(_jpeg(900 + i)))  # warm-up
        profiler.start("new")
        out["new_image"] = _summary([(await _timed(client, base, _body(_jpeg(1 + i))))[0] for i in range(n)])
        profiler.stop()
        hot, uid = _jpeg(10_000), f"bench-{uuid.uuid4().hex}"
        _, reply = await _timed(client, base, _body(hot, uid))
        image_prompt_tokens = reply["usage"]["prompt_tokens"]
        profiler.start("cached")
        out["repeat_image"] = _summary([(await _timed(client, base, _body(hot, uid)))[0] for _ in range(n)])
        profiler.stop()
        out["upload_free"] = _summary([(await _timed(client, base, _body(None, uid)))[0] for _ in range(n)])
        # Text-only prompt of the same token count (the byte-level tokenizer: ~1 token per character).
        filler = "x" * max(1, image_prompt_tokens - 20)
        _, reply = await _timed(client, base, _body(None, text=filler))
        filler = "x" * (len(filler) + image_prompt_tokens - reply["usage"]["prompt_tokens"])
        _, reply = await _timed(client, base, _body(None, text=filler))
        out["text_same_tokens"] = {**_summary([(await _timed(client, base, _body(None, text=filler)))[0]
                                               for _ in range(n)]),
                                   "prompt_tokens": reply["usage"]["prompt_tokens"],
                                   "image_prompt_tokens": image_prompt_tokens}
        # Streaming: TPOT = (total - ttft) / (completion tokens - 1), as vllm bench computes it.
        tpots, chunk_counts = [], []
        for i in range(max(4, n // 2)):
            body = {**_body(hot, uid, max_tokens=64, stream=True), "stream_options": {"include_usage": True}}
            ttft, total, chunks, tokens = await _stream(client, base, body)
            if tokens > 1:  # random weights may stop early: count the tokens streamed
                tpots.append((total - ttft) / (tokens - 1))
                chunk_counts.append(chunks)
        out["stream_64_tokens"] = {"tpot": _summary(tpots) if tpots else None,
                                   "mean_chunks": statistics.fmean(chunk_counts) if chunk_counts else 0}
        hot_pool = [_jpeg(20_000 + i) for i in range(4)]
        rnd = random.Random(1)
        queue = [_body(rnd.choice(hot_pool) if rnd.random() < 0.8 else _jpeg(30_000 + i)) for i in range(4 * n)]
        total = len(queue)
        latencies: list[float] = []

        async def worker():
            while queue:
                latencies.append((await _timed(client, base, queue.pop()))[0])

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(4)))
        out["mixed_80pct_reuse_c4"] = {**_summary(latencies), "req_per_s": round(total / (time.perf_counter() - start), 2)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:bench-llava")
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--profile", default=None, help="tag: py-spy every replica, summaries under bench/results")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import ray
    from ray import serve

    from deployments.app import build_app
    from pipeline.models.source import resolve_model

    checkpoint = resolve_model(args.model)
    port = 8000 + random.randint(100, 900)
    ray.init(num_cpus=8, include_dashboard=True, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app_args = {"model": checkpoint, "served_model_name": "bench", "engine_args": {"max_model_len": 2048},
                "cache": {"namespace": f"irisbench-{uuid.uuid4().hex[:8]}", "ttl_s": 600}}
    try:
        serve.run(build_app(app_args), name="iris", route_prefix="/")
        results = asyncio.run(run(f"http://127.0.0.1:{port}", args.requests, Profiler(args.profile)))
    finally:
        serve.shutdown()
        ray.shutdown()
    results = {"model": args.model, "requests": args.requests, **results}
    print(json.dumps(results, indent=2))
    out = RESULTS / f"hotpath_{args.profile or 'run'}.json"
    out.write_text(json.dumps(results, indent=2))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
