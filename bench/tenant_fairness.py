"""Two tenants on one Iris, with and without fair sharing (config `fair_sharing.enabled`).

Tenant A floods: --flood-clients concurrent clients, each sending a new 4000x3000 JPEG
(decoding dominates) as soon as its previous answer ends. Tenant B asks about one new
small image at a time. Tenants are told apart by their API keys (Authorization: Bearer).

Two Iris systems run side by side, each in its own Ray instance: `fair` (as shipped) and
`fifo` (first come, first served in Preprocess and the VisionEncoder, same slots). Each
round, each system in turn (the order alternates by round) measures B's TTFT alone and
under A's flood; the ratio fair / fifo of B's p50 TTFT under the flood is taken per round
and reported as the median with its spread. Preprocess is pinned to one replica in both,
so that the autoscaler does not hide the queue being measured.

    python -m bench tenants
    python -m bench tenants --rounds 5 --b-requests 12

Writes bench/results/tenant_fairness.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import results, systems
from bench.harness.client import LoadClient, RequestRecord, warm_up
from bench.harness.stats import median_and_range, percentile
from bench.harness.workloads import (
    WorkloadFactory,
    hash_str,
    jpeg_body_b64,
    large_image_workload,
)

MODES = {"fair": {"enabled": True}, "fifo": {"enabled": False}}
PINNED = {"Preprocess": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 1}}}
KEYS = {"a": "Bearer bench-tenant-a", "b": "Bearer bench-tenant-b"}


async def measure_b(
    system: systems.RunningSystem,
    factory: WorkloadFactory,
    n: int,
    flood_clients: int,
    flood_label: int,
    settle_s: float,
) -> tuple[list[RequestRecord], list[RequestRecord], float]:
    """B's n sequential requests (new small images), with A flooding from flood_clients clients (0:
    A idle). Returns B's records, A's, and A's duration."""
    b = LoadClient(system.base_urls, systems.SERVED_NAME, headers={"Authorization": KEYS["b"]})
    a = LoadClient(system.base_urls, systems.SERVED_NAME, headers={"Authorization": KEYS["a"]})
    flood_task, stop = None, False
    if flood_clients:
        flood = large_image_workload(factory, n=100_000, first_label=flood_label)
        flood_task = asyncio.create_task(
            a.closed_loop_until(enumerate(flood.conversations), flood.max_tokens, flood_clients, lambda: stop)
        )
        await asyncio.sleep(settle_s)  # A's queue builds up in the stages first
    b_records, _ = await b.closed_loop(factory.unique(n), 1)
    a_records, a_seconds = [], 0.0
    if flood_task is not None:
        stop = True
        a_records, a_seconds = await flood_task  # A's requests in flight finish
    return b_records, a_records, a_seconds


def _p50_ms(records: list[RequestRecord]) -> float | None:
    ttft = [r.ttft_s * 1000 for r in records if r.ok]
    return round(percentile(ttft, 50), 1) if ttft else None


def run_round(round_index: int, order: list[str], running: dict[str, systems.RunningSystem], args) -> dict:
    out = {}
    for mode in order:
        system = running[mode]
        row = {}
        for phase, clients in (("alone", 0), ("flood", args.flood_clients)):
            # New images for every round, system and phase: nothing is cached from before.
            seed = hash_str(f"{round_index}:{mode}:{phase}") % 10**6
            factory = WorkloadFactory(seed=seed, max_tokens=args.max_tokens)
            b_records, a_records, a_seconds = asyncio.run(
                measure_b(
                    system,
                    factory,
                    args.b_requests,
                    clients,
                    flood_label=10**7 * (round_index + 1),
                    settle_s=args.settle_s,
                )
            )
            row[phase] = {
                "b_ttft_p50_ms": _p50_ms(b_records),
                "b_ok": sum(r.ok for r in b_records),
                "b_failed": sum(not r.ok for r in b_records),
                "b_ttft_ms": [round(r.ttft_s * 1000, 1) for r in b_records if r.ok],
            }
            if clients:
                row[phase].update(
                    {
                        "a_requests_ok": sum(r.ok for r in a_records),
                        "a_failed": sum(not r.ok for r in a_records),
                        "a_images_per_s": round(sum(r.ok for r in a_records) / a_seconds, 2) if a_seconds else None,
                        "a_ttft_p50_ms": _p50_ms(a_records),
                    }
                )
            print(
                f"round {round_index} {mode:>4} {phase:>5}: B p50 TTFT {row[phase]['b_ttft_p50_ms']} ms"
                + (f", A {row[phase]['a_images_per_s']} img/s" if clients else ""),
                flush=True,
            )
        out[mode] = row
    fair, fifo = out["fair"]["flood"]["b_ttft_p50_ms"], out["fifo"]["flood"]["b_ttft_p50_ms"]
    out["b_flood_fair_over_fifo"] = round(fair / fifo, 3) if fair and fifo else None
    return out


def summarise(rounds: list[dict]) -> dict:
    return {
        "b_flood_fair_over_fifo": median_and_range([r["b_flood_fair_over_fifo"] for r in rounds]),
        **{
            f"b_{phase}_{mode}_p50_ms": median_and_range([r[mode][phase]["b_ttft_p50_ms"] for r in rounds])
            for mode in MODES
            for phase in ("alone", "flood")
        },
        **{
            f"a_images_per_s_{mode}": median_and_range([r[mode]["flood"]["a_images_per_s"] for r in rounds])
            for mode in MODES
        },
        "target_met": None,  # set below: the median ratio at most 0.5
    }


def fmt(value, digits: int = 0) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def markdown(run: dict) -> str:
    s = run["summary"]
    lines = [
        f"# Tenant fairness ({results.label(run['machine'])}, {run['model']}, commit {run['commit']})",
        "",
        f"Tenant A: {run['flood_clients']} clients of new 4000x3000 JPEGs; tenant B: one new "
        f"{run['b_px']}px image at a time, {run['b_requests']} requests per phase; {len(run['rounds'])} rounds, "
        "systems alternating. p50 of B's TTFT per phase, median over rounds (min-max).",
        "",
        "| B's TTFT p50 (ms) | fair sharing | first come, first served |",
        "|---|---|---|",
    ]
    for phase, what in (("alone", "A idle"), ("flood", "under A's flood")):
        cells = [
            f"{fmt(s[f'b_{phase}_{m}_p50_ms']['median'])} ({fmt(s[f'b_{phase}_{m}_p50_ms']['min'])}-"
            f"{fmt(s[f'b_{phase}_{m}_p50_ms']['max'])})"
            for m in MODES
        ]
        lines.append(f"| {what} | {cells[0]} | {cells[1]} |")
    a = [f"{fmt(s[f'a_images_per_s_{m}']['median'], 2)}" for m in MODES]
    lines.append(f"| A's images/s during the flood | {a[0]} | {a[1]} |")
    r = s["b_flood_fair_over_fifo"]
    lines += [
        "",
        f"B under the flood, fair ÷ first come first served, per round: median **{fmt(r['median'], 2)}** "
        f"({fmt(r['min'], 2)}-{fmt(r['max'], 2)}); target ≤ 0.5: {'met' if s['target_met'] else 'missed'}.",
        "",
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = results.parser("tenants", __doc__)
    parser.add_argument("--model", default="builtin:tiny-llava")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--flood-clients", type=int, default=8)
    parser.add_argument("--b-requests", type=int, default=8, help="B's requests per phase")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--settle-s", type=float, default=3.0, help="A floods this long before B starts")
    parser.add_argument("--out", type=Path, default=results.RESULTS_DIR / "tenant_fairness.json")
    return parser.parse_args(argv)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    from pipeline.model.source import checkpoint_dtype, resolve_model

    checkpoint = resolve_model(args.model)
    engine = systems.EngineSettings(checkpoint, checkpoint_dtype(checkpoint))
    for conv in WorkloadFactory(0).large(8).conversations:  # draw A's photos now, not during a phase
        jpeg_body_b64(conv.turns[0].image)
    log_dir = Path(tempfile.mkdtemp(prefix="iris-tenants-"))
    run = {
        **results.provenance(results.command_line("tenants", argv)),
        "model": args.model,
        "flood_clients": args.flood_clients,
        "b_requests": args.b_requests,
        "b_px": WorkloadFactory().small_px,
        "logs": str(log_dir),
        "modes": MODES,
        "deployments": PINNED,
    }
    running: dict[str, systems.RunningSystem] = {}
    started = time.perf_counter()
    try:
        for mode, fair_sharing in MODES.items():
            running[mode] = systems.start(
                "iris", 1, engine, log_dir / mode, deployments=PINNED, app_args={"fair_sharing": fair_sharing}
            )
            warm_up(LoadClient(running[mode].base_urls, systems.SERVED_NAME), WorkloadFactory(1))
        run["rounds"] = []
        for i in range(args.rounds):
            order = list(MODES) if i % 2 == 0 else list(MODES)[::-1]
            run["rounds"].append(run_round(i, order, running, args))
    finally:
        for system in running.values():
            system.stop()
    run["seconds"] = round(time.perf_counter() - started, 1)
    run["summary"] = summarise(run["rounds"])
    ratio = run["summary"]["b_flood_fair_over_fifo"]["median"]
    run["summary"]["target_met"] = ratio is not None and ratio <= 0.5
    text = markdown(run)
    results.save(run, args.out, text)
    print(text)


if __name__ == "__main__":
    sys.exit("run it as: python -m bench tenants [options]")
