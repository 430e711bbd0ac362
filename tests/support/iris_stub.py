"""A stand-in for Iris's upload-free surface, for the client's fast tests: remembers the uuids
each API key sent with bytes, answers 409 mm_cache_miss (Iris's shape) for unknown ids sent
alone, and records every body. The real app's behaviour is tests/test_client.py's."""

from __future__ import annotations

import base64
import json
import threading

from blake3 import blake3

from tests.support.http_server import QuietHandler


class IrisStub:
    def __init__(self):
        self.known: set[tuple[str, str]] = set()  # (authorization, uuid)
        self.bodies: list[dict] = []
        self.lock = threading.Lock()

    def handler(self) -> type[QuietHandler]:
        stub = self

        class Handler(QuietHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                status, answer = stub.answer(body, self.headers.get("authorization", ""))
                if status == 200 and body.get("stream"):
                    chunk = {
                        "id": "c",
                        "object": "chat.completion.chunk",
                        "created": 0,
                        "model": "m",
                        "choices": [
                            {
                                "index": 0,
                                "delta": {"content": answer["choices"][0]["message"]["content"]},
                                "finish_reason": "stop",
                            }
                        ],
                    }
                    data = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()
                    return self._send(200, data, [("content-type", "text/event-stream")])
                self._send(status, json.dumps(answer).encode(), [("content-type", "application/json")])

        return Handler

    def answer(self, body: dict, auth: str) -> tuple[int, dict]:
        with self.lock:
            self.bodies.append(body)
            parts = [
                p
                for m in body["messages"]
                if isinstance(m.get("content"), list)
                for p in m["content"]
                if p.get("type") in ("image_url", "video_url")
            ]
            missing, learned = [], []
            for i, part in enumerate(parts):
                uid, url = part.get("uuid"), (part.get("image_url") or {}).get("url")
                if url is None:
                    if (auth, uid) not in self.known:
                        missing.append(i)
                    continue
                if uid is not None and uid.startswith("blake3:") and url.startswith("data:"):
                    if uid != "blake3:" + blake3(base64.b64decode(url.split(",", 1)[1])).hexdigest():
                        return 400, {
                            "error": {
                                "message": "mismatch",
                                "type": "invalid_request_error",
                                "param": None,
                                "code": "invalid_content_uuid",
                            }
                        }
                learned.append((auth, uid))
            if missing:
                return 409, {
                    "error": {
                        "message": "miss",
                        "type": "invalid_request_error",
                        "param": "messages",
                        "code": "mm_cache_miss",
                        "missing": missing,
                    }
                }
            self.known.update(k for k in learned if k[1] is not None)
            return 200, {
                "id": "c",
                "object": "chat.completion",
                "created": 0,
                "model": "m",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": f"{len(parts)} images"},
                        "finish_reason": "stop",
                    }
                ],
            }
