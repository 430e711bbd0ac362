"""A GPU run ready to go: Iris, Ray Serve LLM and `vllm serve` on 7B-sized VLMs, on one GPU.

    python -m bench gpu                                   # both 7b models, the three systems, 1 and 16 clients
    python -m bench gpu --models qwen2_5_vl --systems iris,vllm
    python -m bench gpu --size tiny --models llava --systems iris,vllm --clients 1,2 --requests 4   # on a CPU
    python -m bench gpu --tensor-parallel-size 4 --models qwen2_5_vl   # a tensor-parallel point, 4+ GPUs

For a machine with one NVIDIA GPU (40 GB or more) and no model hub; with
`--tensor-parallel-size N`, N GPUs (N + 1 for Iris, whose VisionEncoder takes 0.2 of another), every
system's engine over N ranks: Iris's LLMDecode in a placement group of N bundles
(deployments/placement.py), Ray Serve LLM's in one of N bundles, `vllm serve --tensor-parallel-size N`.
On a CPU the ranks are processes, one core list each. For each model it

1. builds the random-weight checkpoint `builtin:<size>-<family>` with the project's own builder
   (pipeline/model/builtin): at `--size 7b`, LLaVA-1.5-7B's and Qwen2.5-VL-7B's dimensions in
   bfloat16 (7.06 B and 8.29 B parameters, 14.1 and 16.6 GB on disk, drawn on the GPU; cached in
   IRIS_CHECKPOINT_DIR, so only the first run builds them; an estimated 1–3 min each, not measured:
   no GPU machine was available when this was written);
2. starts each system in turn on the same checkpoint and engine settings (bench/harness/systems.py,
   EngineSettings(gpu=True) where a GPU is found: Iris's VisionEncoder and LLMDecode share the GPU,
   0.2 + 0.8 of it; Ray Serve LLM's placement group holds it; `vllm serve` finds it; every vLLM
   engine gets --gpu-memory-utilization, default 0.8; compiled, with CUDA graphs);
3. warms it up, then measures at each client count (closed loop), in this order: new images
   (`unique`: a new `--image-px` JPEG per request), one image again and again (`repeat`) and text
   only (`text`), each answer `--max-tokens` tokens long (`ignore_eos`, so every system writes as
   many and whole-answer latency compares like with like); TTFT, TPOT, end-to-end latency p50/p90,
   output tokens/s, requests/s, and from each system's counters encoder runs per image and vLLM's
   prefix-cache hit rate;
4. stops it and moves on; ratios Iris / peer come from the same run.

Time: the measurements take at most `--budget-s` (480 s), split evenly over every (model, system,
load point): a point starts no request after its share (13 s with the defaults), or after
`--requests` requests. Around them: the builds, one start per system and model (weights from
the page cache after the first, torch.compile and CUDA graph capture: 1–3 min each, an estimate),
warm-up, and a few seconds per point while Ray's counters settle: about 25–35 min in all.
Without a GPU it runs the same steps on the CPU, engines eager (a smoke run, not figures).

Writes --out (default bench/results/gpu_run.json; every summary, with the commit, the command and
the machine, the GPU by name) and the Markdown tables beside it (.md), after each system, so a
crash later keeps what was measured. Needs Redis at 127.0.0.1:6379 for Iris's feature cache.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import report, results, systems
from bench.harness.client import LoadClient, warm_up
from bench.harness.workloads import WorkloadFactory, hash_str

MODELS = ("llava", "qwen2_5_vl")
PEER_SYSTEMS = ("iris", "rayllm", "vllm")
WORKLOADS = ("unique", "repeat", "text")  # new images, one image again, text only
GPU_MEMORY_UTILIZATION = 0.8  # every engine's; Iris's tower has the rest of its GPU


def parse_args(argv: list[str] | None = None):
    parser = results.parser("gpu", __doc__)
    parser.add_argument("--models", default=",".join(MODELS), help=f"families, comma-separated, of {MODELS}")
    parser.add_argument("--size", default="7b", help="built-in size: 7b (the real dimensions) or tiny / bench")
    parser.add_argument(
        "--systems", default=",".join(PEER_SYSTEMS), help=f"comma-separated subset of {','.join(systems.SYSTEMS)}"
    )
    parser.add_argument("--clients", default="1,16", help="closed-loop client counts, comma-separated")
    parser.add_argument("--requests", type=int, default=64, help="at most this many requests per load point")
    parser.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help="comma-separated, of bench/harness/workloads.py's image and text workloads",
    )
    parser.add_argument(
        "--budget-s", type=float, default=480.0, help="seconds of measurement in all, split evenly over the load points"
    )
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens of every answer")
    parser.add_argument("--image-px", type=int, default=512, help="side of the workloads' JPEGs")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--gpu-memory-utilization", type=float, default=GPU_MEMORY_UTILIZATION)
    parser.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="ranks per engine for every system (GPUs each)"
    )
    parser.add_argument(
        "--eager",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="engines without torch.compile / CUDA graphs (default: on a CPU only)",
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds for one system to start")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(results.RESULTS_DIR / "gpu_run.json"))
    return parser.parse_args(argv)


def main(argv: list[str]) -> None:
    run = run_gpu(parse_args(argv), results.command_line("gpu", argv))
    print(markdown(run))


def run_gpu(args, command: str) -> dict:
    from pipeline.model.source import checkpoint_dtype

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    models = [m.strip().replace("-", "_") for m in args.models.split(",") if m.strip()]
    names = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in names if s not in systems.SYSTEMS]
    if unknown:
        raise SystemExit(f"unknown systems {unknown}; choose from {systems.SYSTEMS}")
    clients = [int(c) for c in args.clients.split(",")]
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    points = [(w, c) for w in workloads for c in clients]
    run = {
        **results.provenance(command),
        "models": {},
        "size": args.size,
        "systems": names,
        "clients": clients,
        "workloads": workloads,
        "max_tokens": args.max_tokens,
        "image_px": args.image_px,
        "seed": args.seed,
        "budget_s": args.budget_s,
        "tensor_parallel_size": args.tensor_parallel_size,
        "starts": [],
        "results": [],
        "ratios": [],
        "duration_s": 0.0,
    }
    gpu = bool(run["machine"]["gpus"])
    eager = (not gpu) if args.eager is None else args.eager
    point_s = args.budget_s / max(1, len(models) * len(names) * len(points))
    run.update(gpu=gpu, eager=eager, point_budget_s=point_s)
    out = Path(args.out)
    log_dir = Path(tempfile.mkdtemp(prefix="iris-gpu-run-logs-"))
    run["logs"] = str(log_dir)
    t0 = time.monotonic()
    for family in models:
        model = f"builtin:{args.size}-{family.replace('_', '-')}"
        built = time.monotonic()
        checkpoint = _build(model)
        dtype = checkpoint_dtype(checkpoint)
        run["models"][model] = {
            "checkpoint": checkpoint,
            "dtype": dtype,
            "ready_s": time.monotonic() - built,
            "disk_gb": sum(p.stat().st_size for p in Path(checkpoint).iterdir()) / 1e9,
        }
        engine = systems.EngineSettings(
            checkpoint,
            dtype,
            max_model_len=args.max_model_len,
            max_videos=0,
            eager=eager,
            gpu=gpu,
            gpu_memory_utilization=args.gpu_memory_utilization if gpu else None,
            tensor_parallel_size=args.tensor_parallel_size,
        )
        for name in names:
            _run_system(run, model, name, engine, points, point_s, args, log_dir)
            run["duration_s"] = time.monotonic() - t0
            _save(run, out)
    run["duration_s"] = time.monotonic() - t0
    _save(run, out)
    return run


def _build(model: str) -> str:
    """The checkpoint's folder, built on first use (on the GPU for the 7b sizes) in a process of its
    own: this one never holds GPU memory or a CUDA context while the systems run."""
    code = "import sys\nfrom pipeline.model.source import resolve_model\nprint(resolve_model(sys.argv[1]))"
    done = subprocess.run([sys.executable, "-c", code, model], cwd=results.ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"building {model} failed:\n{done.stderr[-3000:]}")
    return done.stdout.strip().splitlines()[-1]


def _run_system(
    run: dict,
    model: str,
    name: str,
    engine: systems.EngineSettings,
    points: list[tuple[str, int]],
    point_s: float,
    args,
    log_dir: Path,
) -> None:
    print(f"{model}: starting {name}", file=sys.stderr, flush=True)
    try:
        system = systems.start(name, 1, engine, log_dir, timeout_s=args.timeout)
    except Exception as err:  # one system that cannot start does not stop the others
        run["starts"].append({"model": model, "system": name, "error": str(err)[-2000:]})
        run["results"] += [
            {
                "model": model,
                "system": name,
                "replicas": 1,
                "point": f"{w}-c{c}",
                "skipped": "did not start (see starts)",
            }
            for w, c in points
        ]
        return
    factory = WorkloadFactory(args.seed, args.image_px, max_tokens=args.max_tokens)
    # ignore_eos: every answer max_tokens long, whatever the random weights make of it.
    client = LoadClient(system.base_urls, systems.SERVED_NAME, extra_body={"ignore_eos": True})
    try:
        run["starts"].append(
            {"model": model, "system": name, "start_s": system.start_s, "warm_up": warm_up(client, factory)}
        )
        before = system.counters()
        for workload_name, concurrency in points:
            point = f"{workload_name}-c{concurrency}"
            print(f"{model}: {name} {point}", file=sys.stderr, flush=True)
            entry = {
                "model": model,
                "system": name,
                "replicas": 1,
                "point": point,
                "workload": workload_name,
                "concurrency": concurrency,
            }
            try:
                # The same images and text for every system; new ones at every point.
                workload = WorkloadFactory(
                    hash_str(f"{args.seed}:{model}:{point}") % 2**31, args.image_px, max_tokens=args.max_tokens
                ).build(workload_name, args.requests)
                records, duration = asyncio.run(client.closed_loop(workload, concurrency, duration_s=point_s))
                after = system.counters()
                entry["summary"] = report.summarize(records, duration, workload.distinct_images, after.minus(before))
                entry["description"] = workload.description
                before = after
            except Exception as err:
                entry["skipped"] = f"error: {err}"[-1000:]
                try:
                    before = system.counters()
                except Exception:
                    pass
            run["results"].append(entry)
    finally:
        system.stop()


def _per_model(run: dict, model: str) -> dict:
    rows = [r for r in run["results"] if r["model"] == model]
    return {**run, "model": model, "results": rows, "ratios": report.ratios(rows)}


def _save(run: dict, out: Path) -> None:
    run["ratios"] = [{"model": model, **row} for model in run["models"] for row in _per_model(run, model)["ratios"]]
    results.save(run, out, markdown(run))


def markdown(run: dict) -> str:
    """One section per model (bench/harness/report.py's tables), after a header saying what ran."""
    machine = run["machine"]
    head = [
        f"# `python -m bench gpu`: Iris, Ray Serve LLM and `vllm serve` at size {run['size']}",
        "",
        f"{machine['description']}; commit `{run['commit']}`; {run['started']}; "
        f"{run['duration_s'] / 60:.0f} min in all.",
        "",
        f"    {run['command']}",
        "",
        f"Closed loop at {', '.join(map(str, run['clients']))} clients; {run['image_px']} px JPEGs; every answer "
        f"{run['max_tokens']} tokens (ignore_eos); at most {run['point_budget_s']:.0f} s per load point; "
        f"engines {'on the GPU' if run['gpu'] else 'on the CPU'}{', eager' if run['eager'] else ''}"
        f"{', tensor parallel ' + str(run['tensor_parallel_size']) if run['tensor_parallel_size'] > 1 else ''}.",
        "",
    ]
    for model, info in run["models"].items():
        head.append(
            f"- `{model}`: {info['dtype']}, {info['disk_gb']:.1f} GB, ready in {info['ready_s']:.0f} s "
            f"(built or found in {info['checkpoint']})"
        )
    starts = [s for s in run["starts"] if "start_s" in s]
    if starts:
        head += ["", "Start-up (s): " + ", ".join(f"{s['system']} {s['start_s']:.0f} ({s['model']})" for s in starts)]
    sections = []
    for model in run["models"]:
        if any(r["model"] == model for r in run["results"]):
            text = report.markdown(_per_model(run, model))  # its headings one level down: sections of this one
            sections.append("\n".join("#" + line if line.startswith("#") else line for line in text.splitlines()))
    return "\n".join(head) + "\n\n" + "\n".join(sections)


if __name__ == "__main__":
    sys.exit("run it as: python -m bench gpu [options]")
