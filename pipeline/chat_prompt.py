"""Parsed chat messages -> the message list a checkpoint's chat template expects."""

from __future__ import annotations

from pipeline.chat_request import ImagePlaceholder, ParsedChat


def template_messages(chat: ParsedChat, image_part: dict) -> list[dict]:
    """HF chat-template messages; each image becomes `image_part` (the family's
    placeholder), so the template places the image tokens where the client put the image."""
    out = []
    for message in chat.messages:
        content = [
            dict(image_part) if isinstance(part, ImagePlaceholder) else {"type": "text", "text": part.text}
            for part in message.parts
        ]
        out.append({"role": message.role, "content": content})
    return out

