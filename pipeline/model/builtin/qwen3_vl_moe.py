"""Built-in Qwen3-VL-MoE (the Qwen3-VL-30B-A3B / 235B-A22B line): Qwen3-VL's dynamic-resolution
ViT with DeepStack taps (qwen3_vl.py) in front of a Qwen3-MoE language model: every layer's MLP
is a sparse block of `MOE_EXPERTS` routed experts, `MOE_ACTIVE` active per token (softmax over
the experts, top-k renormalised), no shared expert.

Prompts, processing and embeddings are Qwen3-VL's. The checkpoint stores each layer's experts
fused, as the hub's does: `mlp.experts.gate_up_proj` (experts, hidden, 2·moe_intermediate) and
`mlp.experts.down_proj` (experts, moe_intermediate, hidden); transformers 5 transposes them on
saving back to that layout, and vLLM reads it (`is_fused_checkpoint_transposed`).

vLLM's CPU MoE kernel (CPUUnquantizedExperts: AVX2/AVX-512 "vec"; AMX/NEON/VSX variants take
bfloat16 only) needs hidden size and expert MLP width divisible by 32 (the width is zero-padded
up to it; the hidden size is not). float32 and bfloat16 both run on the vec kernel.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.model.builtin.common import (
    INIT_RANGE,
    Spec,
    byte_level_tokenizer,
    qwen_vision_token_ids,
    save,
)
from pipeline.model.builtin.qwen2_vl import QWEN2_VL_SPECIAL
from pipeline.model.builtin.qwen3_vl import qwen3_vl_processor, vision_config

MOE_EXPERTS = 4
MOE_ACTIVE = 2


def build(spec: Spec, out: Path) -> None:
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    tokenizer = byte_level_tokenizer(QWEN2_VL_SPECIAL, bos=None, eos="<|im_end|>", pad="<|endoftext|>")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN2_VL_SPECIAL}
    head_dim = spec.text_hidden // spec.text_heads
    half = head_dim // 2
    hw = half * 5 // 16  # t, h, w in Qwen3-VL's 24:20:20 ratio (as qwen3_vl.py)
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.text_hidden,
        intermediate_size=spec.text_mlp(),
        num_hidden_layers=spec.text_layers,
        num_attention_heads=spec.text_heads,
        num_key_value_heads=spec.text_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 5000000.0,
            "mrope_section": [half - 2 * hw, hw, hw],
            "mrope_interleaved": True,
        },
        # every layer sparse. Expert MLP width 3/4 of the hidden size (the 30B-A3B's 768/2048 is 3/8):
        # a multiple of 32 for vLLM's CPU kernel, and neither it nor twice it the hidden size, so the
        # fused expert tensors are never square and both loaders orient them by shape unambiguously.
        num_experts=MOE_EXPERTS,
        num_experts_per_tok=MOE_ACTIVE,
        moe_intermediate_size=spec.text_hidden * 3 // 4,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,  # vLLM's Qwen3-MoE block reads it
        # the text config's own default is True, and vLLM's language model reads this one, not the top level's
        tie_word_embeddings=False,
        initializer_range=INIT_RANGE,
        pad_token_id=ids["<|endoftext|>"],
    )
    config = Qwen3VLMoeConfig(
        text_config=text,
        vision_config=vision_config(spec, deepstack=True),
        **qwen_vision_token_ids(ids),
        tie_word_embeddings=False,
    )
    config.initializer_range = INIT_RANGE
    processor = qwen3_vl_processor(spec, tokenizer)
    model = Qwen3VLMoeForConditionalGeneration(config)
    save(model, processor, tokenizer, spec, out)
    hub_expert_layout(out)


def hub_expert_layout(out: Path) -> None:
    """Transpose the fused expert tensors to the hub's layout. transformers 5 keeps experts as
    gate_up_proj (experts, 2·moe_intermediate, hidden) and down_proj (experts, hidden,
    moe_intermediate) and saves them so (its save-time Transpose is skipped when the shape already
    matches its own); the hub's checkpoints hold their transposes, which vLLM's loader expects
    unconditionally (transformers' loader transposes by shape, so it reads either)."""
    from safetensors.torch import load_file, save_file

    for path in sorted(out.glob("*.safetensors")):
        tensors = load_file(str(path))
        fused = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
        save_file(
            {n: (t.transpose(1, 2) if n.endswith(fused) else t).contiguous() for n, t in tensors.items()},
            str(path),
            metadata={"format": "pt"},
        )
