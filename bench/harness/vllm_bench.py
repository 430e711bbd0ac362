"""vLLM's own load client (`vllm bench serve`, random-mm dataset) against one system.

Runs `python -m bench vllm bench serve` (bench/harness/vllm_cli.py) in a subprocess (the
CLI needs its own process and event loop) and reads the JSON it saves. Greedy
(`--temperature 0`), so every system generates the same tokens for the same prompt.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.harness.results import ROOT

BUCKETS = "{(224, 224, 1): 0.5, (512, 384, 1): 0.5}"  # one new 224² or 512×384 image per request


def run(
    base_url: str, model: str, tokenizer: str, num_prompts: int, concurrency: int, seed: int, timeout_s: float = 900
) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "bench",
            "vllm",
            "bench",
            "serve",
            "--backend",
            "openai-chat",
            "--base-url",
            base_url,
            "--endpoint",
            "/v1/chat/completions",
            "--model",
            model,
            "--tokenizer",
            tokenizer,
            "--dataset-name",
            "random-mm",
            "--num-prompts",
            str(num_prompts),
            "--max-concurrency",
            str(concurrency),
            "--random-input-len",
            "32",
            "--random-output-len",
            "16",
            "--random-range-ratio",
            "0",
            "--random-mm-base-items-per-request",
            "1",
            "--random-mm-num-mm-items-range-ratio",
            "0",
            "--random-mm-limit-mm-per-prompt",
            '{"image": 1, "video": 0}',
            "--random-mm-bucket-config",
            BUCKETS,
            "--temperature",
            "0",
            "--seed",
            str(seed),
            "--percentile-metrics",
            "ttft,tpot,e2el",
            "--metric-percentiles",
            "50,90,99",
            "--disable-tqdm",
            "--save-result",
            "--result-dir",
            tmp,
            "--result-filename",
            "out.json",
        ]
        out = Path(tmp) / "out.json"
        crashes = []
        for _ in range(2):
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
            if proc.returncode == 0 and out.exists():
                break
            # The client process has died by a signal (SIGILL) now and then on this CPU, in
            # the client, not in the server under test: run it once more and say so.
            crashes.append(f"vllm bench serve failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
            if proc.returncode >= 0:
                break
        if not out.exists():
            raise RuntimeError("\n".join(crashes))
        raw = json.loads(out.read_text())
    return {
        "requests": num_prompts,
        "ok": raw.get("completed"),
        "failed": raw.get("failed", 0),
        "duration_s": raw.get("duration"),
        "req_per_s": raw.get("request_throughput"),
        "output_tokens_per_s": raw.get("output_throughput"),
        "output_tokens": raw.get("total_output_tokens"),
        "ttft_ms": {
            "p50": raw.get("p50_ttft_ms"),
            "p90": raw.get("p90_ttft_ms"),
            "p99": raw.get("p99_ttft_ms"),
            "mean": raw.get("mean_ttft_ms"),
        },
        "tpot_ms": {
            "p50": raw.get("p50_tpot_ms"),
            "p90": raw.get("p90_tpot_ms"),
            "p99": raw.get("p99_tpot_ms"),
            "mean": raw.get("mean_tpot_ms"),
        },
        "latency_ms": {
            "p50": raw.get("p50_e2el_ms"),
            "p90": raw.get("p90_e2el_ms"),
            "p99": raw.get("p99_e2el_ms"),
            "mean": raw.get("mean_e2el_ms"),
        },
        "errors": [e for e in (raw.get("errors") or []) if e][:5],
        **({"client_crashes": [c[-500:] for c in crashes]} if crashes else {}),
    }
