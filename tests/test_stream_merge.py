"""LLMDecode's merging of engine outputs into stream chunks (no engine needed)."""

import asyncio
import time
from dataclasses import dataclass

from pipeline.api.stream_merge import merged_outputs as _merged


@dataclass
class Out:
    n: int
    finished: bool = False


async def _engine(schedule):
    """Yields each output at its time (seconds from the start)."""
    start = time.perf_counter()
    for at, out in schedule:
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
        yield out


async def _collect(schedule, interval_s):
    start, got = time.perf_counter(), []
    async for outs in _merged(_engine(schedule), interval_s):
        got.append(([o.n for o in outs], time.perf_counter() - start))
    return got


async def test_first_alone_then_merged_per_interval():
    got = await _collect([(0, Out(1)), (0.01, Out(2)), (0.02, Out(3)), (0.5, Out(4, finished=True))], 0.2)
    assert [ns for ns, _ in got] == [[1], [2, 3], [4]]
    assert got[1][1] >= 0.19  # held back for the interval after the first


async def test_last_output_is_not_held_back():
    got = await _collect([(0, Out(1)), (0.01, Out(2)), (0.03, Out(3, finished=True))], 1.0)
    assert [ns for ns, _ in got] == [[1], [2, 3]]
    assert got[-1][1] < 0.5  # not after the 1 s interval: the answer is complete at 30 ms


async def test_engine_error_reaches_the_consumer():
    async def failing():
        yield Out(1)
        raise ValueError("bad schema")

    got = []
    try:
        async for outs in _merged(failing(), 0.01):
            got.append([o.n for o in outs])
    except ValueError as err:
        assert str(err) == "bad schema"
    else:
        raise AssertionError("the engine's error was swallowed")
    assert got == [[1]]
