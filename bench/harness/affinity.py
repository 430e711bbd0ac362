"""GPU-node mode (`compare --gpu-node-mode MODEL_CORES`): some cores play the GPU, the rest the host.

Every system's model work runs on the model cores: vLLM's engine processes (VLLM::EngineCore,
VLLM::Worker, every thread of them) and Iris's VisionEncoder replica; everything else the
system runs (Ray's proxy, controller, raylet and GCS, the Serve replicas that host vLLM's
AsyncLLM, `vllm serve`'s API server) and the harness with its load clients run on the host
cores. Affinity is per thread on Linux, so every thread in /proc/PID/task is set; each engine
binds its OpenMP threads to the model cores itself (VLLM_CPU_OMP_THREADS_BIND, set by
systems.py), and a thread already bound inside the model cores is left as it is. Applied when a
system has started and again before each point, as processes come and go.
"""

from __future__ import annotations

import os

from bench.harness.cpu_usage import is_model_role, role
from bench.harness.profiler import process_tree


def split_cores(model_cores: int, cores: list[int]) -> tuple[list[int], list[int]]:
    """(model cores, host cores): the first `model_cores` of the machine's cores play the GPU."""
    cores = sorted(cores)
    if not 1 <= model_cores < len(cores):
        raise ValueError(
            f"--gpu-node-mode needs between 1 and {len(cores) - 1} model cores on {len(cores)} cores, not {model_cores}"
        )
    return cores[:model_cores], cores[model_cores:]


def omp_bind(model: list[int]) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for every engine: all the model cores (several engines share them,
    as several engines would share one GPU)."""
    return ",".join(map(str, sorted(model)))


def is_model(cmdline: str) -> bool:
    return is_model_role(role(cmdline))


def threads(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def target(cmdline: str, current: set[int], model: set[int], host: set[int]) -> set[int] | None:
    """The affinity one thread of a process with this command line should get, None to leave it:
    a model process's thread already inside the model cores keeps its own (finer) binding."""
    if is_model(cmdline):
        return None if current and current <= model else model
    return None if current == host else host


def plan(tree: dict[int, str], model: list[int], host: list[int], affinity=os.sched_getaffinity) -> dict[int, set[int]]:
    """thread id -> the cores it should get, for every thread of every process in `tree` that
    is not where it belongs."""
    moves: dict[int, set[int]] = {}
    for pid, cmd in tree.items():
        for tid in threads(pid):
            try:
                current = set(affinity(tid))
            except OSError:
                continue
            wanted = target(cmd, current, set(model), set(host))
            if wanted is not None:
                moves[tid] = wanted
    return moves


def apply(roots: list[int], model: list[int], host: list[int]) -> dict:
    """Puts every thread of the processes under `roots` where it belongs; says what it moved, by role."""
    tree = process_tree(roots)
    owner = {tid: pid for pid in tree for tid in threads(pid)}
    moved: dict[str, int] = {}
    failed = 0
    for tid, cores in plan(tree, model, host).items():
        try:
            os.sched_setaffinity(tid, cores)
        except OSError:  # the thread ended meanwhile
            failed += 1
            continue
        name = ("model: " if is_model(tree[owner[tid]]) else "host: ") + role(tree[owner[tid]])
        moved[name] = moved.get(name, 0) + 1
    return {"threads_moved": moved, **({"failed": failed} if failed else {})}


def pin_self(cores: list[int]) -> None:
    """Every thread of this process (the harness, whose load clients inherit it) onto `cores`."""
    for tid in threads(os.getpid()):
        try:
            os.sched_setaffinity(tid, set(cores))
        except OSError:
            pass


def placement(roots: list[int]) -> dict[str, list[int]]:
    """role -> the sorted union of its threads' cores (what the report says each role ran on)."""
    out: dict[str, set[int]] = {}
    for pid, cmd in process_tree(roots).items():
        for tid in threads(pid):
            try:
                out.setdefault(role(cmd), set()).update(os.sched_getaffinity(tid))
            except OSError:
                continue
    return {name: sorted(cores) for name, cores in sorted(out.items())}
