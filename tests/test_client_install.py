"""The client installs alone: a fresh Python 3.11 venv, `pip install` of iris_client's folder
(openai, httpx and blake3 come from the package index), and a run of it against a stand-in of
Iris's upload-free surface, in a venv where Ray, vLLM and torch are not installed at all."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.http_server import http_server
from tests.support.images import unique_png
from tests.support.iris_stub import IrisStub

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import importlib.util, json, sys
from iris_client import IrisClient, content_uuid
url, path = sys.argv[1], sys.argv[2]
client = IrisClient(base_url=url, api_key="k")
ask = [{"role": "user", "content": [{"type": "image", "image": path}, {"type": "text", "text": "what?"}]}]
reports = [client.chat.completions.create(model="m", messages=ask).iris for _ in range(2)]
server_modules = ("ray", "vllm", "torch", "numpy", "PIL")
print(json.dumps({"absent": [m for m in server_modules if importlib.util.find_spec(m) is None],
                  "uuid": content_uuid(open(path, "rb").read()), "where": __import__("iris_client").__file__,
                  "reports": [r.__dict__ for r in reports]}))
"""


@pytest.mark.timeout(600)
def test_the_client_installs_and_runs_alone(tmp_path):
    python = shutil.which("python3.11")
    if python is None:
        pytest.skip("no python3.11 on PATH")
    source = shutil.copytree(
        ROOT / "iris_client", tmp_path / "src" / "iris_client", ignore=shutil.ignore_patterns("__pycache__", "build")
    )
    venv = tmp_path / "venv"
    # Nothing of this checkout on the path (the tests run with PYTHONPATH at the repository root).
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    pip = subprocess.run(
        [str(venv / "bin" / "pip"), "install", "--disable-pip-version-check", "-q", str(source)],
        capture_output=True,
        text=True,
        timeout=500,
        env=env,
    )
    assert pip.returncode == 0, pip.stdout + pip.stderr
    installed = subprocess.run(
        [str(venv / "bin" / "pip"), "list", "--format=json"], capture_output=True, text=True, check=True
    )
    names = {p["name"].lower() for p in json.loads(installed.stdout)}
    assert {"iris-client", "openai", "httpx", "blake3"} <= names
    assert not names & {"ray", "vllm", "torch", "numpy", "pillow"}, names

    image = tmp_path / "photo.png"
    image.write_bytes(unique_png())
    stub = IrisStub()
    with http_server(stub.handler()) as httpd:
        run = subprocess.run(
            [str(venv / "bin" / "python"), "-c", SCRIPT, f"http://127.0.0.1:{httpd.server_port}/v1", str(image)],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
            env=env,
        )
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["absent"] == ["ray", "vllm", "torch", "numpy", "PIL"]
    assert str(venv) in out["where"]  # the installed copy, not this checkout
    from cache_service.keys import content_uuid

    assert out["uuid"] == content_uuid(image.read_bytes())  # the server's hash, computed by the installed client
    first, second = out["reports"]
    assert first["sent_as_id"] == 0 and second["sent_as_id"] == 1 and second["bytes_sent"] == 0
    assert stub.bodies[1]["messages"][0]["content"][0] == {"type": "image_url", "image_url": None, "uuid": out["uuid"]}
    assert sys.version_info >= (3, 10)
