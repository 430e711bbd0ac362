"""Built-in random-weight VLM checkpoints, made locally (no model hub).

    python -m pipeline.models.builtin --family FAMILY --size tiny|bench --out DIR

writes a Hugging Face hub-layout checkpoint (config, safetensors weights, a
byte-level BPE tokenizer, image processor, processor, chat template) that both
transformers and vLLM load. Weights are seeded, so the same arguments always
give the same checkpoint. One module per family; each has `SPECS` (size ->
`Spec`) and `build(spec, out)`.

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


BUILDERS = {
    "llava": Builtin(llava.SPECS, llava.build),
    "qwen2_vl": Builtin(qwen2_vl.SPECS, qwen2_vl.build),
    "qwen2_5_vl": Builtin(qwen2_vl.SPECS, qwen2_vl.build_2_5),
    "qwen3_vl": Builtin(qwen3_vl.SPECS, qwen3_vl.build),
    "qwen3_5": Builtin(qwen3_5.SPECS, qwen3_5.build),
    "llava_next": Builtin(llava_next.SPECS, llava_next.build),
    "internvl": Builtin(internvl.SPECS, internvl.build),
    "minicpmv4_6": Builtin(minicpmv4_6.SPECS, minicpmv4_6.build),
    "gemma3": Builtin(gemma3.SPECS, gemma3.build, served=False),
    "idefics3": Builtin(idefics3.SPECS, idefics3.build, served=False),
    "mistral3": Builtin(mistral3.SPECS, mistral3.build, served=False),
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
