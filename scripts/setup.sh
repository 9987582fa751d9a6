#!/usr/bin/env bash
# Create/refresh the venv with everything megatron_rl needs. Quick (a no-op) when nothing changed.
#
# Picks the newest megatron-core the machine allows (docs/MEGATRON_CORE.md, "Supported range"):
#   Python >= 3.12 -> megatron-core 0.19.2 (0.17+ need Python >= 3.12);  Python 3.11 -> megatron-core 0.16.1.
# The interpreter: $PYTHON if set, else `python3.12` on PATH if it runs, else pyenv's
# $(pyenv root)/versions/3.12.*/bin/python3.12, else python3.11, else python3.
# The venv: $VENV if set; else .venv for the automatic pick and .venv-py3.X when $PYTHON names one, so both
# ends of the range coexist (e.g. PYTHON=python3.11 bash scripts/setup.sh -> .venv-py3.11 with 0.16.1).
#   bash scripts/setup.sh --venv   prints the venv path it would use and installs nothing.
#   bash scripts/setup.sh --needs-gb   prints the disk space (GiB) it would still take, 0 when the venv is ready.
# torch is pinned first: Python 3.11 gets the local CPU wheel; Python 3.12 has no CPU wheel here and gets the
# registry's CUDA build (~5 GB, ~1.5 min; it runs on CPU). An unpinned torch could pull another multi-GB build.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup_common.sh
TORCH_VERSION=${TORCH_VERSION:-2.13.0}

# --venv: the venv's path does not depend on which Python makes it unless PYTHON is set (then .venv-pyX.Y): answer
# at once. run_megatron.sh asks on every launch, and finding the interpreter can take 1-1.5 s (pyenv's shim for a
# python3.12 that is not on PATH takes ~1 s to say so), a third of a small job's launch.
if [ "${1:-}" = "--venv" ] && { [ -n "${VENV:-}" ] || [ -z "${PYTHON:-}" ]; }; then echo "${VENV:-.venv}"; exit 0; fi

runs() { [ -n "$1" ] && "$1" -c "import sys" >/dev/null 2>&1; }

pick_python() {
  if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; return; fi
  if runs python3.12; then echo python3.12; return; fi
  if command -v pyenv >/dev/null 2>&1; then
    local found
    found=$(ls -d "$(pyenv root)"/versions/3.12.*/bin/python3.12 2>/dev/null | sort -V | tail -n 1 || true)
    if runs "$found"; then echo "$found"; return; fi
  fi
  if runs python3.11; then echo python3.11; return; fi
  echo python3
}

PY=$(pick_python)
runs "$PY" || { echo "setup: Python interpreter '$PY' does not run (set PYTHON=/path/to/python3.11 or 3.12)"; exit 1; }
PY_VERSION=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
case "$PY_VERSION" in
  3.11) MCORE_VERSION=0.16.1 ;;
  3.1[2-9]) MCORE_VERSION=0.19.2 ;;
  *) echo "setup: Python $PY_VERSION ($PY) is not supported: megatron_rl needs Python 3.11 (megatron-core" \
       "0.16.1) or >= 3.12 (megatron-core 0.19.2); set PYTHON=/path/to/python3.12"; exit 1 ;;
esac
if [ -n "${VENV:-}" ]; then venv=$VENV
elif [ -n "${PYTHON:-}" ]; then venv=.venv-py$PY_VERSION
else venv=.venv
fi
if [ "${1:-}" = "--venv" ]; then echo "$venv"; exit 0; fi

stamp=$venv/.megatron_rl_setup
want="$( (cat setup.py scripts/setup.sh; echo "$PY_VERSION $MCORE_VERSION $TORCH_VERSION") | sha1sum | cut -d' ' -f1)"
ready() { [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; }
# --needs-gb: the disk space (GiB) this set-up would still take: 0 when the venv is ready (scripts/test.sh sums it).
gb=6; [ "$PY_VERSION" = 3.11 ] && gb=2
if [ "${1:-}" = "--needs-gb" ]; then if ready; then echo 0; else echo "$gb"; fi; exit 0; fi
if ready; then exit 0; fi
need_space setup "$gb" "$venv"
echo "setup: Python $PY_VERSION ($PY) -> megatron-core $MCORE_VERSION, torch $TORCH_VERSION, in $venv" \
  "(first run takes ~1-2 minutes; Python 3.12 downloads a ~5 GB CUDA torch build)"
if [ -x "$venv/bin/python" ] && [ "$("$venv/bin/python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')" != "$PY_VERSION" ]; then
  echo "setup: $venv was made with another Python; recreating it"
  "$PY" -m venv --clear "$venv"
fi
[ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
constraints=$venv/megatron_rl_constraints.txt
printf 'megatron-core==%s\ntorch==%s\n' "$MCORE_VERSION" "$TORCH_VERSION" > "$constraints"
# pip byte-compiles every module it installs (~25 CPU s for torch alone). Not skipped with --no-compile: where
# PYTHONDONTWRITEBYTECODE=1 is set (CI's machine) no process would write the .pyc files, and every one compiled its
# imports anew (the suite took ~1.5x as long, docs/TESTING.md section 1).
pip=("$venv/bin/python" -m pip install -q -c "$constraints")
"$venv/bin/python" -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
"${pip[@]}" "torch==${TORCH_VERSION}" 2>&1 | grep -v "is ignored" || true
# The editable install writes megatron_rl.egg-info in the checkout: one venv's at a time (CI sets up both ends at once)
lock=(); if command -v flock >/dev/null 2>&1; then lock=(flock setup.py); fi
"${lock[@]}" "${pip[@]}" -e ".[test,hf,demo,ray]" 2>&1 | grep -v "is ignored" || true
"$venv/bin/python" -W ignore -c "import torch, megatron.core, yaml, pytest, transformers, mbridge, ray, aiohttp" \
  || { echo "setup: $venv is incomplete (see pip output above)"; exit 1; }
installed=$("$venv/bin/python" -c "import importlib.metadata as m; print(m.version('megatron-core'))")
[ "$installed" = "$MCORE_VERSION" ] || { echo "setup: $venv has megatron-core $installed, want $MCORE_VERSION"; exit 1; }
echo "$want" > "$stamp"
echo "setup: $venv ready (Python $PY_VERSION, megatron-core $MCORE_VERSION)"
