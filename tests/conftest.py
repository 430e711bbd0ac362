"""Session-wide fixtures: built-in tiny checkpoints (built fresh each run),
plain-vLLM reference outputs, and one Ray cluster with Serve for the app tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.cache_fixtures import free_port
from tests.cache_fixtures import make_cache, namespace, raw_redis, redis_process  # noqa: F401  (cache-test fixtures)
from tests.support.images import REFERENCE_TEXT

ROOT = Path(__file__).resolve().parent.parent


def pytest_configure(config):
    # Fresh checkpoints every run, so builder changes are always tested; exported
    # through the environment so Ray workers started by the tests build into the same place.
    os.environ.setdefault("IRIS_CHECKPOINT_DIR", tempfile.mkdtemp(prefix="iris-test-checkpoints-"))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="session")
def tiny_checkpoint():
    from pipeline.models.source import resolve_model

    return lambda family: resolve_model(f"builtin:tiny-{family.replace('_', '-')}")


@pytest.fixture(scope="session")
def image_files(tmp_path_factory):
    from tests.support.images import SIZES, png_bytes

    folder = tmp_path_factory.mktemp("images")
    paths = {}
    for name in SIZES:
        paths[name] = folder / f"{name}.png"
        paths[name].write_bytes(png_bytes(name))
    return paths


@pytest.fixture(scope="session")
def vllm_reference(tiny_checkpoint, image_files, tmp_path_factory):
    """family -> {image name: plain-vLLM result}, one engine process per family."""
    cache: dict[str, dict] = {}

    def get(family: str) -> dict:
        if family not in cache:
            folder = tmp_path_factory.mktemp(f"reference-{family}")
            names = list(image_files)
            cases = [{"image": str(image_files[n]), "text": REFERENCE_TEXT} for n in names]
            (folder / "cases.json").write_text(json.dumps(cases))
            out = folder / "out.json"
            proc = subprocess.run(
                [sys.executable, str(ROOT / "tests/support/vllm_offline.py"), tiny_checkpoint(family),
                 str(folder / "cases.json"), str(out)],
                cwd=ROOT, capture_output=True, text=True, timeout=600)
            assert proc.returncode == 0, proc.stderr[-4000:]
            cache[family] = dict(zip(names, json.loads(out.read_text())))
        return cache[family]

    return get


@pytest.fixture(scope="session")
def serve_instance():
    """Ray with logical CPUs above the physical two, and Serve's proxy on a free port."""
    import ray
    from ray import serve

    port = free_port()
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()
