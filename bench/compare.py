"""Iris against Ray Serve LLM and `vllm serve`, side by side, in one run.

Starts each system under test on the same checkpoint and engine settings
(bench/harness/systems.py), drives it through the same fixed-seed workloads
(bench/harness/workloads.py) with one client (bench/harness/client.py) and
vLLM's own bench client, reads its counters, stops it, and moves on. Ratios
Iris / peer are computed within the run.

    python -m bench compare --quick        # Iris, Ray Serve LLM, vllm serve; 1 replica; a few points
    python -m bench compare                # the full matrix
    python -m bench compare --systems iris,vllm --replicas 1 --points unique-c1,zipf-c4
    python -m bench compare --quick --profile after --name profile_run   # py-spy every process
    python -m bench compare --rounds 3 --systems iris,rayllm,vllm --replicas 1 --points text-c1,repeat-c1
    python -m bench compare --quick --gpu-node-mode 1   # core 0 plays the GPU, the others the host

Each point also counts the host's work per request (bench/harness/host_work.py): CPU ms per request
and per output token by process role, and for Ray-based systems the Ray calls by method and by
role, object-store puts and streamed items. --gpu-node-mode MODEL_CORES puts every system's model
work (vLLM's engine processes, Iris's VisionEncoder) on the first MODEL_CORES cores and everything
else on the rest (bench/harness/affinity.py), so that the model cores play the GPU and the rest the host.

With --rounds N (2 or more) the systems stay up side by side, each Ray-based one in a
Ray instance of its own, and take turns: every point runs on each system in turn
(A, B, C), round after round, the order rotated each round and new images each round.
Iris / peer ratios are taken per round and reported as the median with its range: a
shared machine's noise moves whole minutes, so ratios from one round to the next are
steadier than figures from one system's run to another's. --pause-idle stops the systems
not being measured (SIGSTOP, then SIGCONT): each idle Ray instance keeps ticking, and on
two cores three of them slowed every system's TTFT by a third to a half
(bench/results/video/README.md).

Before it starts anything it refuses a plan whose systems would not fit in memory
(bench/harness/memory_plan.py; --ignore-memory-estimate); a system that loses a replica, an
engine or its controller fails the point, saying what died (bench/harness/liveness.py).

Writes bench/results/<name>.json (every summary, with the commit, the command and
the machine), <name>.md (the tables) and <name>_*.png (plots); <name> is `compare`
or `compare_quick`. Needs Redis at 127.0.0.1:6379 for Iris's feature cache.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from bench.harness import (
    affinity,
    cpu_usage,
    host_work,
    liveness,
    memory_plan,
    report,
    results,
    systems,
    vllm_bench,
)
from bench.harness.client import LoadClient, warm_up
from bench.harness.profiler import Profiler
from bench.harness.rr_proxy import RoundRobinProxy
from bench.harness.workloads import WorkloadFactory, hash_str, image_prompt_chars

SWEEP_WORKLOAD = "zipf"
PROFILED_POINTS = ("unique-c1", "repeat-c1")  # a new image and a cached one, one request at a time


@dataclass(frozen=True)
class LoadPoint:
    """One measurement: a workload of n requests under one load shape."""

    workload: str
    n: int
    concurrency: int | None = None  # closed loop
    rate: float | None = None  # open loop: Poisson arrivals per second
    options: dict = field(default_factory=dict, hash=False)
    sweep: bool = False  # part of the latency-vs-load curve
    stream: bool = True  # False: whole answers (`"stream": false`), named `...-whole`

    @property
    def name(self) -> str:
        if self.workload == "random_mm":
            return f"random_mm-c{self.concurrency}" + ("-again" if self.options.get("again") else "")
        return (
            f"{self.workload}-"
            + (f"c{self.concurrency}" if self.concurrency else f"r{self.rate:g}")
            + ("" if self.stream else "-whole")
        )


FULL = [
    LoadPoint("unique", 16, concurrency=1),
    LoadPoint("unique", 32, concurrency=4),
    LoadPoint("repeat", 16, concurrency=1),
    LoadPoint("text_as_image", 16, concurrency=1),
    LoadPoint("text", 16, concurrency=1),
    # Answers read whole (non-streamed): only the end-to-end latency counts.
    LoadPoint("text", 16, concurrency=1, stream=False),
    LoadPoint("repeat", 16, concurrency=1, stream=False),
    LoadPoint("zipf", 24, concurrency=1, sweep=True),
    LoadPoint("zipf", 48, concurrency=4, sweep=True),
    LoadPoint("zipf", 64, concurrency=8, sweep=True),
    LoadPoint("zipf", 32, rate=4),
    LoadPoint("multiturn", 12, concurrency=1),
    LoadPoint("multiturn", 24, concurrency=4),
    LoadPoint("upload_free", 32, concurrency=4),
    LoadPoint("large", 5, concurrency=1),
    # vLLM's own client, as in issue 8: 60 requests, concurrency 4, then the same images again.
    LoadPoint("random_mm", 60, concurrency=4),
    LoadPoint("random_mm", 60, concurrency=4, options={"again": True}),
]
# Video (a checkpoint that takes video, e.g. --model builtin:bench-qwen2-vl): new clips, the same clip
# again, and conversations about one clip. Chosen with --points or --video.
VIDEO = [
    LoadPoint("video_unique", 8, concurrency=1),
    LoadPoint("video_repeat", 12, concurrency=1),
    LoadPoint("video_multiturn", 12, concurrency=1),
]
QUICK = [
    LoadPoint("unique", 8, concurrency=1),
    LoadPoint("repeat", 8, concurrency=1),
    LoadPoint("zipf", 24, concurrency=4, sweep=True),
    LoadPoint("upload_free", 12, concurrency=4),
    LoadPoint("text", 8, concurrency=1),
]


def measure(
    system: systems.RunningSystem,
    point: LoadPoint,
    factory: WorkloadFactory,
    args,
    image_chars: int,
    tokenizer: str,
    profiler: Profiler | None = None,
    round_: int = 0,
    watch: liveness.Watch | None = None,
) -> dict:
    """One load point's results, with the CPU each request cost by process (bench/harness/cpu_usage.py),
    counted from the load's start to its end (not while counters settle), per request and per output
    token, and the host's work per request in a Ray-based system (bench/harness/host_work.py: Ray
    calls, object-store puts, streamed items), counted from before the point to after it, once Ray's
    counters settle. Each round has images of its own (round 0 those of a run without rounds). With
    `watch`, a system that loses a process meanwhile ends the load: liveness.SystemBroken. In GPU-node
    mode (args.cores) every thread is put on its cores first (bench/harness/affinity.py)."""
    cores = getattr(args, "cores", None)
    placed = affinity.apply(system.root_pids, *cores) if cores else None
    snapshot = (
        host_work.Snapshot(system.root_pids, system.metrics_urls, getattr(args, "ray_event_stats_s", 0.0))
        if systems.base_system(system.name) != "vllm"
        else None
    )
    before = snapshot.take() if snapshot else None
    meter = cpu_usage.Meter(system.root_pids)
    result = _drive(system, point, factory, args, image_chars, tokenizer, profiler, meter, round_, watch)
    summary = result["summary"]
    ok = summary.get("ok") or 0
    summary["cpu_ms_per_request"] = meter.per_request_ms(ok)
    summary["cpu_ms_per_output_token"] = cpu_usage.per_output_token(
        summary["cpu_ms_per_request"], ok, summary.get("output_tokens")
    )
    summary["host_work"] = host_work.diff(before, snapshot.take(), ok) if snapshot else dict(host_work.NO_RAY)
    if placed is not None:
        result["affinity"] = placed
    return result


def _drive(
    system: systems.RunningSystem,
    point: LoadPoint,
    factory: WorkloadFactory,
    args,
    image_chars: int,
    tokenizer: str,
    profiler: Profiler | None,
    meter: cpu_usage.Meter,
    round_: int,
    watch: liveness.Watch | None,
) -> dict:
    if point.workload == "random_mm":
        seed = args.seed + round_  # "-again" runs in the same round as the point it repeats
        if len(system.base_urls) == 1:
            with meter:
                return {
                    "summary": vllm_bench.run(
                        system.base_urls[0], systems.SERVED_NAME, tokenizer, point.n, point.concurrency, seed
                    )
                }
        # vLLM's client drives one URL: independent servers get a round-robin proxy in front.
        with RoundRobinProxy(system.base_urls) as proxy, meter:
            summary = vllm_bench.run(proxy.url, systems.SERVED_NAME, tokenizer, point.n, point.concurrency, seed)
        return {
            "summary": summary,
            "load_balancer": f"round-robin proxy (bench/harness/rr_proxy.py) over "
            f"{len(system.base_urls)} servers, {proxy.requests} requests forwarded",
        }
    options = dict(point.options)
    if point.workload == "text_as_image":
        options["image_chars"] = image_chars
    # Each point gets its own images, so "new" images are new to the system at every point.
    workload_seed = f"{args.seed}:{point.name}" + (f":{round_}" if round_ else "")
    workload = WorkloadFactory(
        hash_str(workload_seed) % 2**31, factory.small_px, factory.prompt_words, factory.max_tokens
    ).build(point.workload, point.n, **options)
    client = LoadClient(system.base_urls, systems.SERVED_NAME, stream=point.stream)
    before = system.counters()
    profiling = profiler is not None and point.name in PROFILED_POINTS
    if profiling:
        profiler.start(system.root_pids, f"{system.name}-{system.replicas}_{point.name}")
    try:
        with meter:
            if point.concurrency:
                load = client.closed_loop(workload, point.concurrency)
            else:
                load = client.open_loop(workload, point.rate, args.seed)
            records, duration = asyncio.run(liveness.guarded(load, watch))
    finally:
        profiles = [p.name for p in profiler.stop()] if profiling else []
    counters = system.counters().minus(before)
    summary = report.summarize(records, duration, workload.distinct_images, counters)
    return {"summary": summary, "description": workload.description, **({"profiles": profiles} if profiles else {})}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = results.parser("compare", __doc__)
    parser.add_argument(
        "--quick", action="store_true", help="Iris, Ray Serve LLM and vllm serve, 1 replica, a few points"
    )
    parser.add_argument("--video", action="store_true", help="the video points only (a model that takes video)")
    parser.add_argument("--model", default="builtin:bench-llava", help="any Iris model reference")
    parser.add_argument("--systems", help=f"comma-separated subset of {','.join(systems.SYSTEMS)}")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME@LABEL:KEY=VALUE[,KEY=VALUE]",
        help="a variant of system NAME started with this environment (for a Ray-based system, its "
        "Ray cluster's: every replica and engine), to list in --systems as NAME@LABEL beside NAME: "
        "an A/B of a setting in one run, e.g. iris-haproxy@mp:VLLM_ENABLE_V1_MULTIPROCESSING=1",
    )
    parser.add_argument("--replicas", help="decode replica counts, e.g. 1,2 (default: 1,2; --quick: 1)")
    parser.add_argument("--points", help="comma-separated load point names to run (default: all of the plan)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="2 or more: the systems up side by side, taking "
        "turns at every point, round after round; ratios as the median of the rounds' (see above)",
    )
    parser.add_argument(
        "--pause-idle",
        action="store_true",
        help="with --rounds: the systems not being measured "
        "are stopped (SIGSTOP) meanwhile, so their idle ticks stay out of the measured one's figures",
    )
    parser.add_argument(
        "--ignore-memory-estimate",
        action="store_true",
        help="start the systems even where "
        "their estimated memory (bench/harness/memory_plan.py) exceeds what is available",
    )
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every point's request count")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--small-px", type=int, default=256, help="side of the small images")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--name", help="output name under --out-dir (default: compare or compare_quick)")
    parser.add_argument("--out-dir", default=str(results.RESULTS_DIR))
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument(
        "--eager",
        action="store_true",
        help="engines without torch.compile: quicker to start, slower to decode (smoke tests; not for figures)",
    )
    parser.add_argument(
        "--gpu-node-mode",
        type=int,
        default=0,
        metavar="MODEL_CORES",
        help="the first "
        "MODEL_CORES cores play the GPU: every system's model work (vLLM's engine processes, "
        "Iris's VisionEncoder) runs there, everything else (and this harness) on the other cores "
        "(bench/harness/affinity.py; docs/benchmarks.md). Default 0: off",
    )
    parser.add_argument(
        "--ray-event-stats-s",
        type=float,
        default=2.0,
        help="Ray-based systems: each Ray "
        "process dumps its event stats (handler counts: calls, streamed items, pins by role; "
        "bench/harness/host_work.py) to its log this often; 0: Ray's default, and no counts by role",
    )
    parser.add_argument(
        "--profile",
        metavar="TAG",
        help=f"py-spy every serving process during {PROFILED_POINTS}; "
        "summaries in --out-dir as profile_TAG_*.txt (sampling costs CPU: not for reported runs)",
    )
    return parser.parse_args(argv)


def parse_variants(specs: list[str]) -> dict[str, dict[str, str]]:
    """--variant values -> {NAME@LABEL: its environment}."""
    variants = {}
    for spec in specs:
        name, _, pairs = spec.partition(":")
        env = dict(pair.split("=", 1) for pair in pairs.split(",") if "=" in pair)
        if "@" not in name or systems.base_system(name) not in systems.SYSTEMS or not env:
            raise SystemExit(
                f"--variant {spec!r}: expected NAME@LABEL:KEY=VALUE[,KEY=VALUE] with NAME one of "
                f"{', '.join(systems.SYSTEMS)}"
            )
        variants[name] = env
    return variants


def main(argv: list[str]) -> int:
    try:
        run = run_comparison(parse_args(argv), results.command_line("compare", argv))
    except memory_plan.DoesNotFit as refused:
        print(refused, file=sys.stderr)
        return 2
    print(report.markdown(run))
    return 0


def run_comparison(args, command: str) -> dict:
    from tqdm import tqdm

    from pipeline.model.source import checkpoint_dtype, resolve_model

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    names = (
        args.systems.split(",")
        if args.systems
        else ["iris", "rayllm", "vllm"]
        if args.quick
        else [s for s in systems.SYSTEMS if not s.endswith("-haproxy")]
    )
    replica_counts = [int(x) for x in (args.replicas or ("1" if args.quick else "1,2")).split(",")]
    args.variant_env = parse_variants(args.variant)
    if unknown := sorted(
        n for n in names if systems.base_system(n) not in systems.SYSTEMS or ("@" in n and n not in args.variant_env)
    ):
        raise SystemExit(
            f"unknown systems {unknown}; choose from {', '.join(systems.SYSTEMS)}, or a NAME@LABEL defined by --variant"
        )
    plan = VIDEO if args.video else QUICK if args.quick else FULL
    if args.points:
        wanted = set(args.points.split(","))
        plan = [p for p in plan + [p for p in FULL + QUICK + VIDEO if p not in plan] if p.name in wanted]
        plan = list({p.name: p for p in plan}.values())
    plan = [replace(p, n=max(2, round(p.n * args.scale))) for p in plan]
    checkpoint = resolve_model(args.model)
    dtype = checkpoint_dtype(checkpoint)
    videos = any(p.workload.startswith("video_") for p in plan)
    engine = systems.EngineSettings(checkpoint, dtype, max_videos=1 if videos else 0, eager=args.eager)
    gpu_node = None
    args.cores = None
    if args.gpu_node_mode:
        model, host = affinity.split_cores(args.gpu_node_mode, sorted(os.sched_getaffinity(0)))
        args.cores = (model, host)
        engine = replace(engine, omp_bind=affinity.omp_bind(model))
        affinity.pin_self(host)  # the harness and its load clients (their children) are host work too
        gpu_node = {"model_cores": model, "host_cores": host, "omp_threads_bind": engine.omp_bind}
    # A router variant differs from its base system only when there are replicas to route between.
    # Without rounds each system runs alone, its points one after another; with rounds, a replica
    # count's systems run side by side.
    groups = [
        [s for s in names if not (systems.base_system(s) in systems.ROUTER_VARIANTS and r == 1)] for r in replica_counts
    ]
    memory = memory_plan.refuse_unless_fits(groups, replica_counts, engine, args.rounds, args.ignore_memory_estimate)
    factory = WorkloadFactory(args.seed, args.small_px, max_tokens=args.max_tokens)
    image_chars = image_prompt_chars(checkpoint, args.small_px)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = args.name or ("compare_quick" if args.quick else "compare")
    log_dir = Path(tempfile.mkdtemp(prefix="iris-compare-logs-"))
    run = {
        **results.provenance(command),
        "model": args.model,
        "checkpoint": checkpoint,
        "dtype": dtype,
        "seed": args.seed,
        "systems": names,
        "variants": args.variant_env,
        "replica_counts": replica_counts,
        "sweep_workload": SWEEP_WORKLOAD,
        "plan": [p.name for p in plan],
        "image_tokens": image_chars,
        "logs": str(log_dir),
        "rounds": args.rounds,
        "memory": memory,
        "gpu_node_mode": gpu_node,
        "ray_event_stats_s": args.ray_event_stats_s,
        "starts": [],
        "results": [],
        "ratios": [],
        "duration_s": 0.0,
    }
    profiler = Profiler(out_dir, args.profile) if args.profile else None
    t0 = time.monotonic()
    bar = tqdm(total=sum(len(g) for g in groups) * len(plan) * args.rounds, unit="point", dynamic_ncols=True)
    try:
        for replicas, group in zip(replica_counts, groups):
            for batch in [group] if args.rounds > 1 else [[s] for s in group]:
                _run_batch(
                    batch, replicas, plan, args, engine, factory, image_chars, checkpoint, log_dir, profiler, run, bar
                )
                run["duration_s"] = time.monotonic() - t0
                _save(run, out_dir, name, plots=False)  # partial results survive a crash later on
    finally:
        bar.close()
    run["duration_s"] = time.monotonic() - t0
    _save(run, out_dir, name, plots=not args.no_plots)
    return run


def _run_batch(
    names: list[str],
    replicas: int,
    plan: list[LoadPoint],
    args,
    engine: systems.EngineSettings,
    factory: WorkloadFactory,
    image_chars: int,
    checkpoint: str,
    log_dir: Path,
    profiler: Profiler | None,
    run: dict,
    bar,
) -> None:
    """Start `names` (all up together), then run the plan's points `args.rounds` times, each point on
    every system in turn; stop them all. Results and starts go into `run`. A system that loses a
    process (liveness.Watch: before, during and after each point) fails that point, is stopped, and
    its later points are skipped, saying what died."""
    running: dict[str, systems.RunningSystem] = {}
    watches: dict[str, liveness.Watch] = {}
    broken: dict[str, str] = {}
    try:
        for system_name in names:
            bar.set_description(f"{system_name} x{replicas}: starting")
            try:
                system = systems.start(
                    system_name,
                    replicas,
                    engine,
                    log_dir,
                    env=getattr(args, "variant_env", {}).get(system_name),
                    ray_event_stats_s=getattr(args, "ray_event_stats_s", 0.0),
                )
            except Exception as err:  # one system that cannot start does not stop the others
                run["starts"].append({"system": system_name, "replicas": replicas, "error": str(err)[-2000:]})
                continue
            running[system_name] = system
            placed = affinity.apply(system.root_pids, *args.cores) if getattr(args, "cores", None) else None
            run["starts"].append(
                {
                    "system": system_name,
                    "replicas": replicas,
                    "start_s": system.start_s,
                    "warm_up": warm_up(LoadClient(system.base_urls, systems.SERVED_NAME), factory),
                    **(
                        {"affinity": {**placed, "placement": affinity.placement(system.root_pids)}}
                        if placed is not None
                        else {}
                    ),
                }
            )
            watches[system_name] = liveness.Watch(system)  # what it runs once it serves
        for round_ in range(args.rounds):
            order = names[round_ % len(names) :] + names[: round_ % len(names)]
            for point in plan:
                for system_name in order:
                    bar.set_description(
                        f"{system_name} x{replicas}: {point.name}"
                        + (f", round {round_ + 1}/{args.rounds}" if args.rounds > 1 else "")
                    )
                    entry = {"system": system_name, "replicas": replicas, "point": point.name, "round": round_}
                    if system_name not in running:
                        run["results"].append(
                            {
                                **entry,
                                "skipped": f"stopped, broken earlier: {broken[system_name]}"
                                if system_name in broken
                                else "did not start (see starts)",
                            }
                        )
                    else:
                        watch = watches[system_name]
                        try:
                            if not watch.check():
                                with systems.measured_alone(running, system_name, args.pause_idle):
                                    result = measure(
                                        running[system_name],
                                        point,
                                        factory,
                                        args,
                                        image_chars,
                                        checkpoint,
                                        profiler,
                                        round_,
                                        watch,
                                    )
                        except liveness.SystemBroken:
                            pass  # watch.broken says what died
                        except Exception as err:
                            result = {"skipped": f"error: {err}"[-1000:]}
                        if watch.check():  # broke before, during or after the point: no figures from it
                            result = {"skipped": f"system broken, point failed: {watch.broken}", "broken": watch.broken}
                            broken[system_name] = watch.broken
                            running.pop(system_name).stop()  # frees its memory, ends its restart loop
                        run["results"].append(
                            {
                                **entry,
                                "workload": point.workload,
                                "concurrency": point.concurrency,
                                "rate": point.rate,
                                "sweep": point.sweep,
                                **result,
                            }
                        )
                    bar.update(1)
    finally:
        for system_name, system in running.items():
            bar.set_description(f"{system_name} x{replicas}: stopping")
            system.stop()


def _save(run: dict, out_dir: Path, name: str, plots: bool) -> None:
    run["ratios"] = report.ratios(run["results"])
    run["ratio_medians"] = report.ratio_medians(run["ratios"])
    path = results.save(run, out_dir / f"{name}.json", report.markdown(run))
    if plots:
        run["plots"] = [p.name for p in report.plots(run, out_dir / name)]
        results.save(run, path)


if __name__ == "__main__":
    sys.exit("run it as: python -m bench compare [options]")
