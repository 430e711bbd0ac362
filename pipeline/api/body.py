"""Request body bytes -> JSON object, or a 400 `invalid_json` in OpenAI's shape.

Hostile bodies handled here rather than crashing the ingress:
- not UTF-8 (JSON on the wire is UTF-8; json.loads would also guess UTF-16/32),
- syntax errors,
- nesting so deep that the parser recurses out of stack (`[[[[...` 20,000 levels
  is a RecursionError inside json.loads),
- nesting deeper than MAX_DEPTH: no chat request is that deep, and everything
  after the parser (pydantic, logging, copies) would walk it recursively.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from pipeline.errors import IrisError, bad_request

# A chat body is ~5 deep (body > messages > message > content > part > image_url);
# client extras such as tool JSON schemas add some. 64 leaves ample room.
MAX_DEPTH = 64
# Bodies at least this large parse in a thread, so they do not stall the other streams.
PARSE_IN_THREAD_BYTES = 256 * 1024
# Where a JSON string holding a data: URL starts.
DATA_URL = b'"data:'
# Elements the depth check walks before it bounds the depth by counting brackets instead.
WALK_BUDGET = 10_000


async def read_body(
    pieces: AsyncIterator[bytes],
    declared_length: str | None,
    max_bytes: int,
    max_text: int | None = None,
    media_strings: int = 0,
) -> bytearray | None:
    """An HTTP body's bytes; 413 as soon as it passes `max_bytes` (nothing more is read).

    With `max_text`: None once the body's text (TextMeter) passes it. The rest is read, up to
    `max_bytes`, and dropped, so that a client still sending reads the refusal rather than a reset
    connection; nothing of it is kept, copied or scanned, so a huge text costs the event loop no
    more than its network reads."""
    if declared_length and declared_length.isdigit() and int(declared_length) > max_bytes:
        raise _too_large(max_bytes)
    raw, size, meter = bytearray(), 0, TextMeter(media_strings)
    async for piece in pieces:
        size += len(piece)
        if size > max_bytes:
            raise _too_large(max_bytes)
        if raw is None:
            continue
        raw += piece
        if max_text is not None and len(raw) > max_text and meter.text_bytes(raw) > max_text:
            raw = None
    if raw is not None and max_text is not None and meter.text_bytes(raw, final=True) > max_text:
        return None
    return raw


async def parse_body(raw: bytes | bytearray) -> dict[str, Any]:
    """`raw` as a JSON object (parse_json_body), in a thread when large."""
    if len(raw) >= PARSE_IN_THREAD_BYTES:
        return await asyncio.to_thread(parse_json_body, raw)
    return parse_json_body(raw)


class TextMeter:
    """The bytes of a body's text as it arrives: all but its first `at_most` JSON strings that
    start with `data:` (base64 images and videos, quotes included), found at C speed without
    parsing. A text that holds `"data:` counts as such; the parsed body's media parts tell."""

    def __init__(self, at_most: int):
        self.at_most = at_most
        self.media = 0  # bytes of the data strings closed so far
        self.found = 0
        self.open: int | None = None  # where a data string not closed yet starts
        self.pos = 0  # bytes before it are classified (a data string, open or closed, or text)

    def text_bytes(self, raw: bytes | bytearray, final: bool = False) -> int:
        """The text among the bytes classified so far (all of them if `final`): it only grows as
        more bytes arrive, so a body over a bound can be refused before its end."""
        while self.found < self.at_most:
            if self.open is not None:
                end = raw.find(b'"', self.pos)  # base64 holds no quote: the string's end
                if end < 0:
                    self.pos = len(raw)
                    break
                self.media += end + 1 - self.open
                self.found, self.open, self.pos = self.found + 1, None, end + 1
                continue
            start = raw.find(DATA_URL, self.pos)
            if start < 0:  # the needle may yet straddle what comes next
                self.pos = max(self.pos, len(raw) - len(DATA_URL) + 1)
                break
            self.open, self.pos = start, start + len(DATA_URL)
        if self.found >= self.at_most or final:
            self.pos = len(raw)
        return self.pos - self.media - (self.pos - self.open if self.open is not None else 0)


def _too_large(max_bytes: int) -> IrisError:
    return IrisError(f"request body larger than {max_bytes} bytes", status_code=413, code="request_too_large")


def parse_json_body(raw: bytes | bytearray, max_depth: int = MAX_DEPTH) -> dict[str, Any]:
    body = _loads(raw, max_depth)
    if _depth_exceeds(body, max_depth, raw):
        raise _too_deep(max_depth)
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    return body


def _loads(raw: bytes | bytearray, max_depth: int) -> Any:
    """msgspec's decoder (a vLLM dependency) on the bytes: it accepts strict UTF-8 JSON only, a
    subset of what json.loads accepts, and gives equal values for it. What it refuses (bad UTF-8,
    syntax errors, NaN, 1e400, escaped lone surrogates) takes the standard library's path, so every
    body parses, or fails, with the values and messages it always had. It is the faster of the two
    on large bodies (bench/results/json_body.md), and makes no str of the whole body."""
    try:
        return msgspec.json.decode(raw)
    except RecursionError:
        raise _too_deep(max_depth) from None
    except msgspec.DecodeError:
        pass
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise bad_request(f"request body is not valid UTF-8 (byte {err.start})", code="invalid_json") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        # err's message names only a position, never echoes the body.
        raise bad_request(f"request body is not valid JSON: {err}", code="invalid_json") from None
    except RecursionError:
        raise _too_deep(max_depth) from None


def _too_deep(max_depth: int):
    return bad_request(f"request body is nested deeper than {max_depth} levels", code="invalid_json")


def _may_exceed(raw: bytes, max_depth: int) -> bool:
    # Cheap (C-speed) bound: nesting needs at least that many opening brackets.
    return raw.count(b"[") + raw.count(b"{") > max_depth


def _depth_exceeds(value: Any, max_depth: int, raw: bytes) -> bool:
    """Level by level over non-empty containers: no recursion on hostile input, and no
    per-node bookkeeping. A chat body has a few dozen elements, walked in microseconds; past
    WALK_BUDGET of them (a body of millions of `[]`) the brackets in `raw` bound the depth first,
    at C speed. Only then: that count costs time per MB, paid by every image body otherwise."""
    level = [value] if isinstance(value, (dict, list)) else []
    depth, visited, bounded = 1, 0, False
    while level:
        visited += sum(map(len, level))
        if visited > WALK_BUDGET and not bounded:
            if not _may_exceed(raw, max_depth):
                return False
            bounded = True
        children = [
            c
            for node in level
            for c in (node.values() if isinstance(node, dict) else node)
            if isinstance(c, (dict, list))
        ]
        if children and depth == max_depth:
            return True
        level = [c for c in children if c]  # an empty container adds no deeper level
        depth += 1
    return False
