"""Will the systems fit in memory? An estimate per system, checked before any is started.

With --rounds the systems of a replica count run side by side; without, one at a time. When
what must be up at once does not fit in the memory available now (less a margin), Ray's memory
monitor kills replicas and the Serve controller in a loop (issue 33: four Ray-based systems
filled a 23 GiB machine, and the run waited on its first point), so the harness refuses the
plan before it starts anything, saying what each system needs, what there is, and what to do.

The estimate per system adds up its processes (host memory, PSS):

    Ray-based (iris*, rayllm*)   RAY_CLUSTER (+ HAPROXY for *-haproxy)
    iris                         one SERVE_REPLICA per Ingress, Preprocess, VisionEncoder and
                                 LLMDecode replica, at each deployment's max_replicas (what its
                                 autoscaler may reach); VisionEncoder + the tower's weights;
                                 each LLMDecode + an engine
    rayllm                       SERVE_REPLICA for its ingress; per replica SERVE_REPLICA (LLMServer) + an engine
    vllm                         per replica API_SERVER + an engine
    an engine                    ENGINE_CORE + its KV cache (VLLM_CPU_KVCACHE_SPACE GiB, as the harness
                                 sets it; on a GPU the KV cache and the weights are in GPU memory,
                                 not counted) + the checkpoint's weights (sizes from its safetensors)

The constants were measured on the 2-core, 24 GiB development machine (no GPU), with vllm-cpu
0.32 and Ray 2.60 at commit 7eee206: Iris (iris-haproxy) and `vllm serve` at one replica each on
builtin:tiny-llava, as tests/test_bench_harness.py's `python -m bench gpu` run starts them, once
they served, summing PSS over each process tree (/proc/PID/smaps_rollup, sampled every 15 s while
the load ran). Rounded up for growth under load: bench/results/soak.json saw the ingress replica's
RSS grow 0.93 -> 1.3 GB in a saturated run. Ray Serve LLM was not measured on its own: its
replicas are Serve replicas that import vLLM, as Iris's are.
"""

from __future__ import annotations

import json
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.harness import systems

MiB, GiB = 2**20, 2**30
# Measured (PSS, see above) -> the constant:
RAY_CLUSTER = 800 * MiB  # 693 MiB: runner (the driver) 106, GCS 47, raylet 32, dashboard 74, autoscaler
#                          monitor 49, log monitor 46, dashboard agent 90, runtime-env agent 49,
#                          ServeController 106, ProxyActor 94
HAPROXY = 128 * MiB  # 106 MiB: the HAProxyManager actor 96, haproxy 10
SERVE_REPLICA = 850 * MiB  # 640-700 MiB: a Serve replica with torch and vLLM imported (Iris's four alike)
API_SERVER = 850 * MiB  # 645-715 MiB: `vllm serve`'s API server process
ENGINE_CORE = 850 * MiB  # 1.69-1.77 GiB with its 1 GiB KV cache: vLLM's EngineCore (its CPU worker in-process)
# Not counted: Iris's feature cache in memory (L1, at most l1_max_bytes per VisionEncoder and
# LLMDecode replica; a compare run's few hundred distinct bench-llava images fill tens of MiB);
# torch.compile's compile workers while an engine starts (gone once it serves).
# Margin: Ray's memory monitor kills workers above 95% of the machine's memory
# (RAY_memory_usage_threshold), so 5% of it stays free; 1 GiB more for the harness itself and
# vLLM's bench client (`vllm bench serve`, a process that imports vLLM).
MONITOR_SHARE = 0.05
HARNESS = 1 * GiB
_TOWER = ("vision", "visual", "mm_projector", "multi_modal_projector", "vpm", "resampler", "merger")


class DoesNotFit(RuntimeError):
    """The plan needs more memory than there is; the message says what to do."""


@dataclass(frozen=True)
class Estimate:
    system: str
    replicas: int
    parts: tuple[tuple[str, int], ...]  # (what, bytes)

    @property
    def total(self) -> int:
        return sum(b for _, b in self.parts)

    def to_dict(self) -> dict:
        return {
            "system": self.system,
            "replicas": self.replicas,
            "gib": round(self.total / GiB, 2),
            "parts": {what: round(b / GiB, 2) for what, b in self.parts},
        }


def weight_bytes(checkpoint: str) -> tuple[int, int] | None:
    """(all weights, the vision tower's and projector's) in bytes, from the checkpoint's safetensors
    headers (other weight files count whole, as language model); None where the checkpoint is not
    on this machine (a hub id not in the local cache)."""
    folder = Path(checkpoint)
    if not folder.is_dir():
        try:
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(checkpoint, local_files_only=True))
        except Exception:  # not cached here (never downloaded from here)
            return None
    total = tower = 0
    for path in sorted(folder.iterdir()):
        if path.suffix == ".safetensors":
            with open(path, "rb") as f:
                header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
            for name, info in header.items():
                if name != "__metadata__":
                    size = info["data_offsets"][1] - info["data_offsets"][0]
                    total += size
                    tower += size if any(part in name for part in _TOWER) else 0
        elif path.suffix in (".bin", ".pt", ".pth") and path.name != "training_args.bin":
            total += path.stat().st_size
    return total, tower


def _kv_cache(engine: systems.EngineSettings) -> int:
    return 0 if engine.gpu else int(float(systems.ENV["VLLM_CPU_KVCACHE_SPACE"]) * GiB)


def _most_replicas(deployment: dict) -> int:
    if isinstance(deployment.get("num_replicas"), int):
        return deployment["num_replicas"]
    return int((deployment.get("autoscaling_config") or {}).get("max_replicas", 1))


def estimate(
    name: str, replicas: int, engine: systems.EngineSettings, weights: tuple[int, int] | None = None
) -> Estimate:
    """Host memory that system `name` with `replicas` decode replicas will hold once it serves
    (module docstring). `weights`: weight_bytes(engine.checkpoint), read here when not given."""
    name = systems.base_system(name)
    weights = weights if weights is not None else weight_bytes(engine.checkpoint)
    all_weights, tower = (0, 0) if engine.gpu or weights is None else weights
    engine_parts = [("engine core", ENGINE_CORE), ("KV cache", _kv_cache(engine)), ("weights", all_weights)]
    parts: list[tuple[str, int]] = []
    if name != "vllm":
        parts.append(("Ray cluster + Serve controller and proxy", RAY_CLUSTER))
    if name.endswith("-haproxy"):
        parts.append(("HAProxy", HAPROXY))
    if name.startswith("iris"):
        config = systems.iris_config(engine, replicas, 0, cache=True, namespace="estimate")
        for deployment in config["applications"][0]["deployments"]:
            count, label = _most_replicas(deployment), deployment["name"]
            parts.append((f"{label} x{count}", count * SERVE_REPLICA))
            if label == "VisionEncoder":
                parts.append((f"{label} weights x{count}", count * tower))
            if label == "LLMDecode":
                parts += [(f"{what} x{count}", count * size) for what, size in engine_parts]
    elif name.startswith("rayllm"):
        parts += [("OpenAiIngress x1", SERVE_REPLICA), (f"LLMServer x{replicas}", replicas * SERVE_REPLICA)]
        parts += [(f"{what} x{replicas}", replicas * size) for what, size in engine_parts]
    else:
        parts.append((f"API server x{replicas}", replicas * API_SERVER))
        parts += [(f"{what} x{replicas}", replicas * size) for what, size in engine_parts]
    if weights is None and not engine.gpu:
        parts.append(("weights unknown (a hub id not in the local cache): not counted", 0))
    return Estimate(name, replicas, tuple((what, size) for what, size in parts if size or "unknown" in what))


def gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB // 10 else f"{n / MiB:.0f} MiB"


def usable(available: int, total: int) -> int:
    """What the systems may take of `available` bytes on a machine of `total` (the margin out)."""
    return available - int(MONITOR_SHARE * total) - HARNESS


def machine_memory() -> tuple[int, int]:
    """(available, total) bytes now."""
    import psutil

    memory = psutil.virtual_memory()
    return memory.available, memory.total


def check(
    batches: list[list[Estimate]], rounds: int, available: int | None = None, total: int | None = None
) -> str | None:
    """None when every batch (the systems up at once) fits in the usable memory; otherwise what
    does not fit, with each system's estimate, the memory there is, and what to do."""
    if available is None or total is None:
        available, total = machine_memory()
    room = usable(available, total)
    over = [batch for batch in batches if sum(e.total for e in batch) > room]
    if not over:
        return None
    lines = [
        "Not started: the systems would not fit in memory (bench/harness/memory_plan.py estimates).",
        f"Available now: {gib(available)} of {gib(total)}; usable for the systems: {gib(room)} "
        f"(kept free: {MONITOR_SHARE:.0%} of memory, where Ray's memory monitor starts killing, "
        f"and {gib(HARNESS)} for the harness).",
    ]
    for batch in over:
        together = "up together (--rounds)" if len(batch) > 1 else "alone"
        lines.append(f"{gib(sum(e.total for e in batch))} needed {together}:")
        lines += [
            f"  {e.system} x{e.replicas}: {gib(e.total)} ("
            + ", ".join(f"{what} {gib(size)}" for what, size in e.parts if size)
            + ")"
            for e in batch
        ]
    advice = ["fewer --systems"] if any(len(b) > 1 for b in over) else []
    advice += ["no --rounds (one system up at a time)"] if rounds > 1 else []
    advice += [
        "fewer --replicas",
        "a smaller model",
        "close what else holds memory",
        "or --ignore-memory-estimate if you know better",
    ]
    lines.append("Try: " + "; ".join(advice) + ".")
    return "\n".join(lines)


def refuse_unless_fits(
    groups: list[list[str]],
    replica_counts: list[int],
    engine: systems.EngineSettings,
    rounds: int,
    ignore: bool = False,
) -> dict:
    """For `python -m bench compare`: `groups[i]`, the systems to run at `replica_counts[i]` replicas,
    up together with rounds > 1, else one at a time. Raises DoesNotFit before anything starts when
    they would not fit, unless `ignore` (then says so on stderr); returns the estimates for the record."""
    weights = weight_bytes(engine.checkpoint)
    batches = [[estimate(s, r, engine, weights) for s in group] for r, group in zip(replica_counts, groups)]
    batches = [b for b in batches if b] if rounds > 1 else [[e] for batch in batches for e in batch]
    available, total = machine_memory()
    problem = check(batches, rounds, available, total)
    if problem and not ignore:
        raise DoesNotFit(problem)
    if problem:
        print(f"{problem}\n--ignore-memory-estimate: starting them anyway.", file=sys.stderr)
    return {
        "available_gib": round(available / GiB, 1),
        "total_gib": round(total / GiB, 1),
        "usable_gib": round(usable(available, total) / GiB, 1),
        "fits": problem is None,
        "estimates": [e.to_dict() for batch in batches for e in batch],
    }
