"""The load client: sends a workload's conversations to an OpenAI-compatible
server and records, per request, TTFT at the first streamed chunk (as vLLM's
own bench client does), end-to-end latency and output tokens. Answers asked for
whole (`stream=False`) have their end-to-end latency as TTFT.

Two load shapes:
  closed loop  `concurrency` clients, each sends its next conversation as soon as
               the previous one ends (saturation throughput)
  open loop    conversations start at Poisson arrival times of a given rate,
               whatever is still in flight (latency under a fixed offered load)

Several base URLs are used round-robin per request, as a plain load balancer
in front of independent servers would.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import aiohttp

from bench.harness.workloads import (
    Conversation,
    Workload,
    WorkloadFactory,
    chat_messages,
)


@dataclass
class RequestRecord:
    conversation: int
    turn: int
    start_s: float  # since the start of the load point
    ok: bool
    status: int = 0
    ttft_s: float | None = None
    latency_s: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, where the server reports it
    resent: bool = False  # upload-free: the uuid missed and the bytes were sent again
    error: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Answer:
    status: int
    ttft_s: float | None = None
    text: str = ""
    usage: dict | None = None
    error: str = ""


class LoadClient:
    def __init__(
        self,
        base_urls: list[str],
        model: str,
        timeout_s: float = 600,
        headers: dict | None = None,
        extra_body: dict | None = None,
        stream: bool = True,
    ):
        self.base_urls = base_urls
        self.stream = stream
        self.model = model
        self.headers = headers or {}  # on every request (e.g. Authorization: Bearer <a tenant's key>)
        self.extra_body = extra_body or {}  # in every request's body (e.g. vLLM's ignore_eos)
        self._next_url = itertools.cycle(base_urls)
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def _post(
        self, session: aiohttp.ClientSession, messages: list[dict], max_tokens: int, start: float
    ) -> _Answer:
        """One request; TTFT counts from `start`, the user's first attempt."""
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": self.stream,
            **self.extra_body,
        }
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        url = f"{next(self._next_url)}/v1/chat/completions"
        async with session.post(url, json=body, headers=self.headers) as response:
            if response.status != 200:
                return _Answer(response.status, error=(await response.text())[:300])
            answer = _Answer(200)
            if not self.stream:
                whole = await response.json()
                if not whole.get("choices"):
                    return _Answer(200, error=json.dumps(whole)[:300])
                answer.ttft_s = time.perf_counter() - start
                answer.text = whole["choices"][0]["message"].get("content") or ""
                answer.usage = whole.get("usage")
                return answer
            text = []
            buffer = b""
            async for piece in response.content.iter_any():
                buffer += piece
                *events, buffer = buffer.split(b"\n\n")
                for event in events:
                    data = event.strip().removeprefix(b"data:").strip()
                    if not data or data == b"[DONE]":
                        continue
                    chunk = json.loads(data)
                    if "error" in chunk:
                        answer.error = json.dumps(chunk["error"])[:300]
                    if chunk.get("choices"):
                        if answer.ttft_s is None:
                            answer.ttft_s = time.perf_counter() - start
                        text.append(chunk["choices"][0].get("delta", {}).get("content") or "")
                    if chunk.get("usage"):
                        answer.usage = chunk["usage"]
            answer.text = "".join(text)
            return answer

    async def conversation(
        self, session: aiohttp.ClientSession, index: int, conv: Conversation, max_tokens: int, t0: float
    ) -> list[RequestRecord]:
        records, history = [], []
        for turn_index, turn in enumerate(conv.turns):
            upload_free = conv.upload_free and turn.image is not None
            messages = chat_messages(history, turn, not upload_free)  # (making a clip's bytes is not the server's time)
            start = time.perf_counter()
            record = RequestRecord(index, turn_index, start - t0, ok=False)
            try:
                answer = await self._post(session, messages, max_tokens, start)
                if upload_free and 400 <= answer.status < 500:
                    record.resent = True  # a cache miss: send the bytes with the same uuid
                    answer = await self._post(session, chat_messages(history, turn, True), max_tokens, start)
                record.status = answer.status
                record.error = answer.error
                if answer.status == 200 and not answer.error and answer.ttft_s is not None:
                    record.ok = True
                    record.ttft_s = answer.ttft_s
                    record.latency_s = time.perf_counter() - start
                    usage = answer.usage or {}
                    record.output_tokens = usage.get("completion_tokens", 0)
                    record.prompt_tokens = usage.get("prompt_tokens", 0)
                    record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as err:
                record.error = f"{type(err).__name__}: {err}"[:300]
            records.append(record)
            if not record.ok:
                break  # the rest of a conversation needs this turn's answer
            history = chat_messages(history, turn, True) + [{"role": "assistant", "content": answer.text}]
        return records

    async def closed_loop(
        self, workload: Workload, concurrency: int, duration_s: float | None = None, t0: float | None = None
    ) -> tuple[list[RequestRecord], float]:
        """duration_s: start no conversation after this many seconds (those in flight finish), even if
        the workload has more; t0: the time.perf_counter() that records' start_s count from (default: now)."""
        queue = list(enumerate(workload.conversations))[::-1]
        records: list[RequestRecord] = []
        async with self._session(concurrency) as session:
            started = time.perf_counter()
            t0 = started if t0 is None else t0

            async def worker():
                while queue and (duration_s is None or time.perf_counter() - started < duration_s):
                    index, conv = queue.pop()
                    records.extend(await self.conversation(session, index, conv, workload.max_tokens, t0))

            await asyncio.gather(*(worker() for _ in range(concurrency)))
            return records, time.perf_counter() - started

    async def closed_loop_until(
        self,
        conversations: Iterable[tuple[int, Conversation]],
        max_tokens: int,
        concurrency: int,
        stop: Callable[[], bool],
    ) -> tuple[list[RequestRecord], float]:
        """Closed loop over (index, conversation) pairs, e.g. an endless generator, until `stop()`
        is true or they run out; conversations in progress finish. `records` fill as they end."""
        source = iter(conversations)
        records: list[RequestRecord] = []
        async with self._session(concurrency) as session:
            t0 = time.perf_counter()

            async def worker():
                for index, conv in source:  # one shared iterator: each conversation goes to one worker
                    if stop():
                        return
                    records.extend(await self.conversation(session, index, conv, max_tokens, t0))

            await asyncio.gather(*(worker() for _ in range(concurrency)))
            return records, time.perf_counter() - t0

    async def open_loop(self, workload: Workload, rate: float, seed: int) -> tuple[list[RequestRecord], float]:
        rng = random.Random(seed)
        records: list[RequestRecord] = []
        async with self._session(len(workload.conversations)) as session:
            t0 = time.perf_counter()
            tasks, at = [], 0.0
            for index, conv in enumerate(workload.conversations):
                delay = at - (time.perf_counter() - t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.ensure_future(self.conversation(session, index, conv, workload.max_tokens, t0)))
                at += rng.expovariate(rate)
            for done in await asyncio.gather(*tasks):
                records.extend(done)
            return records, time.perf_counter() - t0

    def _session(self, connections: int) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(timeout=self.timeout, connector=aiohttp.TCPConnector(limit=max(1, connections)))


def warm_up(client: LoadClient, factory: WorkloadFactory) -> dict:
    """Two sequential requests, then four at once: first-request costs stay out of the figures,
    and a system that fails a cold concurrent burst shows it here."""
    warm = WorkloadFactory(factory.seed + 7919, factory.small_px, factory.prompt_words, factory.max_tokens)
    first, _ = asyncio.run(client.closed_loop(warm.unique(2), 1))
    burst, _ = asyncio.run(client.closed_loop(warm.zipf(8, repeat_share=0.5, pool=2), 4))
    failed = [r for r in first + burst if not r.ok]
    return {
        "requests": len(first) + len(burst),
        "failed": len(failed),
        "errors": sorted({f"{r.status} {r.error[:160]}" for r in failed})[:3],
    }
