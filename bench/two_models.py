"""Two models behind one Iris endpoint (`models:`): does one model's burst of new images hold
the other's first tokens back, and does sharing the endpoint add to it?

A VLM (`vlm`) and a text-only model (`text`), set up two ways in turn: `one-endpoint`, one Iris
app of both (`models:`, each with its own stages, one Ingress), and `apart`, two Iris apps, one
per model, each with its own Ingress and Ray instance: the control, with nothing of Iris shared.
Each round measures the text model's TTFT (sequential requests, `--text-requests` of them) three
times: quiet, while `--burst-clients` clients send the VLM new images back to back, and quiet
again. Per round: burst ÷ quiet, and the machine's noise, quiet again ÷ quiet; reported per setup
as medians with their spread over rounds. The setups run one after the other (three engines of
each at once would not fit this machine's memory), each with its own quiet phases to compare with.

What the burst costs depends on where the models run: on a GPU cluster each model's engines and
encoders have devices of their own, and what they share is the Ingress and the hosts' CPUs; on a
2-core machine everything shares the same two cores, so the burst's CPU work (decoding, the tower,
the VLM's engine) takes them from the text model's engine in both setups; what sharing the endpoint
adds is the difference between the setups.

    python -m bench two-models
    python -m bench two-models --rounds 5 --burst-clients 4

Writes bench/results/two_models.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

from bench.harness import results, systems
from bench.harness.client import LoadClient, RequestRecord, warm_up
from bench.harness.stats import median_and_range, percentile
from bench.harness.workloads import WorkloadFactory, hash_str
from deployments.config import MODEL_FIELDS

NAMES = ("vlm", "text")
SETUPS = ("one-endpoint", "apart")
STAGES = {"vlm": ("Preprocess", "VisionEncoder", "LLMDecode"), "text": ("LLMDecode",)}


def two_model_config(config: dict, text_checkpoint: str) -> None:
    """serve_config.yaml as the harness sets it up for one model (iris_config), made an app of two:
    that model as `vlm`, the text model as `text` with the same engine settings; each stage's
    deployment options under its per-model name."""
    app = config["applications"][0]
    args = app["args"]
    vlm = {name: args.pop(name) for name in list(args) if name in MODEL_FIELDS and name != "tenant_limits"}
    vlm["served_model_name"] = "vlm"
    text = {
        "model": text_checkpoint,
        "served_model_name": "text",
        "engine_args": vlm["engine_args"],
        "stream_interval_s": vlm.get("stream_interval_s", 0.05),
    }
    args["models"] = [vlm, text]
    by_name = {d["name"]: d for d in app["deployments"]}
    app["deployments"] = [by_name["Ingress"]] + [
        {**by_name[stage], "name": f"{stage}:{name}"} for name in NAMES for stage in STAGES[name]
    ]


def one_model_config(config: dict, name: str, text_checkpoint: str) -> None:
    """The same, as an app of the one model `name` (the `apart` setup): the VLM as set up, or the
    text model in its place, with LLMDecode only."""
    args = config["applications"][0]["args"]
    args["served_model_name"] = name
    if name == "text":
        args["model"] = text_checkpoint
        app = config["applications"][0]
        app["deployments"] = [d for d in app["deployments"] if d["name"] in ("Ingress", *STAGES["text"])]


async def measure_text(
    urls: dict[str, list[str]], factory: WorkloadFactory, n: int, burst_clients: int, burst_seed: int, settle_s: float
) -> tuple[list[RequestRecord], list[RequestRecord], float]:
    """The text model's n sequential requests, with burst_clients clients sending the VLM new images
    (0: none). `urls`: each model's base URLs. Returns the text model's records, the VLM's, and the
    burst's duration."""
    text = LoadClient(urls["text"], "text")
    vlm = LoadClient(urls["vlm"], "vlm")
    burst_task, stop = None, False
    if burst_clients:
        burst = WorkloadFactory(seed=burst_seed, max_tokens=factory.max_tokens).unique(100_000)
        burst_task = asyncio.create_task(
            vlm.closed_loop_until(enumerate(burst.conversations), burst.max_tokens, burst_clients, lambda: stop)
        )
        await asyncio.sleep(settle_s)  # the burst's queue builds up first
    text_records, _ = await text.closed_loop(factory.text(n), 1)
    vlm_records, seconds = [], 0.0
    if burst_task is not None:
        stop = True
        vlm_records, seconds = await burst_task
    return text_records, vlm_records, seconds


def _p50_ms(records: list[RequestRecord]) -> float | None:
    ttft = [r.ttft_s * 1000 for r in records if r.ok]
    return round(percentile(ttft, 50), 1) if ttft else None


def run_round(setup: str, index: int, urls: dict[str, list[str]], args) -> dict:
    row = {}
    for phase, clients in (("quiet", 0), ("burst", args.burst_clients), ("quiet_again", 0)):
        factory = WorkloadFactory(seed=hash_str(f"{setup}:{index}:{phase}") % 10**6, max_tokens=args.max_tokens)
        seed = hash_str(f"{setup}:burst:{index}") % 10**6
        text_records, vlm_records, seconds = asyncio.run(
            measure_text(urls, factory, args.text_requests, clients, seed, args.settle_s)
        )
        row[phase] = {
            "text_ttft_p50_ms": _p50_ms(text_records),
            "text_ttft_ms": [round(r.ttft_s * 1000, 1) for r in text_records if r.ok],
            "text_failed": sum(not r.ok for r in text_records),
        }
        if clients:
            row[phase] |= {
                "vlm_ok": sum(r.ok for r in vlm_records),
                "vlm_failed": sum(not r.ok for r in vlm_records),
                "vlm_images_per_s": round(sum(r.ok for r in vlm_records) / seconds, 2) if seconds else None,
                "vlm_ttft_p50_ms": _p50_ms(vlm_records),
            }
        print(f"{setup} round {index} {phase:>11}: text p50 TTFT {row[phase]['text_ttft_p50_ms']} ms", flush=True)
    quiet, burst, again = (row[p]["text_ttft_p50_ms"] for p in ("quiet", "burst", "quiet_again"))
    row["burst_over_quiet"] = round(burst / quiet, 3) if burst and quiet else None
    row["quiet_again_over_quiet"] = round(again / quiet, 3) if again and quiet else None
    return row


def summary(rounds: list[dict]) -> dict:
    return {
        **{
            f"{p}_p50_ms": median_and_range([r[p]["text_ttft_p50_ms"] for r in rounds])
            for p in ("quiet", "burst", "quiet_again")
        },
        "vlm_images_per_s": median_and_range([r["burst"]["vlm_images_per_s"] for r in rounds]),
        "burst_over_quiet": median_and_range([r["burst_over_quiet"] for r in rounds]),
        "quiet_again_over_quiet": median_and_range([r["quiet_again_over_quiet"] for r in rounds]),
    }


def markdown(run: dict) -> str:
    def cell(stat: dict, digits: int = 0) -> str:
        if stat["median"] is None:
            return "–"
        return f"{stat['median']:.{digits}f} ({stat['min']:.{digits}f}–{stat['max']:.{digits}f})"

    rows = [
        ("text model's TTFT p50, quiet (ms)", "quiet_p50_ms", 0),
        ("during the VLM's burst (ms)", "burst_p50_ms", 0),
        ("quiet again (ms)", "quiet_again_p50_ms", 0),
        ("VLM images/s during the burst", "vlm_images_per_s", 1),
        ("**burst ÷ quiet**", "burst_over_quiet", 2),
        ("noise: quiet again ÷ quiet", "quiet_again_over_quiet", 2),
    ]
    setups = list(run["setups"])
    return "\n".join(
        [
            f"# Two models, one endpoint ({results.label(run['machine'])}, commit {run['commit']})",
            "",
            f"`{run['system']}`; `vlm` = {run['vlm']}, `text` = {run['text']}; "
            f"the text model's TTFT over {run['text_requests']} "
            f"sequential requests per phase, the VLM's burst from {run['burst_clients']} clients of new images; "
            f"{run['rounds']} rounds per setup; median over rounds (min–max).",
            "",
            "| | " + " | ".join(setups) + " |",
            "|---|" + "---|" * len(setups),
            *(
                f"| {label} | " + " | ".join(cell(run["setups"][s]["summary"][key], d) for s in setups) + " |"
                for label, key, d in rows
            ),
            "",
        ]
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = results.parser("two-models", __doc__)
    parser.add_argument("--vlm", default="builtin:tiny-llava")
    parser.add_argument("--text", default="builtin:tiny-llama")
    parser.add_argument(
        "--system", default="iris-haproxy", help="iris-haproxy (HAProxy in front, as shipped) or iris (Serve's proxy)"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--burst-clients", type=int, default=4)
    parser.add_argument("--text-requests", type=int, default=12, help="the text model's requests per phase")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--settle-s", type=float, default=3.0, help="the burst runs this long before measuring")
    parser.add_argument("--out", type=Path, default=results.RESULTS_DIR / "two_models.json")
    return parser.parse_args(argv)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    from pipeline.model.source import checkpoint_dtype, resolve_model

    checkpoint = resolve_model(args.vlm)
    engine = systems.EngineSettings(checkpoint, checkpoint_dtype(checkpoint))
    text_checkpoint = resolve_model(args.text)
    log_dir = Path(tempfile.mkdtemp(prefix="iris-two-models-"))
    run = {
        **results.provenance(results.command_line("two-models", argv)),
        "system": args.system,
        "vlm": args.vlm,
        "text": args.text,
        "burst_clients": args.burst_clients,
        "text_requests": args.text_requests,
        "rounds": args.rounds,
        "logs": str(log_dir),
        "setups": {},
    }
    started = time.perf_counter()
    for setup in SETUPS:
        running: dict[str, systems.RunningSystem] = {}
        try:
            if setup == "one-endpoint":
                edit = partial(two_model_config, text_checkpoint=text_checkpoint)
                running["both"] = systems.start(args.system, 1, engine, log_dir / setup, edit_config=edit)
                urls = dict.fromkeys(NAMES, running["both"].base_urls)
            else:
                for name in NAMES:
                    edit = partial(one_model_config, name=name, text_checkpoint=text_checkpoint)
                    running[name] = systems.start(args.system, 1, engine, log_dir / setup / name, edit_config=edit)
                urls = {name: running[name].base_urls for name in NAMES}
            warm = warm_up(LoadClient(urls["vlm"], "vlm"), WorkloadFactory(1))
            asyncio.run(LoadClient(urls["text"], "text").closed_loop(WorkloadFactory(2).text(4), 1))
            rounds = [run_round(setup, i, urls, args) for i in range(args.rounds)]
        finally:
            for system in running.values():
                system.stop()
        run["setups"][setup] = {"warm_up": warm, "rounds": rounds, "summary": summary(rounds)}
    run["seconds"] = round(time.perf_counter() - started, 1)
    text = markdown(run)
    results.save(run, args.out, text)
    print(text)


if __name__ == "__main__":
    sys.exit("run it as: python -m bench two-models [options]")
