"""Session-wide fixtures: built-in tiny checkpoints (built fresh each run), one Ray
cluster of two nodes with Serve for the app tests and the pool of Iris apps on it."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import pytest

from tests.cache_fixtures import (  # noqa: F401  (cache-test fixtures)
    free_port,
    make_cache,
    namespace,
    raw_redis,
    redis_process,
)

ROOT = Path(__file__).resolve().parent.parent


def pytest_configure(config):
    # Fresh checkpoints every run, so builder changes are always tested; exported
    # through the environment so Ray workers started by the tests build into the same place.
    os.environ.setdefault("IRIS_CHECKPOINT_DIR", tempfile.mkdtemp(prefix="iris-test-checkpoints-"))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # Every vLLM engine the tests start (`vllm serve`, Iris's LLMDecode) runs its model in the
    # engine-core process, as vLLM does on one GPU, instead of a worker process of its own (vLLM's
    # CPU default): one process fewer to start per engine, the same computation. (Iris's LLMDecode
    # does so on CPU by itself, deployments/decode.py; this also covers `vllm serve` and in-process engines.)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # The traced apps' spans (tests/test_tracing.py) leave every 0.2 s, not OpenTelemetry's 5 s.
    os.environ.setdefault("OTEL_BSP_SCHEDULE_DELAY", "200")
    # One salt for the tenant labels of metrics (pipeline/tenancy/tenant.py) in the tests and the
    # Ray workers they start, so a test can name a tenant's series.
    os.environ.setdefault("IRIS_METRIC_SALT", "iris-tests")


# Modules that run on the same apps (tests/support/apps.py reference_args: one per checkpoint; the
# tenants app of tests/test_serving_tenants.py, which tests/test_text_limits.py, tests/test_client.py and
# tests/test_dashboard.py use), as (module, its `app` fixture's param or None for all), in the order that
# hands each app from one to the next:
# AppPool keeps one idle app, so each of these apps starts once. test_rollout updates the Qwen2-VL
# app in place, so it comes last.
APP_SHARING_ORDER = [
    ("test_serving_tenants", None),
    ("test_text_limits", None),
    ("test_client", "tenants"),
    ("test_dashboard", None),
    ("test_api_parity", None),
    ("test_vllm_serve_ec", None),
    ("test_serving", "llava"),
    ("test_client", "llava"),
    ("test_tracing", None),
    ("test_families", None),
    ("test_serving", "qwen2_vl"),
    ("test_rollout", None),
]


@pytest.hookimpl(trylast=True)  # after pytest's own ordering by fixture parameters
def pytest_collection_modifyitems(items):
    def group(item) -> int | None:
        module = item.module.__name__.rsplit(".", 1)[-1]
        param = item.callspec.params.get("app") if hasattr(item, "callspec") else None
        return next((i for i, (m, p) in enumerate(APP_SHARING_ORDER) if m == module and p in (None, param)), None)

    shared = sorted((item for item in items if group(item) is not None), key=group)  # stable
    if not shared:
        return
    others = [item for item in items if group(item) is None]
    at = next((i for i, item in enumerate(others) if item.module.__name__ > shared[-1].module.__name__), len(others))
    items[:] = others[:at] + shared + others[at:]  # one block, where test_serving's modules would be


@pytest.fixture(scope="session")
def tiny_checkpoint():
    from pipeline.model.source import resolve_model

    return lambda family: resolve_model(f"builtin:tiny-{family.replace('_', '-')}")


@pytest.fixture(scope="session")
def image_files(tmp_path_factory):
    from tests.support.images import SIZES, png_bytes

    folder = tmp_path_factory.mktemp("images")
    paths = {}
    for name in SIZES:
        paths[name] = folder / f"{name}.png"
        paths[name].write_bytes(png_bytes(name))
    return paths


class VllmServers:
    """`vllm serve` on the built-in checkpoints: the monolithic reference, which also writes its
    encoder's output per image (vLLM's ECExampleConnector, `ec_role: ec_both`; the folder is
    named by the image's uuid). Eager mode (no torch.compile: 35-40 s less per start here); the
    Iris apps compared with it run eager too.

    servers(family, dtype) -> (base URL, encoder-output folder), starting it if need be. The tiny
    LLaVA one stays up for the session (several modules compare against it); starting another
    stops the previous others, except one asked for ahead with `prefetch`: it starts in the
    background while the current one is in use (much of a start is single-threaded imports)."""

    KEEP = ("llava", "float32")

    def __init__(self, checkpoint, tmp_path_factory):
        from concurrent.futures import ThreadPoolExecutor

        self.checkpoint = checkpoint
        self.tmp = tmp_path_factory
        self.pool = ThreadPoolExecutor(2)
        self.running: dict[tuple[str, str], object] = {}  # (family, dtype) -> Future of (system, ec_dir)
        self.prefetched: tuple[str, str] | None = None

    def __call__(self, family: str, dtype: str = "float32") -> tuple[str, Path]:
        key = (family, dtype)
        for other in [k for k in self.running if k not in (self.KEEP, key, self.prefetched)]:
            self._stop(other)
        if self.prefetched == key:
            self.prefetched = None
        system, ec_dir = self._future(key).result()
        return system.base_urls[0], ec_dir

    def prefetch(self, family: str, dtype: str = "float32") -> None:
        self.prefetched = (family, dtype)
        self._future(self.prefetched)

    def close(self) -> None:
        for key in list(self.running):
            self._stop(key)
        self.pool.shutdown()

    def _future(self, key: tuple[str, str]):
        if key not in self.running:
            self.running[key] = self.pool.submit(self._start, *key)
        return self.running[key]

    def _start(self, family: str, dtype: str) -> tuple:
        from bench.harness.systems import EngineSettings, _start_vllm
        from deployments.vllm_args import argv
        from pipeline.model.builtin import BUILDERS

        ec_dir = self.tmp.mktemp(f"ec-{family}-{dtype}")
        ec = {
            "ec_connector": "ECExampleConnector",
            "ec_role": "ec_both",
            "ec_connector_extra_config": {"shared_storage_path": str(ec_dir)},
        }
        engine = EngineSettings(
            self.checkpoint(family),
            dtype,
            2048,
            2,
            1,
            (
                "--seed",
                "0",
                "--enforce-eager",
                "--ec-transfer-config",
                json.dumps(ec),
                "--enable-prompt-tokens-details",  # as Iris by default (usage.cached_tokens)
                *argv(BUILDERS[family].engine_args),  # what the checkpoint's format needs (trust_remote_code)
            ),
        )
        return _start_vllm(1, engine, self.tmp.mktemp("vllm"), time.monotonic(), 600), ec_dir

    def _stop(self, key: tuple[str, str]) -> None:
        try:
            self.running.pop(key).result()[0].stop()
        except Exception:  # a start that failed: its test reported it
            pass


@pytest.fixture(scope="session")
def vllm_server(tiny_checkpoint, tmp_path_factory):
    """conftest's VllmServers: servers(family, dtype) -> (base URL, encoder-output folder)."""
    servers = VllmServers(tiny_checkpoint, tmp_path_factory)
    yield servers
    servers.close()


@pytest.fixture(scope="session")
def ray_cluster():
    """Ray as two nodes on this machine, as a cluster of CPU nodes and accelerator nodes is: the
    head (custom resource CPU_NODE) and a second raylet with its own object store
    (ACCELERATOR_NODE), each with logical CPUs above the physical two. Yields the
    ray.cluster_utils.Cluster (tests/test_node_loss.py removes and adds nodes; it leaves the same
    resources behind). Replicas that name no resource spread over both nodes;
    tests/test_serving_affinity.py places the stages by resources."""
    import ray
    from ray.cluster_utils import Cluster

    from bench.harness.systems import haproxy_env
    from tests.support.apps import ACCELERATOR_NODE, ACCELERATOR_NODE_ARGS, CPU_NODE

    # Every process exports its metrics every 2 s, not Ray's 10 s, so that tests reading them (on the
    # metrics endpoint, or through Prometheus: tests/test_dashboard.py) wait seconds, not tens.
    os.environ.setdefault("RAY_metrics_report_interval_ms", "2000")
    # Ray drops a gauge not set within two report intervals (4 s now); Serve's controller sets its status
    # gauges (serve_deployment_replica_healthy) every 10 s by default: every second here.
    os.environ.setdefault("RAY_SERVE_STATUS_GAUGE_REPORT_INTERVAL_S", "1")
    # Behind HAProxy, as Iris is run (README: Quickstart); its files and ports of its own.
    os.environ.update(haproxy_env(Path(tempfile.mkdtemp(prefix="iris-hap-"))))
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 8,
            "resources": {CPU_NODE: 1000},
            "object_store_memory": 3 << 30,
            "include_dashboard": True,
            "dashboard_port": free_port(),
        },
    )
    assert ACCELERATOR_NODE in ACCELERATOR_NODE_ARGS["resources"]
    cluster.add_node(**ACCELERATOR_NODE_ARGS)
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="session")
def ray_dashboard(ray_cluster):
    """The URL of the session's Ray dashboard (Serve's replica details: GET /api/serve/applications/)."""
    return f"http://{ray_cluster.webui_url}"  # host:port


@pytest.fixture(scope="session")
def serve_instance(ray_dashboard):
    """Serve on the session's Ray cluster, its proxy on the head only, on a free port."""
    from ray import serve

    port = free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


@pytest.fixture(scope="session")
def iris_apps(serve_instance):
    """The session's AppPool (tests/support/apps.py): a module asks it for an Iris app with
    `iris_apps.use(name, args)`, and gets the running one where another module kept the same."""
    from tests.support.apps import AppPool

    pool = AppPool(serve_instance)
    yield pool
    pool.finish()
