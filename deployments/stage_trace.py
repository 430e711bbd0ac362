"""Stage timestamps, for bench/stage_timeline.py: where the milliseconds of one
request go, stage by stage, across Iris's processes.

Off unless the environment variable IRIS_STAGE_TRACE names a file when the
process starts; then `mark` appends one JSON line per stage boundary to it (wall
clock, so the processes of one node agree). Off, it costs one truth test.
"""

from __future__ import annotations

import json
import os
import time

TRACE_FILE = os.environ.get("IRIS_STAGE_TRACE")


def mark(stage: str, ref: str = "") -> None:
    """Record that this process reached `stage` (e.g. "encoder.forward_end") for `ref`
    (a request id or an image key, for reading the trace)."""
    if TRACE_FILE:
        with open(TRACE_FILE, "a") as f:
            f.write(json.dumps({"t": time.time(), "stage": stage, "ref": ref, "pid": os.getpid()}) + "\n")
