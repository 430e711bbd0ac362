"""Read a subset of a checkpoint's weights (the vision tower and projector) without loading the rest."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open


CONFIG_FILES = ["*.json", "*.jinja", "*.txt", "*.model"]


def local_checkpoint(checkpoint: str, weights: bool = False) -> Path:
    """A local folder for `checkpoint`. Hub ids (only when the user named one) are
    downloaded: configs only, plus the safetensors when `weights` is asked for."""
    path = Path(checkpoint)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    patterns = CONFIG_FILES + (["*.safetensors"] if weights else [])
    return Path(snapshot_download(checkpoint, allow_patterns=patterns))


def load_prefixed(checkpoint: str, prefixes: dict[str, str]) -> dict[str, torch.Tensor]:
    """Tensors whose names start with a key of `prefixes`, renamed to start with its value.

    Longer prefixes win, so `model.visual.` and `visual.` can both be listed.
    """
    root = local_checkpoint(checkpoint, weights=True)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {root}")
    ordered = sorted(prefixes.items(), key=lambda kv: -len(kv[0]))
    out: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                for old, new in ordered:
                    if name.startswith(old):
                        out[new + name[len(old):]] = f.get_tensor(name)
                        break
    return out
