#!/usr/bin/env bash
# Create .venv (once) and install nvrx with its dev tools into it.
# torch is pinned to the local CPU wheel first, so that `torch>=2.13` in
# pyproject.toml is already satisfied and pip downloads no CUDA packages. The pin is
# pyproject.toml's floor, so the tests run on the lowest torch nvrx declares.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0 2>&1 | grep -v "is ignored: it is neither" || true
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[dev]' 2>&1 | grep -v "is ignored: it is neither" || true
.venv/bin/python -c 'import torch, submitit, psutil, tabulate, nvrx; print("nvrx", nvrx.__version__, "torch", torch.__version__)'
