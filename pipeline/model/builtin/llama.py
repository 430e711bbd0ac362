"""Built-in text-only Llama (`LlamaForCausalLM`): LLaVA's language model alone, for apps that serve a
VLM beside a text model. The same tokenizer and text config as LLaVA's (`clip_llama`), no vision tower,
no image processor; a chat template of text only (string content or lists of text parts)."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.model.builtin.common import INIT_RANGE, Spec
from pipeline.model.builtin.llava import clip_llama

_TEXT_OF = (
    "{{ message['content'] if message['content'] is string "
    "else message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') }}"
)
# LLaVA's conversation format without images: USER: ... / ASSISTANT: ...</s>
LLAMA_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}" + _TEXT_OF + "{{ '\\n' }}"
    "{% elif message['role'] == 'user' %}USER: " + _TEXT_OF + "{{ '\\n' }}"
    "{% else %}ASSISTANT: " + _TEXT_OF + "</s>{{ '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def build(spec: Spec, out: Path) -> None:
    import torch
    from transformers import LlamaForCausalLM

    tokenizer, _, _, text = clip_llama(spec)
    text.initializer_range = INIT_RANGE
    model = LlamaForCausalLM(text).to(getattr(torch, spec.dtype)).eval()
    model.config.dtype = spec.dtype
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.chat_template = LLAMA_CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    # The chat template also in tokenizer_config.json: some loaders read it only there.
    path = out / "tokenizer_config.json"
    settings = json.loads(path.read_text())
    settings["chat_template"] = LLAMA_CHAT_TEMPLATE
    path.write_text(json.dumps(settings, indent=2))
