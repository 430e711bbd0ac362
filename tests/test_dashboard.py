"""The Grafana dashboard (cluster/grafana/iris-dashboard.json) against the code and a real Prometheus.

Offline: every metric a panel queries is one Iris declares (read from deployments/ by its source) or one
Ray Serve declares (read from the installed Ray's serve package), named as Ray exports it (prefix `ray_`,
counters `_total`, histograms `_bucket`/`_sum`/`_count`); and every Iris metric is on some panel.

Live: a Prometheus (the `prometheus` binary; the test fails if it is missing) scrapes the session's Ray
cluster every second while a short load on the tenants app (tests/test_serving_tenants.py's, still up:
conftest's APP_SHARING_ORDER) makes every kind of event; then every panel's every query must return a
series. With IRIS_DASHBOARD_PNG=path, the panels are also drawn from that Prometheus
(bench/dashboard_plot.py) into that PNG (docs/img/dashboard.png was drawn so).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from bench.dashboard_plot import DASHBOARD, expand, panel_queries
from tests.support.images import REFERENCE_TEXT, data_url, image_part, unique_png

ROOT = Path(__file__).resolve().parent.parent
# Ray Serve's own metrics the dashboard shows (checked against the installed Ray's source below).
SERVE_METRICS_SHOWN = {"serve_deployment_replica_healthy"}
# vLLM's engine metrics the dashboard shows, as vLLM declares them (its Ray stat logger exports them
# with ':' as '_'; checked against the installed vLLM's source below).
VLLM_METRICS_SHOWN = {
    "vllm:num_requests_running": "Gauge",
    "vllm:num_requests_waiting": "Gauge",
    "vllm:kv_cache_usage_perc": "Gauge",
}
_SUFFIXES = {"Counter": ("_total",), "Gauge": ("",), "Histogram": ("_bucket", "_sum", "_count")}
_CONSTRUCTORS = {
    "Counter": "Counter",
    "Gauge": "Gauge",
    "Histogram": "Histogram",
    "latency_histogram": "Histogram",
}  # deployments/metrics.py's helper


def declared_metrics(folder: Path, prefix: str) -> dict[str, str]:
    """{name: kind} of every metric constructed in `folder`'s Python files with a literal name that
    starts with `prefix`: metrics.Counter("iris_requests", ...), latency_histogram("iris_ttft_seconds", ...)."""
    found = {}
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            name = node.args[0]
            if func in _CONSTRUCTORS and isinstance(name, ast.Constant) and str(name.value).startswith(prefix):
                found[name.value] = _CONSTRUCTORS[func]
    return found


def exported_names(declared: dict[str, str]) -> dict[str, str]:
    """{name Prometheus sees: the declared metric}: Ray prefixes `ray_` and adds the kind's suffixes."""
    return {f"ray_{name}{suffix}": name for name, kind in declared.items() for suffix in _SUFFIXES[kind]}


_NOT_METRICS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "inf",
    "nan",
}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers outside label matchers, range windows,
    grouping clauses and strings that are not function calls or keywords."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    s = re.sub(r"\{[^}]*\}", " ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    return {
        m.group()
        for m in re.finditer(r"(?<![\w.])[a-zA-Z_:][\w:]*", s)
        if m.group().lower() not in _NOT_METRICS and not s[m.end() :].lstrip().startswith("(")
    }


def _iris_metrics() -> dict[str, str]:
    return declared_metrics(ROOT / "deployments", "iris_")


def _ray_serve_metrics() -> dict[str, str]:
    ray = Path(importlib.util.find_spec("ray").origin).parent  # its source, without importing Ray
    return declared_metrics(ray / "serve/_private", "serve_")


def test_metric_names_are_read_from_promql():
    expr = (
        'histogram_quantile(0.9, sum by (le, stage) (rate(ray_a_bucket{application=~"$application", '
        'event=~"x|y"}[$__rate_interval]))) / sum without (replica) (ray_b_total) or on (job) ray_c'
    )
    assert metric_names(expr) == {"ray_a_bucket", "ray_b_total", "ray_c"}


def test_iris_metrics_are_found_in_the_code():
    """The scan finds each kind of declaration (so an empty or partial scan cannot pass the tests below)."""
    iris = _iris_metrics()
    assert {
        "iris_requests": "Counter",
        "iris_ttft_seconds": "Histogram",
        "iris_feature_cache_degraded": "Gauge",
        "iris_encoder_batch_size": "Histogram",
        "iris_vllm_prefix_cache_hit_tokens": "Counter",
    }.items() <= iris.items()
    assert len(iris) >= 14, iris


def _vllm_metrics_shown() -> dict[str, str]:
    """VLLM_METRICS_SHOWN as Ray exports them, each checked to be declared in vLLM's stat loggers."""
    loggers = (Path(importlib.util.find_spec("vllm").origin).parent / "v1/metrics/loggers.py").read_text()
    for name in VLLM_METRICS_SHOWN:
        assert f'name="{name}"' in loggers, f"{name}: not a metric of the installed vLLM"
    return {name.replace(":", "_"): kind for name, kind in VLLM_METRICS_SHOWN.items()}


def test_every_panel_queries_only_declared_metrics():
    known = (
        exported_names(_iris_metrics())
        | exported_names({n: k for n, k in _ray_serve_metrics().items() if n in SERVE_METRICS_SHOWN})
        | exported_names(_vllm_metrics_shown())
    )
    assert SERVE_METRICS_SHOWN <= set(_ray_serve_metrics()), "a Ray Serve metric the dashboard shows is not in Ray"
    unknown = {(q.panel, name) for q in panel_queries() for name in metric_names(q.expr) if name not in known}
    assert not unknown, f"panels query metrics that neither Iris, Ray Serve nor vLLM declares: {sorted(unknown)}"


def test_every_iris_metric_is_on_a_panel():
    exported = exported_names(_iris_metrics())
    shown = {exported[name] for q in panel_queries() for name in metric_names(q.expr) if name in exported}
    assert set(_iris_metrics()) - shown == set(), "Iris metrics on no panel"


def test_cache_event_filters_name_real_events():
    """The feature-cache panels filter iris_feature_cache_events by `event`, whose values are CacheStats'
    fields (deployments/metrics.py CacheMetrics): each filter matches some, each alternative names one."""
    from dataclasses import fields

    from cache_service.stats import CacheStats

    events = {f.name for f in fields(CacheStats)}
    filters = {m for q in panel_queries() for m in re.findall(r'event=~?"([^"]*)"', q.expr)}
    assert len(filters) >= 2, filters
    for pattern in filters:
        assert any(re.fullmatch(pattern, e) for e in events), f"event filter {pattern!r} matches no CacheStats field"
        literal = [a for a in pattern.split("|") if re.fullmatch(r"\w+", a)]
        assert set(literal) <= events, f"{pattern!r}: {set(literal) - events} are no CacheStats fields"


def test_dashboard_shape():
    """Imports into any Grafana: the datasource is a variable, every query uses it, ids are unique."""
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for panel in dashboard["panels"]:
        assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"]), panel["title"]
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"]), panel["title"]


# ---- live: a real Prometheus, a loaded app ----


@pytest.fixture(scope="module")
def tenants_app(iris_apps, tiny_checkpoint):
    from tests.test_serving_tenants import APP, CONFIG, app_args

    with iris_apps.use(APP, app_args(tiny_checkpoint("llava")), route_prefix="/tenants", config=CONFIG) as app:
        yield app


def _chat(app, key: str | None, parts: list[dict]) -> httpx.Response:
    body = {
        "messages": [{"role": "user", "content": parts + [{"type": "text", "text": REFERENCE_TEXT}]}],
        "max_tokens": 2,
        "temperature": 0,
    }
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{app.url}/v1/chat/completions", json=body, headers=headers, timeout=120)


def _load(app) -> dict[str, int]:
    """Every kind of event the panels show, in a few seconds; returns the status codes' counts."""
    from tests.test_serving_tenants import KEYS

    alpha = KEYS["alpha"]
    uids = [f"dash-{uuid.uuid4().hex}" for _ in range(2)]
    new = [image_part(data_url(unique_png()), uid) for uid in uids]
    codes = []
    codes.append(_chat(app, alpha, new).status_code)  # computed: Preprocess, VisionEncoder, the cache's puts
    codes.append(_chat(app, alpha, new).status_code)  # cached; vLLM's prefix cache hits
    codes.append(_chat(app, alpha, [image_part(None, uids[0])]).status_code)  # upload-free
    codes.append(_chat(app, alpha, [image_part(None, f"never-sent-{uuid.uuid4().hex}")]).status_code)  # 409
    same = image_part(data_url(unique_png()))
    with ThreadPoolExecutor(4) as pool:  # one new image four times at once: single-flight waits when they overlap
        codes += [r.status_code for r in pool.map(lambda _: _chat(app, alpha, [same]), range(4))]
    for _ in range(IMAGES_TRIES):  # over the `images` tenant's images per minute: 429s
        codes.append(_chat(app, KEYS["images"], [image_part(data_url(unique_png()))]).status_code)
    codes.append(_chat(app, None, []).status_code)  # no key: 401
    return {str(c): codes.count(c) for c in sorted(set(codes))}


IMAGES_TRIES = 3  # tests/test_serving_tenants.py's images tenant: 2 images a minute


def alpha_key() -> str:
    """Tenant alpha's key (tests/test_serving_tenants.py)."""
    from tests.test_serving_tenants import KEYS

    return KEYS["alpha"]


def expr_shows_vllm_gauge(expr: str) -> bool:
    return any(name.replace(":", "_") in expr for name, kind in VLLM_METRICS_SHOWN.items() if kind == "Gauge")


def _query(prometheus: str, expr: str) -> list[dict]:
    r = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=10)
    assert r.status_code == 200, (expr, r.text)
    return r.json()["data"]["result"]


def test_every_panel_shows_data_from_a_real_prometheus(tenants_app):
    from tests.support.prometheus import prometheus, service_discovery_file

    started = time.monotonic()
    with prometheus(service_discovery_file()) as url:
        prometheus_up, wall_up = time.monotonic(), time.time()
        codes = _load(tenants_app)
        loaded = time.monotonic()
        assert {"200", "409", "429", "401"} <= set(codes), codes
        queries = [(q.panel, q.legend, expand(q.expr, tenants_app.name, "1m")) for q in panel_queries()]
        deadline = time.monotonic() + 60
        while True:
            empty = [(panel, legend, expr) for panel, legend, expr in queries if not _query(url, expr)]
            if not empty or time.monotonic() > deadline:
                break
            if any(expr_shows_vllm_gauge(expr) for _, _, expr in empty):
                # vLLM sets its gauges only while its engine steps, and Ray drops a gauge left unset for two
                # report intervals: the load may be over before Prometheus's first scrape. One more request.
                _chat(tenants_app, alpha_key(), [])
            time.sleep(1)
        print(
            f"prometheus ready in {prometheus_up - started:.1f} s; load {loaded - prometheus_up:.1f} s {codes}; "
            f"every panel's data after {time.monotonic() - loaded:.1f} s more"
        )
        if os.environ.get("IRIS_DASHBOARD_PNG"):  # for docs/img/dashboard.png: a minute of the same load
            from bench.dashboard_plot import plot

            for _ in range(6):
                _load(tenants_app)
                time.sleep(8)
            plot(url, Path(os.environ["IRIS_DASHBOARD_PNG"]), wall_up - 5, time.time(), tenants_app.name, "10s")
    assert not empty, "panels with no data from Prometheus:\n" + "\n".join(
        f"  {panel} [{legend}]: {expr}" for panel, legend, expr in empty
    )
