#!/usr/bin/env bash
# Set up the venvs if needed (the trainer's and the engine's), then run the whole test suite. Extra arguments go
# to pytest.
# The venv is the one scripts/setup.sh picks (the newest megatron-core the machine allows); PYTHON=... or
# VENV=... choose another end of the supported range, as for setup.sh (docs/MEGATRON_CORE.md).
# Exit code is pytest's: non-zero on any failure, and 5 (also a failure) when no test ran.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup_common.sh
# Both venvs are made at once (below): the disk must hold both before either starts
need=$(( $(bash scripts/setup.sh --needs-gb) + $(bash scripts/setup_engine.sh --needs-gb) ))
[ "$need" = 0 ] || need_space test "$need" "the venvs still to be made"
# The inference engine's own environment (vLLM, .venv-engine; ~6-7 min the first time): the engine tests
# (tests/inference, marker `engine`) run the real engine and fail instead of skipping when it is missing. It is
# set up beside the trainer's venv, at the same time (each pip install is mostly one core unpacking wheels).
bash scripts/setup_engine.sh &
engine_setup=$!
# Slurm and munge for the Slurm tests (tests/cluster, marker `slurm`; apt, as root), also at the same time; those
# tests fail instead of skipping without it (MEGATRON_RL_REQUIRE_SLURM=1).
bash scripts/setup_slurm.sh &
slurm_setup=$!
bash scripts/setup.sh || { wait "$engine_setup" "$slurm_setup" || true; exit 1; }  # no pip left running
wait "$engine_setup" || { wait "$slurm_setup" || true; echo "test: the engine's set-up (scripts/setup_engine.sh) failed: see above"; exit 1; }
wait "$slurm_setup" || { echo "test: the Slurm set-up (scripts/setup_slurm.sh) failed: see above"; exit 1; }
export MEGATRON_RL_REQUIRE_SLURM=1
export MEGATRON_RL_ENGINE_PYTHON=${MEGATRON_RL_ENGINE_PYTHON:-$PWD/$(bash scripts/setup_engine.sh --venv)/bin/python}
export MEGATRON_RL_REQUIRE_ENGINE=1
venv=$(bash scripts/setup.sh --venv)
"$venv/bin/python" -c "import importlib.metadata as m, sys; print(f'tests: Python {sys.version.split()[0]}, ' \
f'megatron-core {m.version(\"megatron-core\")}, torch {m.version(\"torch\")} ($venv)')"
# Two test files at once (pytest-xdist; a file's tests stay together on one worker, so a module's fixture, e.g. a
# fleet, is built once; the heaviest files first: tests/conftest.py): the 2 cores stay busy while a test waits on an
# engine, a kill or a timeout (docs/TESTING.md section 1). MEGATRON_RL_TEST_WORKERS=N runs N at once; 0: one file
# at a time, in this process.
workers=${MEGATRON_RL_TEST_WORKERS:-2}
xdist=()
if [ "$workers" != 0 ]; then xdist=(-n "$workers" --dist loadfile --no-loadscope-reorder); fi
exec "$venv/bin/python" -m pytest tests "${xdist[@]}" "$@"
