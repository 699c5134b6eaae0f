#!/usr/bin/env bash
# Idempotent set-up: a Python 3.11 virtual environment in .venv with the pinned
# PyTorch, the solvers and this package in editable mode. Safe to run twice.
set -euo pipefail
cd "$(dirname "$0")"

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
  echo "install.sh: Python 3.11 is required (found $("$PYTHON" --version 2>&1))" >&2
  exit 2
fi

# The CUDA build of torch takes about 5.5 GB in .venv; pip fails half-way with
# "No space left on device" when the disk is short, so say so before starting.
if ! .venv/bin/python -c 'import torch' >/dev/null 2>&1; then
  free_kb=$(df -Pk . | awk 'NR==2 {print $4}')
  if [ "${free_kb:-0}" -lt $((7 * 1024 * 1024)) ]; then
    echo "install.sh: $((free_kb / 1024)) MB free on this disk; torch and torchvision need about 7 GB (5.5 GB installed plus unpacking)" >&2
    exit 3
  fi
fi

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PY=.venv/bin/python
export PIP_DISABLE_PIP_VERSION_CHECK=1

# torch and torchvision first, with plain pip: it takes them from this
# machine's disk, pinned so that nothing pulls a newer build.
$PY -m pip install -q "torch==2.14.1" "torchvision==0.29.1"
$PY -m pip install -q -r requirements.txt
$PY -m pip install -q --no-build-isolation --no-deps -e .
echo "install.sh: ready ($($PY -c 'import torch, monet_like; print("torch", torch.__version__, "monet_like", monet_like.__version__)'))"
