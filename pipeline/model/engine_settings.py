"""What every stage loads of the checkpoint: one set of vLLM model settings for Preprocess, the
VisionEncoder and LLMDecode.

LLMDecode's engine is built from `engine_args`, the `vllm serve` command line. The part of it that
says what is loaded, every argument vLLM's `EngineArgs.create_model_config()` and
`create_load_config()` take (`revision`, `code_revision`, `tokenizer`, `tokenizer_revision`,
`tokenizer_mode`, `trust_remote_code`, `hf_overrides`, `config_format`, `load_format`,
`download_dir`, `quantization`, `mm_processor_kwargs`, `media_io_kwargs`, `mm_encoder_*`, ...), is
what Preprocess and the VisionEncoder build vLLM's processor and tower from, through vLLM's own
`EngineArgs`: whatever `vllm serve` would load, every stage loads. The model settings are a plain
mapping of EngineArgs field names (`model_fields()`) to values, so they travel to every replica.

Settings a stage cannot honour are refused before anything loads (`refusals`), naming the stage.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

from cache_service.keys import content_hash

# Set by Iris for the stages that build vLLM's processor and tower outside an engine: the tower and
# projector only, called directly (no compilation), fed embeddings back by the start-up check.
# LLMDecode's engine gets the user's values of these.
STAGE_OWN = {"mm_encoder_only": True, "enable_mm_embeds": True, "enforce_eager": True}
# Iris's own settings, passed beside the model settings (IrisConfig's dtype and media limits).
IRIS_OWN = ("model", "dtype", "limit_mm_per_prompt")

# Model settings that shape no item's features: left out of the fingerprint, so that changing them
# keeps the cache. What is not here and not vLLM's default is in it (a setting too many there costs
# a cold cache once; one too few would serve features of another model). The weights are hashed as
# loaded, so where they come from (model_weights, load_format, download_dir, ...) is not needed.
NOT_FEATURES = frozenset(
    {
        *STAGE_OWN,
        "max_model_len",
        "served_model_name",
        "seed",
        "max_logprobs",
        "logprobs_mode",
        "return_sampling_mask",
        "use_fp64_gumbel",
        "enable_trace_replay",
        "generation_config",
        "override_generation_config",
        "enable_sleep_mode",
        "sleep_mode_offload_cudagraph",
        "sleep_preserve_parameter_names",
        "enable_cumem_allocator",
        "enable_nccl_comm_suspend",
        "logits_processors",
        "enable_prompt_embeds",
        "skip_mm_profiling",
        "mm_processor_cache_gb",
        "mm_processor_cache_type",
        "mm_shm_cache_max_object_size_mb",
        "mm_hasher_algorithm",
        "mm_tensor_ipc",
        "mm_ipc_gpu_memory_gb",
        "renderer_num_workers",
        "io_processor_plugin",
        "allowed_local_media_path",
        "allowed_media_domains",
        "interleave_mm_strings",
        "disable_sliding_window",
        "disable_cascade_attn",
        "pooler_config",
        "mm_encoder_fp8_scale_save_path",
        "mm_encoder_fp8_scale_save_margin",
        "hf_token",
        "download_dir",
        "model_weights",
        "load_format",
        "ignore_patterns",
        "model_loader_extra_config",
        "use_tqdm_on_load",
        "safetensors_load_strategy",
        "safetensors_prefetch_num_threads",
        "safetensors_prefetch_block_size",
        "pt_load_map_location",
    }
)
# Settings naming a folder or a hub id whose files shape features: a local folder is fingerprinted
# by its contents (the same on every node wherever it lies), a hub id by its name.
FOLDER_SETTINGS = ("tokenizer", "hf_config_path")
# Files of a folder that are not fingerprinted: weights (hashed as loaded).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")

# vLLM settings no stage of Iris can honour, or one stage only, by flag: (value that cannot be
# honoured, why). Checked on the whole `vllm serve` command line.
_UNHONOURED = {
    "enable_tower_connector_lora": (
        True,
        "VisionEncoder: it computes one set of features per image for every "
        "request, without LoRA adapters, and LLMDecode's engine never runs its tower, "
        "so an adapter's tower and connector weights would apply nowhere",
    ),
    "language_model_only": (
        True,
        "LLMDecode: its engine would take no images or videos, which every request with one needs",
    ),
    "mm_encoder_only": (True, "LLMDecode: its engine would load no language model"),
    "skip_tokenizer_init": (
        True,
        "Preprocess: vLLM's multimodal processor lays out an item's placeholder tokens with the tokenizer",
    ),
}


@cache
def model_fields() -> frozenset[str]:
    """vLLM's EngineArgs fields that say what is loaded: the arguments of its ModelConfig and
    LoadConfig, which `create_model_config()` and `create_load_config()` fill from them."""
    from vllm.config import LoadConfig, ModelConfig
    from vllm.engine.arg_utils import EngineArgs

    taken = set(inspect.signature(ModelConfig).parameters) | set(inspect.signature(LoadConfig).parameters)
    return frozenset({f.name for f in dataclasses.fields(EngineArgs)} & taken)


def model_settings(engine_args, defaults) -> dict[str, Any]:
    """The model part of `engine_args` (vLLM's parsed `vllm serve` arguments, or its EngineArgs) where
    it differs from `defaults` (the same without the user's flags), less Iris's own settings."""
    return {
        name: getattr(engine_args, name)
        for name in sorted(model_fields() - set(IRIS_OWN))
        if getattr(engine_args, name, None) != getattr(defaults, name, None)
    }


def refusals(engine_args) -> list[str]:
    """What no stage of Iris, or not every stage, can honour in these engine arguments (vLLM's parsed
    `vllm serve` arguments, or its EngineArgs), each naming the flag and the stage."""
    return [
        f"engine_args.{name}: {why}"
        for name, (value, why) in _UNHONOURED.items()
        if getattr(engine_args, name, None) == value
    ]


def stage_engine_args(checkpoint: str, settings: Mapping[str, Any], dtype: str, limits: dict[str, int]):
    """vLLM's EngineArgs for the processor and tower of a stage: the model settings, Iris's dtype
    and limits, the tower alone (`mm_encoder_only`)."""
    from vllm.engine.arg_utils import EngineArgs

    unknown = sorted(set(settings) - model_fields())
    if unknown:
        raise ValueError(f"not vLLM model settings: {unknown} (EngineArgs fields of its ModelConfig and LoadConfig)")
    own = sorted(set(settings) & set(IRIS_OWN))
    if own:
        raise ValueError(f"{own} are Iris's own settings, not model settings")
    return EngineArgs(model=checkpoint, **{**dict(settings), **STAGE_OWN}, dtype=dtype, limit_mm_per_prompt=limits)


def takes_media(checkpoint: str, settings: Mapping[str, Any]) -> bool:
    """Whether the checkpoint takes images or videos at all, as vLLM's own config says
    (`ModelConfig.is_multimodal_model`), built as the stages build it (`stage_engine_args`: the model
    settings, the checkpoint's dtype): False for a text-only model, which only LLMDecode serves."""
    try:
        return stage_engine_args(checkpoint, settings, "auto", {}).create_model_config().is_multimodal_model
    except Exception as err:
        refusal = load_refusal(checkpoint, settings, err)
        if refusal is None:
            raise
        raise refusal from err


def load_refusal(checkpoint: str, settings: Mapping[str, Any], err: Exception) -> Exception | None:
    """What to tell the user when vLLM refuses to load the checkpoint with these settings, where
    Iris can say more than vLLM's error; None to pass vLLM's on."""
    if not settings.get("trust_remote_code") and "trust_remote_code" in str(err):
        return ValueError(
            f"{checkpoint} needs code it ships itself (a config or processor class named by its "
            "auto_map), which vLLM runs only with trust_remote_code, as `vllm serve` refuses it without "
            "--trust-remote-code: set engine_args.trust_remote_code: true, and Preprocess, the VisionEncoder "
            "and LLMDecode each run that code from the checkpoint on their node"
        )
    return None


def config_dtype(hf_config) -> str:
    """The dtype the checkpoint's config says (the root's, else its text model's), e.g. "bfloat16";
    float32 where it says none. Read from the config vLLM resolved (hf_overrides, revision, ...)."""
    name = getattr(hf_config, "dtype", None) or getattr(hf_config.get_text_config(), "dtype", None)
    return str(name or "float32").removeprefix("torch.")


def feature_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The settings that shape features, as they go into the fingerprint: a local folder by the
    digest of its files, not its path."""
    out = {}
    for name, value in settings.items():
        if name in NOT_FEATURES:
            continue
        if name in FOLDER_SETTINGS and isinstance(value, str) and Path(value).exists():
            value = {"files": folder_digest(Path(value))}
        out[name] = value
    return json.loads(json.dumps(out, sort_keys=True, default=str))


def folder_digest(path: Path, pattern: str = "*") -> str:
    """A hash of a folder's files matching `pattern` but weights (their names and contents), or of one file."""
    if path.is_file():
        return content_hash(path.read_bytes())
    parts = []
    for file in sorted(p for p in path.rglob(pattern) if p.is_file() and not p.name.endswith(WEIGHT_SUFFIXES)):
        parts += [str(file.relative_to(path)).encode(), content_hash(file.read_bytes()).encode()]
    return content_hash(b"\0".join(parts))


def model_differences(ours, theirs) -> list[str]:
    """Where two of vLLM's ModelConfigs load other things (config, tokenizer, code, processor
    settings, dtype): empty when a stage built from `ours` computes what an engine built from
    `theirs` computes."""
    diffs = []
    for name in (
        "model",
        "tokenizer",
        "tokenizer_mode",
        "tokenizer_revision",
        "revision",
        "code_revision",
        "trust_remote_code",
        "config_format",
        "dtype",
        "quantization",
    ):
        a, b = getattr(ours, name, None), getattr(theirs, name, None)
        if a != b:
            diffs.append(f"{name}: {a!r} against {b!r}")
    if ours.hf_config.to_dict() != theirs.hf_config.to_dict():
        diffs.append("the model's config (hf_config)")
    mm_a, mm_b = ours.multimodal_config, theirs.multimodal_config
    for name in (
        "mm_processor_kwargs",
        "media_io_kwargs",
        "mm_encoder_attn_backend",
        "mm_encoder_attn_dtype",
        "mm_device_do_normalize",
        "video_pruning_rate",
    ):
        a, b = getattr(mm_a, name, None), getattr(mm_b, name, None)
        if a != b:
            diffs.append(f"{name}: {a!r} against {b!r}")
    return diffs
