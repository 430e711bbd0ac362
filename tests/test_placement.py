"""LLMDecode's placement groups (deployments/placement.py), from config alone: no Ray, no engine.

What Serve reserves per replica for tensor_parallel_size × pipeline_parallel_size ranks, which
vLLM executor runs them, and which groups (Iris's or a user's placement_group_bundles in
serve_config.yaml) are refused and why. tests/test_parallel_engine.py runs the ranks themselves.
"""

from __future__ import annotations

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from deployments.config import IrisConfig
from deployments.placement import DecodePlacement, group_problem, options_problem, plan

GPU, CPU = DecodePlacement(), DecodePlacement(device="CPU")


def test_one_rank_keeps_the_replica_as_it_was():
    placement = plan({"max_model_len": 4096}, GPU)
    assert (placement.world_size, placement.bundles, placement.executor) == (1, None, None)
    assert placement.serve_options() == {} and placement.engine_flags() == {}
    assert plan({"tensor_parallel_size": 1}, CPU).serve_options() == {}


def test_tp2_on_gpu_nodes_one_gpu_bundle_per_rank_the_replica_with_rank_0():
    placement = plan({"tensor_parallel_size": 2}, GPU)
    assert placement.engine_flags() == {"distributed_executor_backend": "ray"}
    assert placement.serve_options() == {
        "placement_group_bundles": [{"GPU": 1, "CPU": 1}, {"GPU": 1}],
        "placement_group_strategy": "PACK",
        "ray_actor_options": {"num_cpus": 1, "num_gpus": 0},
    }


def test_tp4_pp2_eight_gpu_bundles_spread_for_pipeline_stages():
    placement = plan({"tensor_parallel_size": 4, "pipeline_parallel_size": 2}, DecodePlacement(strategy="SPREAD"))
    bundles = placement.serve_options()["placement_group_bundles"]
    assert placement.world_size == 8 and len(bundles) == 8
    assert bundles[0] == {"GPU": 1, "CPU": 1} and bundles[1:] == [{"GPU": 1}] * 7
    assert placement.strategy == "SPREAD"
    assert group_problem(placement, bundles) is None


def test_own_bundle_per_rank_and_replica_cpus():
    config = DecodePlacement(replica_cpus=2, bundle_per_rank={"GPU": 1, "CPU": 4, "accelerator_type:H100": 0.001})
    bundles = plan({"tensor_parallel_size": 2}, config).bundles
    assert bundles == [
        {"GPU": 1, "CPU": 6, "accelerator_type:H100": 0.001},
        {"GPU": 1, "CPU": 4, "accelerator_type:H100": 0.001},
    ]


def test_multiprocessing_executor_on_gpu_the_replica_holds_every_gpu():
    placement = plan({"tensor_parallel_size": 4, "distributed_executor_backend": "mp"}, GPU)
    assert placement.serve_options() == {
        "placement_group_bundles": [{"CPU": 1, "GPU": 4.0}],
        "placement_group_strategy": "STRICT_PACK",
        "ray_actor_options": {"num_cpus": 1, "num_gpus": 4.0},
    }
    with pytest.raises(ValueError, match="spreading ranks needs the Ray executor"):
        plan({"pipeline_parallel_size": 2, "distributed_executor_backend": "mp"}, DecodePlacement(strategy="SPREAD"))


def test_cpu_nodes_one_cpu_per_rank_on_the_replica_node():
    placement = plan({"tensor_parallel_size": 2}, CPU)
    assert placement.engine_flags() == {"distributed_executor_backend": "mp"}
    assert placement.serve_options() == {
        "placement_group_bundles": [{"CPU": 2}, {"CPU": 1}],
        "placement_group_strategy": "STRICT_PACK",
        "ray_actor_options": {"num_cpus": 1, "num_gpus": 0},
    }
    assert plan({"pipeline_parallel_size": 2}, DecodePlacement(device="CPU", cpus_per_rank=0.5)).bundles == [
        {"CPU": 1.5},
        {"CPU": 0.5},
    ]


@pytest.mark.parametrize(
    ("engine_args", "config", "refusal"),
    [
        ({"tensor_parallel_size": 2, "distributed_executor_backend": "ray"}, CPU, "does not support ray"),
        ({"pipeline_parallel_size": 2}, DecodePlacement(device="CPU", strategy="SPREAD"), "must be STRICT_PACK"),
        ({"tensor_parallel_size": 2}, DecodePlacement(strategy="STRICT_SPREAD"), "a node of its own"),
        ({"tensor_parallel_size": 2}, DecodePlacement(bundle_per_rank={"GPU": 2}), "at most one GPU"),
        ({"tensor_parallel_size": 2}, DecodePlacement(bundle_per_rank={"CPU": 4}), "at most one GPU"),
        ({"tensor_parallel_size": 2, "distributed_executor_backend": "uni"}, GPU, "Ray executor"),
        ({"data_parallel_size": 2}, GPU, "by replicas"),
    ],
)
def test_settings_no_placement_runs_are_refused(engine_args, config, refusal):
    with pytest.raises(ValueError, match=refusal):
        plan(engine_args, config)


def test_strict_spread_for_pipeline_stages_alone():
    placement = plan({"pipeline_parallel_size": 2}, DecodePlacement(strategy="STRICT_SPREAD"))
    assert placement.bundles == [{"GPU": 1, "CPU": 1}, {"GPU": 1}] and placement.strategy == "STRICT_SPREAD"


def test_iris_config_refuses_at_build_time_and_names_the_field():
    with pytest.raises(ValueError, match="STRICT_PACK"):
        IrisConfig.model_validate(
            {"engine_args": {"tensor_parallel_size": 2}, "decode_placement": {"device": "CPU", "strategy": "PACK"}}
        )
    assert IrisConfig.model_validate({"engine_args": {"tensor_parallel_size": 2}}).decode_ranks().world_size == 2


@pytest.mark.parametrize(
    ("bundles", "problem"),
    [
        (None, "needs a placement group"),
        ([{"CPU": 1}, {"GPU": 1}], "holds 1 bundles with a GPU for 2 vLLM ranks"),
        ([{"CPU": 1, "GPU": 2}], "more than one GPU"),
        ([{"CPU": 1}, {"GPU": 1}, {"GPU": 1}], None),  # the replica's own bundle first: vLLM skips it
        ([{"CPU": 1, "GPU": 1}, {"GPU": 1}, {"GPU": 1}], None),  # more GPU bundles than ranks: the first two
    ],
)
def test_a_users_own_gpu_group_is_respected_or_refused(bundles, problem):
    placement = plan({"tensor_parallel_size": 2}, GPU)
    found = group_problem(placement, bundles)
    assert (found is None) if problem is None else (problem in found), found


def test_a_users_own_cpu_group_must_hold_the_ranks_and_the_replica():
    placement = plan({"tensor_parallel_size": 2}, CPU)
    assert group_problem(placement, [{"CPU": 1}, {"CPU": 1}]) is not None  # the replica's CPU missing
    assert group_problem(placement, [{"CPU": 3}]) is None
    mp = plan({"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}, GPU)
    assert "holds every GPU" in group_problem(mp, [{"CPU": 1, "GPU": 1}, {"GPU": 1}])


def test_serve_config_options_that_override_the_builders():
    placement = plan({"tensor_parallel_size": 2}, GPU)
    assert options_problem(placement, {}) is None
    # serve_config.yaml's usual one-GPU decode actor: it would wait forever in a bundle without one.
    # serve_config.yaml's usual one-GPU decode actor: it would take rank 0's GPU, and rank 0 would wait forever.
    assert "num_gpus 1" in options_problem(placement, {"ray_actor_options": {"num_cpus": 1, "num_gpus": 1}})
    assert options_problem(placement, {"ray_actor_options": {"num_cpus": 1, "num_gpus": 0}}) is None
    assert "first bundle" in options_problem(placement, {"ray_actor_options": {"num_cpus": 4, "num_gpus": 0}})
    assert options_problem(placement, {"placement_group_bundles": [{"GPU": 1}]}) is not None
    mp = plan({"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}, GPU)
    assert "num_gpus: 2" in options_problem(mp, {"ray_actor_options": {"num_cpus": 1, "num_gpus": 1}})


def test_builder_options_are_what_serve_accepts():
    """The options the builder gives LLMDecode pass Serve's own checks of a deployment's placement group
    (the replica actor within the first bundle, a known strategy), and a serve config that spells them."""
    from deployments.decode import LLMDecode

    for engine_args, config in [
        ({"tensor_parallel_size": 2}, GPU),
        ({"tensor_parallel_size": 2}, CPU),
        ({"tensor_parallel_size": 4, "pipeline_parallel_size": 2}, GPU),
        ({"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}, GPU),
    ]:
        options = plan(engine_args, config).serve_options()
        LLMDecode.options(**options)
    with pytest.raises(ValueError, match="first bundle"):  # what Serve itself refuses
        LLMDecode.options(ray_actor_options={"num_cpus": 4}, placement_group_bundles=[{"CPU": 1}])
    schema = {
        "applications": [
            {
                "name": "iris",
                "import_path": "deployments.app:build_app",
                "deployments": [{"name": "LLMDecode", **plan({"tensor_parallel_size": 2}, GPU).serve_options()}],
            }
        ]
    }
    ServeDeploySchema.model_validate(yaml.safe_load(yaml.safe_dump(schema)))
