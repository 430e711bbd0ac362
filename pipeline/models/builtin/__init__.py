"""Built-in random-weight VLM checkpoints, made locally (no model hub).

    python -m pipeline.models.builtin --family FAMILY --size tiny|bench --out DIR

writes a Hugging Face hub-layout checkpoint (config, safetensors weights, a
byte-level BPE tokenizer, image processor, processor, chat template) that both
transformers and vLLM load. Weights are seeded, so the same arguments always
give the same checkpoint. One module per family with its `build(spec, out)`; the
sizes of all (size -> `Spec`) are in BUILDERS below.

- `tiny`: hidden size 128, 2 layers, small images; for tests.
- `bench`: a realistically sized vision tower in front of a small language
  model, so vision work dominates time as in real deployments.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipeline.models.builtin import (gemma3, idefics3, internvl, llava, llava_next, minicpmv4_6, mistral3, qwen2_vl,
                                     qwen3_5, qwen3_vl)
from pipeline.models.builtin.common import SEED, Spec


@dataclass(frozen=True)
class Builtin:
    specs: dict[str, Spec]  # size -> sizes
    build: Callable[[Spec, Path], None]
    # Whether Iris serves it (tests/test_families.py runs it end to end). The others are
    # checkpoints `vllm serve` runs but vLLM 0.32 takes no image embeddings for: Iris
    # refuses them at start-up, naming why (tests/test_vision_model.py).
    served: bool = True


# Spec: text hidden, layers, heads, kv heads; vision hidden, layers, heads; image side, patch; dtype.
QWEN2_SIZES = {  # Qwen2-VL and Qwen2.5-VL
    "tiny": Spec(128, 2, 4, 2, 64, 2, 4, 112, 14, "float32"),
    "bench": Spec(256, 2, 4, 2, 768, 12, 12, 224, 14, "bfloat16"),
}
BUILDERS = {
    "llava": Builtin({
        "tiny": Spec(128, 2, 4, 2, 64, 2, 4, 56, 14, "float32"),
        "bench": Spec(256, 2, 4, 2, 768, 12, 12, 224, 16, "bfloat16"),
    }, llava.build),
    "qwen2_vl": Builtin(QWEN2_SIZES, qwen2_vl.build),
    "qwen2_5_vl": Builtin(QWEN2_SIZES, qwen2_vl.build_2_5),
    "qwen3_vl": Builtin({
        "tiny": Spec(128, 2, 4, 2, 64, 2, 4, 112, 16, "float32"),
    }, qwen3_vl.build),
    "qwen3_5": Builtin({
        # bfloat16: vLLM's CPU Gated DeltaNet kernel takes BF16 only (float32 fails at the first step).
        "tiny": Spec(128, 2, 2, 1, 64, 2, 4, 112, 16, "bfloat16"),
    }, qwen3_5.build),
    "llava_next": Builtin({
        "tiny": Spec(128, 2, 4, 2, 64, 2, 4, 56, 14, "float32"),
    }, llava_next.build),
    "internvl": Builtin({
        # 56 px tiles of 14 px patches: 4x4 patches, pixel-shuffled (ratio 0.5) to 4 tokens a tile.
        "tiny": Spec(128, 2, 4, 2, 64, 2, 4, 56, 14, "float32"),
    }, internvl.build),
    "minicpmv4_6": Builtin({
        # image_size: scale_resolution (side of one view); patch 4 gives 16 tokens per view.
        # bfloat16: vLLM's CPU Gated DeltaNet kernel takes BF16 only (float32 fails at the first step).
        "tiny": Spec(128, 2, 2, 1, 64, 2, 4, 64, 4, "bfloat16"),
    }, minicpmv4_6.build),
    "gemma3": Builtin({
        # 64 px of 8 px patches: 8x8 patches, average-pooled to 4x4 = 16 tokens an image.
        "tiny": Spec(128, 2, 4, 2, 64, 2, 4, 64, 8, "float32"),
    }, gemma3.build, served=False),
    "idefics3": Builtin({
        "tiny": Spec(128, 2, 4, 2, 64, 2, 4, 64, 16, "float32"),
    }, idefics3.build, served=False),
    "mistral3": Builtin({
        # image_size: a multiple of patch × merge, so padded images never exceed the tower's rope grid
        "tiny": Spec(128, 2, 4, 2, 64, 2, 4, 96, 16, "float32"),
    }, mistral3.build, served=False),
}
FAMILIES = tuple(BUILDERS)
SERVED_FAMILIES = tuple(family for family, b in BUILDERS.items() if b.served)
SIZES = ("tiny", "bench")

# Bump when the builder's output changes, so cached built-in checkpoints are rebuilt.
BUILDER_VERSION = 2  # 2: Qwen chat templates place videos; Qwen2-VL frames sized like its images


def available() -> list[tuple[str, str]]:
    """Every (family, size) that can be built."""
    return [(family, size) for family, builtin in BUILDERS.items() for size in builtin.specs]


def build_checkpoint(family: str, size: str, out: str | os.PathLike) -> Path:
    """Write the built-in checkpoint `family`/`size` to `out` and return its path."""
    import torch

    if (family, size) not in available():
        raise ValueError(f"unknown built-in checkpoint {family}/{size}; choose one of {available()}")
    builtin = BUILDERS[family]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    builtin.build(builtin.specs[size], out)
    (out / "iris_builtin.json").write_text(json.dumps(
        {"family": family, "size": size, "builder_version": BUILDER_VERSION, "seed": SEED}, indent=2))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=FAMILIES, required=True)
    parser.add_argument("--size", choices=SIZES, default="tiny")
    parser.add_argument("--out", required=True, help="output folder")
    args = parser.parse_args()
    print(build_checkpoint(args.family, args.size, args.out))


if __name__ == "__main__":
    main()
