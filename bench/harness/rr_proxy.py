"""A plain round-robin HTTP load balancer, for clients that take one base URL.

vLLM's own bench client (`vllm bench serve`) drives one server; a system of
several independent servers (`vllm serve` ×2) gets this in front, as a plain
load balancer would be: each request goes to the next server, its response is
streamed back as it arrives. It runs on its own event loop in a thread.

    with RoundRobinProxy(["http://127.0.0.1:8001", "http://127.0.0.1:8002"]) as proxy:
        vllm_bench.run(proxy.url, ...)
"""

from __future__ import annotations

import asyncio
import itertools
import threading

import aiohttp
from aiohttp import web

from bench.harness.systems import free_port

_FORWARDED = ("content-type", "authorization", "accept")


class RoundRobinProxy:
    def __init__(self, backends: list[str]):
        if not backends:
            raise ValueError("no backends")
        self.backends = backends
        self._next = itertools.cycle(backends)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.requests = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rr-proxy", daemon=True)
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        backend = next(self._next)
        self.requests += 1
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED}
        async with self._session.request(
            request.method, backend + request.path_qs, data=await request.read(), headers=headers
        ) as upstream:
            response = web.StreamResponse(
                status=upstream.status,
                headers={"content-type": upstream.headers.get("content-type", "application/octet-stream")},
            )
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def _start(self) -> None:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None), connector=aiohttp.TCPConnector(limit=0)
        )
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def _stop(self) -> None:
        await self._runner.cleanup()
        await self._session.close()

    def __enter__(self) -> RoundRobinProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
