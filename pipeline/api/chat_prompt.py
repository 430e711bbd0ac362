"""Parsed chat messages -> the message list a checkpoint's chat template expects."""

from __future__ import annotations

from pipeline.api.chat_request import ChatMessage, MediaPlaceholder


def messages_for_template(messages: list[ChatMessage]) -> list[dict]:
    """HF chat-template messages, with each image and video where the client put it."""
    out = []
    for message in messages:
        content = [
            # Hugging Face chat templates render {"type": "image"} / {"type": "video"} as the model's placeholder.
            {"type": part.modality} if isinstance(part, MediaPlaceholder) else {"type": "text", "text": part.text}
            for part in message.parts
        ]
        out.append({"role": message.role, "content": content})
    return out

