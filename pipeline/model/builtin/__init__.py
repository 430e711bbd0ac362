"""Built-in random-weight VLM checkpoints, made locally (no model hub).

    python -m pipeline.model.builtin --family FAMILY --size tiny|bench --out DIR

writes a Hugging Face hub-layout checkpoint (config, safetensors weights, a
byte-level BPE tokenizer, image processor, processor, chat template) that both
transformers and vLLM load (Pixtral in Mistral's own format instead: params.json, tekken.json,
consolidated.safetensors, which vLLM and mistral_common load). Weights are seeded, so the same arguments always
give the same checkpoint. One module per family with its `build(spec, out)`; the
sizes of all (size -> `Spec`) are in BUILDERS below.

`--family llama` is text-only (TEXT_BUILDERS: LLaVA's Llama alone, `builtin:tiny-llama`), for
apps that serve a VLM beside a text model.

- `tiny`: hidden size 128, 2 layers, small images; for tests.
- `bench`: a realistically sized vision tower in front of a small language
  model, so vision work dominates time as in real deployments.
- `7b` (LLaVA and Qwen2.5-VL): the real models' dimensions, bfloat16, random weights
  (`python -m bench gpu` measures them on a GPU). LLaVA-1.5-7B: CLIP ViT-L/14 at 336 px
  (1024 hidden, 24 layers, 16 heads, MLP 4096) + LLaMA-2-7B (4096 hidden, 32 layers, 32
  heads, MLP 11008, vocabulary 32064): 7.06 B parameters, 14.1 GB. Qwen2.5-VL-7B: its ViT
  (1280 hidden, 32 layers, 16 heads, MLP 3420, full attention in blocks 7, 15, 23, 31) + Qwen2
  (3584 hidden, 28 layers, 28 heads, 4 KV heads, MLP 18944, vocabulary 152064): 8.29 B
  parameters, 16.6 GB. Only the tokenizer differs from the real ones: bytes, padded with tokens
  no text encodes to, so prompts are longer in tokens than with the real tokenizers. The weights
  are drawn in bfloat16 on a GPU where there is one (`fast_build`); then writing the safetensors
  takes most of the time (estimated, not measured: no GPU machine was available when this was
  written: 1–3 min each on a GPU machine with a local NVMe disk; on a CPU, several minutes more,
  and 16 GB of memory beside the 15–17 GB written).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.model.builtin import (
    gemma3,
    glm4v,
    idefics3,
    internvl,
    internvl_chat,
    llama,
    llama4,
    llava,
    llava_next,
    llava_onevision,
    minicpmv,
    minicpmv4_6,
    minicpmv4_7,
    mistral3,
    paligemma,
    phi3v,
    pixtral,
    qwen2_vl,
    qwen3_5,
    qwen3_5_moe,
    qwen3_vl,
    qwen3_vl_moe,
    smolvlm,
)
from pipeline.model.builtin.common import SEED, Spec


@dataclass(frozen=True)
class Builtin:
    name: str  # the family as its users call it (docs/families.md, the README)
    specs: dict[str, Spec]  # size -> sizes
    build: Callable[[Spec, Path], None]
    # Where its fidelity test runs: "app", a whole Iris app against `vllm serve` on the same
    # checkpoint (tests/test_families.py), or "engine", Iris's image path against vLLM's own
    # engine, one process per family (tests/test_family_engines.py: what CI has time for).
    # ("several-models" for a text-only built-in: served beside VLMs, tests/test_several_models.py.)
    tested: str = "app"
    # engine_args its checkpoints need, as any checkpoint of their format does (trust_remote_code for
    # checkpoint code): what the tests and the family table serve it with.
    engine_args: dict = field(default_factory=dict)


# Spec: text hidden, layers, heads, kv heads; vision hidden, layers, heads; image side, patch; dtype.
QWEN2_SIZES = {  # Qwen2-VL and Qwen2.5-VL
    "tiny": Spec(128, 2, 4, 2, 64, 2, 4, 112, 14, "float32"),
    "bench": Spec(256, 2, 4, 2, 768, 12, 12, 224, 14, "bfloat16"),
}
# The real models' dimensions (their config.json: llava-hf/llava-1.5-7b-hf, Qwen/Qwen2.5-VL-7B-Instruct).
LLAVA_1_5_7B = Spec(
    4096, 32, 32, 32, 1024, 24, 16, 336, 14, "bfloat16", text_intermediate=11008, vocab_size=32064, fast_build=True
)
QWEN2_5_VL_7B = Spec(
    3584,
    28,
    28,
    4,
    1280,
    32,
    16,
    3584,
    14,
    "bfloat16",  # 3584²: max_pixels 12845056
    text_intermediate=18944,
    vision_intermediate=3420,
    vocab_size=152064,
    vision_full_attention=(7, 15, 23, 31),
    fast_build=True,
)
BUILDERS = {
    "llava": Builtin(
        "LLaVA",
        {
            "tiny": Spec(128, 2, 4, 2, 64, 2, 4, 56, 14, "float32"),
            "bench": Spec(256, 2, 4, 2, 768, 12, 12, 224, 16, "bfloat16"),
            "7b": LLAVA_1_5_7B,
        },
        llava.build,
    ),
    "qwen2_vl": Builtin("Qwen2-VL", QWEN2_SIZES, qwen2_vl.build),
    "qwen2_5_vl": Builtin("Qwen2.5-VL", {**QWEN2_SIZES, "7b": QWEN2_5_VL_7B}, qwen2_vl.build_2_5),
    "qwen3_vl": Builtin(
        "Qwen3-VL",
        {
            "tiny": Spec(128, 2, 4, 2, 64, 2, 4, 112, 16, "float32"),
        },
        qwen3_vl.build,
    ),
    "qwen3_5": Builtin(
        "Qwen3.5",
        {
            # bfloat16: vLLM's CPU Gated DeltaNet kernel takes BF16 only (float32 fails at the first step).
            "tiny": Spec(128, 2, 2, 1, 64, 2, 4, 112, 16, "bfloat16"),
        },
        qwen3_5.build,
    ),
    "qwen3_vl_moe": Builtin(
        "Qwen3-VL-MoE",
        {
            # 4 experts, 2 active, expert MLP 96 wide (not square: vLLM and transformers transpose by layout)
            "tiny": Spec(128, 2, 4, 2, 64, 2, 4, 112, 16, "float32"),
        },
        qwen3_vl_moe.build,
        tested="engine",
    ),
    "qwen3_5_moe": Builtin(
        "Qwen3.5-MoE",
        {
            "tiny": Spec(128, 2, 2, 1, 64, 2, 4, 112, 16, "bfloat16"),
        },
        qwen3_5_moe.build,
        tested="engine",
    ),
    "llava_next": Builtin(
        "LLaVA-NeXT",
        {
            "tiny": Spec(128, 2, 4, 2, 64, 2, 4, 56, 14, "float32"),
        },
        llava_next.build,
    ),
    "internvl": Builtin(
        "InternVL",
        {
            # 56 px tiles of 14 px patches: 4x4 patches, pixel-shuffled (ratio 0.5) to 4 tokens a tile.
            "tiny": Spec(128, 2, 4, 2, 64, 2, 4, 56, 14, "float32"),
        },
        internvl.build,
    ),
    "internvl_chat": Builtin(
        "InternVL (original format)",
        {
            "tiny": Spec(128, 2, 4, 2, 64, 2, 4, 56, 14, "float32"),
        },
        internvl_chat.build,
        engine_args={"trust_remote_code": True},
    ),
    "minicpmv4_6": Builtin(
        "MiniCPM-V 4.6",
        {
            # image_size: scale_resolution (side of one view); patch 4 gives 16 tokens per view.
            # bfloat16: vLLM's CPU Gated DeltaNet kernel takes BF16 only (float32 fails at the first step).
            "tiny": Spec(128, 2, 2, 1, 64, 2, 4, 64, 4, "bfloat16"),
        },
        minicpmv4_6.build,
    ),
    "minicpmv4_7": Builtin(
        "MiniCPM-V 4.7",
        {
            # As MiniCPM-V 4.6's: 16 tokens a view of 64 px; bfloat16 for vLLM's CPU Gated DeltaNet kernel.
            "tiny": Spec(128, 2, 2, 1, 64, 2, 4, 64, 4, "bfloat16"),
        },
        minicpmv4_7.build,
        tested="engine",
    ),
    "gemma3": Builtin(
        "Gemma 3",
        {
            # 64 px of 8 px patches: 8x8 patches, average-pooled to 4x4 = 16 tokens an image.
            "tiny": Spec(128, 2, 4, 2, 64, 2, 4, 64, 8, "float32"),
        },
        gemma3.build,
    ),
    "idefics3": Builtin(
        "Idefics3",
        {
            "tiny": Spec(128, 2, 4, 2, 64, 2, 4, 64, 16, "float32"),
        },
        idefics3.build,
        tested="engine",
    ),
    "glm4v": Builtin(
        "GLM-4.1V",
        {
            "tiny": Spec(128, 2, 4, 2, 64, 2, 4, 112, 14, "float32"),
        },
        glm4v.build,
        tested="engine",
    ),
    "smolvlm": Builtin(
        "SmolVLM",
        {
            # 64 px tiles of 16 px patches, pixel shuffle x2: 4 tokens a tile, up to 2x2 tiles + a global view
            "tiny": Spec(128, 2, 4, 2, 64, 2, 4, 64, 16, "float32"),
        },
        smolvlm.build,
        tested="engine",
    ),
    "llama4": Builtin(
        "Llama 4",
        {
            # 112 px tiles of 14 px patches, pixel-shuffled to 16 tokens a tile; a dense and an MoE layer
            "tiny": Spec(128, 2, 4, 2, 64, 2, 4, 112, 14, "float32"),
        },
        llama4.build,
        tested="engine",
    ),
    "llava_onevision": Builtin(
        "LLaVA-OneVision",
        {
            "tiny": Spec(128, 2, 4, 2, 64, 2, 4, 56, 14, "float32"),
        },
        llava_onevision.build,
        tested="engine",
    ),
    "paligemma": Builtin(
        "PaliGemma",
        {  # 16 tokens an image; vLLM takes one image a prompt
            "tiny": Spec(128, 2, 4, 2, 64, 2, 4, 56, 14, "float32"),
        },
        paligemma.build,
        tested="engine",
    ),
    "mistral3": Builtin(
        "Mistral 3",
        {
            # image_size: a multiple of patch × merge, so padded images never exceed the tower's rope grid
            "tiny": Spec(128, 2, 4, 2, 64, 2, 4, 96, 16, "float32"),
        },
        mistral3.build,
        tested="engine",
    ),
    "phi3v": Builtin(
        "Phi-3-Vision",
        {
            # vLLM fixes the tower at CLIP ViT-L/14-336 (1024 wide, 16 heads, 336 px of 14 px patches); of
            # its 24 layers the checkpoint's features take the second (layer_idx -23): 2 layers are built.
            # Up to 4 crops of 336 px and a global view; Phi-3's 32064-token vocabulary (bytes, padded).
            "tiny": Spec(128, 2, 4, 2, 1024, 2, 16, 336, 14, "float32", vocab_size=32064),
        },
        phi3v.build,
        engine_args={"trust_remote_code": True},
    ),
    "pixtral": Builtin(
        "Pixtral (Mistral format)",
        {
            # params.json, tekken.json and consolidated.safetensors (Pixtral-12B's layout: no patch merging):
            # 96 px of 16 px patches, up to 6x6 [IMG] tokens an image, each row ending in [IMG_BREAK].
            "tiny": Spec(128, 2, 4, 2, 64, 2, 4, 96, 16, "float32"),
        },
        pixtral.build,
        tested="engine",
        engine_args={"tokenizer_mode": "mistral", "config_format": "mistral", "load_format": "mistral"},
    ),
    "minicpmv": Builtin(
        "MiniCPM-V 4.5 (original format)",
        {
            # image_size: scale_resolution (side of one view); 4 px patches: 16×16 patches a view, resampled
            # to 16 queries. The resampler has hidden / 128 heads: 1. Up to 4 slices and the source view.
            "tiny": Spec(128, 2, 2, 1, 64, 2, 4, 64, 4, "float32"),
        },
        minicpmv.build,
        tested="engine",
        engine_args={"trust_remote_code": True},
    ),
}
# Text-only built-ins, for apps that serve a VLM beside a text model: built and resolved like the
# others (`builtin:tiny-llama`), but no VLM family (FAMILIES, the family table and tests).
TEXT_BUILDERS = {
    "llama": Builtin(
        "Llama (text only)",
        {"tiny": BUILDERS["llava"].specs["tiny"]},  # LLaVA's language model and tokenizer alone
        llama.build,
        tested="several-models",  # tests/test_several_models.py: served beside two VLMs in one app
    ),
}
FAMILIES = tuple(BUILDERS)
APP_TESTED_FAMILIES = tuple(family for family, b in BUILDERS.items() if b.tested == "app")
ENGINE_TESTED_FAMILIES = tuple(family for family, b in BUILDERS.items() if b.tested == "engine")
SIZES = ("tiny", "bench", "7b")

# Bump when the builder's output changes, so cached built-in checkpoints are rebuilt.
# 2: Qwen chat templates place videos; Qwen2-VL frames sized like its images; 3: InternVL's too;
# 4: Qwen3-VL has tool and thinking tokens and a template with tools
BUILDER_VERSION = 4


def find_builtin(family: str) -> Builtin:
    """The built-in `family`, a VLM family or a text-only one (KeyError if none)."""
    return BUILDERS[family] if family in BUILDERS else TEXT_BUILDERS[family]


def available() -> list[tuple[str, str]]:
    """Every (family, size) that can be built, text-only built-ins too."""
    return [(family, size) for family, b in {**BUILDERS, **TEXT_BUILDERS}.items() for size in b.specs]


def build_checkpoint(family: str, size: str, out: str | os.PathLike) -> Path:
    """Write the built-in checkpoint `family`/`size` to `out` and return its path."""
    import torch

    if (family, size) not in available():
        raise ValueError(f"unknown built-in checkpoint {family}/{size}; choose one of {available()}")
    chosen = find_builtin(family)
    spec = chosen.specs[size]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    if spec.fast_build:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        with drawing_weights(spec, device):
            chosen.build(spec, out)
        if device == "cuda":
            torch.cuda.empty_cache()  # the process may serve next (a replica that built it): free the GPU
    else:
        chosen.build(spec, out)
    (out / "iris_builtin.json").write_text(
        json.dumps({"family": family, "size": size, "builder_version": BUILDER_VERSION, "seed": SEED}, indent=2)
    )
    return out


@contextlib.contextmanager
def drawing_weights(spec: Spec, device: str):
    """Modules built inside are allocated on `device` in the checkpoint's dtype and initialised there
    (device "meta": nothing allocated, for counting parameters)."""
    import torch

    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, spec.dtype))
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=(*FAMILIES, *TEXT_BUILDERS), required=True)
    parser.add_argument("--size", choices=SIZES, default="tiny")
    parser.add_argument("--out", required=True, help="output folder")
    args = parser.parse_args()
    print(build_checkpoint(args.family, args.size, args.out))


if __name__ == "__main__":
    main()
