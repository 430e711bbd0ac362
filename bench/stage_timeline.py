"""Where the milliseconds of one Iris request go, stage by stage.

Starts Iris as the harness does (bench/harness/systems.py) with IRIS_STAGE_TRACE
set, so every stage marks its boundaries (deployments/stage_trace.py), then sends
sequential requests of three kinds: a new image each time, the same image again
and again (served from the feature cache), and text of the same token count.
Each request's marks, between the client's send and its first token, become
segments (e.g. "vision tower", "tokenize the prompt"); the medians per kind are
printed and saved.

    python -m bench stage-timeline            # bench/results/stage_timeline.{json,md}

One client at a time: with several requests in flight the marks of one request
could not be told from another's. Run it alone: other load on the machine shows
in every segment.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import results, systems
from bench.harness.client import LoadClient, warm_up
from bench.harness.stats import percentile
from bench.harness.workloads import WorkloadFactory, image_prompt_chars

# The boundaries in the order a request crosses them, and what lies between each and the next.
PATH = [
    ("client.sent", "HTTP proxy to ingress"),
    ("ingress.received", "read and parse the body"),
    ("ingress.parsed", "hash the images, ask the cache which are present"),
    ("ingress.looked_up", "call Preprocess"),
    ("preprocess.queued", "wait for the tenant's turn (fair sharing)"),
    ("preprocess.start", "decode the bytes (an image, or a video's sampled frames)"),
    ("preprocess.decoded", "vLLM's processor: resize, normalise"),
    ("preprocess.end", "pixels to VisionEncoder (object store)"),
    ("encoder.start", "cache claim, tenant's turn, batch queue"),
    ("encoder.forward_start", "vision tower + projector"),
    ("encoder.forward_end", "features into the object store"),
    ("encoder.end", "result to LLMDecode (called while the features were computed)"),
    ("decode.start", "features from the object store or the cache"),
    ("decode.features_in", "tokenize the prompt"),
    ("decode.engine_call", "vLLM: prefill to the first token"),
    ("decode.first_output", "first chunk to the ingress"),
    ("ingress.first_token", "SSE through the HTTP proxy"),
    ("client.first_token", ""),
]
ORDER = {stage: i for i, (stage, _) in enumerate(PATH)}
SEGMENT_NAMES = {stage: what for stage, what in PATH}


def request_segments(marks: list[dict], sent: float, first_token: float) -> list[tuple[str, str, float]]:
    """(from, to, ms) for one request: the first mark of each boundary between the client's
    `sent` and `first_token` (wall clock), in path order; boundaries a request skips (a cached
    image never reaches Preprocess) join their neighbours into one segment, and so do those it
    crossed earlier than the path has them (LLMDecode called while a new image is encoded):
    they are off the critical path."""
    seen: dict[str, float] = {"client.sent": sent, "client.first_token": first_token}
    for m in sorted(marks, key=lambda m: m["t"]):
        if sent <= m["t"] <= first_token and m["stage"] in ORDER:
            seen.setdefault(m["stage"], m["t"])
    stages: list[str] = []
    for stage in sorted(seen, key=ORDER.__getitem__):
        if not stages or seen[stage] >= seen[stages[-1]]:
            stages.append(stage)
    return [(a, b, (seen[b] - seen[a]) * 1000) for a, b in zip(stages, stages[1:])]


def summarise(per_request: list[list[tuple[str, str, float]]]) -> dict:
    """Median ms per segment over the requests that crossed it, in path order, and the median total."""
    by_segment: dict[tuple[str, str], list[float]] = {}
    for segments in per_request:
        for a, b, ms in segments:
            by_segment.setdefault((a, b), []).append(ms)
    rows = [
        {"from": a, "to": b, "what": SEGMENT_NAMES[a], "median_ms": round(percentile(v, 50), 1), "requests": len(v)}
        for (a, b), v in sorted(by_segment.items(), key=lambda kv: ORDER[kv[0][0]])
    ]
    totals = [sum(ms for _, _, ms in segments) for segments in per_request]
    return {
        "segments": rows,
        "ttft_median_ms": round(percentile(totals, 50), 1) if totals else None,
        "requests": len(per_request),
    }


def run_kind(client: LoadClient, workload, trace: Path, skip_first: int = 0) -> dict:
    t0_wall, t0 = time.time(), time.perf_counter()
    records, _ = asyncio.run(client.closed_loop(workload, 1, t0=t0))
    marks = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
    per_request = [
        request_segments(marks, t0_wall + r.start_s, t0_wall + r.start_s + r.ttft_s)
        for r in sorted(records, key=lambda r: r.start_s)[skip_first:]
        if r.ok
    ]
    failed = sum(not r.ok for r in records)
    return {**summarise(per_request), "failed": failed, "description": workload.description}


def markdown(run: dict) -> str:
    kinds = list(run["kinds"])
    lines = [
        f"# Where an Iris request's time goes ({run['model']})",
        "",
        f"Commit `{run['commit']}`; {run['machine']['description']}; {run['started']}.",
        "",
        f"    {run['command']}",
        "",
        "Median milliseconds per segment, from the client's send to its first token, one request at a "
        "time. A blank cell: that kind of request does not cross the segment.",
        "",
        "| segment | " + " | ".join(kinds) + " |",
        "|---|" + "---|" * len(kinds),
    ]
    cells: dict[tuple[str, str], dict[str, float]] = {}
    for kind in kinds:
        for row in run["kinds"][kind]["segments"]:
            cells.setdefault((row["from"], row["to"]), {})[kind] = row["median_ms"]
    for (a, b), by_kind in sorted(cells.items(), key=lambda kv: (ORDER[kv[0][0]], ORDER[kv[0][1]])):
        label = SEGMENT_NAMES[a] if ORDER[b] == ORDER[a] + 1 else f"{a} → {b}"
        lines.append(f"| {label} | " + " | ".join(f"{by_kind[k]:.1f}" if k in by_kind else "" for k in kinds) + " |")
    lines.append(
        "| **TTFT at the client (median)** | "
        + " | ".join(f"**{run['kinds'][k]['ttft_median_ms']:.1f}**" for k in kinds)
        + " |"
    )
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    parser = results.parser("stage-timeline", __doc__)
    parser.add_argument("--model", default="builtin:bench-llava")
    parser.add_argument("--requests", type=int, default=16, help="requests per kind")
    parser.add_argument(
        "--video",
        action="store_true",
        help="new and repeated clips instead (a model that takes video, e.g. builtin:tiny-qwen2-vl)",
    )
    parser.add_argument(
        "--system",
        default="iris",
        choices=("iris", "iris-haproxy"),
        help="iris-haproxy: behind Ray Serve's HAProxy, straight to the Ingress replica's own port",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="stage_timeline")
    parser.add_argument("--out-dir", default=str(results.RESULTS_DIR))
    args = parser.parse_args(argv)

    from pipeline.model.source import checkpoint_dtype, resolve_model

    checkpoint = resolve_model(args.model)
    engine = systems.EngineSettings(checkpoint, checkpoint_dtype(checkpoint), max_videos=int(args.video))
    factory = WorkloadFactory(args.seed, max_tokens=16)
    log_dir = Path(tempfile.mkdtemp(prefix="iris-timeline-"))
    trace = log_dir / "stage_trace.jsonl"
    run = {
        **results.provenance(results.command_line("stage-timeline", argv)),
        "model": args.model,
        "system": args.system,
        "kinds": {},
    }
    system = systems.start(args.system, 1, engine, log_dir, env={"IRIS_STAGE_TRACE": str(trace)})
    try:
        client = LoadClient(system.base_urls, systems.SERVED_NAME)
        warm_up(client, factory)
        n = args.requests
        if args.video:
            run["kinds"]["new clip"] = run_kind(client, factory.video_unique(n), trace)
            run["kinds"]["repeated clip"] = run_kind(client, factory.video_repeat(n + 1), trace, skip_first=1)
        else:
            run["kinds"]["new image"] = run_kind(client, factory.unique(n), trace)
            run["kinds"]["repeated image"] = run_kind(client, factory.repeat(n + 1), trace, skip_first=1)
            run["kinds"]["text, same tokens"] = run_kind(
                client, factory.text_as_image(n, image_prompt_chars(checkpoint, factory.small_px)), trace
            )
    finally:
        system.stop()
    results.save(run, Path(args.out_dir) / f"{args.name}.json", markdown(run))
    print(markdown(run))


if __name__ == "__main__":
    sys.exit("run it as: python -m bench stage-timeline [options]")
