#!/usr/bin/env bash
# Regenerates the locks in requirements/ from pyproject.toml and the *.in files beside this
# script. Resolution only (it reads PyPI, installs nothing); run it after changing a
# dependency in pyproject.toml or a pin in an *.in file, then rerun scripts/install.sh.
#
#   bash requirements/compile.sh                   # keep every pin that is still allowed
#   bash requirements/compile.sh --upgrade         # newest allowed versions of everything
#   bash requirements/compile.sh --upgrade-package httpx
#
# The locks, all for CPython 3.11 on x86_64 Linux (glibc >= 2.28), every file hash-pinned:
#   cpu.txt        the CPU build with the test and bench extras: scripts/install.sh, CI
#   cuda.txt       the CUDA build with the test and bench extras: scripts/install.sh on a GPU
#   cuda-prod.txt  the CUDA build without extras or tools, versions taken from cuda.txt:
#                  cluster/Dockerfile
# The CPU lock is installed and tested on every CI run. The CUDA locks are resolved, not
# install-tested here (no GPU on the development machines); their header says so.
set -euo pipefail
cd "$(dirname "$0")/.."

UV=${UV:-}
if [ -z "$UV" ]; then
  if [ -x .venv/bin/uv ]; then UV=.venv/bin/uv; elif command -v uv >/dev/null; then UV=uv
  else echo "compile.sh: no uv (run scripts/install.sh first, or set UV=/path/to/uv)" >&2; exit 1; fi
fi

COMMON=(--python-version 3.11 --python-platform x86_64-manylinux_2_28 --generate-hashes
        --custom-compile-command "bash requirements/compile.sh" --quiet)

"$UV" pip compile "${COMMON[@]}" "$@" pyproject.toml --extra test --extra bench \
  requirements/cpu.in requirements/tools.in --override requirements/cpu-overrides.txt \
  -o requirements/cpu.txt

"$UV" pip compile "${COMMON[@]}" "$@" pyproject.toml --extra test --extra bench \
  requirements/cuda.in requirements/tools.in -o requirements/cuda.txt

# The image's lock: the same versions as cuda.txt (constraints), without test/bench extras
# and without the development tools.
"$UV" pip compile "${COMMON[@]}" pyproject.toml requirements/cuda.in \
  --constraint requirements/cuda.txt -o requirements/cuda-prod.txt

note='# RESOLVED, NOT INSTALL-TESTED: this CUDA lock was produced by dependency resolution for
# x86_64 Linux (manylinux_2_28) on a machine without a GPU; no install of it has been tested.
#'
for lock in requirements/cuda.txt requirements/cuda-prod.txt; do
  { echo "$note"; cat "$lock"; } > "$lock.tmp" && mv "$lock.tmp" "$lock"
done
echo "compile.sh: wrote requirements/cpu.txt, cuda.txt, cuda-prod.txt"
