"""Soak: Iris under a mixed workload at saturation for several minutes, then checks.

    python -m bench soak --minutes 5            # writes bench/results/soak.json and soak.png
    python -m bench soak --minutes 30 --faults --out bench/results/soak_faults.json

Starts Iris as the benchmark does (serve_config.yaml, a private Ray cluster, the shared
Redis with a namespace of its own), runs a closed loop of new, repeated, multi-turn,
upload-free and text-only conversations, and samples every serving process's RSS
(Serve replicas and vLLM's engine processes) over time. Afterwards it checks:

    rss         after warm-up, no process's private memory (RSS less its shared pages)
                grows by more than 10% (median of the first and of the last minute after
                warm-up); a replica that replaced a killed one from its own warm-up on,
                where it lived long enough to judge. Shared pages are left out of the
                verdict (recorded and plotted): they are Ray's object store and vLLM's
                shared-memory caches mapped in, which fill up to their configured sizes
    ttl         every Redis key Iris wrote (its namespace) has a TTL
    locks       no single-flight lock outlives its expiry: each lock key left has a TTL
                no longer than cache.lock_ttl_s, and none is left lock_ttl_s after the load
                drained (a release that timed out under load leaves its lock to the TTL)
    errors      zero failed requests; with --faults, zero failed otherwise than with a
                documented 409/503/504 in OpenAI's shape (in-band once a stream has started)
    hung        (--faults) no answer later than the app's request_timeout_s

--faults (issue 42): two tenants (API keys), two decode replicas, features to the decoder
through Iris's EC connector (its staging folder in a small tmpfs of the soak's own, root
only), a redis-server of the soak's own; during the load, at fixed fractions of the run:
Redis killed and started again 10 s later, a VisionEncoder replica killed (kill -9), an
LLMDecode replica killed, the staging tmpfs filled for 20 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import psutil

from bench.harness import results, systems
from bench.harness.client import LoadClient, RequestRecord
from bench.harness.profiler import serving_processes
from bench.harness.stats import percentile
from bench.harness.workloads import WorkloadFactory

RSS_GROWTH_LIMIT = 0.10
WINDOW_S = 60.0  # RSS compared as medians over the first and the last window after warm-up
# --faults: when each happens, as a fraction of the run
FAULTS = ((0.25, "redis_restart"), (0.45, "encoder_killed"), (0.65, "decode_killed"), (0.80, "staging_full"))
FAULT_TIMEOUT_S = 60.0  # the app's request_timeout_s under --faults
# The in-process caches, bounded, sized to fill within the warm-up, so that what grows after it is
# not a cache filling: Iris's L1 (cache.l1_max_bytes, 1 GiB per process by default: at this load it
# fills in hours) and vLLM's multimodal processor cache (mm_processor_cache_gb, 4 GiB per engine).
BOUNDED_CACHES = {"cache": {"l1_max_bytes": 16 << 20}, "engine_args": {"mm_processor_cache_gb": 0.05}}
# What a client may be answered while a fault lasts (docs/operations.md); anything else is an error.
DOCUMENTED = {
    409: {"mm_cache_miss"},
    503: {"replica_unavailable", "features_unavailable", "encoder_unavailable"},
    504: {"timeout"},
}
TENANTS = {"tenant-a": "sk-soak-a", "tenant-b": "sk-soak-b"}


def mixed_conversations(seed: int):
    """Endless (index, conversation): each round of 48 mixes every kind, with new images each round."""
    index = itertools.count()
    for round_ in itertools.count():
        factory = WorkloadFactory(seed=seed * 100_000 + round_, small_px=128)
        round_convs = (
            factory.unique(8).conversations
            + factory.zipf(16).conversations
            + factory.multiturn(9).conversations
            + factory.upload_free(8).conversations
            + factory.text(8).conversations
        )
        random.Random(round_).shuffle(round_convs)
        for conv in round_convs:
            yield next(index), conv


# ----------------------------------------------------------------------------- analysis
def private_bytes(sample: dict) -> int:
    """A sample's private memory: its RSS less the pages it shares (file-backed and shared memory)."""
    return sample["rss"] - sample.get("shared", 0)


def rss_growth(samples: list[dict], warmup_s: float, window_s: float = WINDOW_S) -> dict[str, dict]:
    """Per process: median private memory over the first and the last `window_s` after warm-up, and
    the growth. A process that started during the run (a replacement) warms up from its own start;
    one that did not live three windows past its warm-up is not judged."""
    by_process: dict[str, list[tuple[float, int]]] = {}
    for s in samples:
        by_process.setdefault(f"{s['name']} (pid {s['pid']})", []).append((s["t"], private_bytes(s)))
    first_t = min((s["t"] for s in samples), default=0.0)
    out = {}
    for name, points in sorted(by_process.items()):
        begin = warmup_s + (points[0][0] if points[0][0] > first_t else 0.0)
        points = [(t, r) for t, r in points if t >= begin]
        if not points or points[-1][0] - begin < 3 * window_s:
            continue
        end = points[-1][0]
        first = [r for t, r in points if t <= begin + window_s]
        last = [r for t, r in points if t >= end - window_s]
        start_mb, end_mb = percentile(first, 50) / 2**20, percentile(last, 50) / 2**20
        out[name] = {
            "start_mb": round(start_mb, 1),
            "end_mb": round(end_mb, 1),
            "growth": round(end_mb / start_mb - 1, 4),
            "samples": len(points),
        }
    return out


def latency_over_time(records: list[RequestRecord], bin_s: float) -> list[dict]:
    """Per bin of request start times: requests, failures, TTFT and latency p50/p95 (ok requests)."""
    bins: dict[int, list[RequestRecord]] = {}
    for r in records:
        bins.setdefault(int(r.start_s // bin_s), []).append(r)
    out = []
    for b in sorted(bins):
        ok = [r for r in bins[b] if r.ok]
        lat = [r.latency_s for r in ok]
        ttft = [r.ttft_s for r in ok]
        out.append(
            {
                "t": b * bin_s,
                "requests": len(bins[b]),
                "errors": len(bins[b]) - len(ok),
                "latency_p50": percentile(lat, 50),
                "latency_p95": percentile(lat, 95),
                "ttft_p50": percentile(ttft, 50),
                "ttft_p95": percentile(ttft, 95),
            }
        )
    return out


def redis_key_checks(client, namespace: str, lock_ttl_s: float) -> dict:
    """TTLs of every key in Iris's namespace; lock keys separately (see cache_service/redis_tier.py)."""
    no_ttl, locks, keys = [], [], 0
    for key in client.scan_iter(match=f"{namespace}:*", count=1000):
        keys += 1
        pttl = client.pttl(key)
        if pttl == -1:
            no_ttl.append(key.decode(errors="replace"))
        if key.endswith(b":lock"):
            locks.append({"key": key.decode(errors="replace"), "pttl_ms": pttl})
    too_long = [lock for lock in locks if lock["pttl_ms"] == -1 or lock["pttl_ms"] > lock_ttl_s * 1000]
    return {"keys": keys, "keys_without_ttl": no_ttl, "lock_keys": locks, "locks_beyond_expiry": too_long}


def documented_failure(record: RequestRecord) -> bool:
    """Whether a failed request was answered a documented 409/503/504 in OpenAI's error shape, as
    its status or in-band (status 200) once its stream had started."""
    try:
        error = json.loads(record.error)
        error = error.get("error", error)
        codes = DOCUMENTED[record.status] if record.status in DOCUMENTED else set().union(*DOCUMENTED.values())
        return record.status in (*DOCUMENTED, 200) and error["code"] in codes and {"message", "type"} <= set(error)
    except (ValueError, KeyError, TypeError, AttributeError):
        return False


def failure_label(record: RequestRecord) -> str:
    """ "<status> <OpenAI error code>" of a failed request."""
    try:
        error = json.loads(record.error)
        return f"{record.status} {error.get('error', error)['code']}"
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"{record.status} ?"


def verdict(growth: dict, errors: int, keys: dict, locks_after_drain: int, late: int = 0) -> dict:
    return {
        "rss": all(g["growth"] <= RSS_GROWTH_LIMIT for g in growth.values()),
        "errors": errors == 0,
        "hung": late == 0,
        "ttl": not keys["keys_without_ttl"],
        "locks": not keys["locks_beyond_expiry"] and locks_after_drain == 0,
    }


# ----------------------------------------------------------------------------- faults
class SoakRedis:
    """A redis-server of the soak's own, which --faults kills and starts again (same port)."""

    def __init__(self, port: int):
        self.port, self.proc = port, None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
        )
        for _ in range(100):
            ping = subprocess.run(["redis-cli", "-p", str(self.port), "ping"], capture_output=True)
            if ping.stdout.strip() == b"PONG":
                return
            time.sleep(0.1)
        raise RuntimeError(f"redis-server on port {self.port} did not start")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


@contextlib.contextmanager
def small_tmpfs(size_mb: int = 16):
    """A tmpfs of `size_mb` for the staging folders (what a pod's /dev/shm is), or None where this
    process may not mount one."""
    where = Path(tempfile.mkdtemp(prefix="iris-soak-shm-"))
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(where)]).returncode == 0
    try:
        yield where if mounted else None
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(where)])
        with contextlib.suppress(OSError):
            where.rmdir()


def fill(folder: Path) -> Path:
    """Write a file into `folder` until its file system is full."""
    path = folder / "soak-fill"
    with open(path, "wb") as f:
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 2**20)
                f.flush()
    return path


def kill_replica(roots: list[int], deployment: str) -> str:
    """kill -9 one live replica process of `deployment`; what was killed."""
    for name, pid in serving_processes(roots).items():
        if deployment in name:
            psutil.Process(pid).kill()
            return f"{name} pid {pid}"
    return f"no {deployment} replica found"


async def inject_faults(system, redis_server: SoakRedis, staging: Path | None, duration_s: float, events: list) -> None:
    t0 = time.perf_counter()
    for fraction, fault in FAULTS:
        await asyncio.sleep(max(0.0, fraction * duration_s - (time.perf_counter() - t0)))
        event = {"t": round(time.perf_counter() - t0, 1), "fault": fault}
        if fault == "redis_restart":
            redis_server.kill()
            await asyncio.sleep(10)
            redis_server.start()
            event["detail"] = "down 10 s, started empty"
        elif fault == "encoder_killed":
            event["detail"] = kill_replica(system.root_pids, "VisionEncoder")
        elif fault == "decode_killed":
            event["detail"] = kill_replica(system.root_pids, "LLMDecode")
        elif staging is None:
            event["detail"] = "skipped: no tmpfs could be mounted (not root)"
        else:
            filler = await asyncio.to_thread(fill, staging)
            await asyncio.sleep(20)
            filler.unlink()
            event["detail"] = "staging tmpfs full for 20 s"
        events.append(event)
        print(f"  fault at {event['t']:.0f} s: {fault} ({event['detail']})", flush=True)


# ----------------------------------------------------------------------------- run
async def _run(system, minutes: float, concurrency: int, sample_s: float, seed: int, faults=None):
    """`faults`: (SoakRedis, staging folder) to inject them; the load is then two tenants'."""
    roots = system.root_pids
    samples: list[dict] = []
    deadline = time.monotonic() + minutes * 60
    stop = lambda: time.monotonic() >= deadline  # noqa: E731
    conversations = mixed_conversations(seed)  # one source, shared by the tenants' clients
    if faults:
        clients = [
            LoadClient(system.base_urls, systems.SERVED_NAME, FAULT_TIMEOUT_S + 30, {"Authorization": f"Bearer {key}"})
            for key in TENANTS.values()
        ]
        shares = [concurrency // 2, concurrency - concurrency // 2]
    else:
        clients, shares = [LoadClient(system.base_urls, systems.SERVED_NAME, timeout_s=300)], [concurrency]
    loads = [client.closed_loop_until(conversations, 16, n, stop) for client, n in zip(clients, shares)]
    load = asyncio.ensure_future(asyncio.gather(*loads))
    events: list[dict] = []
    injecting = asyncio.ensure_future(inject_faults(system, *faults, minutes * 60, events)) if faults else None
    t0 = time.perf_counter()
    while not load.done():
        t = time.perf_counter() - t0
        for name, pid in serving_processes(roots).items():
            try:
                memory = psutil.Process(pid).memory_info()
                # serving_processes tells same-named processes apart by a "+": by pid here, which stays
                name = name.rstrip("+")
                samples.append({"t": round(t, 2), "name": name, "pid": pid, "rss": memory.rss, "shared": memory.shared})
            except psutil.Error:
                pass
        await asyncio.wait([load], timeout=sample_s)
    done = await load
    if injecting is not None:
        await injecting
    records = [r for tenant_records, _ in done for r in tenant_records]
    return records, max(d for _, d in done), samples, events


def plot(path: Path, samples: list[dict], latency: list[dict], warmup_s: float, events: list[dict] = ()) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, shared_ax, ax2) = plt.subplots(3, 1, figsize=(10, 11), sharex=True)
    for name, pid in sorted({(s["name"], s["pid"]) for s in samples}):
        own = [s for s in samples if (s["name"], s["pid"]) == (name, pid)]
        t = [s["t"] for s in own]
        ax1.plot(t, [private_bytes(s) / 2**20 for s in own], label=f"{name} ({pid})")
        shared_ax.plot(t, [s.get("shared", 0) / 2**20 for s in own])
    for ax in (ax1, shared_ax):
        ax.axvline(warmup_s, color="grey", linestyle="--", label="end of warm-up" if ax is ax1 else None)
    for event in events:
        for ax in (ax1, shared_ax, ax2):
            ax.axvline(event["t"], color="red", linestyle=":")
        ax1.annotate(event["fault"], (event["t"], 0), xycoords=("data", "axes fraction"), rotation=90, fontsize=7)
    ax1.set_ylabel("MiB")
    ax1.set_title("Private memory (RSS less shared pages) of every serving process: judged")
    ax1.legend(fontsize=7, ncol=2)
    shared_ax.set_ylabel("MiB")
    shared_ax.set_title("Shared pages mapped in (Ray's object store, vLLM's shared-memory caches): not judged")
    for key, style in (("latency_p50", "-"), ("latency_p95", "--"), ("ttft_p50", "-"), ("ttft_p95", "--")):
        pts = [(b["t"], b[key]) for b in latency if b[key] is not None]
        ax2.plot([p[0] for p in pts], [p[1] for p in pts], style, label=key)
    ax2.set_xlabel("seconds since the load started")
    ax2.set_ylabel("seconds")
    ax2.set_title("Latency over time (requests binned by start time)")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    parser = results.parser("soak", __doc__)
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--warmup-s", type=float, default=None, help="default: a fifth of the run")
    parser.add_argument("--concurrency", type=int, default=8, help="closed-loop clients")
    parser.add_argument("--sample-s", type=float, default=2.0, help="RSS sampling interval")
    parser.add_argument("--model", default="builtin:tiny-llava")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(results.RESULTS_DIR / "soak.json"))
    parser.add_argument("--faults", action="store_true", help="two tenants, and faults during the load (see above)")
    args = parser.parse_args(argv)

    from pipeline.model.source import checkpoint_dtype, resolve_model

    record = results.provenance(results.command_line("soak", argv))
    checkpoint = resolve_model(args.model)
    dtype = checkpoint_dtype(checkpoint)
    warmup_s = args.warmup_s if args.warmup_s is not None else args.minutes * 60 / 5
    with contextlib.ExitStack() as stack:
        return _soak(args, record, checkpoint, dtype, warmup_s, stack)


def _soak(args, record: dict, checkpoint: str, dtype: str, warmup_s: float, stack: contextlib.ExitStack) -> int:
    import redis

    log_dir = Path(tempfile.mkdtemp(prefix="iris-soak-logs-"))
    engine = systems.EngineSettings(checkpoint, dtype)
    faults, redis_port = None, 6379
    if args.faults:
        redis_server = SoakRedis(systems.free_port())
        stack.callback(redis_server.kill)
        redis_port = redis_server.port
        staging = stack.enter_context(small_tmpfs())
        faults = (redis_server, staging)
        system = systems.start(
            "iris-connector",
            2,
            engine,
            log_dir,
            env={"IRIS_SOAK_KEYS": json.dumps({t: [k] for t, k in TENANTS.items()}), **_staging_env(staging)},
            app_args={
                **BOUNDED_CACHES,
                "auth": {"api_keys_env": "IRIS_SOAK_KEYS"},
                "request_timeout_s": FAULT_TIMEOUT_S,
                "cache": {**BOUNDED_CACHES["cache"], "redis_url": redis_server.url},
            },
        )
    else:
        system = systems.start("iris", 1, engine, log_dir, app_args=BOUNDED_CACHES)
    try:
        records, duration, samples, events = asyncio.run(
            _run(system, args.minutes, args.concurrency, args.sample_s, args.seed, faults)
        )
        cache = system.meta["config"]["applications"][0]["args"]["cache"]
        lock_ttl_s = cache.get("lock_ttl_s", 30.0)
        client = redis.Redis(host="127.0.0.1", port=redis_port)
        keys = redis_key_checks(client, system.namespace, lock_ttl_s)
        time.sleep(2)  # write-behind and lock releases of the last requests

        def count_locks() -> int:
            return sum(1 for _ in client.scan_iter(match=f"{system.namespace}:*:lock", count=1000))

        # A release that timed out under load leaves its lock to the TTL, the designed
        # backstop; what must not happen is a lock that outlives it.
        locks_2s_after_drain = count_locks()
        time.sleep(lock_ttl_s)
        locks_after_drain = count_locks()
    finally:
        system.stop()
    failed = [r for r in records if not r.ok]
    documented = [r for r in failed if args.faults and documented_failure(r)]
    errors = [r.to_dict() for r in failed if r not in documented]
    late = [r.to_dict() for r in records if r.ok and args.faults and r.latency_s > FAULT_TIMEOUT_S]
    growth = rss_growth(samples, warmup_s, min(WINDOW_S, (duration - warmup_s) / 3))
    latency = latency_over_time(records, bin_s=10.0)
    checks = verdict(growth, len(errors), keys, locks_after_drain, len(late))
    out = Path(args.out)
    result = {
        **record,
        "model": args.model,
        "concurrency": args.concurrency,
        "duration_s": round(duration, 1),
        "warmup_s": warmup_s,
        "bounded_caches": BOUNDED_CACHES,
        "requests": len(records),
        "errors": len(errors),
        "error_samples": errors[:5],
        "faults": events,
        "documented_failures": dict(Counter(failure_label(r) for r in documented)),
        "late": late[:5],
        "resent_upload_free": sum(r.resent for r in records),
        "checks": checks,
        "passed": all(checks.values()),
        "rss_growth": growth,
        "redis": {
            **keys,
            "lock_keys": keys["lock_keys"][:20],
            "keys_without_ttl": keys["keys_without_ttl"][:20],
            "locks_2s_after_drain": locks_2s_after_drain,
            "locks_after_drain": locks_after_drain,
        },
        "latency_over_time": latency,
        "rss_samples": samples,
    }
    results.save(result, out)
    plot(out.with_suffix(".png"), samples, latency, warmup_s, events)
    shown = ("duration_s", "requests", "errors", "documented_failures", "checks", "passed")
    print(json.dumps({k: result[k] for k in shown}))
    for name, g in growth.items():
        print(f"  {name:40s} {g['start_mb']:8.1f} -> {g['end_mb']:8.1f} MiB ({g['growth']:+.1%})")
    return 0 if result["passed"] else 1


def _staging_env(staging: Path | None) -> dict:
    from pipeline.model.ec_staging import STAGING_DIR_ENV

    return {STAGING_DIR_ENV: str(staging)} if staging else {}


if __name__ == "__main__":
    sys.exit("run it as: python -m bench soak [options]")
