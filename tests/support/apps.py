"""Iris apps for the tests, on the session's Ray Serve instance (conftest's serve_instance).

start_app is the one way a test module starts an app: a name and route prefix of its own, a
fresh cache namespace, running and answering /health before the tests see it; deleted on exit,
and its keys in the shared Redis once it is gone. AppPool (conftest's `iris_apps`) hands one running app to
every module that asks for the same args, so an app two modules need is started once.
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field

import httpx

from tests.support.namespaces import SHARED_REDIS_URL, delete_namespace, new_namespace
from tests.support.otlp_receiver import trace_receiver

# Custom resources of the session's two Ray nodes (conftest's serve_instance): what a real
# cluster's CPU nodes and GPU nodes are told apart by, here on one machine.
CPU_NODE, ACCELERATOR_NODE = "iris_cpu_node", "iris_accelerator_node"
# The accelerator node's ray.cluster_utils.Cluster.add_node arguments (the one a node lost is replaced with).
ACCELERATOR_NODE_ARGS = {"num_cpus": 8, "resources": {ACCELERATOR_NODE: 1000}, "object_store_memory": 3 << 30}
START_TIMEOUT_S = 600.0  # vLLM starts in ~40 s on an idle 2-core box, minutes under load


@dataclass(frozen=True)
class App:
    """A running Iris app."""

    name: str  # its Serve application name
    url: str  # the proxy's base URL and the app's route prefix: {url}/v1/chat/completions
    namespace: str  # its cache namespace
    args: dict = field(repr=False, compare=False)  # what build_app was given (namespace included)

    def handle(self, deployment: str):
        from ray import serve

        return serve.get_deployment_handle(deployment, app_name=self.name)

    def stats(self, deployment: str, timeout_s: float | None = None) -> dict:
        """The deployment's `stats()` (every Iris stage has one)."""
        return self.handle(deployment).stats.remote().result(timeout_s=timeout_s)


def run_on_fresh_loop(coro: Coroutine):
    """`coro` on an event loop of its own, closed after: unlike asyncio.run, leaves no "no current
    event loop" state behind for the tests that run after."""
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


_RUNNING: dict[str, App] = {}


def running_app(name: str) -> App:
    """The app started here under Serve application name `name`."""
    return _RUNNING[name]


def reference_args(
    checkpoint: str, dtype: str = "float32", served_model_name: str = "bench", engine_args: dict | None = None
) -> dict:
    """The Iris app compared with `vllm serve` (conftest's vllm_server) on the same checkpoint (the
    same served name and dtype, two images a prompt, eager like the reference), and the app
    tests/test_serving.py drives: one app per checkpoint serves test_api_parity, test_families and
    test_serving one after another (conftest orders them so). `engine_args`: what the checkpoint's
    format needs on top (a built-in's, e.g. trust_remote_code)."""
    return {
        "model": checkpoint,
        "served_model_name": served_model_name,
        "max_images_per_prompt": 2,
        "dtype": dtype,
        "engine_args": {"max_model_len": 2048, "enforce_eager": True, **(engine_args or {})},
        "cache": {"ttl_s": 3600},
        # test_serving: a 12-frame clip is over max_video_frames; 127.0.0.1 serves the http(s) clip.
        "media": {
            "max_image_bytes": 200_000,
            "max_video_bytes": 3_000_000,
            "max_video_frames": 10_000,
            "max_video_duration_s": 600,
            "allowed_fetch_cidrs": ["127.0.0.1/32"],
        },
        "tenant_header": "X-Iris-Tenant",  # test_serving plays the trusted gateway
        # Traced, to the test process's receiver (tests/test_tracing.py reads what it got).
        "tracing": {"otlp_endpoint": trace_receiver().endpoint, "protocol": "http/protobuf"},
    }


@contextmanager
def beside(start_peer: Callable[[], object], app: AbstractContextManager[App]) -> Iterator[tuple[App, object]]:
    """(app, peer): enters `app` (start_app, AppPool.use) while `start_peer()` (a `vllm serve`
    to compare with) starts in a thread: much of a start is single-threaded imports, and there
    are two cores."""
    with ThreadPoolExecutor(1) as pool:
        starting = pool.submit(start_peer)
        with app as running:
            yield running, starting.result()


@contextmanager
def start_app(
    serve_url: str,
    name: str,
    args: dict,
    *,
    route_prefix: str | None = None,
    config: dict | None = None,
    timeout_s: float = START_TIMEOUT_S,
) -> Iterator[App]:
    """Iris app `name` at `serve_url` + `route_prefix` (default "/" + name), built from `args`
    with a new cache namespace (any namespace in args is replaced).

    config: the rest of a Serve config application entry (import_path, deployments, ...): the app
    is deployed from it as `serve deploy` deploys serve_config.yaml, so that strings in it (a
    request_router_class) are loaded as in production. Without it, serve.run(build_app(args))."""
    from ray import serve

    finish_deletions(wait=name in _DELETING)  # a name is deployed again only once its old app is gone
    route_prefix = route_prefix or f"/{name}"
    namespace = new_namespace()
    args = copy.deepcopy(args)
    args["cache"] = {**args.get("cache", {}), "namespace": namespace}
    app = App(name, serve_url + route_prefix, namespace, args)
    deadline = time.monotonic() + timeout_s
    application = None
    if config is None:
        from deployments.app import build_app

        application = build_app(args)  # invalid args raise here, before anything is deployed
    _RUNNING[name] = app
    try:
        if application is not None:
            serve.run(application, name=name, route_prefix=route_prefix)
        else:
            _deploy_from_config(name, route_prefix, args, config, deadline)
        _wait_healthy(app, deadline)
        yield app
    finally:
        # Not waited for: the replicas' graceful shutdown takes ~8 s (LLMDecode: its engine), in
        # which the next app starts or the next tests run. Its keys go once it is gone.
        _RUNNING.pop(name, None)
        serve.delete(name, _blocking=False)
        _DELETING[name] = namespace if _redis_url(args) == SHARED_REDIS_URL else None


_DELETING: dict[str, str | None] = {}  # apps being deleted -> their namespace in the shared Redis


def finish_deletions(wait: bool = True, timeout_s: float = 120.0) -> None:
    """Delete the keys of the apps start_app deleted that are gone; with `wait`, until all are."""
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while _DELETING:
        present = serve.status().applications
        for name in [n for n in _DELETING if n not in present]:
            namespace = _DELETING.pop(name)
            if namespace is not None:
                delete_namespace(namespace)
        if not wait or not _DELETING:
            return
        assert time.monotonic() < deadline, f"apps still being deleted after {timeout_s} s: {sorted(_DELETING)}"
        time.sleep(0.5)


def _redis_url(args: dict) -> str | None:
    from cache_service.config import CacheConfig

    return args["cache"].get("redis_url", CacheConfig.model_fields["redis_url"].default)


def _deploy_from_config(name: str, route_prefix: str, args: dict, config: dict, deadline: float) -> None:
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    entry = {**copy.deepcopy(config), "name": name, "route_prefix": route_prefix, "args": args}
    _get_global_client().deploy_apps(ServeDeploySchema.model_validate({"applications": [entry]}))
    while True:
        status = serve.status().applications.get(name)
        if status is not None and status.status == "RUNNING":
            return
        assert status is None or status.status not in ("DEPLOY_FAILED", "UNHEALTHY"), status
        assert time.monotonic() < deadline, f"{name} not running: {status}"
        time.sleep(2)


def _wait_healthy(app: App, deadline: float) -> None:
    """Until the proxy routes to the app and its ingress answers /health."""
    while True:
        try:
            r = httpx.get(f"{app.url}/health", timeout=10)
            if r.status_code == 200 and r.json().get("status") == "ok":
                return
            problem = f"{r.status_code} {r.text[:200]}"
        except (httpx.HTTPError, ValueError) as err:  # not up yet, or not Iris's JSON
            problem = repr(err)
        assert time.monotonic() < deadline, f"{app.name}: /health did not answer ok: {problem}"
        time.sleep(0.5)


class AppPool:
    """Running apps by what they run. `use` hands out the running app with the same args and
    config, whatever its name, or starts one with start_app. An app used with keep=True stays up
    after its user is done, for a later module with the same args (with a namespace of its own, an
    app's keys are no other's); a kept app still idle when another app starts is stopped first, so
    no more apps run at once than if nothing were kept."""

    def __init__(self, serve_url: str):
        self.serve_url = serve_url
        self._kept: dict[str, tuple[App, ExitStack]] = {}

    @contextmanager
    def use(
        self, name: str, args: dict, *, keep: bool = False, route_prefix: str | None = None, config: dict | None = None
    ) -> Iterator[App]:
        key = json.dumps(
            [{**args, "cache": {k: v for k, v in args.get("cache", {}).items() if k != "namespace"}}, config],
            sort_keys=True,
            default=str,
        )
        entry = self._kept.pop(key, None)
        if entry is None:
            self.close()
            stack = ExitStack()
            entry = (
                stack.enter_context(start_app(self.serve_url, name, args, route_prefix=route_prefix, config=config)),
                stack,
            )
        try:
            yield entry[0]
        finally:
            if keep:
                self._kept[key] = entry
            else:
                entry[1].close()

    def close(self) -> None:
        """Stop the kept apps."""
        while self._kept:
            self._kept.popitem()[1][1].close()

    def finish(self) -> None:
        """Stop the kept apps and wait until every app is deleted and its keys gone."""
        self.close()
        finish_deletions(wait=True)


def metrics_text() -> str:
    """Prometheus text of every live node of the session's Ray cluster: a replica's metrics are
    served by the node it runs on."""
    import ray

    return "\n".join(
        httpx.get(f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics", timeout=10).text
        for n in ray.nodes()
        if n["Alive"]
    )
