"""Parsed chat messages -> the message list a checkpoint's chat template expects."""

from __future__ import annotations

from pipeline.chat_request import ChatMessage, ImagePlaceholder, ParsedChat


# Hugging Face chat templates (LLaVA, Qwen2-VL, ...) render this part as the model's image placeholder.
IMAGE_PART = {"type": "image"}


def template_messages(chat: ParsedChat) -> list[dict]:
    """HF chat-template messages, with each image where the client put it."""
    return messages_for_template(chat.messages)


def messages_for_template(messages: list[ChatMessage]) -> list[dict]:
    out = []
    for message in messages:
        content = [
            dict(IMAGE_PART) if isinstance(part, ImagePlaceholder) else {"type": "text", "text": part.text}
            for part in message.parts
        ]
        out.append({"role": message.role, "content": content})
    return out

