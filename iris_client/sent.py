"""Which images this process has sent to which server: a bounded LRU of keys, shared by the
clients of a process (thread-safe), so an image sent once goes by id afterwards."""

from __future__ import annotations

import threading
from collections import OrderedDict

DEFAULT_MAX_KEYS = 100_000  # ~150 bytes each


class SentKeys:
    def __init__(self, max_keys: int = DEFAULT_MAX_KEYS):
        self.max_keys = max_keys
        # (server scope, uuid) -> characters of the data: URL that was sent for it (what sending the id saves)
        self._keys: OrderedDict[tuple[str, str], int] = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, key: tuple[str, str]) -> bool:
        return self.get(key) is not None

    def get(self, key: tuple[str, str]) -> int | None:
        """The size of what was sent under `key`, or None when it was not sent (or was forgotten)."""
        with self._lock:
            size = self._keys.get(key)
            if size is not None:
                self._keys.move_to_end(key)
            return size

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, key: tuple[str, str], size: int) -> None:
        with self._lock:
            self._keys[key] = size
            self._keys.move_to_end(key)
            while len(self._keys) > self.max_keys:
                self._keys.popitem(last=False)

    def discard(self, key: tuple[str, str]) -> None:
        with self._lock:
            self._keys.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._keys.clear()


PROCESS_SENT_KEYS = SentKeys()  # what every client of this process shares unless given its own
