"""One call's stream of messages from LLMDecode, opened with its first message in hand
(DecodeOpened: the answer's status, its body unless it streams, or Iris's outcome: keys to
compute again, a rolling update). Whoever stops reading (the deadline, a client that left)
cancels the decode call with it.

The call carries the request's first image key as Serve's `session_id`, which Iris's
request router reads (deployments/image_affinity_router.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable

from ray.serve.handle import DeploymentHandle

from deployments.affinity import affinity_key
from pipeline.stage_io import DecodeCall, DecodeOpened


class DecodeStream:
    def __init__(self, first: DecodeOpened, rest):
        self.first = first
        self._rest = rest  # Serve's streaming response

    @classmethod
    async def open(cls, decode: DeploymentHandle, call: DecodeCall, alongside: Awaitable | None = None) -> DecodeStream:
        """The stream, once its first message is here. Opened while `alongside` (the request's
        encodes) finishes, whose failure (a bad video, a dead replica) is the request's answer,
        whatever the decoder made of it."""
        if alongside is None:
            return await cls._open(decode, call)
        opening = asyncio.ensure_future(cls._open(decode, call))
        try:
            await alongside
        except BaseException:
            opening.cancel()
            if opening.done() and not opening.cancelled() and opening.exception() is None:
                opening.result().cancel()
            raise
        return await opening

    @classmethod
    async def _open(cls, decode: DeploymentHandle, call: DecodeCall) -> DecodeStream:
        rest = decode.options(stream=True, session_id=session_of(call)).generate.remote(call)
        try:
            first = await rest.__anext__()
        except BaseException:
            rest.cancel()
            raise
        return cls(first, rest)

    def cancel(self) -> None:
        self._rest.cancel()

    async def messages(self, deadline: float) -> AsyncIterator:
        """Every message after the first, while the event loop's clock is before `deadline`;
        TimeoutError after. Closing it cancels the decode call. (The timeout scope never
        spans a yield: the consumer awaits other things in between, e.g. the client.)"""
        try:
            while True:
                async with asyncio.timeout_at(deadline):
                    try:
                        message = await self._rest.__anext__()
                    except StopAsyncIteration:
                        return
                yield message
        finally:
            self._rest.cancel()


def session_of(call: DecodeCall) -> str:
    """The decode call's Serve `session_id`: the key its affinity router places it by ("": none)."""
    return affinity_key(call.media_keys) or ""
