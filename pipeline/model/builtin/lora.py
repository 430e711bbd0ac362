"""A random-weight LoRA adapter for a built-in checkpoint, in PEFT's folder layout
(adapter_config.json, adapter_model.safetensors), as `vllm serve --lora-modules name=PATH`
and Iris's `engine_args.lora_modules` load it.

    python -c "from pipeline.model.builtin.lora import build_lora; build_lora(CHECKPOINT, OUT)"

It adapts the language model's attention projections only (q_proj, k_proj, v_proj, o_proj of
every decoder layer; never the vision tower), so the image features an adapter request needs
are the base model's. Seeded: the same checkpoint and arguments always give the same adapter.
Both factors are drawn wide (PEFT itself starts B at zero, an adapter that changes nothing), so
the adapted model answers a greedy request differently from the base model.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from pipeline.model.builtin.common import SEED

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
# A decoder layer's attention projection of the language model (not the tower's: its blocks are
# `visual.blocks.N` / `vision_tower...`, and its projections are named otherwise).
_PROJECTION = re.compile(
    r"^(?P<prefix>(?:model\.)?(?:language_model\.)?(?:model\.)?layers\.\d+\.self_attn\.)"
    r"(?P<target>" + "|".join(TARGETS) + r")\.weight$"
)
INIT_STD = 0.2


def build_lora(
    checkpoint: str | os.PathLike, out: str | os.PathLike, rank: int = 8, alpha: int = 16, seed: int = SEED
) -> Path:
    """Write the adapter for the checkpoint's language model to `out` and return its path."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    checkpoint, out = Path(checkpoint), Path(out)
    shapes: dict[str, tuple[int, int]] = {}
    for path in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                if _PROJECTION.match(name):
                    shapes[name] = tuple(f.get_slice(name).get_shape())
    if not shapes:
        raise ValueError(f"{checkpoint}: no language-model attention projections ({', '.join(TARGETS)}) to adapt")
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name in sorted(shapes):
        out_features, in_features = shapes[name]
        module = "base_model.model." + name.removesuffix(".weight")
        tensors[f"{module}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * INIT_STD
        tensors[f"{module}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * INIT_STD
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {n: t.contiguous() for n, t in tensors.items()},
        str(out / "adapter_model.safetensors"),
        metadata={"format": "pt"},
    )
    (out / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "base_model_name_or_path": str(checkpoint),
                "r": rank,
                "lora_alpha": alpha,
                "lora_dropout": 0.0,
                "bias": "none",
                "fan_in_fan_out": False,
                "target_modules": sorted({_PROJECTION.match(n)["target"] for n in shapes}),
                "modules_to_save": None,
                "use_rslora": False,
                "use_dora": False,
                "inference_mode": True,
            },
            indent=2,
        )
    )
    return out
