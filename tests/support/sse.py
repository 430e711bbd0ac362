"""Server-sent events as Iris and `vllm serve` stream them (OpenAI's streaming format)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable

DONE = "[DONE]"
_LINE_END = re.compile(r"\r\n|\r|\n")  # SSE's line ends, and no others


def sse_events(body: str | Iterable[str]) -> list[str]:
    """The data of each event, in order, "[DONE]" included: the `data:` lines of an event joined
    by newlines, an event ended by a blank line (or by the end of the stream). Comment lines
    (":...") are skipped; any other field fails, since neither server sends one.

    body: the whole body, or its text in chunks (httpx's `r.iter_text()`). Not lines split by
    `str.splitlines` or httpx's `iter_lines`: they also split at U+0085, U+2028 and other
    characters that a token in a data line may be."""
    text = body if isinstance(body, str) else "".join(body)
    events: list[str] = []
    data: list[str] = []
    for line in _LINE_END.split(text):
        if not line:
            if data:
                events.append("\n".join(data))
                data = []
        elif line.startswith("data:"):
            value = line[len("data:") :]
            data.append(value[1:] if value.startswith(" ") else value)
        else:
            assert line.startswith(":"), f"not a data line of a server-sent event stream: {line!r}"
    if data:
        events.append("\n".join(data))
    return events


def sse_chunks(body: str | Iterable[str]) -> list[dict]:
    """The JSON chunks of a stream (sse_events' body), without its "[DONE]"."""
    return [json.loads(event) for event in sse_events(body) if event != DONE]
