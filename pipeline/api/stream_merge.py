"""A stream's items (vLLM's SSE events) merged into lists, one per Ray message: one message per
token costs more than the token on a busy node (LLMDecode's `stream_interval_s`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

_END = object()


async def merged_outputs(
    outputs: AsyncIterator, interval_s: float, last: Callable[[object], bool] = lambda out: out.finished
) -> AsyncIterator[list]:
    """Items in lists: the first alone at once, then whatever arrived while the previous
    list was sent, at most one list per `interval_s`; the `last` item goes as soon as it
    arrives (waiting would only delay the answer)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    last_queued = asyncio.Event()  # the finished output, the end or an error is in the queue

    async def pump():
        try:
            async for out in outputs:
                queue.put_nowait(out)
                if last(out):
                    last_queued.set()
            queue.put_nowait(_END)
        except Exception as err:  # e.g. vLLM's input validation: re-raised to the consumer
            queue.put_nowait(err)
        last_queued.set()

    task = asyncio.ensure_future(pump())
    last_sent = None
    try:
        while True:
            batch = [await queue.get()]
            wait = 0 if last_sent is None else last_sent + interval_s - loop.time()
            if wait > 0 and not last_queued.is_set():
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(last_queued.wait(), wait)
            while not queue.empty():
                batch.append(queue.get_nowait())
            end = batch[-1] is _END or isinstance(batch[-1], Exception)
            outs = batch[:-1] if end else batch
            if outs:
                yield outs
                last_sent = loop.time()
            if end:
                if isinstance(batch[-1], Exception):
                    raise batch[-1]
                return
    finally:
        task.cancel()  # the client went away: cancelling generate() aborts the request in vLLM
