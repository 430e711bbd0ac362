"""Built-in Pixtral in Mistral's own format (Pixtral-12B's layout), as `vllm serve` loads it with
`--tokenizer-mode mistral --config-format mistral --load-format mistral`:

- `params.json`: Mistral's config (`dim`, `n_layers`, ...) with a `vision_encoder` section, which
  vLLM reads into `PixtralForConditionalGeneration`'s config
  (vllm/transformers_utils/configs/mistral.py);
- `tekken.json`: a Tekken tokenizer (mistral_common's `Tekkenizer` file: the 256 byte tokens, no
  merges, Pixtral's special tokens [IMG] 10, [IMG_BREAK] 12, [IMG_END] 13, ...) with an `image`
  section, from which mistral_common's image encoder sizes images (longest edge up to
  `image_size`, padded to whole patches) and lays out their tokens: one [IMG] a patch, each row
  ending in [IMG_BREAK], the last in [IMG_END]. There is no chat template: mistral_common renders
  chats;
- `consolidated.safetensors`: the weights under Mistral's names (`tok_embeddings`,
  `layers.N.attention.wq`, `vision_encoder.transformer.layers.N.feed_forward.w1`,
  `vision_language_adapter.w_in`, ...).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

from pipeline.model.builtin.common import INIT_RANGE, Spec

# Tekken's version 7 (Pixtral's tokenizer family with system prompts); its special tokens at the ranks
# mistral_common gives them (Tekkenizer.DEPRECATED_SPECIAL_TOKENS), padded with <SPECIAL_N> fillers.
TEKKEN_VERSION = "v7"
NUM_SPECIAL_TOKENS = 32
# Tekken's pre-tokenizer pattern (tiktoken's pat_str) as in Mistral's tekken.json files.
TEKKEN_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|"
    r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def tekken(spec: Spec) -> tuple[dict, dict[str, int]]:
    """tekken.json's contents (byte tokens only) and its special tokens' ids."""
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    special = [dict(t) for t in Tekkenizer.DEPRECATED_SPECIAL_TOKENS]
    special += [
        {"rank": i, "token_str": Tekkenizer.SPECIAL_TOKEN_TEMPLATE.format(id=i), "is_control": True}
        for i in range(len(special), NUM_SPECIAL_TOKENS)
    ]
    vocab = []
    for i in range(256):
        try:
            text = bytes([i]).decode("utf-8")
        except UnicodeDecodeError:
            text = None
        vocab.append({"rank": i, "token_bytes": base64.b64encode(bytes([i])).decode(), "token_str": text})
    data = {
        "config": {
            "pattern": TEKKEN_PATTERN,
            "num_vocab_tokens": len(vocab),
            "default_vocab_size": len(vocab) + NUM_SPECIAL_TOKENS,
            "default_num_special_tokens": NUM_SPECIAL_TOKENS,
            "version": TEKKEN_VERSION,
        },
        "vocab": vocab,
        "special_tokens": special,
        "image": {"image_patch_size": spec.patch_size, "max_image_size": spec.image_size, "spatial_merge_size": 1},
    }
    return data, {t["token_str"]: t["rank"] for t in special}


def build(spec: Spec, out: Path) -> None:
    import torch
    from safetensors.torch import save_file

    data, ids = tekken(spec)
    vocab_size = data["config"]["default_vocab_size"]
    head_dim = spec.text_hidden // spec.text_heads
    params = {
        "dim": spec.text_hidden,
        "n_layers": spec.text_layers,
        "head_dim": head_dim,
        "hidden_dim": spec.text_mlp(),
        "n_heads": spec.text_heads,
        "n_kv_heads": spec.text_kv_heads,
        "rope_theta": 1000000.0,
        "norm_eps": 1e-5,
        "vocab_size": vocab_size,
        "max_position_embeddings": 4096,
        "vision_encoder": {
            "hidden_size": spec.vision_hidden,
            "num_channels": 3,
            "image_size": spec.image_size,
            "patch_size": spec.patch_size,
            "rope_theta": 10000.0,
            "intermediate_size": spec.vision_mlp(),
            "num_hidden_layers": spec.vision_layers,
            "num_attention_heads": spec.vision_heads,
            "image_token_id": ids["[IMG]"],
            "image_break_token_id": ids["[IMG_BREAK]"],
            "image_end_token_id": ids["[IMG_END]"],
            "adapter_bias": True,
        },
    }
    dtype = getattr(torch, spec.dtype)

    def linear(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols) * INIT_RANGE

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n)

    def block(prefix: str, dim: int, heads: int, kv_heads: int, head: int, mlp: int) -> dict[str, torch.Tensor]:
        return {
            f"{prefix}.attention.wq.weight": linear(heads * head, dim),
            f"{prefix}.attention.wk.weight": linear(kv_heads * head, dim),
            f"{prefix}.attention.wv.weight": linear(kv_heads * head, dim),
            f"{prefix}.attention.wo.weight": linear(dim, heads * head),
            f"{prefix}.attention_norm.weight": ones(dim),
            f"{prefix}.ffn_norm.weight": ones(dim),
            f"{prefix}.feed_forward.w1.weight": linear(mlp, dim),
            f"{prefix}.feed_forward.w2.weight": linear(dim, mlp),
            f"{prefix}.feed_forward.w3.weight": linear(mlp, dim),
        }

    d, v = spec.text_hidden, spec.vision_hidden
    tensors = {"tok_embeddings.weight": linear(vocab_size, d)}
    for i in range(spec.text_layers):
        tensors |= block(f"layers.{i}", d, spec.text_heads, spec.text_kv_heads, head_dim, spec.text_mlp())
    tensors |= {"norm.weight": ones(d), "output.weight": linear(vocab_size, d)}
    tensors |= {
        "vision_encoder.patch_conv.weight": torch.randn(v, 3, spec.patch_size, spec.patch_size) * INIT_RANGE,
        "vision_encoder.ln_pre.weight": ones(v),
    }
    vhead = v // spec.vision_heads
    for i in range(spec.vision_layers):
        tensors |= block(
            f"vision_encoder.transformer.layers.{i}", v, spec.vision_heads, spec.vision_heads, vhead, spec.vision_mlp()
        )
    tensors |= {
        "vision_language_adapter.w_in.weight": linear(d, v),
        "vision_language_adapter.w_in.bias": torch.randn(d) * INIT_RANGE,
        "vision_language_adapter.w_out.weight": linear(d, d),
        "vision_language_adapter.w_out.bias": torch.randn(d) * INIT_RANGE,
    }
    save_file({n: t.to(dtype).contiguous() for n, t in tensors.items()}, str(out / "consolidated.safetensors"))
    (out / "params.json").write_text(json.dumps(params, indent=2))
    (out / "tekken.json").write_text(json.dumps(data, indent=2))
