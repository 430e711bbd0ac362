"""cluster/: the RayService is generated (never edited by hand), valid against KubeRay's
own CRD schema with unknown fields rejected, places GPU deployments on GPU pods only,
and reaches a password-protected Redis with LRU eviction. All offline."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CRD = ROOT / "cluster/vendor/kuberay/ray.io_rayservices.yaml"
SECRET = {"name": "iris-redis", "key": "password"}


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_rayservice", ROOT / "scripts/gen_rayservice.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _manifest() -> dict:
    return yaml.safe_load((ROOT / "cluster/rayservice.yaml").read_text())


def _closed(schema):
    """The CRD schema with every object that lists `properties` closed to other keys
    (the CRD leaves them open; the API server prunes unknown fields silently)."""
    if isinstance(schema, dict):
        schema = {k: _closed(v) for k, v in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_closed(v) for v in schema]
    return schema


@pytest.fixture(scope="module")
def validator():
    crd = yaml.safe_load(CRD.read_text())
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = _closed(v1["schema"]["openAPIV3Schema"])
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def _errors(validator, manifest) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(manifest)]


def test_committed_manifest_is_the_generated_one():
    assert (ROOT / "cluster/rayservice.yaml").read_text() == _load_generator().render(), \
        "cluster/rayservice.yaml is stale: run python scripts/gen_rayservice.py"


def test_generator_merges_by_name_and_rejects_unknown_names():
    merge = _load_generator().merge
    base = {"a": 1, "apps": [{"name": "x", "k": {"p": 1, "q": 2}}, {"name": "y"}], "drop": 1}
    out = merge(base, {"apps": [{"name": "x", "k": {"q": 3}}], "drop": None})
    assert out == {"a": 1, "apps": [{"name": "x", "k": {"p": 1, "q": 3}}, {"name": "y"}]}
    with pytest.raises(ValueError, match="LLMDecodee"):
        merge(base | {"apps": [{"name": "LLMDecode"}]}, {"apps": [{"name": "LLMDecodee"}]})


def test_manifest_matches_kuberay_crd(validator):
    manifest = _manifest()
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayService"
    assert _errors(validator, manifest) == []
    assert manifest["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is True


@pytest.mark.parametrize("break_it, expected", [
    (lambda m: m["spec"]["rayClusterConfig"].update(enableInTreeAutoscalling=True), "enableInTreeAutoscalling"),
    (lambda m: m["spec"]["rayClusterConfig"]["workerGroupSpecs"][0].pop("groupName"), "groupName"),
    (lambda m: m["spec"]["rayClusterConfig"]["workerGroupSpecs"][1].update(maxReplica=8), "maxReplica"),
    (lambda m: m["spec"].update(serveConfigV2={"not": "a string"}), "serveConfigV2"),
    (lambda m: m["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
     .update(resource={}), "resource"),
])
def test_broken_manifests_fail(validator, break_it, expected):
    manifest = copy.deepcopy(_manifest())
    break_it(manifest)
    errors = _errors(validator, manifest)
    assert errors and any(expected in e for e in errors), errors


# ---- placement: what Ray sees on each pod, and what each deployment asks for ----

def _quantity(value) -> float:
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def _group_resources(group: dict) -> dict[str, float]:
    """Ray's CPU/GPU on one pod of the group: container limits, unless rayStartParams override."""
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    params = group.get("rayStartParams", {})
    return {"CPU": _quantity(params.get("num-cpus", limits.get("cpu", 0))),
            "GPU": _quantity(params.get("num-gpus", limits.get("nvidia.com/gpu", 0)))}


def _groups(manifest) -> dict[str, dict[str, float]]:
    cluster = manifest["spec"]["rayClusterConfig"]
    groups = {g["groupName"]: _group_resources(g) for g in cluster["workerGroupSpecs"]}
    groups["head"] = _group_resources(cluster["headGroupSpec"])
    return groups


def _deployment_needs(manifest) -> dict[str, dict[str, float]]:
    (app,) = yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"]
    return {d["name"]: {"CPU": d["ray_actor_options"].get("num_cpus", 1), "GPU": d["ray_actor_options"].get("num_gpus", 0)}
            for d in app["deployments"]}


def _placement_problems(manifest) -> list[str]:
    groups = _groups(manifest)
    problems = []
    for name, need in _deployment_needs(manifest).items():
        fits = [g for g, have in groups.items() if all(have[r] >= need[r] for r in need)]
        gpu_groups = [g for g in fits if groups[g]["GPU"] > 0]
        if not fits:
            problems.append(f"{name} fits no group")
        elif need["GPU"] > 0 and fits != gpu_groups:
            problems.append(f"{name} asks for GPUs but fits {fits}")
        elif need["GPU"] > 0 and not gpu_groups:
            problems.append(f"{name} asks for GPUs and no group has them")
    return problems


def test_gpu_deployments_fit_only_gpu_groups():
    manifest = _manifest()
    needs = _deployment_needs(manifest)
    assert needs["LLMDecode"]["GPU"] > 0 and needs["VisionEncoder"]["GPU"] > 0
    assert needs["Preprocess"]["GPU"] == 0 and needs["Ingress"]["GPU"] == 0
    assert _groups(manifest)["head"] == {"CPU": 0, "GPU": 0}  # the head runs no replicas
    assert _placement_problems(manifest) == []


def test_broken_placement_is_caught():
    manifest = copy.deepcopy(_manifest())
    gpu = next(g for g in manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"] if g["groupName"] == "gpu")
    del gpu["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    assert any("LLMDecode" in p for p in _placement_problems(manifest))


# ---- Redis: eviction and password ----

def _containers(manifest):
    cluster = manifest["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        yield from group["template"]["spec"]["containers"]


def _secret_env(container, name):
    env = {e["name"]: e for e in container.get("env", [])}
    return env.get(name, {}).get("valueFrom", {}).get("secretKeyRef")


def test_redis_evicts_lru_and_requires_the_secret_password():
    docs = list(yaml.safe_load_all((ROOT / "cluster/redis.yaml").read_text()))
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    (redis,) = deployment["spec"]["template"]["spec"]["containers"]
    args = redis["args"]
    assert args[args.index("--maxmemory-policy") + 1] == "allkeys-lru"
    assert args[args.index("--maxmemory") + 1].endswith("gb")
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"  # expanded by Kubernetes
    assert _secret_env(redis, "REDIS_PASSWORD") == SECRET


def test_every_ray_pod_gets_the_password_that_redis_url_names():
    from deployments.config import IrisConfig

    manifest = _manifest()
    (app,) = yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"]
    url = IrisConfig.model_validate(app["args"]).cache.redis_url
    assert url == "redis://:${IRIS_REDIS_PASSWORD}@iris-redis:6379/0"
    for container in _containers(manifest):
        assert _secret_env(container, "IRIS_REDIS_PASSWORD") == SECRET, container["name"]


def test_kustomization_lists_the_manifests():
    kustomization = yaml.safe_load((ROOT / "cluster/kustomization.yaml").read_text())
    assert set(kustomization["resources"]) == {"redis.yaml", "rayservice.yaml"}
    assert all((ROOT / "cluster" / r).exists() for r in kustomization["resources"])
