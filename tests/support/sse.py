"""Server-sent events as Iris and `vllm serve` stream them (OpenAI's streaming format)."""

from __future__ import annotations

import json
from collections.abc import Iterable

DONE = "[DONE]"


def sse_events(lines: Iterable[str]) -> list[str]:
    """The data of each event, in order, "[DONE]" included: the `data:` lines of an event joined
    by newlines, an event ended by a blank line (or by the end of the stream). Comment lines
    (":...") are skipped; any other field fails, since neither server sends one."""
    events: list[str] = []
    data: list[str] = []
    for line in lines:
        line = line.rstrip("\r")
        if not line:
            if data:
                events.append("\n".join(data))
                data = []
        elif line.startswith("data:"):
            value = line[len("data:"):]
            data.append(value[1:] if value.startswith(" ") else value)
        else:
            assert line.startswith(":"), f"not a data line of a server-sent event stream: {line!r}"
    if data:
        events.append("\n".join(data))
    return events


def sse_chunks(lines: Iterable[str]) -> list[dict]:
    """The JSON chunks of a stream, without its "[DONE]"."""
    return [json.loads(event) for event in sse_events(lines) if event != DONE]
