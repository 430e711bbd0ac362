"""What the client saved: per request (`response.iris`, the `on_report` callback) and in total."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class Report:
    images: int = 0  # image items in the request (the client's and passed-through ones)
    sent_as_id: int = 0  # sent by uuid only and answered without their bytes
    bytes_sent: int = 0  # characters of image data: URLs sent, resends included
    bytes_saved: int = 0  # characters of data: URLs not sent (the images answered by id)
    resent: list[int] = field(default_factory=list)  # indexes resent with their bytes after a 409
    attempts: int = 1  # 2 when the server asked for a resend


@dataclass
class Totals:
    """Running totals of a client (all its requests that got an answer)."""

    requests: int = 0
    resends: int = 0  # requests that needed a resend
    images: int = 0
    sent_as_id: int = 0
    bytes_sent: int = 0
    bytes_saved: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, report: Report) -> None:
        with self._lock:
            self.requests += 1
            self.resends += report.attempts > 1
            self.images += report.images
            self.sent_as_id += report.sent_as_id
            self.bytes_sent += report.bytes_sent
            self.bytes_saved += report.bytes_saved
