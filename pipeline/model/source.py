"""Turn the user's `model` setting into something transformers and vLLM can load.

Accepted forms:
- `builtin:<size>-<family>` (e.g. `builtin:tiny-llava`, `builtin:bench-qwen2-vl`):
  built locally on first use into IRIS_CHECKPOINT_DIR (default ~/.cache/iris/checkpoints);
- a local checkpoint folder;
- a hub id (e.g. `llava-hf/llava-1.5-7b-hf`): handed to transformers/vLLM as is.
  Only this form may reach a model hub, and only because the user asked for it.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from pathlib import Path

from pipeline.model.builtin import BUILDER_VERSION, available, build_checkpoint

BUILTIN_PREFIX = "builtin:"


def builtin_names() -> list[str]:
    return [f"{BUILTIN_PREFIX}{size}-{family.replace('_', '-')}" for family, size in available()]


def builtin_engine_args(model: str) -> dict:
    """The engine_args a built-in's checkpoints need, as any checkpoint of its format does (e.g.
    trust_remote_code for one that ships its code); {} for other models."""
    from pipeline.model.builtin import find_builtin

    if not model.startswith(BUILTIN_PREFIX):
        return {}
    family = model[len(BUILTIN_PREFIX) :].partition("-")[2].replace("-", "_")
    try:
        return dict(find_builtin(family).engine_args)
    except KeyError:
        return {}


def checkpoint_dir() -> Path:
    return Path(os.environ.get("IRIS_CHECKPOINT_DIR", Path.home() / ".cache" / "iris" / "checkpoints"))


def resolve_model(model: str) -> str:
    """Return a local folder (built-in or local) or the hub id unchanged."""
    if model.startswith(BUILTIN_PREFIX):
        return str(_ensure_builtin(model))
    path = Path(model).expanduser()
    if path.exists():
        if not any((path / name).is_file() for name in ("config.json", "params.json")):
            raise ValueError(
                f"model path {model!r} has no config.json (Hugging Face format) or params.json (Mistral's format): "
                "not a checkpoint folder"
            )
        return str(path.resolve())
    if model.startswith((".", "/", "~")):
        raise ValueError(f"model path {model!r} does not exist")
    return model  # a hub id


def _ensure_builtin(model: str) -> Path:
    name = model[len(BUILTIN_PREFIX) :]
    size, _, family = name.partition("-")
    family = family.replace("-", "_")
    if (family, size) not in available():
        raise ValueError(f"unknown built-in model {model!r}; choose one of {builtin_names()}")
    root = checkpoint_dir()
    target = root / f"{size}-{family}-v{BUILDER_VERSION}"
    if (target / "iris_builtin.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    # Several replicas may start at once: one builds, the others wait on the lock.
    with open(root / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "iris_builtin.json").is_file():
            tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
            try:
                build_checkpoint(family, size, tmp)
                shutil.rmtree(target, ignore_errors=True)
                tmp.rename(target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def checkpoint_dtype(checkpoint: str) -> str:
    """The dtype a checkpoint was saved in (config.json), e.g. "bfloat16"; float32 if it says none. What the
    benchmarks give every system alike (the stages resolve "auto" through vLLM: engine_settings.py)."""
    path = Path(checkpoint) / "config.json"
    if path.is_file():
        config = json.loads(path.read_text())
    elif (Path(checkpoint) / "params.json").is_file():  # Mistral's format: a dtype where it says one
        config = json.loads((Path(checkpoint) / "params.json").read_text())
    else:  # a hub id
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(checkpoint).to_dict()
    text = config.get("text_config") or {}
    name = config.get("dtype") or config.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype")
    return str(name or "float32").removeprefix("torch.")
