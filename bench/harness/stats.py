"""The one percentile of bench/, and the timing loops built on it."""

from __future__ import annotations

import statistics
import time
from collections.abc import Awaitable, Callable, Iterable


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0 to 100) with linear interpolation between the closest ranks, as
    numpy's default; percentile(v, 50) is the median. None for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside 0..100")
    k = (len(ordered) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def distribution(values: list[float], scale: float = 1.0, qs: tuple[int, ...] = (50, 90, 99)) -> dict:
    """{"p50": ..., "p90": ..., "p99": ..., "mean": ...} of values × scale (e.g. 1000: seconds to ms)."""
    out: dict = {f"p{q:g}": _scaled(percentile(values, q), scale) for q in qs}
    out["mean"] = statistics.fmean(values) * scale if values else None
    return out


def median_and_range(values: Iterable[float | None], digits: int = 3) -> dict:
    """{"median", "min", "max"} of the values that are not None (rounded; None for none): how the
    benchmarks that alternate systems in rounds report a per-round ratio."""
    present = [v for v in values if v is not None]
    if not present:
        return {"median": None, "min": None, "max": None}
    return {
        "median": round(percentile(present, 50), digits),
        "min": round(min(present), digits),
        "max": round(max(present), digits),
    }


def _scaled(value: float | None, scale: float) -> float | None:
    return None if value is None else value * scale


def timed(fn: Callable[[], object], iters: int, warmup: int = 3) -> list[float]:
    """Seconds per call of fn, `iters` calls after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


async def timed_async(fn: Callable[[], Awaitable[object]], iters: int, warmup: int = 3) -> list[float]:
    """timed() for a coroutine function."""
    for _ in range(warmup):
        await fn()
    out = []
    for _ in range(iters):
        start = time.perf_counter()
        await fn()
        out.append(time.perf_counter() - start)
    return out
