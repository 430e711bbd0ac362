"""Notice a system breaking under the harness: a root process exiting, a Serve replica or a vLLM
engine core dying, the Serve controller restarting.

Ray's memory monitor kills replicas (and the Serve controller) when the machine runs out of
memory; Serve then starts new ones, and a load point would wait on requests that never come
back, or report figures from a system rebuilt halfway through it. The harness sees this from
/proc alone, at no cost to the system under test: a `Watch`, taken once the system serves,
remembers the pids of its processes that must last the run:

- its roots (the serve runner, or each `vllm serve` process);
- `ray::ServeController`: a pid that goes, or a second one that appears, is a restart;
- each vLLM engine core (`VLLM::EngineCore`): no benchmark system scales its engines;
- each Serve replica of a deployment whose replica count is fixed in the system's config
  (min_replicas == max_replicas, or num_replicas). Replicas of an autoscaled deployment may
  come and go; for those, fewer live replicas than min_replicas is a death.

`check()` compares with /proc now (a scan of every process: before and after each point);
`alive()` only asks whether the remembered pids still run (a few system calls: every
WATCH_INTERVAL_S during a point, through `guarded`, which ends the load at the first death).
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

from bench.harness.profiler import process_tree

WATCH_INTERVAL_S = 2.0  # during a point: a death ends it within about this long
_CONTROLLER = re.compile(r"^ray::ServeController\b")
_ENGINE = re.compile(r"^VLLM::EngineCore\w*")
# ray::ServeReplica:<app>:<deployment>[.<method being run>]; Ray Serve LLM's is e.g. LLMServer:bench.
_REPLICA = re.compile(r"^ray::ServeReplica:([^: ]+):([^. ]+)")


class SystemBroken(RuntimeError):
    """A system under test lost a process it needs; the message says which system and what."""


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")  # a zombie has died, its parent just has not reaped it yet


def fixed_deployments(config: dict | None) -> tuple[set[str], dict[str, int]]:
    """From a Serve config: the deployments whose replica count cannot move, and the minimum of
    those that autoscale. Ray Serve LLM's LLMServer deployments (`LLMServer:<model id>`) come from
    its llm_configs."""
    fixed, minimum = set(), {}

    def add(name: str, deployment: dict) -> None:
        scaling = deployment.get("autoscaling_config") or {}
        if deployment.get("num_replicas", "auto") != "auto" or (
            scaling and scaling.get("min_replicas", 1) == scaling.get("max_replicas", 1)
        ):
            fixed.add(name)
        else:
            minimum[name] = scaling.get("min_replicas", 1)

    for app in (config or {}).get("applications", []):
        for deployment in app.get("deployments", []):
            add(deployment["name"], deployment)
        for llm in (app.get("args") or {}).get("llm_configs", []):
            add(f"LLMServer:{llm['model_loading_config']['model_id']}", llm.get("deployment_config", {}))
    return fixed, minimum


def _describe(kind: str, name: str) -> str:
    return {"controller": "the Serve controller", "engine": f"{name} (a vLLM engine)", "replica": f"replica {name}"}[
        kind
    ]


def _watched(roots: list[int]) -> dict[int, tuple[str, str]]:
    """pid -> (kind, name) for the processes under `roots` that a Watch follows; a replica's
    name is <app>:<deployment>."""
    found = {}
    for pid, cmdline in process_tree(roots).items():
        if _CONTROLLER.match(cmdline):
            found[pid] = ("controller", "ServeController")
        elif m := _ENGINE.match(cmdline):
            found[pid] = ("engine", m.group(0))
        elif m := _REPLICA.match(cmdline):
            found[pid] = ("replica", f"{m.group(1)}:{m.group(2)}")
    return found


def _deployment(name: str) -> str:
    return name.partition(":")[2]


class Watch:
    """What must last while `system` runs (see the module's docstring), taken now.

    `system` needs `name`, `procs` (Popen roots), `logs` and `meta` (with "config", a Serve config,
    for Ray-based systems): bench.harness.systems.RunningSystem."""

    def __init__(self, system):
        self.system = system
        self.fixed, self.minimum = fixed_deployments(system.meta.get("config"))
        self.baseline = _watched(self.roots)
        self.broken: str | None = None  # the first problem found; the system stays broken

    @property
    def roots(self) -> list[int]:
        return [p.pid for p in self.system.procs]

    def _must_last(self) -> dict[int, str]:
        return {
            pid: _describe(kind, name)
            for pid, (kind, name) in self.baseline.items()
            if kind != "replica" or _deployment(name) in self.fixed
        }

    def alive(self) -> str | None:
        """Cheap: a root that exited, or a remembered process that is gone; None while all run."""
        if self.broken:
            return self.broken
        problems = []
        for proc, log in zip(self.system.procs, self.system.logs or [None] * len(self.system.procs)):
            if proc.poll() is not None:
                problems.append(f"{log.name if log else 'process'} (pid {proc.pid}) exited with {proc.returncode}")
        for pid, what in sorted(self._must_last().items()):
            if not _running(pid):
                problems.append(f"{what} (pid {pid}) died")
        return self._broken(problems)

    def check(self) -> str | None:
        """alive(), plus a scan of the system's processes: a new Serve controller (a restart),
        an autoscaled deployment below its minimum."""
        problem = self.alive()
        if problem:
            return problem
        now = _watched(self.roots)
        problems = []
        old = {pid for pid, (kind, _) in self.baseline.items() if kind == "controller"}
        new = {pid for pid, (kind, _) in now.items() if kind == "controller"} - old
        if old and new:
            problems.append(f"the Serve controller restarted (pid {sorted(old)[0]} -> {sorted(new)[0]})")
        # Autoscaled deployments, and those the config does not name (Ray Serve LLM's ingress): 1.
        elastic = {_deployment(name) for kind, name in self.baseline.values() if kind == "replica"} - self.fixed
        for deployment in sorted(elastic):
            least = self.minimum.get(deployment, 1)
            live = sum(1 for kind, name in now.values() if kind == "replica" and _deployment(name) == deployment)
            if live < least:
                problems.append(f"{deployment} has {live} live replicas, fewer than its minimum {least}")
        return self._broken(problems)

    def _broken(self, problems: list[str]) -> str | None:
        if problems and not self.broken:
            logs = ", ".join(str(log) for log in self.system.logs or []) or "its log"
            self.broken = (
                f"{self.system.name}: " + "; ".join(problems) + f" (out of memory? see {logs}, `dmesg`, "
                "and for Ray's memory monitor the raylet's log)"
            )
        return self.broken


async def guarded(load, watch: Watch | None, interval_s: float = WATCH_INTERVAL_S):
    """Await the coroutine `load`; every `interval_s` ask `watch.alive()`, and at the first death
    cancel the load and raise SystemBroken (instead of waiting on requests that will not come back)."""
    task = asyncio.ensure_future(load)
    if watch is None:
        return await task
    while True:
        done, _ = await asyncio.wait({task}, timeout=interval_s)
        if done:
            return task.result()
        problem = watch.alive()
        if problem:
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
            raise SystemBroken(problem)
