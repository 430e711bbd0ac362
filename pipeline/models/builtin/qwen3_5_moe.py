"""Built-in Qwen3.5-MoE (the Qwen3.5-35B-A3B / 397B-A17B line): Qwen3.5 (qwen3_5.py) with every
language-model MLP a sparse block: `MOE_EXPERTS` routed experts, `MOE_ACTIVE` active per token
(softmax over the experts, top-k renormalised) plus one shared expert whose output a sigmoid gate
scales. The same Qwen3-VL ViT without DeepStack taps, the same hybrid Gated DeltaNet / gated
full-attention layers, the same prompts, processing and embeddings as Qwen3.5.

bfloat16: vLLM's CPU Gated DeltaNet kernel takes BF16 only (as Qwen3.5's). vLLM's CPU MoE kernel
(CPUUnquantizedExperts) needs the hidden size and expert MLP width divisible by 32.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.models.builtin.common import INIT_RANGE, Spec, byte_level_tokenizer, save, token_ids
from pipeline.models.builtin.qwen2_vl import QWEN2_VL_SPECIAL
from pipeline.models.builtin.qwen3_5 import hybrid_text_config
from pipeline.models.builtin.qwen3_vl import qwen3_vl_processor, vision_config

MOE_EXPERTS = 4
MOE_ACTIVE = 2


def build(spec: Spec, out: Path) -> None:
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    tokenizer = byte_level_tokenizer(QWEN2_VL_SPECIAL, bos=None, eos="<|im_end|>", pad="<|endoftext|>")
    ids = token_ids(tokenizer, QWEN2_VL_SPECIAL)
    text = hybrid_text_config(spec, tokenizer)
    del text["intermediate_size"]  # no dense MLP: every layer is sparse
    # Expert and shared-expert width 3/4 of the hidden size (the 35B-A3B's are 512/2048): a multiple
    # of 32 for vLLM's CPU kernel, and the fused expert tensors never square.
    moe_width = spec.text_hidden * 3 // 4
    text.update(num_experts=MOE_EXPERTS, num_experts_per_tok=MOE_ACTIVE, moe_intermediate_size=moe_width,
                shared_expert_intermediate_size=moe_width,
                norm_topk_prob=True)  # transformers always renormalises; vLLM's block reads this (default True)
    config = Qwen3_5MoeConfig(
        text_config=text, vision_config=vision_config(spec, deepstack=False),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    config.bos_token_id, config.eos_token_id = None, ids["<|im_end|>"]
    config.pad_token_id = ids["<|endoftext|>"]
    config.initializer_range = INIT_RANGE
    processor = qwen3_vl_processor(spec, tokenizer)
    model = Qwen3_5MoeForConditionalGeneration(config)
    save(model, processor, tokenizer, spec, out)
