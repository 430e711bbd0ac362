"""Turns a run's per-request records into summaries, ratios, a Markdown report and plots."""

from __future__ import annotations

import statistics
from pathlib import Path

from bench.harness.client import RequestRecord
from bench.harness.cpu_usage import is_model_role, per_output_token
from bench.harness.metrics import Counters
from bench.harness.results import label
from bench.harness.stats import distribution, median_and_range, percentile
from bench.harness.systems import base_system

IRIS = ("iris", "iris-haproxy", "iris-connector")  # each against each peer (variants, NAME@LABEL, as NAME)
PEERS = ("rayllm", "rayllm-affinity", "rayllm-haproxy", "vllm")
# Iris variants also compared with Iris itself: the EC connector path against the embeddings path.
AGAINST_IRIS = ("iris-connector",)


def summarize(records: list[RequestRecord], duration_s: float, distinct_images: int, counters: Counters | None) -> dict:
    ok = [r for r in records if r.ok]
    tpot = [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    output_tokens = sum(r.output_tokens for r in ok)
    summary = {
        "requests": len(records),
        "ok": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration_s,
        "req_per_s": len(ok) / duration_s if duration_s else None,
        "ttft_ms": distribution([r.ttft_s for r in ok], 1000),
        "latency_ms": distribution([r.latency_s for r in ok], 1000),
        "tpot_ms": distribution(tpot, 1000),
        # Whole answers: output tokens of the requests that succeeded per second of the load point,
        # and each request's own rate (its output tokens over its end-to-end latency).
        "output_tokens_per_s": output_tokens / duration_s if duration_s else None,
        "request_output_tokens_per_s": distribution([r.output_tokens / r.latency_s for r in ok if r.latency_s]),
        "output_tokens": output_tokens,
        "output_tokens_mean": statistics.fmean(r.output_tokens for r in ok) if ok else None,
        "prompt_tokens_mean": statistics.fmean(r.prompt_tokens for r in ok) if ok else None,
        "resent": sum(r.resent for r in records),
        "errors": sorted({f"{r.status} {r.error[:160]}" for r in records if not r.ok})[:5],
        "distinct_images": distinct_images,
    }
    if counters is not None:
        summary["encoder_runs"] = counters.encoder_runs
        summary["encoder_runs_per_distinct_image"] = (
            counters.encoder_runs / distinct_images if distinct_images else None
        )
        if counters.preprocess_runs is not None:
            summary["preprocess_runs_per_distinct_image"] = (
                counters.preprocess_runs / distinct_images if distinct_images else None
            )
        summary["prefix_hit_rate_by_replica"] = counters.prefix_hit_rates()
        summary["prefix_hit_rate"] = counters.pooled_prefix_hit_rate()
        summary["prompt_token_share_by_replica"] = counters.prompt_token_shares()
        if counters.stage_seconds:
            summary["stage_mean_ms"] = counters.stage_means_ms()
    return summary


def _index(results: list[dict]) -> dict[tuple[str, int, str], dict]:
    """(system, replicas, point) -> the measured result; over several rounds, one whose summary
    holds the median of the rounds' figures (failures summed)."""
    grouped: dict[tuple[str, int, str], list[dict]] = {}
    for r in results:
        if r.get("summary"):
            grouped.setdefault((r["system"], r["replicas"], r["point"]), []).append(r)
    return {
        key: rs[0] if len(rs) == 1 else {**rs[0], "summary": _median_summary([r["summary"] for r in rs])}
        for key, rs in grouped.items()
    }


_SUMMED = (
    "requests",
    "ok",
    "failed",
    "resent",
    "distinct_images",
    "encoder_runs",
    "output_tokens",
)  # each round has its own images


def _median_summary(summaries: list[dict]) -> dict:
    """Each number the median of the summaries' (counts summed), nested dicts alike; other values the first's."""
    out = {}
    for key, first in summaries[0].items():
        values = [s.get(key) for s in summaries]
        if isinstance(first, dict):
            out[key] = _median_summary([v if isinstance(v, dict) else {} for v in values])
        elif isinstance(first, (int, float)) and not isinstance(first, bool):
            numbers = [v for v in values if isinstance(v, (int, float))]
            out[key] = sum(numbers) if key in _SUMMED else percentile(numbers, 50)
        else:
            out[key] = first
    return out


RATIO_METRICS = ("ttft_p50", "ttft_p90", "tpot_p50", "latency_p50", "latency_p90", "req_per_s", "output_tokens_per_s")


def ratios(results: list[dict]) -> list[dict]:
    """Iris / peer for each load point, replica count and round, from the same run."""
    rows = []
    for round_ in sorted({r.get("round", 0) for r in results}):
        index = _index([r for r in results if r.get("round", 0) == round_])
        present = {system for system, _, _ in index}
        for (system, replicas, point), iris in index.items():
            base = base_system(system)
            if base not in IRIS:
                continue
            peers = sorted(
                (p for p in present if base_system(p) in PEERS), key=lambda p: (PEERS.index(base_system(p)), p)
            )
            peers += ["iris"] if base in AGAINST_IRIS else []
            for peer in peers + ([base] if base != system else []):  # a variant also against what it varies
                other = index.get((peer, replicas, point))
                if other is None:
                    continue
                a, b = iris["summary"], other["summary"]
                rows.append(
                    {
                        "point": point,
                        "replicas": replicas,
                        "system": system,
                        "peer": peer,
                        "round": round_,
                        "ttft_p50": _ratio(_get(a, "ttft_ms", "p50"), _get(b, "ttft_ms", "p50")),
                        "ttft_p90": _ratio(_get(a, "ttft_ms", "p90"), _get(b, "ttft_ms", "p90")),
                        "tpot_p50": _ratio(_get(a, "tpot_ms", "p50"), _get(b, "tpot_ms", "p50")),
                        "latency_p50": _ratio(_get(a, "latency_ms", "p50"), _get(b, "latency_ms", "p50")),
                        "latency_p90": _ratio(_get(a, "latency_ms", "p90"), _get(b, "latency_ms", "p90")),
                        "req_per_s": _ratio(a.get("req_per_s"), b.get("req_per_s")),
                        "output_tokens_per_s": _ratio(a.get("output_tokens_per_s"), b.get("output_tokens_per_s")),
                    }
                )
    return rows


def ratio_medians(rows: list[dict]) -> list[dict]:
    """The per-round ratios of each (point, replicas, Iris system, peer) as {metric: {median, min,
    max}} and the number of rounds: a target counts as met when the median meets it."""
    grouped: dict[tuple, list[dict]] = {}
    for row in rows:
        grouped.setdefault((row["point"], row["replicas"], row.get("system", "iris"), row["peer"]), []).append(row)
    out = []
    for (point, replicas, system, peer), group in grouped.items():
        entry = {"point": point, "replicas": replicas, "system": system, "peer": peer, "rounds": len(group)}
        for metric in RATIO_METRICS:
            entry[metric] = median_and_range(row.get(metric) for row in group)
        out.append(entry)
    return out


def _get(summary: dict, metric: str, stat: str):
    """summary[metric][stat], None where it was not measured (results saved before it was)."""
    return (summary.get(metric) or {}).get(stat)


def _ratio(a, b):
    return a / b if a is not None and b else None


def _ratio_cell(ratio: dict | None, spread: bool) -> str:
    if ratio is None or ratio["median"] is None:
        return "–"
    return f"{ratio['median']:.2f}" + (f" ({ratio['min']:.2f}–{ratio['max']:.2f})" if spread else "")


def _fmt(value, digits: int = 0) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _table(points: list[str], systems: list[str], result, cell) -> list[str]:
    """A Markdown table, a row per load point and a column per system: `cell(summary)` of
    `result(system, point)`, blank where it did not run; rows with no cell left out."""
    lines = ["| load point | " + " | ".join(systems) + " |", "|---|" + "---|" * len(systems)]
    for point in points:
        cells = [cell(r["summary"]) if (r := result(system, point)) is not None else "" for system in systems]
        if any(cells):
            lines.append(f"| {point} | " + " | ".join(cells) + " |")
    return lines


def markdown(run: dict) -> str:
    results = [r for r in run["results"] if r.get("summary")]
    index = _index(results)
    systems = [s for s in run["systems"] if any(r["system"] == s for r in results)]
    points = list(dict.fromkeys(r["point"] for r in results))
    machine = run["machine"]
    lines = [
        f"# Iris vs Ray Serve LLM vs `vllm serve` ({run['model']})",
        "",
        f"Figures from a {machine['description']}; commit `{run['commit']}`; {run['started']}; "
        f"{run['duration_s'] / 60:.0f} min.",
        "",
        f"    {run['command']}",
        "",
        gpu_node_line(run),
        "",
        *(
            [
                f"{run['rounds']} rounds, the systems up side by side and taking turns at each point; the "
                "figures per system are the median of the rounds'.",
                "",
            ]
            if run.get("rounds", 1) > 1
            else []
        ),
        "Each cell: p50 TTFT ms / p90 TTFT ms / requests per second (failed requests, if any, in brackets).",
        "TTFT is measured at the first streamed chunk, as vLLM's bench client does.",
        "",
        "Whole answers (the second table of each section): p50 end-to-end latency ms / p90 end-to-end ms / "
        "p50 TPOT ms / output tokens per second (output tokens of the requests that succeeded over the "
        "point's duration).",
        "",
    ]
    for replicas in sorted({r["replicas"] for r in results}):

        def ttft_cell(s: dict) -> str:
            cell = f"{_fmt(s['ttft_ms']['p50'])} / {_fmt(s['ttft_ms']['p90'])} / {_fmt(s['req_per_s'], 1)}"
            return cell + (f" ({s['failed']} failed)" if s["failed"] else "")

        def whole_answer_cell(s: dict) -> str:
            return (
                f"{_fmt(_get(s, 'latency_ms', 'p50'))} / {_fmt(_get(s, 'latency_ms', 'p90'))} / "
                f"{_fmt(_get(s, 'tpot_ms', 'p50'), 1)} / {_fmt(s.get('output_tokens_per_s'), 1)}"
            )

        lines += [
            f"## {replicas} decode replica{'s' if replicas > 1 else ''}",
            "",
            *_table(points, systems, lambda system, point: index.get((system, replicas, point)), ttft_cell),
            "",
            "Whole answers: p50 e2e ms / p90 e2e ms / p50 TPOT ms / output tok/s",
            "",
            *_table(points, systems, lambda system, point: index.get((system, replicas, point)), whole_answer_cell),
        ]
        lines.append("")
        rows = [x for x in run.get("ratio_medians") or ratio_medians(run["ratios"]) if x["replicas"] == replicas]
        if rows:
            several = any(x["rounds"] > 1 for x in rows)
            lines += [
                "Iris / peer, same run (below 1 is Iris faster for TTFT, TPOT and end-to-end latency; above 1 "
                "is Iris faster for req/s and output tok/s)"
                + (": the median of the rounds' ratios, its range in brackets" if several else "")
                + ":",
                "",
                "| load point | peer | p50 TTFT | p90 TTFT | p50 TPOT | p50 e2e | p90 e2e | req/s | output tok/s |"
                + (" rounds |" if several else ""),
                "|---|---|---|---|---|---|---|---|---|" + ("---|" if several else ""),
            ]
            for x in rows:
                cells = [_ratio_cell(x.get(metric), several) for metric in RATIO_METRICS]
                peer = x["peer"] if x.get("system", "iris") == "iris" else f"{x['system']} / {x['peer']}"
                lines.append(
                    f"| {x['point']} | {peer} | " + " | ".join(cells) + " |" + (f" {x['rounds']} |" if several else "")
                )
            lines.append("")
    lines += [
        "## Encoder runs per distinct image, prefix-cache hit rate per replica",
        "",
        "Iris counts its VisionEncoder's computations; the vLLM-based peers, their multimodal "
        "processor-cache misses (see bench/harness/metrics.py).",
        "",
        "Prefix hit rate: prompt tokens served from vLLM's prefix cache, all replicas together, then "
        "per replica; load share: each replica's share of the prompt tokens.",
        "",
        "| system | replicas | load point | distinct images | encoder runs / image | prefix hit rate "
        "(by replica) | load share by replica |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in index.values():  # over several rounds, the median of the rounds'
        s = r["summary"]
        if not s.get("distinct_images"):
            continue
        rates = ", ".join(
            _fmt(v * 100 if v is not None else None) + "%" for v in (s.get("prefix_hit_rate_by_replica") or {}).values()
        )
        pooled = s.get("prefix_hit_rate")
        shares = ", ".join(f"{v * 100:.0f}%" for v in (s.get("prompt_token_share_by_replica") or {}).values())
        lines.append(
            f"| {r['system']} | {r['replicas']} | {r['point']} | {s['distinct_images']} | "
            f"{_fmt(s.get('encoder_runs_per_distinct_image'), 2)} | "
            f"{_fmt(pooled * 100 if pooled is not None else None)}% ({rates}) | {shares or '–'} |"
        )
    cpu_rows = [r for r in results if r["summary"].get("cpu_ms_per_request")]
    if cpu_rows:
        lines += [
            "",
            "## CPU per request, by process",
            "",
            "CPU milliseconds (user + system) each request cost, from the load's start to its end, summed over "
            "every process of the system (Ray's own included) and the Redis server; the six largest roles "
            f"(bench/harness/cpu_usage.py). On this machine's {machine['cpus']} CPUs, 1000 ms of CPU per second "
            f"is {100 / machine['cpus']:.0f}% of the machine.",
            "",
            "Per output token: the same CPU over the output tokens of the requests that succeeded. Host: "
            "every role but the model's (vLLM's engine processes VLLM::*, Iris's VisionEncoder), the part a "
            "GPU would not take over.",
            "",
            "| system | replicas | load point | total ms/request | ms/output token | host ms/request | "
            "host ms/output token | largest (ms/request) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in cpu_rows:
            s = r["summary"]
            cpu = dict(s["cpu_ms_per_request"])
            total = cpu.pop("total", None)
            host = host_cpu(cpu)
            tokens = s.get("output_tokens")
            per_token = (s.get("cpu_ms_per_output_token") or {}).get("total")
            host_token = per_output_token({"host": host}, s.get("ok"), tokens).get("host")
            top = ", ".join(f"{name} {ms:.0f}" for name, ms in list(cpu.items())[:6])
            lines.append(
                f"| {r['system']} | {r['replicas']} | {r['point']} | {_fmt(total)} | {_fmt(per_token, 2)} | "
                f"{_fmt(host)} | {_fmt(host_token, 2)} | {top} |"
            )
    work_rows = [r for r in results if r["summary"].get("host_work")]
    if work_rows:
        lines += [
            "",
            "## Host work per request: Ray calls, object-store puts, streamed items",
            "",
            *HOST_WORK_NOTES,
            "",
            "| system | replicas | load point | Ray calls / request, by method | calls sent, by role | "
            "streamed items received, by role | object-store puts (pins by role) | other Ray calls | "
            "stats dump ms |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in work_rows:
            lines.append(
                f"| {r['system']} | {r['replicas']} | {r['point']} | "
                + " | ".join(host_work_cells(r["summary"]["host_work"]))
                + " |"
            )
    skipped = [r for r in run["results"] if not r.get("summary")]
    if skipped:
        lines += ["", "## Not measured", ""] + [
            f"- {r['system']} ×{r['replicas']} {r['point']}: {r['skipped']}" for r in skipped
        ]
    return "\n".join(lines) + "\n"


def host_cpu(per_request: dict[str, float]) -> float:
    """CPU ms per request of every role but the model's (and the total)."""
    return round(sum(ms for name, ms in per_request.items() if name != "total" and not is_model_role(name)), 1)


def gpu_node_line(run: dict) -> str:
    mode = run.get("gpu_node_mode")
    if not mode:
        return (
            "GPU-node mode: off (every process may run on any core; the model's work competes with the "
            "host's for the same cores)."
        )
    return (
        f"GPU-node mode: cores {mode['model_cores']} play the GPU (vLLM's engine processes, every thread, "
        f"and Iris's VisionEncoder; engines bind VLLM_CPU_OMP_THREADS_BIND={mode['omp_threads_bind']}), "
        f"cores {mode['host_cores']} the host (everything else, the harness and its load clients too); "
        "see docs/benchmarks.md for what this does and does not model."
    )


HOST_WORK_NOTES = [
    "Per completed request, between snapshots before and after the point (bench/harness/host_work.py). "
    "Ray calls by method: Ray's `ray_tasks` metric (finished or failed actor tasks, counted by the caller), "
    "the methods a request calls (a replica's `handle_request*`, and an ASGI ingress's "
    "`ProxyActor.receive_asgi_messages` for the request's body); it names the callee, not the caller. Calls sent by "
    "role and streamed items received by role: each Ray process's own event stats "
    "(`CoreWorkerService.grpc_client.PushTask`, `grpc_server.ReportGeneratorItemReturns`: one message per "
    "item a streaming generator yields to its caller), including the control plane's calls (health checks, "
    'long polls), which also make the "other Ray calls" column. Object-store puts: objects the raylet '
    "created in the shared-memory store (`ray_object_store_dist_count`, node-wide); values under 100 KiB "
    "travel inside the messages and are not puts. Stats dump ms: the CPU the event-stats dumps themselves "
    "took, part of the CPU figures above. `vllm serve` makes no Ray calls: n/a.",
]


def _counts(values: dict | None, digits: int = 2) -> str:
    if values is None:
        return "n/a (no event stats)"
    rest = {k: v for k, v in values.items() if k != "total"}
    return f"{values.get('total', 0):.{digits}f}" + (
        ": " + ", ".join(f"{k} {v:.{digits}f}" for k, v in rest.items()) if rest else ""
    )


def host_work_cells(work: dict) -> list[str]:
    """The host-work table's cells for one point (see HOST_WORK_NOTES)."""
    if work.get("ray") is False:
        return ["0 (n/a: no Ray)"] * 3 + ["0 (n/a)", "0", "–"]
    stale = f" (stale dumps: {', '.join(work['stale_roles'])})" if work.get("stale_roles") else ""
    return [
        _counts(work.get("ray_calls_per_request")),
        _counts(work.get("calls_sent_by_role")) + stale,
        _counts(work.get("streamed_items_received_by_role")),
        f"{_fmt(work.get('object_store_puts_per_request'), 2)} ({_counts(work.get('object_pins_by_role'))})",
        _fmt(work.get("other_ray_calls_per_request"), 2),
        _fmt(work.get("event_stats_dump_ms_per_request"), 2),
    ]


def plots(run: dict, out_prefix: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [r for r in run["results"] if r.get("summary")]
    index = _index(results)
    replica_counts = sorted({r["replicas"] for r in results})
    systems = [s for s in run["systems"] if any(r["system"] == s for r in results)]
    # One colour per system in every panel, whichever systems a panel has.
    colour = {s: f"C{i}" for i, s in enumerate(run["systems"])}
    where = f"{label(run['machine'])}, {run['model']}"
    saved = []

    # Latency against achieved load, for the points of the load sweep.
    fig, axes = plt.subplots(1, len(replica_counts), figsize=(6 * len(replica_counts), 4.5), squeeze=False)
    for ax, replicas in zip(axes[0], replica_counts):
        for system in systems:
            pts = sorted(
                (r["summary"]["req_per_s"], r["summary"]["ttft_ms"]["p50"])
                for r in results
                if r["system"] == system
                and r["replicas"] == replicas
                and r.get("sweep")
                and r["summary"]["ttft_ms"]["p50"] is not None
            )
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=system, color=colour[system])
        ax.set_title(f"{run['sweep_workload']} workload, {replicas} decode replica(s)")
        ax.set_xlabel("achieved requests/s")
        ax.set_ylabel("p50 TTFT (ms)")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend()
    saved.append(_finish(plt, fig, f"Latency vs load ({where})", out_prefix, "latency_vs_load"))

    # p50 TTFT per load point, grouped by system.
    points = list(dict.fromkeys(r["point"] for r in results if not r.get("sweep")))
    fig, axes = plt.subplots(
        len(replica_counts), 1, figsize=(max(8, 1.1 * len(points)), 4 * len(replica_counts)), squeeze=False
    )
    width = 0.8 / max(1, len(systems))
    for ax, replicas in zip(axes[:, 0], replica_counts):
        for k, system in enumerate(systems):
            values = []
            for point in points:
                r = index.get((system, replicas, point))
                values.append(r["summary"]["ttft_ms"]["p50"] if r and r["summary"]["ttft_ms"]["p50"] else 0)
            ax.bar([i + k * width for i in range(len(points))], values, width, label=system, color=colour[system])
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(points))], points, rotation=30, ha="right")
        ax.set_ylabel("p50 TTFT (ms)")
        ax.set_yscale("log")
        ax.set_title(f"{replicas} decode replica(s)")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend()
    saved.append(_finish(plt, fig, f"p50 TTFT by workload ({where})", out_prefix, "ttft_by_workload"))
    return saved


def _finish(plt, fig, title: str, out_prefix: Path, suffix: str) -> Path:
    fig.suptitle(title)
    fig.tight_layout()
    path = out_prefix.with_name(f"{out_prefix.name}_{suffix}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
