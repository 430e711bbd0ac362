"""Every served family whose built-in checkpoint tests/test_families.py does not run through a
whole app: its image path against vLLM's own engine, one process per family
(tests/support/family_engine.py; an app and a `vllm serve` per family would not fit in CI).

Per family, on one engine: greedy tokens of Iris's features (as LLMDecode feeds them:
embeddings, or the image with its features staged for the EC connector) identical to the
engine running its own tower, for one image, two sizes and two images in one prompt; the
connector's counters say the tower never ran for an item Iris supplied; Iris's features equal
the engine's own encoder output within test_families' tolerance; and the tokens depend on the
image. The chat route (`vllm serve`'s rendering of an image_url part) answers too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pipeline.model.builtin import BUILDERS, ENGINE_TESTED_FAMILIES
from pipeline.model.embedding_form import CONNECTOR
from tests.support.family_engine import CASES
from tests.test_families import FEATURE_RTOL

TIMEOUT_S = 600


# Each family with its format's engine_args; and one whose model settings differ from its checkpoint's
# config (an hf_overrides taking LLaVA's features from the tower's last layer, not the one before),
# which Iris's encoder must honour as the engine does (tests/test_stage_settings.py: the other
# settings, without an engine).
VARIANTS = [(family, BUILDERS[family].engine_args) for family in ENGINE_TESTED_FAMILIES] + [
    ("llava", {"hf_overrides": {"vision_feature_layer": -1}})
]


def _variant_id(variant) -> str:
    family, engine_args = variant
    return family if engine_args == BUILDERS[family].engine_args else f"{family}+{'+'.join(engine_args)}"


@pytest.fixture(scope="module", params=VARIANTS, ids=_variant_id)
def checked(request, tiny_checkpoint) -> tuple[str, dict]:
    family, engine_args = request.param
    dtype = BUILDERS[family].specs["tiny"].dtype
    run = subprocess.run(
        [sys.executable, "-m", "tests.support.family_engine", tiny_checkpoint(family), dtype, json.dumps(engine_args)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=os.environ.copy(),
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return family, json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["one image", "another size", "two images"])
def test_greedy_tokens_equal_the_engine_own_tower(checked, case):
    family, result = checked
    if case not in result["cases"]:  # more images than vLLM takes in one prompt for this model
        assert result["image_limit"] < len(CASES[case]), (family, case)
        return
    engine, iris = result["cases"][case]["engine"], result["cases"][case]["iris"]
    assert iris["tokens"] == engine["tokens"], (family, case)
    assert engine["loaded"] == 0, (family, case, engine)  # nothing staged under its uuids: its own tower
    if result["delivery"] == CONNECTOR:
        assert engine["encoded"] > 0, (family, case, engine)
        # Every distinct image of the case came from the connector; the tower never ran.
        assert (iris["loaded"], iris["encoded"]) == (len(set(CASES[case])), 0), (family, case, iris)
    else:
        assert iris["loaded"] == iris["encoded"] == 0, (family, case, iris)


def test_features_equal_the_engine_encoder_output(checked):
    family, result = checked
    for image, f in result["features"].items():
        assert f["shape"][0] == f["shape"][1] and f["dtype"][0] == f["dtype"][1], (family, image, f)
        assert f["scale"] > 0 and f["max_diff"] <= FEATURE_RTOL * f["scale"], (family, image, f)


def test_greedy_output_depends_on_the_image(checked):
    family, result = checked
    square, wide = result["cases"]["one image"]["engine"], result["cases"]["another size"]["engine"]
    assert (square["tokens"], square["logprobs"]) != (wide["tokens"], wide["logprobs"]), family


def test_chat_route_answers_with_the_same_tokens(checked):
    """vLLM's chat rendering (what `vllm serve` runs) lays the image out as the checkpoint's
    template and processor say, and its greedy answer starts as the engine's own."""
    family, result = checked
    assert result["chat"] == result["cases"]["one image"]["engine"]["tokens"][: len(result["chat"])], family
