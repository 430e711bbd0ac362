"""Built-in Qwen3-VL: dynamic-resolution ViT (patch 16, learned + rotary positions) whose
merger is the projector, with DeepStack taps that add features of inner ViT layers to the
first language-model layers; Qwen3 language model with interleaved multimodal RoPE.

Its tokenizer and chat template are the real Qwen3-VL's in what vLLM's tool and reasoning
parsers read (`--tool-call-parser hermes --reasoning-parser qwen3`): `<tool_call>`,
`</tool_call>`, `<think>`, `</think>` (and `<tool_response>`, `</tool_response>`) are single
tokens; the template lists the request's tools in the system turn, renders an assistant's
tool calls as `<tool_call>{json}</tool_call>` and the `tool` role as `<tool_response>`, and
with `enable_thinking` false closes an empty `<think>` block after the generation prompt."""

from __future__ import annotations

from pathlib import Path

from pipeline.model.builtin.common import (
    INIT_RANGE,
    Spec,
    byte_level_tokenizer,
    qwen_vision_token_ids,
    save,
)
from pipeline.model.builtin.qwen2_vl import QWEN2_VL_CHAT_TEMPLATE, QWEN2_VL_SPECIAL

# The real Qwen3-VL's tool-call and thinking markers, single tokens as in its vocabulary.
QWEN3_VL_SPECIAL = [
    *QWEN2_VL_SPECIAL,
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]

# A message's content: None, a string, or parts (text, image, video). Inline, not a macro: vLLM
# detects the "openai" content format from loops over message['content'] in the template.
_CONTENT = (
    "{%- if message['content'] is none %}"
    "{%- elif message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
)
# Qwen3's template in what the tests read of it: tools (JSON signatures in the system turn),
# assistant tool calls, tool results grouped into one user turn, and the thinking switch.
QWEN3_VL_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{%- set message = messages[0] %}"
    + _CONTENT
    + "{{- '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, '
    '"arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and tools and loop.first %}"  # in the tools turn above
    "{%- elif message['role'] == 'user' or message['role'] == 'system' %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}" + _CONTENT + "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    + _CONTENT
    + "{%- if message['tool_calls'] is defined and message['tool_calls'] %}"
    "{%- for tool_call in message['tool_calls'] %}"
    "{%- if (loop.first and message['content']) or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{%- if tool_call['function'] is defined %}{%- set tool_call = tool_call['function'] %}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' }}{{- tool_call['name'] }}{{- '\", \"arguments\": ' }}"
    "{%- if tool_call['arguments'] is string %}{{- tool_call['arguments'] }}"
    "{%- else %}{{- tool_call['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}" + _CONTENT + "{{- '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"
)


def build(spec: Spec, out: Path) -> None:
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    tokenizer = byte_level_tokenizer(QWEN3_VL_SPECIAL, bos=None, eos="<|im_end|>", pad="<|endoftext|>")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN3_VL_SPECIAL}
    head_dim = spec.text_hidden // spec.text_heads
    half = head_dim // 2
    # t, h, w in Qwen3-VL's 24:20:20 ratio, sums to head_dim/2; interleaved h/w need 3*section <= half
    hw = half * 5 // 16
    mrope_section = [half - 2 * hw, hw, hw]
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.text_hidden,
        intermediate_size=4 * spec.text_hidden,
        num_hidden_layers=spec.text_layers,
        num_attention_heads=spec.text_heads,
        num_key_value_heads=spec.text_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 5000000.0,
            "mrope_section": mrope_section,
            "mrope_interleaved": True,
        },
        initializer_range=INIT_RANGE,
        pad_token_id=ids["<|endoftext|>"],
    )
    vision = vision_config(spec, deepstack=True)
    config = Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        **qwen_vision_token_ids(ids),
        tie_word_embeddings=False,
    )
    config.initializer_range = INIT_RANGE
    processor = qwen3_vl_processor(spec, tokenizer, QWEN3_VL_CHAT_TEMPLATE)
    model = Qwen3VLForConditionalGeneration(config)
    save(model, processor, tokenizer, spec, out)


def vision_config(spec: Spec, deepstack: bool) -> dict:
    """The Qwen3-VL ViT (also Qwen3.5's, without DeepStack taps)."""
    grid = spec.image_size // spec.patch_size  # learned position grid, interpolated to each image
    taps = {"deepstack_visual_indexes": list(range(spec.vision_layers))} if deepstack else {}
    return dict(
        depth=spec.vision_layers,
        hidden_size=spec.vision_hidden,
        intermediate_size=4 * spec.vision_hidden,
        num_heads=spec.vision_heads,
        hidden_act="gelu_pytorch_tanh",
        in_channels=3,
        patch_size=spec.patch_size,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=spec.text_hidden,
        num_position_embeddings=grid * grid,
        **taps,
        initializer_range=INIT_RANGE,
    )


def qwen3_vl_processor(spec: Spec, tokenizer, chat_template: str = QWEN2_VL_CHAT_TEMPLATE):
    """Qwen3-VL's processor (also Qwen3.5's, with the Qwen2-VL template): images up to
    image_size² pixels, mean and std 0.5."""
    from transformers import (
        Qwen2VLImageProcessor,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )

    unit = spec.patch_size * 2  # one merged visual token covers unit×unit pixels
    mean_std = dict(image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    image_processor = Qwen2VLImageProcessor(
        min_pixels=unit * unit * 4,
        max_pixels=spec.image_size * spec.image_size,
        patch_size=spec.patch_size,
        merge_size=2,
        temporal_patch_size=2,
        **mean_std,
    )
    video_processor = Qwen3VLVideoProcessor(
        size={"shortest_edge": unit * unit * 4, "longest_edge": spec.image_size * spec.image_size},
        patch_size=spec.patch_size,
        merge_size=2,
        temporal_patch_size=2,
        cap_pixels_per_frame=True,
        **mean_std,
    )
    return Qwen3VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=chat_template,
    )
