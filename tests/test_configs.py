"""The shipped configs are valid Serve configs whose args IrisConfig accepts, and
bad args stop start-up with a message naming the field."""

from pathlib import Path

import pytest
import yaml

from deployments.app import deployment_name
from deployments.config import IrisConfig
from deployments.placement import options_problem

ROOT = Path(__file__).resolve().parent.parent
DEPLOYMENTS = {"Ingress", "Preprocess", "VisionEncoder", "LLMDecode"}


def _serve_configs() -> dict[str, dict]:
    configs = {"serve_config.yaml": yaml.safe_load((ROOT / "serve_config.yaml").read_text())}
    for name in (
        "cluster/rayservice.yaml",
        "cluster/tensor_parallel/rayservice.yaml",
        "cluster/two_models/rayservice.yaml",  # `models:`, deployments named <Stage>:<model>
    ):
        configs[name] = yaml.safe_load(yaml.safe_load((ROOT / name).read_text())["spec"]["serveConfigV2"])
    return configs


@pytest.mark.parametrize("name", list(_serve_configs()))
def test_shipped_serve_configs_are_valid(name):
    from ray.serve.schema import ServeDeploySchema

    config = _serve_configs()[name]
    schema = (
        ServeDeploySchema.model_validate(config)
        if hasattr(ServeDeploySchema, "model_validate")
        else ServeDeploySchema.parse_obj(config)
    )
    (app,) = schema.applications
    assert app.import_path == "deployments.app:build_app"
    iris = IrisConfig.model_validate(app.args)
    assert {d.name.partition(":")[0] for d in app.deployments} == DEPLOYMENTS
    for d in app.deployments:  # each stage sized and scaled on its own
        assert d.ray_actor_options and d.max_ongoing_requests and d.autoscaling_config, d.name
    # LLMDecode's options in the file replace the builder's: they hold its vLLM ranks (deployments/placement.py).
    options = {d["name"]: d for d in config["applications"][0]["deployments"]}
    for model in iris.model_configs():
        assert options_problem(model.decode_ranks(), options[deployment_name("LLMDecode", iris, model)]) is None


def test_default_serve_config_fits_two_cpus():
    """`serve run` on the 2-core machine declares 2 logical CPUs: all replicas at max scale must fit."""
    app = _serve_configs()["serve_config.yaml"]["applications"][0]
    total = sum(
        d["ray_actor_options"]["num_cpus"] * d["autoscaling_config"]["max_replicas"] for d in app["deployments"]
    )
    assert total <= 2
    assert all(d["ray_actor_options"].get("num_gpus", 0) == 0 for d in app["deployments"])


@pytest.mark.parametrize(
    "args, field",
    [
        ({"max_images_per_prompt": 0}, "max_images_per_prompt"),
        ({"cache": {"ttl_s": -1}}, "cache.ttl_s"),
        ({"engine_args": {"no_such_arg": 1}}, "no_such_arg"),
        ({"engine_args": {"enable_prefix_caching": False}}, "enable_prefix_caching"),
        ({"engine_args": {"dtype": "float16"}}, "dtype"),
        ({"media": {"max_image_bytes": "lots"}}, "media.max_image_bytes"),
        ({"modle": "typo"}, "modle"),
        # Several models: each entry holds one model's settings only, and names tell them apart.
        ({"models": [{"model": "a", "cache": {"ttl_s": 1}}]}, "models[0]: ['cache'] are the app's"),
        ({"models": [{"model": "a"}, {"model": "b", "max_images_per_prompt": 0}]}, "models[1]: max_images_per_prompt"),
        ({"models": [{"model": "a"}, {"model": "b", "engine_args": {"dtype": "half"}}]}, "models[1]: engine_args"),
        ({"model": "a", "models": [{"model": "b"}]}, "['model'] belong to a model"),
        ({"models": [{"model": "a"}, {"model": "b", "served_model_name": "a"}]}, "two models answer to 'a'"),
        (
            {
                "models": [
                    {"model": "a", "engine_args": {"enable_lora": True, "lora_modules": ["b=/x"]}},
                    {"model": "b"},
                ]
            },
            "two models answer to 'b'",
        ),
        ({"models": [{"model": "org/m.1"}, {"model": "org--m_1"}]}, "would share the deployment names"),
    ],
)
def test_bad_args_name_the_field(args, field):
    from deployments.app import build_app

    with pytest.raises(ValueError, match="invalid Iris application args") as err:
        build_app(args)
    assert field in str(err.value)


@pytest.mark.parametrize("name", list(_serve_configs()))
def test_import_paths_and_routers_resolve(name):
    """What Serve imports by string at deploy time: the app builder and the LLMDecode router."""
    from ray._common.utils import import_attr
    from ray.serve.request_router import RequestRouter

    (app,) = _serve_configs()[name]["applications"]
    assert callable(import_attr(app["import_path"]))
    routers = {d["name"]: d["request_router_config"] for d in app["deployments"] if "request_router_config" in d}
    assert routers and {name.partition(":")[0] for name in routers} == {"LLMDecode"}
    for router in routers.values():
        cls = import_attr(router["request_router_class"])
        assert issubclass(cls, RequestRouter)
        # The kwargs are accepted as Serve will pass them (initialize_state rejects unknown ones).
        cls.initialize_state(object.__new__(cls), **router.get("request_router_kwargs", {}))


@pytest.mark.parametrize("name", list(_serve_configs()))
def test_the_ingress_runs_user_code_on_its_own_loop_however_it_is_deployed(name):
    """A config's ray_actor_options replace the code's: each shipped config carries the Ingress's
    environment (user code on the replica's event loop) as deployments/ingress.py sets it."""
    from deployments.ingress import INGRESS_ENV, Ingress

    assert Ingress.ray_actor_options["runtime_env"]["env_vars"] == INGRESS_ENV
    (app,) = _serve_configs()[name]["applications"]
    (ingress,) = [d for d in app["deployments"] if d["name"] == "Ingress"]
    assert ingress["ray_actor_options"]["runtime_env"]["env_vars"] == INGRESS_ENV


def test_kuberay_pods_put_haproxy_in_front_of_the_ingress_replicas():
    """RAY_SERVE_ENABLE_HA_PROXY is read where Ray starts, so every Ray container carries it."""
    spec = yaml.safe_load((ROOT / "cluster/rayservice.yaml").read_text())["spec"]["rayClusterConfig"]
    pods = [spec["headGroupSpec"]] + spec["workerGroupSpecs"]
    for pod in pods:
        for container in pod["template"]["spec"]["containers"]:
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            assert env.get("RAY_SERVE_ENABLE_HA_PROXY") == "1", container["name"]
