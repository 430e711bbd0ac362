"""One set of vLLM model settings for every stage (pipeline/model/engine_settings.py): what
`engine_args` says about the model (revision, tokenizer, hf_overrides, ...) reaches vLLM's processor
and tower in Preprocess and the VisionEncoder as it reaches LLMDecode's engine, and the fingerprint;
what a stage cannot honour is refused when the config is read, naming the stage.

No engine starts here: LLMDecode's side is the ModelConfig vLLM builds from the very flags LLMDecode
gives its engine (deployments/decode.py `engine_flags`), which LLMDecode compares with the other
stages' before its engine starts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from deployments.config import IrisConfig
from pipeline.model.builtin import BUILDERS, FAMILIES
from pipeline.model.engine_settings import model_differences
from pipeline.model.vision_model import VisionModel
from tests.support import remote_code
from tests.support.images import png_bytes

BASE_ARGS = {"max_model_len": 2048, "enforce_eager": True}


def stages(engine_args: dict, model: str = "builtin:tiny-llava"):
    """(the VisionModel every stage builds, the ModelConfig of LLMDecode's engine) for these engine_args."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    from deployments.decode import engine_flags
    from deployments.vllm_args import serve_args

    config = IrisConfig(model=model, engine_args={**BASE_ARGS, **engine_args})
    vision = config.vision_model()
    flags = engine_flags(config, vision, {})
    return vision, AsyncEngineArgs.from_cli_args(serve_args(vision.checkpoint, flags)).create_model_config()


def features(vision: VisionModel, image: str = "wide") -> torch.Tensor:
    """The features the encoder computes for one image."""
    if vision.model is None:
        vision.load_encoder()
    (out,) = vision.encode([vision.preprocess(vision.load_image(png_bytes(image)))])
    return out.tensors[vision.forms["image"].values_field]


def test_hf_overrides_shape_the_tower_the_encoder_builds(tmp_path, tiny_checkpoint):
    """An hf_overrides that changes the vision path (LLaVA's vision_feature_layer: which of the
    tower's layers its features come from, so how many layers vLLM builds) is what the encoder
    builds, as the decode engine would: features equal those of a checkpoint whose config.json says
    so, other than without it, under another fingerprint."""
    override = {"hf_overrides": {"vision_feature_layer": -1}}
    plain, plain_decode = stages({})
    vision, decode = stages(override)
    assert decode.hf_config.vision_feature_layer == -1  # what LLMDecode's engine loads
    assert vision.vllm_config.model_config.hf_config.vision_feature_layer == -1
    assert model_differences(vision.vllm_config.model_config, decode) == []
    assert model_differences(plain.vllm_config.model_config, plain_decode) == []
    # LLMDecode's start-up check refuses a vision path that loaded something else.
    assert "the model's config (hf_config)" in model_differences(plain.vllm_config.model_config, decode)

    baked = tmp_path / "baked"  # the override written into the checkpoint itself
    shutil.copytree(tiny_checkpoint("llava"), baked)
    config = json.loads((baked / "config.json").read_text())
    (baked / "config.json").write_text(json.dumps({**config, "vision_feature_layer": -1}))
    reference = VisionModel(str(baked))

    assert torch.equal(features(vision), features(reference))
    assert not torch.allclose(features(vision), features(plain))
    assert vision.fingerprint() != plain.fingerprint()


def test_a_tokenizer_folder_reaches_the_processor(tmp_path, tiny_checkpoint):
    """`tokenizer` naming another folder: vLLM's processor in Preprocess uses it, as LLMDecode's
    engine does, and the fingerprint follows its files, not its path."""
    other = tmp_path / "tokenizer"
    other.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(Path(tiny_checkpoint("llava")) / name, other / name)
    settings = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**settings, "model_max_length": 1234}))

    plain, _ = stages({})
    vision, decode = stages({"tokenizer": str(other)})
    # (Not by its name_or_path: vLLM sets that to the model's when it builds the HF processor around it.)
    tokenizer = vision.processor.info.get_hf_processor().tokenizer
    assert tokenizer is vision.processor.info.get_tokenizer() and tokenizer.model_max_length == 1234
    assert decode.tokenizer == str(other) == vision.vllm_config.model_config.tokenizer
    assert model_differences(vision.vllm_config.model_config, decode) == []
    assert vision.processing_id() != plain.processing_id()
    moved = tmp_path / "moved"  # the same files elsewhere (another node's path): the same fingerprint
    shutil.copytree(other, moved)
    assert VisionModel(vision.checkpoint, settings={"tokenizer": str(moved)}).processing_id() == vision.processing_id()


@pytest.fixture
def offline_hub(tmp_path, tiny_checkpoint, monkeypatch):
    """A Hugging Face cache holding `iris-test/tiny-llava` at two commits (the second with
    LLaVA's features taken from the tower's last layer), `main` at the first, the hub offline:
    vLLM resolves a hub id and its `revision` in the cache as it would download them."""
    import huggingface_hub.constants

    repo = tmp_path / "hub" / "models--iris-test--tiny-llava"
    first, second = "1" * 40, "2" * 40
    for commit in (first, second):
        shutil.copytree(tiny_checkpoint("llava"), repo / "snapshots" / commit)
    config = repo / "snapshots" / second / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "vision_feature_layer": -1}))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(first)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return "iris-test/tiny-llava", first, second


def test_a_revision_is_what_every_stage_loads(offline_hub):
    """`revision` of a hub id: the encoder loads that commit's config and weights, as LLMDecode's
    engine does, not the default branch's; its features and fingerprint are that commit's."""
    model, first, second = offline_hub
    default, _ = stages({}, model)
    vision, decode = stages({"revision": second}, model)
    pinned_first, _ = stages({"revision": first}, model)
    assert Path(decode.model).name == second  # (offline, vLLM loads the cached snapshot's folder)
    assert Path(vision.vllm_config.model_config.model).name == second
    assert model_differences(vision.vllm_config.model_config, decode) == []
    assert vision.vllm_config.model_config.hf_config.vision_feature_layer == -1
    assert not torch.allclose(features(vision), features(default))
    assert torch.equal(features(pinned_first), features(default))
    assert len({vision.fingerprint(), default.fingerprint(), pinned_first.fingerprint()}) == 3


@pytest.mark.parametrize(
    "setting",
    [
        {"revision": "v2"},
        {"code_revision": "v2"},
        {"tokenizer_revision": "v2"},
        {"hf_overrides": {"projector_hidden_act": "gelu"}},
        {"mm_processor_kwargs": {"do_resize": True}},
        {"trust_remote_code": True},
    ],
)
def test_settings_that_may_shape_features_change_the_fingerprint(tiny_checkpoint, setting):
    """Every model setting that may change what the processor or tower computes is in the
    fingerprint (here on a local folder, where vLLM ignores revisions: a hub id's would change it)."""
    plain = VisionModel(tiny_checkpoint("llava"))
    assert VisionModel(tiny_checkpoint("llava"), settings=setting).processing_id() != plain.processing_id()


def test_settings_that_shape_no_features_keep_the_fingerprint(tiny_checkpoint):
    """Engine settings of the decoder only (context length, seed, logprobs, where weights are
    downloaded to) keep the cache: the fingerprint is the one of a deployment without them."""
    plain = IrisConfig(model="builtin:tiny-llava").vision_model()
    tuned = IrisConfig(
        model="builtin:tiny-llava",
        engine_args={
            "max_model_len": 1024,
            "seed": 7,
            "max_logprobs": 3,
            "download_dir": "/tmp/elsewhere",
            "enforce_eager": True,
            "generation_config": "vllm",
        },
    ).vision_model()
    assert tuned.settings and tuned.processing_id() == plain.processing_id()


@pytest.mark.parametrize(
    ("engine_args", "stage"),
    [
        ({"enable_lora": True, "enable_tower_connector_lora": True}, "VisionEncoder"),
        ({"language_model_only": True}, "LLMDecode"),
        ({"mm_encoder_only": True}, "LLMDecode"),
        ({"skip_tokenizer_init": True}, "Preprocess"),
    ],
)
def test_a_setting_a_stage_cannot_honour_is_refused_with_the_config(engine_args, stage):
    """Refused when the config is read (serve build / deploy), naming the flag and the stage."""
    with pytest.raises(ValidationError) as refused:
        IrisConfig(engine_args=engine_args)
    message = str(refused.value)
    assert stage in message and f"engine_args.{next(reversed(engine_args))}" in message, message


@pytest.fixture
def remote_code_llava(tmp_path, tiny_checkpoint) -> Path:
    return remote_code.remote_code_llava(tiny_checkpoint("llava"), tmp_path / "remote-llava")


def test_checkpoint_code_is_refused_until_trusted(remote_code_llava):
    """As `vllm serve` without --trust-remote-code: refused, saying which setting runs it."""
    with pytest.raises(ValueError, match="engine_args.trust_remote_code: true"):
        IrisConfig(model=str(remote_code_llava), engine_args=BASE_ARGS).vision_model()


def test_trusted_checkpoint_code_runs_in_every_stage(remote_code_llava, tiny_checkpoint):
    """With trust_remote_code, the stages load the config class from the checkpoint's code, as
    LLMDecode's engine does; the features are those of the same weights without it, the
    fingerprint covers the code."""
    vision, decode = stages({"trust_remote_code": True}, str(remote_code_llava))
    for config in (vision.vllm_config.model_config.hf_config, decode.hf_config):
        assert type(config).__name__ == "IrisLlavaConfig" and type(config).__module__.startswith("transformers_modules")
    assert model_differences(vision.vllm_config.model_config, decode) == []
    plain = VisionModel(tiny_checkpoint("llava"))
    assert torch.equal(features(vision), features(plain))
    other_code = VisionModel(str(remote_code_llava), settings={"trust_remote_code": True})
    assert other_code.processing_id() == vision.processing_id()
    (remote_code_llava / remote_code.CODE_FILE).write_text(remote_code.REMOTE_CONFIG + "\n# another revision\n")
    assert (
        VisionModel(str(remote_code_llava), settings={"trust_remote_code": True}).processing_id()
        != vision.processing_id()
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_loads_in_every_stage_what_llmdecode_loads(family):
    """LLMDecode refuses to start on any difference (deployments/decode.py): none for the built-ins
    with their format's settings."""
    model = f"builtin:tiny-{family.replace('_', '-')}"
    vision, decode = stages(BUILDERS[family].engine_args, model)
    assert model_differences(vision.vllm_config.model_config, decode) == []


def test_a_builtin_that_ships_its_code_is_refused_with_the_config_until_trusted():
    with pytest.raises(ValidationError, match="trust_remote_code"):
        IrisConfig(model="builtin:tiny-internvl-chat")
    assert IrisConfig(model="builtin:tiny-internvl-chat", engine_args={"trust_remote_code": True})
