#!/usr/bin/env bash
# Create/refresh .venv with everything megatron_rl needs (CPU). Quick when nothing changed.
# torch is pinned first: its CPU wheel is local; an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
stamp=.venv/.megatron_rl_setup
want="$(cat setup.py scripts/setup.sh | sha1sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "setup: preparing .venv (first run takes ~1-2 minutes)"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
.venv/bin/python -m pip install -q "torch==${TORCH_VERSION}" 2>&1 | grep -v "is ignored" || true
.venv/bin/python -m pip install -q -e ".[test,hf,demo]" 2>&1 | grep -v "is ignored" || true
.venv/bin/python -W ignore -c "import torch, megatron.core, yaml, pytest, transformers" \
  || { echo "setup: .venv is incomplete (see pip output above)"; exit 1; }
echo "$want" > "$stamp"
echo "setup: .venv ready"
