"""A node lost under load (issue 34): the Ray node that holds the VisionEncoder and LLMDecode
replicas, then the one that holds Preprocess, killed (every process of it, no graceful stop) while
a few clients send new images and text. Every request ends by its deadline, every failure is a
503 or 504 in OpenAI's error shape (in-band once a stream has started), and service returns once
Serve has started the replicas again on a node that replaces the lost one (added right after the
kill, as an autoscaler would); the time to recover is measured and reported.

One app (tiny LLaVA, from serve_config.yaml) placed by resources: Ingress on the head (which holds
the GCS, the Serve controller and HAProxy, and is never killed), Preprocess on a node of its own
(added here), the encoder and decode on the session's accelerator node. The module leaves the
cluster's nodes as it found them: the accelerator node replaced by an equal one, its own node gone.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import ray
import yaml
from ray import serve

from tests.support.apps import ACCELERATOR_NODE, ACCELERATOR_NODE_ARGS, CPU_NODE, run_on_fresh_loop
from tests.support.images import data_url, unique_png
from tests.support.sse import DONE, sse_events

ROOT = Path(__file__).resolve().parent.parent
APP = "iris-node-loss"
MODEL = "tiny-llava"
TIMEOUT_S = 10.0  # the app's request_timeout_s
MARGIN_S = 3.0  # a request may end this long past its deadline (the answer's way back, a busy 2-core box)
RECOVERY_BOUND_S = 300.0  # vLLM starts in ~40 s on an idle 2-core box, minutes under load
CLIENTS = 3
# What a request that a lost node broke may end with (status by the error's code).
FAILURE_CODES = {"replica_unavailable": 503, "features_unavailable": 503, "timeout": 504}

PREPROCESS_NODE = "iris_preprocess_node"
PREPROCESS_NODE_ARGS = {"num_cpus": 2, "resources": {PREPROCESS_NODE: 1000}, "object_store_memory": 256 << 20}
PLACEMENT = {
    "Ingress": CPU_NODE,
    "Preprocess": PREPROCESS_NODE,
    "VisionEncoder": ACCELERATOR_NODE,
    "LLMDecode": ACCELERATOR_NODE,
}


def _alive_node_id(resource: str) -> str | None:
    return next((n["NodeID"] for n in ray.nodes() if n["Alive"] and resource in n["Resources"]), None)


def _cluster_node(cluster, resource: str):
    """The cluster's (one) live worker node that has `resource`."""
    node_id = _alive_node_id(resource)
    return next(n for n in cluster.worker_nodes if n.node_id == node_id)


@pytest.fixture(scope="module")
def preprocess_node(ray_cluster):
    ray_cluster.add_node(**PREPROCESS_NODE_ARGS)
    yield
    # The app is being deleted (its replicas stop where they are; none is started again), and
    # the node goes with its Preprocess replica.
    ids = {n["NodeID"] for n in ray.nodes() if n["Alive"] and PREPROCESS_NODE in n["Resources"]}
    for node in [n for n in ray_cluster.worker_nodes if n.node_id in ids]:
        ray_cluster.remove_node(node)
    assert _alive_node_id(PREPROCESS_NODE) is None


@pytest.fixture(scope="module")
def node_loss_app(iris_apps, tiny_checkpoint, preprocess_node):
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"][0]
    args = config.pop("args")
    args.update(
        model=tiny_checkpoint("llava"),
        served_model_name=MODEL,
        request_timeout_s=TIMEOUT_S,
        engine_args={"max_model_len": 2048, "enforce_eager": True},
    )
    for deployment in config["deployments"]:
        del deployment["autoscaling_config"]
        deployment["num_replicas"] = 1
        deployment["ray_actor_options"] = {
            **deployment.get("ray_actor_options", {}),
            "resources": {PLACEMENT[deployment["name"]]: 1},
        }
    with iris_apps.use(APP, args, route_prefix="/node-loss", config=config) as app:
        yield app.url


# --------------------------------------------------------------------------- one request
@dataclass
class Outcome:
    kind: str  # image, image-stream, text-stream
    start: float  # time.monotonic()
    end: float
    status: int = 0  # HTTP status (200 for a stream that failed in-band)
    error: dict | None = None  # OpenAI's error object, when the request failed with one
    problem: str = ""  # anything that is neither an answer nor a clean 503/504

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and not self.problem

    @property
    def elapsed(self) -> float:
        return self.end - self.start

    @property
    def failure_status(self) -> int | None:
        """503 or 504 for a clean failure, whether as the status or in-band."""
        return FAILURE_CODES.get(self.error["code"]) if self.error else None


def _body(kind: str) -> dict:
    content = [{"type": "text", "text": "What is in this picture?"}]
    if kind.startswith("image"):
        content.insert(0, {"type": "image_url", "image_url": {"url": data_url(unique_png(size=(96, 96)))}})
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 8,
        "temperature": 0,
        "stream": kind.endswith("stream"),
    }


async def _request(client: httpx.AsyncClient, base: str, kind: str) -> Outcome:
    outcome = Outcome(kind, time.monotonic(), 0.0)
    try:
        async with client.stream("POST", f"{base}/v1/chat/completions", json=_body(kind)) as r:
            text = (await r.aread()).decode()
        outcome.status = r.status_code
        if r.status_code != 200:
            outcome.error = json.loads(text)["error"]
            _check_error(outcome, r.status_code)
        elif kind.endswith("stream"):
            events = sse_events(text)
            assert events[-1] == DONE, events[-3:]
            last = json.loads(events[-2])
            if "error" in last:  # the stream had started when the node went
                outcome.error = last["error"]
                _check_error(outcome, None)
        else:
            assert json.loads(text)["choices"][0]["message"]["role"] == "assistant", text[:300]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, AssertionError) as err:
        outcome.problem = f"{type(err).__name__}: {err}"[:300]
    outcome.end = time.monotonic()
    return outcome


def _check_error(outcome: Outcome, status: int | None) -> None:
    """A clean failure: OpenAI's error shape, 503 or 504 (as the status, or in-band, status None)."""
    error = outcome.error
    assert isinstance(error, dict) and set(error) >= {"message", "type", "param", "code"}, error
    assert error["type"] in ("server_error", "service_unavailable_error"), error
    assert error["code"] in FAILURE_CODES and status in (None, FAILURE_CODES[error["code"]]), (status, error)


# --------------------------------------------------------------------------- a node lost under load
def _replica_nodes(dashboard: str, deployments: list[str]) -> dict[str, set[str]]:
    """The nodes each deployment's RUNNING replicas are on (Serve's own replica details)."""
    details = httpx.get(f"{dashboard}/api/serve/applications/", timeout=30).json()
    found = details["applications"][APP]["deployments"]
    return {name: {r["node_id"] for r in found[name]["replicas"] if r["state"] == "RUNNING"} for name in deployments}


def _healthy() -> bool:
    app = serve.status().applications[APP]
    return app.status == "RUNNING" and all(d.status == "HEALTHY" for d in app.deployments.values())


async def _load(base: str, stop: threading.Event, outcomes: list[Outcome]) -> None:
    """CLIENTS closed-loop clients (new images, streamed and not, and text) until `stop`; a client
    that got an error waits 0.2 s before its next request, as a retrying client would."""
    kinds = ["image", "image-stream", "text-stream"]
    # A client-side bound well past the deadline: a request that hangs shows as a problem.
    async with httpx.AsyncClient(timeout=TIMEOUT_S + 20) as client:

        async def client_loop(i: int):
            n = i
            while not stop.is_set():
                outcome = await _request(client, base, kinds[n % len(kinds)])
                outcomes.append(outcome)
                n += 1
                if not outcome.ok:
                    await asyncio.sleep(0.2)

        await asyncio.gather(*(client_loop(i) for i in range(CLIENTS)))


async def _probe(base: str) -> Outcome:
    async with httpx.AsyncClient(timeout=TIMEOUT_S + 20) as client:
        return await _request(client, base, "image")


def _lose_node(
    cluster, dashboard: str, base: str, resource: str, node_args: dict, deployments: list[str]
) -> tuple[list[Outcome], dict]:
    """Kills the node with `resource` under load, adds its replacement, and waits until served again.
    The load runs in a thread of its own: Ray adds and removes nodes from the main thread only."""
    victim = _cluster_node(cluster, resource)
    assert _replica_nodes(dashboard, deployments) == {name: {victim.node_id} for name in deployments}
    marks: dict[str, float] = {}
    stop, outcomes = threading.Event(), []
    load = threading.Thread(target=lambda: run_on_fresh_loop(_load(base, stop, outcomes)))
    load.start()
    try:
        time.sleep(3)  # the load runs; requests are in flight at every stage
        marks["kill"] = time.monotonic()
        cluster.remove_node(victim, allow_graceful=False)
        # Its replacement, as an autoscaler would add one (KubeRay: a pod of the same group).
        cluster.add_node(**node_args)
        marks["node_added"] = time.monotonic()
        # Recovered: every deployment HEALTHY, the lost ones running elsewhere, and a new image
        # answered through every stage.
        while True:
            assert time.monotonic() - marks["kill"] < RECOVERY_BOUND_S, "not recovered"
            if "healthy" not in marks:
                nodes = _replica_nodes(dashboard, deployments)
                if all(n and victim.node_id not in n for n in nodes.values()) and _healthy():
                    marks["healthy"] = time.monotonic()
            probe = run_on_fresh_loop(_probe(base))
            if probe.ok and "healthy" in marks:
                marks["answered"] = probe.end
                break
            time.sleep(0.5)
        time.sleep(2)  # the load goes on, served again
    finally:
        stop.set()
        load.join(TIMEOUT_S + 30)
        if _alive_node_id(resource) is None:  # the test failed before its replacement came
            cluster.add_node(**node_args)
    assert not load.is_alive(), "the load's requests ended"
    times = {
        "node_added_s": marks["node_added"] - marks["kill"],
        "healthy_s": marks["healthy"] - marks["kill"],
        "recovered_s": marks["answered"] - marks["kill"],
    }
    return outcomes, {**marks, "times": times}


def _report(case: str, outcomes: list[Outcome], marks: dict, record_property) -> dict:
    counts: dict[str, int] = {}
    for o in outcomes:
        key = "200" if o.ok else str(o.failure_status or o.problem[:40]) + (" in-band" if o.status == 200 else "")
        counts[key] = counts.get(key, 0) + 1
    summary = {
        "case": case,
        "requests": len(outcomes),
        "outcomes": counts,
        "max_elapsed_s": round(max(o.elapsed for o in outcomes), 2),
        **{k: round(v, 1) for k, v in marks["times"].items()},
    }
    print(f"node loss: {json.dumps(summary)}")
    record_property("node_loss", json.dumps(summary))  # in the JUnit XML (pytest --junitxml)
    return summary


def _check(outcomes: list[Outcome], marks: dict) -> None:
    kill = marks["kill"]
    problems = [o for o in outcomes if not o.ok and o.failure_status is None]
    assert not problems, problems[:3]
    late = [o for o in outcomes if o.elapsed > TIMEOUT_S + MARGIN_S]
    assert not late, late[:3]  # none past its deadline
    assert any(o.ok and o.end < kill for o in outcomes), "the load was served before the kill"
    assert any(o.start < kill < o.end for o in outcomes), "requests were in flight when the node went"
    assert any(o.ok and o.start > marks["answered"] for o in outcomes), "the load is served again"


def test_losing_the_accelerator_node(ray_cluster, ray_dashboard, node_loss_app, record_property):
    """The node of the VisionEncoder and LLMDecode replicas (on a GPU cluster: the GPU node)."""
    outcomes, marks = _lose_node(
        ray_cluster,
        ray_dashboard,
        node_loss_app,
        ACCELERATOR_NODE,
        ACCELERATOR_NODE_ARGS,
        ["VisionEncoder", "LLMDecode"],
    )
    _report("accelerator node", outcomes, marks, record_property)
    _check(outcomes, marks)


def test_losing_the_preprocess_node(ray_cluster, ray_dashboard, node_loss_app, record_property):
    """The node of the Preprocess replica (on a GPU cluster: a CPU node)."""
    outcomes, marks = _lose_node(
        ray_cluster, ray_dashboard, node_loss_app, PREPROCESS_NODE, PREPROCESS_NODE_ARGS, ["Preprocess"]
    )
    _report("preprocess node", outcomes, marks, record_property)
    _check(outcomes, marks)
