"""One request's images on the wire: ids for the images sent before, bytes for the rest, and
after a 409 mm_cache_miss the bytes of exactly the images the server listed.

Indexes are the server's: every image_url / video_url part in message order (the client's
`image` parts become image_url parts), as Iris counts them in `missing`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import httpx

from iris_client.content import Loaded, content_uuid, data_url, load
from iris_client.report import Report
from iris_client.sent import SentKeys

_MEDIA_PARTS = ("image_url", "video_url")


@dataclass
class Item:
    index: int
    message: int
    part: int
    uuid: str | None  # what goes as the part's uuid; None: sent as it is every time
    source: object = None  # what the caller gave (loaded lazily); None: a part passed through
    loaded: Loaded | None = None
    detail: str | None = None
    full: bool = True  # sent with its bytes (or URL) in the attempt being built
    passthrough: dict | None = None  # the caller's own image_url/video_url part, unchanged
    size: int = 0  # characters of the URL sent for it


class Plan:
    def __init__(self, messages: list, scope: str, sent: SentKeys, fetch_urls: bool, http: httpx.Client | None):
        self.scope, self.sent, self.fetch_urls, self.http = scope, sent, fetch_urls, http
        self.wire: list = []
        self.items: list[Item] = []
        self.report = Report()
        for mi, message in enumerate(messages):
            content = message.get("content") if isinstance(message, dict) else None
            if not isinstance(content, list):
                self.wire.append(message)
                continue
            parts = []
            for pi, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "image":
                    self.items.append(self._image(part, mi, pi))
                elif kind in _MEDIA_PARTS:
                    self.items.append(Item(len(self.items), mi, pi, part.get("uuid"), passthrough=part))
                parts.append(part)
            self.wire.append({**message, "content": parts})
        self.report.images = len(self.items)

    def _image(self, part: dict, mi: int, pi: int) -> Item:
        if "image" not in part:
            raise ValueError(
                f"messages[{mi}].content[{pi}]: an 'image' part needs 'image' (bytes, a path, "
                "a PIL image, a URL, or None with a uuid sent before)"
            )
        item = Item(len(self.items), mi, pi, part.get("uuid"), part["image"], detail=part.get("detail"))
        if item.uuid is None:
            if item.source is None:
                raise ValueError(f"messages[{mi}].content[{pi}]: an image of None needs a uuid")
            item.loaded = self._load(item)
            if item.loaded.data is not None:  # named by its content: the server's own key for it
                item.uuid = content_uuid(item.loaded.data)
        # Optimistic: an id the server was sent before goes alone.
        item.full = item.uuid is None or self._sent_size(item) is None
        if item.full and item.source is None:
            item.full = False  # the caller has no bytes: upload-free or nothing (a 409 then raises)
        return item

    def _load(self, item: Item) -> Loaded:
        if item.loaded is None:
            item.loaded = load(item.source, self.fetch_urls, self.http)
        return item.loaded

    def _sent_size(self, item: Item) -> int | None:
        return self.sent.get((self.scope, item.uuid)) if item.uuid is not None else None

    def messages(self) -> list:
        """The messages of the next attempt."""
        wire = copy.copy(self.wire)
        for item in self.items:
            if item.passthrough is not None:
                continue
            message = wire[item.message] = {**wire[item.message], "content": list(wire[item.message]["content"])}
            message["content"][item.part] = self._part(item)
        return wire

    def _part(self, item: Item) -> dict:
        if not item.full:
            item.size = self._sent_size(item) or 0  # what the id stands for
            return {"type": "image_url", "image_url": None, "uuid": item.uuid}
        loaded = self._load(item)
        url = data_url(loaded.data) if loaded.data is not None else loaded.url
        image_url = {"url": url} if item.detail is None else {"url": url, "detail": item.detail}
        self.report.bytes_sent += len(url)
        part = {"type": "image_url", "image_url": image_url}
        if item.uuid is not None:
            part["uuid"] = item.uuid
        item.size = len(url)
        return part

    def resend(self, missing: list[int]) -> list[int]:
        """Mark `missing` to go with their bytes; the indexes that cannot (already sent with
        them, passed through, or nothing to send): the request cannot succeed."""
        for i in missing:
            if 0 <= i < len(self.items) and self.items[i].uuid is not None:
                self.sent.discard((self.scope, self.items[i].uuid))
        hopeless = [
            i
            for i in missing
            if not (0 <= i < len(self.items))
            or self.items[i].full
            or self.items[i].passthrough is not None
            or self.items[i].source is None
        ]
        if not hopeless:
            for i in missing:
                self.items[i].full = True
            self.report.resent = sorted(missing)
            self.report.attempts += 1
        return hopeless

    def answered(self) -> Report:
        """The request was answered: what was sent is known to the server now; what it saved."""
        for item in self.items:
            if item.passthrough is not None:
                if item.passthrough.get(item.passthrough["type"]) is None:
                    self.report.sent_as_id += 1  # the caller's own upload-free part
                continue
            if item.full:
                if item.uuid is not None:
                    self.sent.add((self.scope, item.uuid), item.size)
            else:
                self.report.sent_as_id += 1
                self.report.bytes_saved += item.size
        return self.report
