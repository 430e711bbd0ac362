"""Engines on one CPU-only node get cores of their own (deployments/cpu_binding.py, LLMDecode), and
run the model in vLLM's engine-core process, without the busy-waiting worker process of vLLM's CPU default."""

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from deployments.cpu_binding import omp_threads_bind, rank_binds


def test_one_engine_keeps_vllms_default():
    assert omp_threads_bind(0, 1, [0, 1]) is None


def test_engines_split_the_cores_vllm_would_give_one_engine():
    # vLLM leaves the last core to the processes around the engine; so do we.
    assert [omp_threads_bind(i, 2, list(range(8))) for i in range(2)] == ["0,1,2,3", "4,5,6"]
    assert [omp_threads_bind(i, 3, [3, 2, 1, 0]) for i in range(3)] == ["0", "1", "2"]
    assert [omp_threads_bind(i, 2, [0, 1], reserve=0) for i in range(2)] == ["0", "1"]
    assert [omp_threads_bind(i, 3, list(range(8)), reserve=0) for i in range(3)] == ["0,1,2", "3,4,5", "6,7"]


def test_more_engines_than_cores_share_round_robin():
    assert [omp_threads_bind(i, 2, [0, 1]) for i in range(2)] == ["0", "0"]  # one usable core
    assert [omp_threads_bind(i, 3, [0, 1, 2]) for i in range(3)] == ["0", "1", "0"]
    assert omp_threads_bind(5, 2, [0, 1, 2, 3, 4], reserve=0) == "3,4"  # a rank past the count wraps


def _context(local_rank, max_replicas=None, world_size=1):
    autoscaling = SimpleNamespace(max_replicas=max_replicas) if max_replicas else None
    return SimpleNamespace(
        world_size=world_size,
        rank=SimpleNamespace(local_rank=local_rank),
        _deployment_config=SimpleNamespace(autoscaling_config=autoscaling),
    )


@pytest.mark.parametrize(
    "context, expected",
    [
        (_context(1, max_replicas=2), "2,3"),  # autoscaling: the maximum may share the node
        (_context(0, world_size=2), "0,1"),  # fixed num_replicas
        (_context(0, max_replicas=1), None),  # alone: vLLM's default
    ],
)
def test_decode_replica_binds_by_its_local_rank(monkeypatch, context, expected):
    import deployments.decode as decode

    environ: dict[str, str] = {}  # the replica's environment, never this process's (other tests start vLLM)
    monkeypatch.setattr(decode.os, "environ", environ)
    monkeypatch.setattr(decode.os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3, 4})
    monkeypatch.setattr(decode.serve, "get_replica_context", lambda: context)
    decode._bind_engine_cores()
    assert environ.get("VLLM_CPU_OMP_THREADS_BIND") == expected


@pytest.mark.parametrize(
    "context, expected",
    [
        (_context(0, max_replicas=1), "0,1|2,3"),  # alone: vLLM's cores (the last one left out), split per rank
        (_context(1, max_replicas=2), "2|3"),  # its share of the node, split per rank
    ],
)
def test_a_replica_of_two_ranks_gives_each_rank_its_cores(monkeypatch, context, expected):
    """tensor_parallel_size 2 on a CPU node: vLLM's format, one list per rank (`|`)."""
    import deployments.decode as decode

    environ: dict[str, str] = {}
    monkeypatch.setattr(decode.os, "environ", environ)
    monkeypatch.setattr(decode.os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3, 4})
    monkeypatch.setattr(decode.serve, "get_replica_context", lambda: context)
    decode._bind_engine_cores(2)
    assert environ.get("VLLM_CPU_OMP_THREADS_BIND") == expected


@pytest.mark.parametrize(
    ("cores", "ranks", "bind"),
    [
        ([0, 1], 2, "0|1"),  # the 2-core machine: one core per rank, none left in reserve
        ([0, 1, 2, 3, 4], 2, "0,1|2,3"),  # the last core left to the other processes, as vLLM's default
        ([0], 2, "0|0"),
        ([4, 5, 6, 7], 4, "4|5|6|7"),
    ],
)
def test_ranks_get_cores_of_their_own(cores, ranks, bind):
    assert rank_binds(cores, ranks) == bind


def test_a_users_binding_wins(monkeypatch):
    import deployments.decode as decode

    environ = {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    monkeypatch.setattr(decode.os, "environ", environ)
    monkeypatch.setattr(decode.serve, "get_replica_context", lambda: _context(1, max_replicas=2))
    decode._bind_engine_cores()
    assert environ == {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}


def test_binding_leaves_a_process_outside_serve_alone(monkeypatch):
    import deployments.decode as decode

    environ: dict[str, str] = {}
    monkeypatch.setattr(decode.os, "environ", environ)
    decode._bind_engine_cores()  # no replica context here: nothing to go by
    assert environ == {}


@pytest.mark.parametrize(
    "cuda, environ, expected",
    [
        (False, {}, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}),  # CPU: no worker process
        (False, {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}),  # the user's wins
        (True, {}, {}),  # a GPU: vLLM's own layout (at one GPU the model is in the engine core already)
    ],
)
def test_decode_replica_runs_the_model_in_the_engine_process_on_cpu(monkeypatch, cuda, environ, expected):
    import deployments.decode as decode

    monkeypatch.setattr(decode.os, "environ", environ)  # the replica's, never this process's
    monkeypatch.setattr(decode.torch.cuda, "is_available", lambda: cuda)
    decode._model_in_engine_process()
    assert environ == expected


@pytest.mark.parametrize("multiprocessing, backend", [("0", "uni"), ("1", "mp")])
def test_what_that_setting_does_in_vllm(tiny_checkpoint, multiprocessing, backend):
    """vLLM 0.32's CPU platform keeps the "uni" executor (the model in the engine-core process) with
    the setting, and switches to "mp" (a worker process of its own) without it. In a process of its
    own: vLLM's CPU platform edits the environment (LD_PRELOAD) of whoever builds the config."""
    code = (
        "import sys; from vllm.engine.arg_utils import EngineArgs; "
        "c = EngineArgs(model=sys.argv[1], max_model_len=2048, enforce_eager=True).create_engine_config(); "
        "print('backend=' + str(c.parallel_config.distributed_executor_backend))"
    )
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": multiprocessing}
    out = subprocess.run(
        [sys.executable, "-c", code, tiny_checkpoint("llava")], env=env, capture_output=True, text=True, timeout=300
    )
    assert f"backend={backend}" in out.stdout.splitlines(), out.stdout[-2000:] + out.stderr[-2000:]
