"""Built-in MiniCPM-V 4.7: MiniCPM-V 4.6's tower, window-attention merger, 2×2 merger and Qwen3.5
hybrid language model (pipeline/model/builtin/minicpmv4_6.py, whose tokenizer, image and video
processors and config fields it reuses), all of the tower's layers kept (its config has no
`drop_vision_last_layer`), and canvas M-RoPE: the language model's 3-D positions lay each image's
thumbnail and slices out on a 2-D canvas, which the config pins with the ids of `<image>`,
`</image>`, `<slice>`, `</slice>` and the newline between slice rows. transformers' model always
uses it; vLLM's only where the config says `mrope_mode: canvas` (else every token gets sequential
positions, as for 4.6), as OpenBMB's MiniCPM-V configs do: the built-in says it.

The processor is transformers' MiniCPMV4_7Processor (no `<image_id>` before a video's frames,
`mm_token_type_ids` with the ids) over 4.6's image and video processors.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.model.builtin.common import Spec, save, token_ids
from pipeline.model.builtin.minicpmv4_6 import (
    MINICPMV4_6_SPECIAL,
    config_fields,
    finish_config,
    minicpmv_processor,
    minicpmv_tokenizer,
)


def build(spec: Spec, out: Path) -> None:
    from transformers import MiniCPMV4_7Config, MiniCPMV4_7ForConditionalGeneration, MiniCPMV4_7Processor

    tokenizer = minicpmv_tokenizer()
    ids = token_ids(tokenizer, MINICPMV4_6_SPECIAL)
    (newline_id,) = tokenizer.encode("\n", add_special_tokens=False)
    config = MiniCPMV4_7Config(
        **config_fields(spec, tokenizer, ids),
        image_start_id=ids["<image>"],
        image_end_id=ids["</image>"],
        slice_start_id=ids["<slice>"],
        slice_end_id=ids["</slice>"],
        newline_id=newline_id,
    )
    config.mrope_mode = "canvas"
    finish_config(config, ids)
    processor = minicpmv_processor(MiniCPMV4_7Processor, spec, tokenizer)
    model = MiniCPMV4_7ForConditionalGeneration(config)
    save(model, processor, tokenizer, spec, out)
