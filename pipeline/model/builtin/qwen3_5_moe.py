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

from pipeline.model.builtin.common import Spec
from pipeline.model.builtin.qwen3_5 import build_hybrid

MOE_EXPERTS = 4
MOE_ACTIVE = 2


def build(spec: Spec, out: Path) -> None:
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    def sparse(text: dict) -> dict:
        del text["intermediate_size"]  # no dense MLP: every layer is sparse
        # Expert and shared-expert width 3/4 of the hidden size (the 35B-A3B's are 512/2048): a multiple
        # of 32 for vLLM's CPU kernel, and the fused expert tensors never square.
        moe_width = spec.text_hidden * 3 // 4
        text.update(
            num_experts=MOE_EXPERTS,
            num_experts_per_tok=MOE_ACTIVE,
            moe_intermediate_size=moe_width,
            shared_expert_intermediate_size=moe_width,
            norm_topk_prob=True,
        )  # transformers always renormalises; vLLM's block reads this (default True)
        return text

    build_hybrid(spec, out, Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration, sparse)
