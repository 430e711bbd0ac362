"""Independent autoscaling, watched: Preprocess scales out under a CPU-heavy load of
large images and back in after it, while VisionEncoder and LLMDecode stay put.

Starts Iris through the harness (bench/harness/systems.py, serve_runner.py) with
serve_config.yaml as shipped except a bench-only autoscaling_config for Preprocess
(short delays, a small target), then drives it in phases:

    before   one client, new 12 MP JPEGs (Preprocess stays at 1)
    load     --load-clients clients, new 12 MP JPEGs (Preprocess should scale out)
    after    one client again (Preprocess should scale back in)
    idle     no requests, until Preprocess is back at min_replicas (or --idle-max-s)

The runner logs every deployment's replica counts from serve.status() once a
second; every request's TTFT is recorded with its start time. Writes
bench/results/autoscale.json and autoscale.png (replicas per deployment over
time; TTFT over time).

    python -m bench autoscale
    python -m bench autoscale --load-s 30 --after-s 30 --name autoscale_try

The ceiling on one machine: Preprocess replicas are processes on the same
cores as everything else (Ray's CPUs are logical), so more of them cannot
decode faster than the cores allow; the JSON states the figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import report, results, systems
from bench.harness.client import LoadClient, RequestRecord, warm_up
from bench.harness.stats import percentile
from bench.harness.workloads import WorkloadFactory, jpeg_body_b64, large_image_workload

SCALED = "Preprocess"
# Bench-only: react within seconds instead of Serve's defaults (30 s up, 600 s down, 30 s look-back).
# Downscaling waits 20 s: with 8 s, brief dips of the reported queue under full load (metrics pushed
# late by replicas busy on saturated cores) removed replicas that were still starting.
PREPROCESS_AUTOSCALING = {
    "min_replicas": 1,
    "max_replicas": 4,
    "target_ongoing_requests": 1,
    "upscale_delay_s": 3,
    "downscale_delay_s": 20,
    "look_back_period_s": 5,
}
# Handles and replicas report their queue lengths to the controller every 10 s by default.
AUTOSCALING_ENV = {
    "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
}


# ---------------------------------------------------------------- timeline analysis (pure)


def replica_series(status_lines: list[dict], t0: float) -> dict[str, list[tuple[float, int, int]]]:
    """Deployment -> [(seconds since t0, RUNNING replicas, replicas in any state)] from serve_runner's log."""
    series: dict[str, list[tuple[float, int, int]]] = {}
    for line in status_lines:
        for deployment, states in line["replicas"].items():
            series.setdefault(deployment, []).append(
                (round(line["t"] - t0, 2), states.get("RUNNING", 0), sum(states.values()))
            )
    return series


def scaling_summary(series: dict[str, list[tuple[float, int, int]]], scaled: str, load_end_s: float) -> dict:
    """What each deployment did, and whether `scaled` alone moved out and came back in after the load."""
    out: dict = {"load_end_s": load_end_s, "deployments": {}}
    for deployment, points in series.items():
        running = [p[1] for p in points]
        initial, peak = running[0], max(running)
        peak_at = next(t for t, r, _ in points if r == peak)
        out["deployments"][deployment] = {
            "initial": initial,
            "peak": peak,
            "final": running[-1],
            "constant": all(p[1] == initial and p[2] == initial for p in points),
            # the autoscaler's decision (a replica starting) and the new replicas serving
            "decided_out_s": next((t for t, _, total in points if total > initial), None),
            "first_above_initial_s": next((t for t, r, _ in points if r > initial), None),
            "peak_at_s": peak_at,
            "scale_in_started_s": next((t for t, r, _ in points if t > peak_at and r < peak), None),
            "running_at_load_end": running_at(points, load_end_s),
            "back_to_initial_s": next(
                (t for t, r, total in points if t > peak_at and r == initial and total == initial), None
            ),
        }
    mine = out["deployments"].get(scaled)
    others = {d: v for d, v in out["deployments"].items() if d != scaled}
    out["scaled_out"] = bool(mine and mine["peak"] > mine["initial"])
    # Still scaled out when the load stopped, back at the initial count only after it. (Under load it
    # may settle lower than its peak: that is the autoscaler tracking the queue, not scaling in.)
    out["scaled_back_in"] = bool(
        out["scaled_out"]
        and mine["final"] == mine["initial"]
        and (mine["running_at_load_end"] or 0) > mine["initial"]
        and mine["back_to_initial_s"] is not None
        and mine["back_to_initial_s"] >= load_end_s
    )
    out["others_constant"] = bool(others) and all(v["constant"] for v in others.values())
    out["moved_out_and_back_alone"] = out["scaled_out"] and out["scaled_back_in"] and out["others_constant"]
    return out


def running_at(points: list[tuple[float, int, int]], t: float) -> int | None:
    """RUNNING replicas at time t: the last sample at or before t."""
    current = None
    for when, running, _ in points:
        if when > t:
            break
        current = running
    return current


def ttft_by_replicas(requests: list[dict], points: list[tuple[float, int, int]]) -> dict[str, dict]:
    """TTFT of the successful requests grouped by how many replicas were RUNNING when each started."""
    groups: dict[int, list[float]] = {}
    for r in requests:
        if r["ok"]:
            n = running_at(points, r["start_s"])
            if n is not None:
                groups.setdefault(n, []).append(r["ttft_ms"])
    return {
        str(n): {"requests": len(v), "ttft_p50_ms": percentile(v, 50), "ttft_mean_ms": statistics.fmean(v)}
        for n, v in sorted(groups.items())
    }


# ---------------------------------------------------------------- the run


def run_phases(
    system: systems.RunningSystem, factory: WorkloadFactory, phases: list[tuple[str, int, float]], t0: float
) -> tuple[list[dict], list[dict]]:
    client = LoadClient(system.base_urls, systems.SERVED_NAME)
    done: list[dict] = []
    requests: list[dict] = []
    label = 0
    for name, clients, seconds in phases:
        # More conversations than the phase can use: it ends on time, not on count.
        workload = large_image_workload(factory, n=int(seconds * 20) + clients, first_label=label)
        label += len(workload.conversations)
        start = time.perf_counter() - t0
        before = system.counters()
        records, duration = asyncio.run(client.closed_loop(workload, clients, duration_s=seconds, t0=t0))
        counters = system.counters().minus(before)
        summary = report.summarize(records, duration, len(records), counters)
        done.append(
            {
                "phase": name,
                "clients": clients,
                "start_s": round(start, 2),
                "end_s": round(start + duration, 2),
                "summary": summary,
            }
        )
        requests += [_request_row(r, name) for r in records]
        print(
            f"{name:>7}: {clients} client(s), {len(records)} requests in {duration:.0f} s, "
            f"{summary['req_per_s']:.2f} req/s, TTFT p50 {summary['ttft_ms']['p50'] or 0:.0f} ms, "
            f"preprocess {summary.get('stage_mean_ms', {}).get('preprocess', 0):.0f} ms/image",
            flush=True,
        )
    return done, requests


def _request_row(r: RequestRecord, phase: str) -> dict:
    return {
        "phase": phase,
        "start_s": round(r.start_s, 3),
        "ok": r.ok,
        "ttft_ms": round(r.ttft_s * 1000, 1) if r.ttft_s is not None else None,
        "latency_ms": round(r.latency_s * 1000, 1) if r.latency_s is not None else None,
        **({"error": f"{r.status} {r.error[:160]}"} if not r.ok else {}),
    }


def wait_scaled_in(status_log: Path, max_s: float) -> float:
    """Idle until SCALED is back at its minimum in the runner's log; returns the seconds waited."""
    start = time.monotonic()
    while time.monotonic() - start < max_s:
        lines = _read_status(status_log)
        if lines:
            states = lines[-1]["replicas"].get(SCALED, {})
            if sum(states.values()) == states.get("RUNNING", 0) == PREPROCESS_AUTOSCALING["min_replicas"]:
                break
        time.sleep(1)
    time.sleep(3)  # a few samples at the final count
    return time.monotonic() - start


def _read_status(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def ceiling(
    cores: int, logical_cpus: int, preprocess_ms_one_client: float | None, load_req_per_s: float | None
) -> dict:
    """The most Preprocess could do here: every core decoding, each image at its one-client cost
    (an upper bound: the other stages and the client need the same cores)."""
    per_core = 1000 / preprocess_ms_one_client if preprocess_ms_one_client else None
    return {
        "physical_cores": cores,
        "ray_logical_cpus": logical_cpus,
        "preprocess_ms_per_image_one_client": preprocess_ms_one_client,
        "images_per_s_if_preprocess_had_every_core": per_core * cores if per_core else None,
        "load_req_per_s": load_req_per_s,
        "statement": (
            f"Ray is given {logical_cpus} logical CPUs, but this machine has {cores} CPUs, "
            f"shared by Ingress, Preprocess, VisionEncoder, LLMDecode (vLLM), Redis and the load client: "
            f"Preprocess replicas beyond {cores} cannot decode faster, and together they cannot get more "
            f"than ~{cores} cores of decoding (fewer, since the other stages need the same cores). "
            f"More replicas add queue capacity there, not throughput; on a cluster each would bring "
            f"its own cores."
        ),
    }


def plot(run: dict, out_prefix: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True, gridspec_kw={"height_ratios": [1, 1.3]})
    for i, (deployment, points) in enumerate(sorted(run["timeline"].items())):
        top.step(
            [p[0] for p in points],
            [p[1] + 0.04 * (i - 1.5) for p in points],
            where="post",
            label=deployment,
            color=f"C{i}",
            linewidth=2,
        )
        if deployment == SCALED:  # the autoscaler's decision shows before the new replicas run
            top.step(
                [p[0] for p in points],
                [p[2] for p in points],
                where="post",
                color=f"C{i}",
                linestyle="--",
                linewidth=1,
                label=f"{deployment} incl. starting/stopping",
            )
    top.set_ylabel("RUNNING replicas")
    top.set_yticks(range(0, PREPROCESS_AUTOSCALING["max_replicas"] + 2))
    top.legend(loc="upper right")
    ok = [r for r in run["requests"] if r["ok"]]
    for i, phase in enumerate(run["phases"]):
        for ax in (top, bottom):
            ax.axvspan(phase["start_s"], phase["end_s"], color="grey", alpha=0.08 if i % 2 else 0.18, linewidth=0)
        top.text(
            (phase["start_s"] + phase["end_s"]) / 2,
            PREPROCESS_AUTOSCALING["max_replicas"] + 1.5,
            f"{phase['phase']}\n{phase['clients']} client(s)",
            ha="center",
            va="top",
            fontsize=8,
        )
        phase_rows = [r for r in ok if r["phase"] == phase["phase"]]
        if not phase_rows:
            continue
        bottom.scatter(
            [r["start_s"] for r in phase_rows],
            [r["ttft_ms"] for r in phase_rows],
            s=8,
            color=f"C{4 + i}",
            label=f"{phase['phase']} (p50 {phase['summary']['ttft_ms']['p50'] or 0:.0f} ms)",
        )
    bottom.set_yscale("log")
    bottom.set_ylabel("TTFT (ms), by request start")
    bottom.set_xlabel("seconds since the first phase started")
    bottom.legend(loc="upper right", fontsize=8)
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"Preprocess autoscaling under 12 MP JPEGs ({results.label(run['machine'])}, {run['model']})")
    fig.tight_layout()
    path = out_prefix.with_suffix(".png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def analyse(run: dict) -> None:
    """Everything derived from the recorded timeline and requests (also for --reanalyse)."""
    series = run["timeline"]
    load = next(p for p in run["phases"] if p["phase"] == "load")
    before = next(p for p in run["phases"] if p["phase"] == "before")
    run["scaling"] = scaling_summary(series, SCALED, load["end_s"])
    run["ttft_by_preprocess_replicas"] = ttft_by_replicas(
        [r for r in run["requests"] if r["phase"] == "load"], series.get(SCALED, [])
    )
    run["ceiling"] = ceiling(
        run["ceiling"]["physical_cores"] if "ceiling" in run else run["machine"]["cpus"],
        run["ray_logical_cpus"],
        before["summary"].get("stage_mean_ms", {}).get("preprocess"),
        load["summary"]["req_per_s"],
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = results.parser("autoscale", __doc__)
    parser.add_argument(
        "--model",
        default="builtin:tiny-llava",
        help="the tiny model's vision tower and decoder are cheap, so decoding 12 MP JPEGs dominates",
    )
    parser.add_argument("--before-s", type=float, default=30)
    # Long enough for new replicas to start on busy cores and then serve a while.
    parser.add_argument("--load-s", type=float, default=120)
    parser.add_argument("--load-clients", type=int, default=8)
    parser.add_argument("--after-s", type=float, default=60)
    parser.add_argument("--idle-max-s", type=float, default=90)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-cpus", type=int, default=8, help="Ray's logical CPUs (serve_runner's default)")
    parser.add_argument("--name", default="autoscale")
    parser.add_argument("--out-dir", default=str(results.RESULTS_DIR))
    parser.add_argument(
        "--reanalyse",
        metavar="JSON",
        help="recompute the analysis and plot of a saved run, in place, without starting anything",
    )
    return parser.parse_args(argv)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.reanalyse:
        path = Path(args.reanalyse)
        run = json.loads(path.read_text())
        run["timeline"] = {d: [tuple(p) for p in pts] for d, pts in run["timeline"].items()}
        analyse(run)
        run["plot"] = plot(run, path.with_suffix("")).name
        results.save(run, path)
        print(json.dumps(run["scaling"], indent=1))
        return
    from pipeline.model.source import checkpoint_dtype, resolve_model

    checkpoint = resolve_model(args.model)
    engine = systems.EngineSettings(checkpoint, checkpoint_dtype(checkpoint))
    factory = WorkloadFactory(args.seed, max_tokens=16)
    for conv in factory.large(8).conversations:  # draw the photos now, not during the first phase
        jpeg_body_b64(conv.turns[0].image)
    log_dir = Path(tempfile.mkdtemp(prefix="iris-autoscale-"))
    status_log = log_dir / "replicas.jsonl"
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    run = {
        **results.provenance(results.command_line("autoscale", argv)),
        "model": args.model,
        "checkpoint": checkpoint,
        "preprocess_autoscaling_config": PREPROCESS_AUTOSCALING,
        "env": AUTOSCALING_ENV,
        "logs": str(log_dir),
        "ray_logical_cpus": args.num_cpus,
    }
    system = systems.start(
        "iris",
        1,
        engine,
        log_dir,
        deployments={SCALED: {"autoscaling_config": PREPROCESS_AUTOSCALING}},
        env=AUTOSCALING_ENV,
        status_log=status_log,
    )
    try:
        run["start_s"] = system.start_s
        client = LoadClient(system.base_urls, systems.SERVED_NAME)
        run["warm_up"] = warm_up(client, factory)
        # First large images cost more (allocations, thread pools): keep that out of the "before" phase.
        large, _ = asyncio.run(client.closed_loop(large_image_workload(factory, 4, first_label=10**6), 1))
        run["warm_up"]["large_images_failed"] = sum(not r.ok for r in large)
        wait_scaled_in(status_log, 120)  # in case the warm-up's burst scaled Preprocess out
        t0, t0_wall = time.perf_counter(), time.time()
        phases = [("before", 1, args.before_s), ("load", args.load_clients, args.load_s), ("after", 1, args.after_s)]
        run["phases"], run["requests"] = run_phases(system, factory, phases, t0)
        idle_start = time.perf_counter() - t0
        waited = wait_scaled_in(status_log, args.idle_max_s)
        run["phases"].append(
            {
                "phase": "idle",
                "clients": 0,
                "start_s": round(idle_start, 2),
                "end_s": round(idle_start + waited, 2),
                "summary": report.summarize([], waited, 0, None),
            }
        )
    finally:
        system.stop()
    run["timeline"] = replica_series([line for line in _read_status(status_log) if line["t"] >= t0_wall - 5], t0_wall)
    analyse(run)
    run["plot"] = plot(run, out_dir / args.name).name
    results.save(run, out_dir / f"{args.name}.json")
    print(
        json.dumps(
            {
                "scaling": run["scaling"],
                "ttft_by_preprocess_replicas": run["ttft_by_preprocess_replicas"],
                "ceiling": run["ceiling"],
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    sys.exit("run it as: python -m bench autoscale [options]")
