"""One request's stream of DecodeChunks from LLMDecode, opened with its first chunk in hand:
an error the engine answers with becomes the response's status code, even for a
streamed answer. Whoever stops reading (the deadline, a client that left) cancels
the decode request with it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from ray.serve.handle import DeploymentHandle

from pipeline.stage_io import DecodeChunk, DecodeRequest


class DecodeStream:
    def __init__(self, first: DecodeChunk, rest):
        self.first = first
        self._rest = rest  # Serve's streaming response

    @classmethod
    async def open(cls, decode: DeploymentHandle, request: DecodeRequest) -> DecodeStream:
        """The stream, once its first chunk is here; raises the error that chunk carries."""
        rest = decode.options(stream=True).generate.remote(request)
        try:
            first = await rest.__anext__()
        except BaseException:
            rest.cancel()
            raise
        stream = cls(first, rest)
        if first.error:
            stream.cancel()
            raise first.error
        return stream

    def cancel(self) -> None:
        self._rest.cancel()

    async def chunks(self, deadline: float) -> AsyncIterator[DecodeChunk]:
        """Every chunk, the first included, while the event loop's clock is before `deadline`;
        TimeoutError after. Closing it cancels the decode request. (The timeout scope never
        spans a yield: the consumer awaits other things in between, e.g. the client.)"""
        try:
            yield self.first
            while True:
                async with asyncio.timeout_at(deadline):
                    try:
                        chunk = await self._rest.__anext__()
                    except StopAsyncIteration:
                        return
                yield chunk
        finally:
            self._rest.cancel()
