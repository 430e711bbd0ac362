"""CPU time a system spends per request, by process role, over one load point.

Every process under the system's own process tree counts (Ray's GCS, raylet,
proxy and agents too, not only the serving replicas and vLLM's engine
processes), plus the Redis server, which Iris's feature cache uses: the
figures are what each request costs the machine. Read from /proc/PID/stat
(user + system time), so measuring costs nothing while the load runs.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from bench.harness.profiler import _processes, process_tree

_TICK_S = 1 / os.sysconf("SC_CLK_TCK")
_ROLES = [
    (re.compile(r"^ray::ServeReplica:[^: ]+:([^. :]+)"), r"\1"),  # a Serve replica, by deployment
    (re.compile(r"^(VLLM::\w+)"), r"\1"),  # vLLM's engine core and workers
    (re.compile(r"^ray::(\w+)"), r"\1"),  # ProxyActor, ServeController, ...
    (re.compile(r"vllm\.entrypoints\.openai\.api_server"), "vllm api_server"),
    (re.compile(r"^\S*/(raylet|gcs_server|redis-server)\b"), r"\1"),
    (re.compile(r"^redis-server\b"), "redis-server"),
    (re.compile(r"dashboard/agent\.py|dashboard/dashboard\.py"), "dashboard"),
    (re.compile(r"bench\.harness\.serve_runner"), "Serve runner (driver)"),
]


def is_model_role(name: str) -> bool:
    """The model's work (vLLM's engine processes, Iris's VisionEncoder): what a GPU takes over;
    every other role is the host's."""
    return name.startswith("VLLM::") or name == "VisionEncoder"


def role(cmdline: str) -> str:
    for pattern, name in _ROLES:
        m = pattern.search(cmdline)
        if m:
            return m.expand(name)
    return "other Ray processes"


def _cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime


def snapshot(roots: list[int]) -> dict[int, tuple[str, float]]:
    """pid -> (role, CPU seconds so far) for the processes under `roots` and any Redis server."""
    tree = process_tree(roots)
    tree.update({pid: cmd for pid, (_, cmd) in _processes().items() if cmd.split(" ", 1)[0].endswith("redis-server")})
    return {pid: (role(cmd), _cpu_s(pid)) for pid, cmd in tree.items()}


def per_request_ms(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], requests: int
) -> dict[str, float]:
    """CPU milliseconds per request by role between two snapshots, largest first, with "total".
    A process that started in between counts from zero; one that ended is lost."""
    if not requests:
        return {}
    by_role: dict[str, float] = {}
    for pid, (name, cpu) in after.items():
        spent = cpu - before.get(pid, (name, 0.0))[1]
        by_role[name] = by_role.get(name, 0.0) + spent
    ms = {name: round(1000 * s / requests, 1) for name, s in sorted(by_role.items(), key=lambda kv: -kv[1]) if s > 0}
    return {"total": round(sum(ms.values()), 1), **ms}


def per_output_token(per_request: dict[str, float], requests: int, output_tokens: float | None) -> dict[str, float]:
    """CPU ms per output token by role, from the per-request figures over `requests` requests that
    produced `output_tokens` tokens in all; {} where tokens were not counted."""
    if not output_tokens or not requests:
        return {}
    return {name: round(ms * requests / output_tokens, 2) for name, ms in per_request.items()}


class Meter:
    """`with meter:` around a load; then `per_request_ms(requests)`."""

    def __init__(self, roots: list[int]):
        self.roots = roots
        self.before: dict[int, tuple[str, float]] = {}
        self.after: dict[int, tuple[str, float]] = {}

    def __enter__(self) -> Meter:
        self.before = snapshot(self.roots)
        return self

    def __exit__(self, *_exc) -> None:
        self.after = snapshot(self.roots)

    def per_request_ms(self, requests: int) -> dict[str, float]:
        return per_request_ms(self.before, self.after, requests) if self.after else {}
