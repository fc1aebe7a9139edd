#!/usr/bin/env bash
# Create .venv-nvrx (once) holding NVIDIA's nvidia-resiliency-ext 0.4.1, the reference the
# differential tier (tests/differential) compares nvrx against. torch is installed first
# from the local CPU wheel so that the reference's `torch>=2.3` is already satisfied and
# pip fetches no other torch. A venv that already holds that version is left as it is (the
# tests check that it imports).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-nvrx
NVRX_REF_VERSION=0.4.1
installed() {
    "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('nvidia-resiliency-ext') != '$NVRX_REF_VERSION')" 2>/dev/null
}
if installed; then
    exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check torch==2.13.0 2>&1 | grep -v "is ignored: it is neither" || true
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "nvidia-resiliency-ext==$NVRX_REF_VERSION" 2>&1 | grep -v "is ignored: it is neither" || true
"$VENV/bin/python" -W ignore -c 'import torch, nvidia_resiliency_ext.inprocess, nvidia_resiliency_ext.fault_tolerance; print("reference nvidia-resiliency-ext '"$NVRX_REF_VERSION"' torch", torch.__version__)'
