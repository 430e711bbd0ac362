"""One request's stream of DecodeChunks from LLMDecode, opened with its first chunk in hand:
an error the engine answers with becomes the response's status code, even for a
streamed answer. Whoever stops reading (the deadline, a client that left) cancels
the decode request with it.

The call carries the request's first image key as Serve's `session_id`, which Iris's
request router reads (deployments/image_affinity_router.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable

from ray.serve.handle import DeploymentHandle

from deployments.affinity import affinity_key
from pipeline.stage_io import DecodeChunk, DecodeRequest


class DecodeStream:
    def __init__(self, first: DecodeChunk, rest):
        self.first = first
        self._rest = rest  # Serve's streaming response

    @classmethod
    async def open(cls, decode: DeploymentHandle, request: DecodeRequest,
                   alongside: Awaitable | None = None) -> DecodeStream:
        """The stream, once its first chunk is here; raises the error that chunk carries. Opened while
        `alongside` (the request's encodes) finishes, whose failure (a bad video, a dead replica) is
        the request's answer, whatever the decoder made of it."""
        if alongside is None:
            return await cls._open(decode, request)
        opening = asyncio.ensure_future(cls._open(decode, request))
        try:
            await alongside
        except BaseException:
            opening.cancel()
            if opening.done() and not opening.cancelled() and opening.exception() is None:
                opening.result().cancel()
            raise
        return await opening

    @classmethod
    async def _open(cls, decode: DeploymentHandle, request: DecodeRequest) -> DecodeStream:
        rest = decode.options(stream=True, session_id=session_of(request)).generate.remote(request)
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


def session_of(request: DecodeRequest) -> str:
    """The decode call's Serve `session_id`: the key its affinity router places it by ("": none)."""
    return affinity_key(request.media_keys) or ""
