"""Cold start: the first concurrent burst on a new Preprocess replica must not fail.

transformers imports lazily; several threads importing AutoImageProcessor at
once in a fresh process used to raise ImportError (issue 11: 3 of 60 requests
answered 500 right after start). Each case runs in a fresh interpreter, since
in this test process transformers is long imported and the race cannot happen.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def burst(checkpoint: str, *flags: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.support.preprocess_burst", str(checkpoint), *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["fresh"], "an image processor was imported before the burst: the test would prove nothing"
    return out


# The first preprocess of a new VisionModel loads the image processor lazily; a burst of
# them must not race on it (before a fix, a lazy burst failed in most fresh processes).
@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_concurrent_first_preprocess_has_no_errors(tiny_checkpoint, family):
    out = burst(tiny_checkpoint(family))
    assert out["errors"] == [] and out["results"] == 8, out
