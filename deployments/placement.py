"""Where one LLMDecode replica's vLLM ranks run: its placement group, from `engine_args` (no Ray).

A replica with `tensor_parallel_size` × `pipeline_parallel_size` (× `prefill_context_parallel_size`)
ranks holds a placement group of its own, as Ray Serve LLM's LLMServer does
(`get_deployment_options`): one bundle per rank, the replica actor's own resources added to the
first one, so the actor (vLLM's engine core, the driver) always sits on the node of rank 0. Serve
reserves the group with the replica and frees it with the replica: autoscaling and rolling updates
add and remove whole groups.

- GPU nodes, vLLM's Ray executor (the default): `{"GPU": 1}` per rank; vLLM starts one worker actor in
  each bundle that holds a GPU. PACK (the default) puts the group on one node where it fits;
  SPREAD / STRICT_SPREAD put pipeline stages on nodes of their own.
- GPU nodes, vLLM's multiprocessing executor (`distributed_executor_backend: mp`): the replica actor
  holds every GPU of the replica in one bundle and vLLM forks its workers on that node, as
  `vllm serve` does on one machine.
- CPU nodes: multiprocessing only, one bundle of `cpus_per_rank` per rank, STRICT_PACK. vLLM 0.32's
  CPU platform runs no Ray workers: `CpuPlatform.ray_device_key` is "" and
  `vllm/v1/executor/ray_utils.py` (`initialize_ray_cluster`) raises "current platform cpu does not
  support ray" for it.

One rank (the default) keeps today's replica: no group, Serve's `ray_actor_options` as configured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

STRATEGIES = ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD")
CPU_NO_RAY = (
    "vLLM's CPU platform runs no Ray workers (CpuPlatform.ray_device_key is empty; "
    "vllm/v1/executor/ray_utils.py raises 'current platform cpu does not support ray')"
)


class DecodePlacement(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    device: Literal["GPU", "CPU"] = Field(
        "GPU",
        description="What each vLLM rank of an LLMDecode replica reserves when engine_args ask for more than one "
        "(tensor_parallel_size × pipeline_parallel_size): a GPU, or `cpus_per_rank` CPUs on a CPU-only node.",
    )
    strategy: Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"] | None = Field(
        None,
        description="The replica's placement-group strategy. None: PACK with vLLM's Ray executor (the group on "
        "one node where it fits), STRICT_PACK with its multiprocessing one (every rank on the replica's node). "
        "SPREAD / STRICT_SPREAD put pipeline stages on nodes of their own (Ray executor only).",
    )
    replica_cpus: float = Field(
        1,
        gt=0,
        description="CPUs of the replica actor itself (vLLM's engine core), added to rank 0's bundle; "
        "LLMDecode's `ray_actor_options` must fit in that bundle (num_gpus: 0 with the Ray executor).",
    )
    cpus_per_rank: float = Field(1, gt=0, description="CPUs each rank reserves on a CPU-only node.")
    bundle_per_rank: dict[str, float] | None = Field(
        None,
        description="Each rank's bundle in place of the default ({GPU: 1}, or {CPU: cpus_per_rank}), e.g. "
        "{GPU: 1, CPU: 2} or with an accelerator_type resource; Ray executor or CPU only.",
    )


@dataclass(frozen=True)
class Placement:
    """One replica's ranks and the group that holds them; `bundles` None: one rank, no group."""

    world_size: int
    executor: str | None  # vLLM's distributed_executor_backend; None: vLLM's own choice (one rank)
    bundles: list[dict[str, float]] | None = None
    strategy: str | None = None
    replica: dict[str, float] | None = None  # the replica actor's own resources (in bundles[0])

    def serve_options(self) -> dict[str, Any]:
        """LLMDecode's Serve deployment options for the group (none for one rank)."""
        if self.bundles is None:
            return {}
        return {
            "placement_group_bundles": [dict(b) for b in self.bundles],
            "placement_group_strategy": self.strategy,
            "ray_actor_options": {"num_cpus": self.replica["CPU"], "num_gpus": self.replica.get("GPU", 0)},
        }

    def engine_flags(self) -> dict[str, Any]:
        return {"distributed_executor_backend": self.executor} if self.executor else {}


def world_size(engine_args: dict[str, Any]) -> int:
    return (
        int(engine_args.get("tensor_parallel_size") or 1)
        * int(engine_args.get("pipeline_parallel_size") or 1)
        * int(engine_args.get("prefill_context_parallel_size") or 1)
    )


def plan(engine_args: dict[str, Any], config: DecodePlacement) -> Placement:
    """The replica's ranks and group for these `engine_args`; ValueError naming what cannot run."""
    if int(engine_args.get("data_parallel_size") or 1) > 1:
        raise ValueError(
            "engine_args.data_parallel_size: Iris scales LLMDecode by replicas (each its own engine "
            "and group): set num_replicas or autoscaling_config instead"
        )
    world = world_size(engine_args)
    executor = engine_args.get("distributed_executor_backend")
    if world == 1:
        return Placement(1, executor)
    if config.device == "CPU":
        if executor not in (None, "mp"):
            raise ValueError(
                f"engine_args.distributed_executor_backend {executor!r} on CPU nodes: {CPU_NO_RAY}; "
                "ranks on CPU nodes run in vLLM's multiprocessing executor (mp), on one node"
            )
        if config.strategy not in (None, "STRICT_PACK"):
            raise ValueError(
                f"decode_placement.strategy {config.strategy} on CPU nodes: vLLM's multiprocessing "
                f"executor forks every rank on the replica's node, so the group must be STRICT_PACK; "
                f"{CPU_NO_RAY}"
            )
        rank = dict(config.bundle_per_rank or {"CPU": config.cpus_per_rank})
        if rank.get("GPU"):
            raise ValueError("decode_placement.bundle_per_rank holds a GPU but device is CPU")
        return _grouped(world, "mp", rank, "STRICT_PACK", {"CPU": config.replica_cpus})
    executor = executor or "ray"
    if executor == "mp":  # every GPU with the replica actor, which forks the workers (vllm serve on one node)
        if config.strategy not in (None, "STRICT_PACK", "PACK"):
            raise ValueError(
                f"decode_placement.strategy {config.strategy} with distributed_executor_backend mp: "
                "its workers run on the replica's node; spreading ranks needs the Ray executor (ray)"
            )
        if config.bundle_per_rank is not None:
            raise ValueError(
                "decode_placement.bundle_per_rank with distributed_executor_backend mp: the replica "
                "actor holds all its GPUs in one bundle; use the Ray executor for bundles per rank"
            )
        replica = {"CPU": config.replica_cpus, "GPU": float(world)}
        return Placement(world, "mp", [dict(replica)], "STRICT_PACK", replica)
    if executor != "ray":
        raise ValueError(
            f"engine_args.distributed_executor_backend {executor!r}: Iris places vLLM's ranks for "
            "its Ray executor (ray) or its multiprocessing one (mp)"
        )
    rank = dict(config.bundle_per_rank or {"GPU": 1})
    if not 0 < rank.get("GPU", 0) <= 1:
        raise ValueError(
            f"decode_placement.bundle_per_rank {rank}: vLLM's Ray executor starts one worker per bundle "
            "holding a GPU, at most one GPU each"
        )
    strategy = config.strategy or "PACK"
    tp = int(engine_args.get("tensor_parallel_size") or 1)
    if strategy == "STRICT_SPREAD" and tp > 1:
        raise ValueError(
            f"decode_placement.strategy STRICT_SPREAD with tensor_parallel_size {tp} puts every "
            "tensor-parallel rank on a node of its own; spread pipeline stages with SPREAD, or use "
            "STRICT_SPREAD with tensor_parallel_size 1"
        )
    return _grouped(world, "ray", rank, strategy, {"CPU": config.replica_cpus, "GPU": 0.0})


def _grouped(world: int, executor: str, rank: dict[str, float], strategy: str, replica: dict[str, float]) -> Placement:
    """One bundle per rank, the replica actor's resources added to the first (Ray Serve LLM's
    `_merge_replica_actor_and_child_actor_bundles`)."""
    first = {key: rank.get(key, 0) + replica.get(key, 0) for key in {**rank, **replica}}
    first = {key: value for key, value in first.items() if value}
    return Placement(world, executor, [first] + [dict(rank) for _ in range(world - 1)], strategy, replica)


def group_problem(placement: Placement, bundles: list[dict[str, float]] | None) -> str | None:
    """Why a placement group with these bundles (the replica's own at start-up, or a user's
    `placement_group_bundles` in serve_config.yaml) cannot hold the replica's ranks; None if it can."""
    if placement.bundles is None:
        return None
    ranks = f"{placement.world_size} vLLM ranks"
    if not bundles:
        return (
            f"LLMDecode runs {ranks} per replica and needs a placement group: leave placement_group_bundles "
            "to Iris (decode_placement) or give one that holds them"
        )
    if placement.executor == "ray":
        gpus = [b.get("GPU", 0) for b in bundles]
        if any(g > 1 for g in gpus):
            return "a bundle with more than one GPU: vLLM's Ray executor takes one GPU per bundle"
        if sum(1 for g in gpus if g) < placement.world_size:
            return (
                f"the placement group holds {sum(1 for g in gpus if g)} bundles with a GPU for {ranks}: "
                "vLLM's Ray executor starts one worker in each of the first bundles that hold a GPU"
            )
        return None
    need = {key: sum(b.get(key, 0) for b in placement.bundles) for key in ("CPU", "GPU")}
    have = {key: sum(b.get(key, 0) for b in bundles) for key in ("CPU", "GPU")}
    if placement.executor == "mp" and "GPU" in placement.replica and bundles[0].get("GPU", 0) < need["GPU"]:
        return (
            f"the first bundle holds {bundles[0].get('GPU', 0)} GPUs for {ranks}: with vLLM's multiprocessing "
            "executor the replica actor holds every GPU of its ranks"
        )
    short = [key for key in need if have[key] < need[key]]
    if short:
        return f"the placement group holds {have} for {ranks} and the replica, which need {need}"
    return None


def options_problem(placement: Placement, options: dict[str, Any]) -> str | None:
    """Why LLMDecode's deployment options in a serve config (what overrides the builder's) cannot run
    this placement; None if they can."""
    if placement.bundles is None:
        return None
    bundles = options.get("placement_group_bundles", placement.bundles)
    problem = group_problem(placement, bundles)
    if problem or not bundles:
        return problem
    actor = options.get("ray_actor_options", placement.serve_options()["ray_actor_options"]) or {}
    gpus, want = actor.get("num_gpus", 0), placement.replica.get("GPU", 0)
    if gpus != want:
        holder = (
            "the replica actor holds every GPU of its ranks (vLLM's multiprocessing executor)"
            if want
            else "each rank's bundle holds its device and vLLM's workers take it"
        )
        return (
            f"LLMDecode's ray_actor_options num_gpus {gpus} with {placement.world_size} ranks: {holder}; "
            f"set num_gpus: {want:g} or leave ray_actor_options to Iris"
        )
    if actor.get("num_cpus", 1) > bundles[0].get("CPU", 0):
        return (
            f"LLMDecode's ray_actor_options num_cpus {actor.get('num_cpus', 1)} exceeds its placement group's "
            f"first bundle ({bundles[0]}), where Serve places the replica actor"
        )
    return None
