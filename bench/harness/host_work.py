"""The host's work per request in a Ray-based system, counted by role: Ray calls (actor tasks),
object-store puts and streamed messages, read before and after a load point.

What Ray 2.60 exposes, and what each count here is taken from (checked on a running cluster):

    Ray calls by method   Ray's Prometheus gauge `ray_tasks{Source="owner", State="FINISHED"|"FAILED"}`,
                          which each owner (caller) keeps per task name, e.g.
                          `ServeReplica:iris:Ingress.handle_request_streaming`. It counts every actor
                          task, including those of Serve replicas whose task events Serve turns off
                          (by default), but carries no caller label: caller → callee
                          pairs are not measured, only the callee's method (and, below, how many calls
                          each role sent and received).
    calls sent / received by role, streamed messages by role, object pins by role
                          each Ray worker's own event stats (the handler counts of its io_context), which
                          a core worker prints to its log (`python-core-worker-*_PID.log`) every
                          RAY_event_stats_print_interval_ms: `CoreWorkerService.grpc_client.PushTask`
                          (actor tasks this process sent), `grpc_server.PushTask` (received),
                          `grpc_server.ReportGeneratorItemReturns` (streamed items this process received
                          from a streaming generator it called; `grpc_client...` = items it sent),
                          `NodeManagerService.grpc_client.PinObjectIDs` (objects it created in the object
                          store and pinned at the raylet). Core workers do not export these as metrics
                          (their gRPC server counters stay out of /metrics), so the harness turns the dump
                          on for Ray-based systems (systems.start, --ray-event-stats-s); the dumps' own
                          CPU (`CoreWorker.PrintEventStats`) is reported beside the counts.
    object-store puts     the raylet's `ray_object_store_dist_count{Source="CreatedByWorker"}`: objects
                          created in the shared-memory object store, the whole node. Small values
                          (under 100 KiB) never get there: they travel inline in the PushTask or
                          ReportGeneratorItemReturns message, so they are not puts.

Not available without changing the systems: Ray's state API (`ray.util.state.list_tasks` /
`summarize_tasks`) needs the dashboard, which the harness's clusters run without, and Serve
turns task events off for its actors, so it would list no replica calls anyway.
"""

from __future__ import annotations

import datetime
import re
import time
from pathlib import Path

from bench.harness.cpu_usage import role
from bench.harness.metrics import parse
from bench.harness.profiler import process_tree

EVENT_STATS_ENV = "RAY_event_stats_print_interval_ms"
_HEADER = re.compile(
    r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) [A-Z] \d+ \d+\] core_worker\.cc:\d+: Event stats:", re.M
)
_ENTRY = re.compile(r"^\t(\S.*?) - (\d+) total \([^)]*\)(?:, Execution time: mean = \S+ms, total = ([\d.]+)ms)?", re.M)
_LOG_PID = re.compile(r"^python-core-(?:worker|driver)-[0-9a-f]+_(\d+)\.log$")
_LOG_DIR = re.compile(r"--log_dir=(\S+)")

# Handler names in a core worker's event stats -> what they count.
SENT_CALLS = "CoreWorkerService.grpc_client.PushTask"
RECEIVED_CALLS = "CoreWorkerService.grpc_server.PushTask"
ITEMS_RECEIVED = "CoreWorkerService.grpc_server.ReportGeneratorItemReturns"
ITEMS_SENT = "CoreWorkerService.grpc_client.ReportGeneratorItemReturns"
PINS = "NodeManagerService.grpc_client.PinObjectIDs"
DUMP = "CoreWorker.PrintEventStats"
COUNTED = (SENT_CALLS, RECEIVED_CALLS, ITEMS_RECEIVED, ITEMS_SENT, PINS)
TERMINAL = ("FINISHED", "FAILED")
# Methods a request calls: a Serve replica's handle_request* and, for an ASGI (FastAPI) ingress, the
# replica's calls back to the proxy for the request's messages.
REQUEST_METHODS = ("handle_request", "receive_asgi_messages")


def parse_event_stats(text: str) -> tuple[float | None, dict[str, int], float]:
    """The last complete event-stats dump in a core worker's log text: (its wall-clock time,
    handler -> count, milliseconds the dumps themselves have taken so far). (None, {}, 0) if none."""
    headers = list(_HEADER.finditer(text))
    for i in range(len(headers) - 1, -1, -1):
        end = headers[i + 1].start() if i + 1 < len(headers) else len(text)
        block = text[headers[i].end() : end]
        if "Other Stats:" not in block and i == len(headers) - 1:
            continue  # still being written
        counts: dict[str, int] = {}
        dump_ms = 0.0
        for m in _ENTRY.finditer(block):
            counts[m.group(1)] = counts.get(m.group(1), 0) + int(m.group(2))
            if m.group(1) == DUMP and m.group(3):
                dump_ms += float(m.group(3))
        when = datetime.datetime.strptime(headers[i].group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        return when, counts, dump_ms
    return None, {}, 0.0


def _tail(path: Path, size: int = 256 * 1024) -> str:
    with open(path, "rb") as f:
        f.seek(0, 2)
        f.seek(max(0, f.tell() - size))
        return f.read().decode(errors="replace")


def log_dir(tree: dict[int, str]) -> Path | None:
    """The Ray session's log folder, from the GCS server's command line in the system's process tree."""
    for cmd in tree.values():
        if "gcs_server" in cmd.split(" ", 1)[0] and (m := _LOG_DIR.search(cmd)):
            return Path(m.group(1))
    return None


def worker_stats(roots: list[int], fresh_after: float | None = None, wait_s: float = 0.0) -> dict[int, dict]:
    """pid -> {"role", "t", "counts", "dump_ms"} for each live Ray worker or driver under `roots`
    whose log holds an event-stats dump. With `fresh_after`, waits up to `wait_s` for every one's
    last dump to be newer than that moment; those still older are marked "stale": True."""
    tree = process_tree(roots)
    folder = log_dir(tree)
    if folder is None or not folder.is_dir():
        return {}
    logs = {
        int(m.group(1)): folder / name
        for name in (p.name for p in folder.iterdir())
        if (m := _LOG_PID.match(name)) and int(m.group(1)) in tree
    }
    deadline = time.monotonic() + wait_s
    while True:
        out = {}
        for pid, path in logs.items():
            try:
                when, counts, dump_ms = parse_event_stats(_tail(path))
            except OSError:
                continue
            if when is not None:
                out[pid] = {"role": role(tree[pid]), "t": when, "counts": counts, "dump_ms": dump_ms}
        stale = [pid for pid, s in out.items() if fresh_after is not None and s["t"] < fresh_after]
        if not stale or time.monotonic() >= deadline:
            for pid in stale:
                out[pid]["stale"] = True
            return out
        time.sleep(0.25)


def ray_counts(metrics_text: str) -> dict:
    """From a Ray node's /metrics: {"tasks": {task name: finished or failed, as owner},
    "object_store_creates": objects created in the object store by workers}."""
    tasks: dict[str, float] = {}
    creates = 0.0
    for name, labels, value in parse(metrics_text):
        if name == "ray_tasks" and labels.get("Source") == "owner" and labels.get("State") in TERMINAL:
            tasks[labels.get("Name", "?")] = tasks.get(labels.get("Name", "?"), 0.0) + value
        elif name == "ray_object_store_dist_count" and labels.get("Source") == "CreatedByWorker":
            creates += value
    return {"tasks": tasks, "object_store_creates": creates}


def short_method(task_name: str) -> str:
    """`ServeReplica:iris:Ingress.handle_request_streaming` -> `Ingress.handle_request_streaming`
    (the app's name dropped; `ServeReplica:app:LLMServer:bench.m` -> `LLMServer:bench.m`)."""
    return (
        task_name.split(":", 2)[2] if task_name.startswith("ServeReplica:") and task_name.count(":") >= 2 else task_name
    )


def _per_request(values: dict[str, float], requests: int) -> dict[str, float]:
    out = {k: round(v / requests, 2) for k, v in sorted(values.items(), key=lambda kv: -kv[1]) if v}
    return {"total": round(sum(values.values()) / requests, 2), **out} if out else {"total": 0.0}


def diff(before: dict, after: dict, requests: int) -> dict:
    """Per-request host work between two snapshots (`Snapshot.take`'s dicts): Ray calls by callee
    method (Serve's per-request methods; other actor tasks, the control plane's, apart), calls sent
    and received by role, streamed items received and sent by role, object-store puts (node-wide)
    and object pins by role, and the event-stats dumps' own CPU ms per request. A process that
    started in between counts from zero; one that ended is lost."""
    if not requests:
        return {}
    tasks_before, tasks_after = before["metrics"]["tasks"], after["metrics"]["tasks"]
    per_method: dict[str, float] = {}
    other: dict[str, float] = {}
    for name, value in tasks_after.items():
        delta = value - tasks_before.get(name, 0.0)
        if not delta:
            continue
        method = short_method(name)
        into = per_method if method.rpartition(".")[2].startswith(REQUEST_METHODS) else other
        into[method] = into.get(method, 0.0) + delta
    by_role: dict[str, dict[str, float]] = {handler: {} for handler in COUNTED}
    dump_ms = 0.0
    stale = set()
    for pid, now in after["workers"].items():
        then = before["workers"].get(pid, {"counts": {}, "dump_ms": 0.0})
        if now.get("stale") or then.get("stale"):
            stale.add(now["role"])
        for handler in COUNTED:
            delta = now["counts"].get(handler, 0) - then["counts"].get(handler, 0)
            if delta:
                by_role[handler][now["role"]] = by_role[handler].get(now["role"], 0.0) + delta
        dump_ms += now["dump_ms"] - then["dump_ms"]
    workers = bool(after["workers"])
    creates = after["metrics"]["object_store_creates"] - before["metrics"]["object_store_creates"]
    return {
        "ray_calls_per_request": _per_request(per_method, requests),
        "other_ray_calls_per_request": round(sum(other.values()) / requests, 2),
        "other_ray_calls_by_method": _per_request(other, requests),
        "calls_sent_by_role": _per_request(by_role[SENT_CALLS], requests) if workers else None,
        "calls_received_by_role": _per_request(by_role[RECEIVED_CALLS], requests) if workers else None,
        "streamed_items_received_by_role": _per_request(by_role[ITEMS_RECEIVED], requests) if workers else None,
        "streamed_items_sent_by_role": _per_request(by_role[ITEMS_SENT], requests) if workers else None,
        "object_store_puts_per_request": round(creates / requests, 2),
        "object_pins_by_role": _per_request(by_role[PINS], requests) if workers else None,
        "event_stats_dump_ms_per_request": round(dump_ms / requests, 2) if workers else None,
        **({"stale_roles": sorted(stale)} if stale else {}),
    }


NO_RAY = {
    "ray": False,
    "note": "no Ray: `vllm serve`'s API server and engine talk over ZeroMQ and shared "
    "memory, which nothing here counts; Ray calls, object-store puts and streamed Ray items are 0",
}


class Snapshot:
    """`take()` before and after a load point on a Ray-based system; `diff`."""

    def __init__(self, roots: list[int], metrics_urls: list[str], stats_interval_s: float):
        self.roots, self.urls, self.interval = roots, metrics_urls, stats_interval_s

    def _metrics(self) -> dict:
        import httpx

        total = {"tasks": {}, "object_store_creates": 0.0}
        for url in self.urls:
            counts = ray_counts(httpx.get(url, timeout=10).text)
            for name, value in counts["tasks"].items():
                total["tasks"][name] = total["tasks"].get(name, 0.0) + value
            total["object_store_creates"] += counts["object_store_creates"]
        return total

    def take(self) -> dict:
        """Ray's metrics once they stop moving (exported every second, with a lag) and every worker's
        event stats dumped after this call began."""
        start = time.time()
        current = self._metrics()
        for _ in range(10):
            time.sleep(1.5)
            latest = self._metrics()
            if latest == current:
                break
            current = latest
        workers = worker_stats(self.roots, start, 2 * self.interval + 1) if self.interval else {}
        return {"metrics": current, "workers": workers}
