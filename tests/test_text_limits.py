"""A request's text is bounded by the model's context before anything parses or tokenizes it
(deployments/request_parsing.py): a huge text message is a quick 400 `context_length_exceeded`
and never stalls the streams of other requests (issue 42).

On the tenants app of tests/test_serving_tenants.py (conftest's APP_SHARING_ORDER runs this module
after it): the tiny LLaVA with max_model_len 2048, two ingress replicas and the default media
limits, whose body cap (~193 MiB) lets a 150 MB text body in."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import httpx
import pytest

from deployments.config import IrisConfig
from deployments.request_parsing import TEXT_SLACK_BYTES
from tests.support.images import REFERENCE_TEXT, data_url, image_part, unique_png

MAX_MODEL_LEN = 2048  # the tenants app's engine_args
TEXT_CAP = MAX_MODEL_LEN * IrisConfig().max_text_bytes_per_token + TEXT_SLACK_BYTES
HUGE_BYTES = 150_000_000
MAX_GAP_S = 0.2


@pytest.fixture(scope="module")
def app(iris_apps, tiny_checkpoint):
    from tests.test_serving_tenants import APP, CONFIG, app_args

    with iris_apps.use(
        APP, app_args(tiny_checkpoint("llava")), route_prefix="/tenants", config=CONFIG, keep=True
    ) as running:
        yield running


@pytest.fixture(scope="module")
def key():
    from tests.test_serving_tenants import KEYS

    return KEYS["beta"]  # a tenant without limits


def _post(app, key: str, path: str, raw: bytes, timeout: float = 300) -> httpx.Response:
    return httpx.post(
        f"{app.url}{path}",
        content=raw,
        timeout=timeout,
        headers={"authorization": f"Bearer {key}", "content-type": "application/json"},
    )


def _chat_body(text: str, size: int | None = None) -> bytes:
    """A text-only chat body; with `size`, its text padded so that the body is exactly `size` bytes."""

    def body(t: str) -> bytes:
        return json.dumps({"messages": [{"role": "user", "content": t}], "max_tokens": 2}).encode()

    if size is None:
        return body(text)
    raw = body(text + "x" * (size - len(body(text))))
    assert len(raw) == size
    return raw


def _assert_context_length_exceeded(r: httpx.Response, param: str = "messages") -> None:
    assert r.status_code == 400, (r.status_code, r.text[:500])
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["type"] == "invalid_request_error", error
    assert error["param"] == param and f"{MAX_MODEL_LEN} tokens" in error["message"], error


# Posts a file's bytes from a process of its own, so that sending them holds no lock of the test
# process's, whose threads time the streams. Reads the file, says so, and posts once told to (its
# start-up and the read do not compete with the streams being timed); prints when it sent and when
# the answer came (time.monotonic is the system's clock, the same in both processes), then the answer.
# At the lowest priority: a client does not share the server's cores, and on the 2 cores of the test
# machine, sending 150 MB at full speed alone stretched the streams' chunks to 243 ms (CI, stop 49);
# niced, four rounds alone on this machine: the longest gap 74 ms.
POSTER = """
import json, os, sys, time, httpx
os.nice(19)
url, key, path = sys.argv[1:]
raw = open(path, "rb").read()
client = httpx.Client(timeout=300, headers={"authorization": f"Bearer {key}", "content-type": "application/json"})
print("ready", flush=True)
sys.stdin.readline()
started = time.monotonic()
r = client.post(url, content=raw)
print(json.dumps([started, time.monotonic(), r.status_code, r.text]), flush=True)
"""


class Poster:
    def __init__(self, app, key: str, path: str, raw_file):
        self.process = subprocess.Popen(
            [sys.executable, "-c", POSTER, f"{app.url}{path}", key, str(raw_file)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout.readline().strip() == "ready"

    def post(self) -> tuple[float, float, int, str]:
        """(sent, answered, status, body)"""
        out, _ = self.process.communicate("go\n", timeout=300)
        assert self.process.returncode == 0, out
        return tuple(json.loads(out.strip().splitlines()[-1]))


class Stream(threading.Thread):
    """A long completion stream, read in a thread of its own; `arrivals`: when each chunk came."""

    def __init__(self, app, key: str):
        super().__init__(daemon=True)
        self.app, self.key = app, key
        self.arrivals: list[float] = []
        self.chunks: list[str] = []
        self.status: int | None = None
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self):
        body = {
            "prompt": "Once upon a time",
            "max_tokens": 1900,
            "min_tokens": 1900,
            "ignore_eos": True,
            "stream": True,
        }
        try:
            with httpx.stream(
                "POST",
                f"{self.app.url}/v1/completions",
                json=body,
                timeout=300,
                headers={"authorization": f"Bearer {self.key}"},
            ) as r:
                self.status = r.status_code
                for chunk in r.iter_text():
                    self.arrivals.append(time.monotonic())
                    self.chunks.append(chunk)
                    if self.stop.is_set():
                        return
        except BaseException as err:  # reported by the test
            self.error = err

    def gaps_within(self, start: float, end: float) -> list[float]:
        """Gaps between consecutive chunks, of those that end within [start, end]."""
        a = self.arrivals
        return [a[i] - a[i - 1] for i in range(1, len(a)) if start <= a[i] and a[i - 1] <= end]

    def gaps_before(self, start: float, end: float) -> list[float]:
        """Gaps between consecutive chunks that both came within [start, end]."""
        a = self.arrivals
        return [a[i] - a[i - 1] for i in range(1, len(a)) if start <= a[i - 1] and a[i] <= end]


def test_150_mb_text_beside_running_streams_is_a_quick_400_and_stalls_nothing(app, key, tmp_path):
    """Two streams (one per ingress replica, as the proxy spreads them) run while a 150 MB text
    message arrives: their chunks keep coming at most 200 ms apart, the huge one is a 400 in
    OpenAI's shape, nothing answers 5xx, and the replicas answer afterwards."""
    huge = tmp_path / "huge.json"
    huge.write_bytes(_chat_body("", HUGE_BYTES))
    poster = Poster(app, key, "/v1/chat/completions", huge)
    streams = [Stream(app, key) for _ in range(2)]
    for s in streams:
        s.start()
    deadline = time.monotonic() + 120
    while not all(len(s.arrivals) >= 5 for s in streams):
        assert time.monotonic() < deadline and not any(s.error for s in streams), [s.error for s in streams]
        time.sleep(0.05)
    time.sleep(1.0)  # the streams' own pace before (1 s: their 1900 tokens must outlast the huge request)
    started, answered, status, text = poster.post()
    r = httpx.Response(status, text=text)
    time.sleep(1.0)  # and just after: what the huge request left behind on the replicas
    for s in streams:
        s.stop.set()
    for s in streams:
        s.join(60)
    try:
        gaps = [g for s in streams for g in s.gaps_within(started, answered + 1.0)]
        before = [g for s in streams for g in s.gaps_before(started - 1.0, started)]
        print(
            f"150 MB text: answered {r.status_code} {r.text[:300]!r} in {answered - started:.2f} s; stream gaps "
            f"meanwhile: the 5 longest (ms) {[round(g * 1000) for g in sorted(gaps)[-5:]]} of {len(gaps)} "
            f"(the 1 s before: {[round(g * 1000) for g in sorted(before)[-5:]]} of {len(before)}); "
            f"streams ended {[round(s.arrivals[-1] - answered, 2) for s in streams]} s after the answer"
        )
        for s in streams:
            assert s.error is None and s.status == 200, (s.status, s.error)
            assert s.arrivals[-1] > answered + 0.5, "a stream ended before the huge request was answered"
        assert max(gaps) < MAX_GAP_S, sorted(gaps)[-5:]
        _assert_context_length_exceeded(r)
    finally:
        huge.unlink()
    after = _post(app, key, "/v1/chat/completions", _chat_body(REFERENCE_TEXT))
    assert after.status_code == 200, after.text
    assert httpx.get(f"{app.url}/health", timeout=30).status_code == 200


def test_a_text_just_over_the_cap_is_refused_before_vllm_and_one_under_it_reaches_vllm(app, key):
    over = _post(app, key, "/v1/chat/completions", _chat_body("", TEXT_CAP + 1))
    _assert_context_length_exceeded(over)
    # At the cap: parsed and handed to vLLM, whose own length check refuses it (2048 tokens are
    # fewer than 98 KiB of text), in vLLM's shape.
    under = _post(app, key, "/v1/chat/completions", _chat_body("", TEXT_CAP))
    assert under.status_code == 400, under.text[:500]
    assert under.json()["error"]["type"] == "BadRequestError", under.text[:500]
    assert "maximum context length is 2048 tokens" in under.json()["error"]["message"]
    # Every route that takes text: completions, the Responses API, /tokenize.
    for path, field, param in (
        ("/v1/completions", "prompt", "prompt"),
        ("/v1/responses", "input", "input"),
        ("/tokenize", "prompt", "prompt"),
    ):
        raw = json.dumps({field: "x" * TEXT_CAP}).encode()
        _assert_context_length_exceeded(_post(app, key, path, raw), param)


def test_text_that_looks_like_a_data_url_is_text(app, key):
    """Base64 images and videos do not count as text; a text part that starts with `data:` does,
    once the parsed body shows it is no media part."""
    fake = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "data:" + "x" * TEXT_CAP}]}],
        "max_tokens": 2,
    }
    _assert_context_length_exceeded(_post(app, key, "/v1/chat/completions", json.dumps(fake).encode()))
    # A real image beside a short text: its base64 (over the text cap) is not text.
    image = image_part(data_url(unique_png(size=(320, 320))))
    assert len(image["image_url"]["url"]) > TEXT_CAP
    body = {
        "messages": [{"role": "user", "content": [image, {"type": "text", "text": REFERENCE_TEXT}]}],
        "max_tokens": 2,
    }
    r = _post(app, key, "/v1/chat/completions", json.dumps(body).encode())
    assert r.status_code == 200, r.text[:500]
