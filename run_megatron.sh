#!/usr/bin/env bash
# Launch the megatron_rl main job (python -m megatron_rl.job.main) with torchrun.
#   NPROC        processes per node (default 2); with CUDA, at most one per visible GPU (else parallel.device=cpu)
#   CONFIG       YAML of config overrides (default: configs/user_job.yaml when data.train_files (or
#                job.environment / job.agent) is given, else configs/demo_cpu.yaml, the digit game;
#                configs/demo_gpu.yaml: one GPU). A YAML of yours (outside configs/) builds on that default
#                unless it has a top-level `base: <path>` or `base: null`. Relative paths, here and in every
#                path key, are taken from the directory you run this script from (megatron_rl/job/paths.py).
#   PY           the Python to run (a path or a command on PATH, e.g. PY=python3; default: the venv that
#                scripts/setup.sh --venv names)
#   NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT   torchrun's multi-node settings (defaults: one node, a free port)
#   RDZV_ENDPOINT  use c10d rendezvous at host:port instead of MASTER_ADDR/PORT
#   extra arguments: dotted key=value overrides, e.g. optimizer.lr=1e-4 logging.output_dir=outputs/x
# Set-up (the venv) is the README's job: this script installs nothing.
# Exit code: 0 when the run completed, or had already reached demo.num_steps (one line says so; nothing is
# rewritten); 2 for a usage error (config, directories, a checkpoint of another run: one line, before or after
# the ranks start); 1 for a full or read-only disk during a save; otherwise torchrun's (a crash keeps its report).
set -euo pipefail
export MEGATRON_RL_CALLER_CWD=$PWD  # relative paths are the caller's (megatron_rl/job/paths.py)
export MEGATRON_RL_LAUNCH_TIME=${EPOCHREALTIME:-$(date +%s)}  # the summary's start-up time (job/reporting.py)
cd "$(dirname "$0")"
PY=${PY:-$(bash scripts/setup.sh --venv)/bin/python}
command -v "$PY" >/dev/null || {
  echo "run_megatron.sh: $PY not found; run 'bash scripts/setup.sh' first, or name an interpreter: PY=python3 (see README)"
  exit 1
}
NPROC=${NPROC:-2}
# The config files, printed first ("base config: <path>[, then <path>] (<why>)"): $CONFIG (a user's YAML on the
# base the command would pick, unless it says `base: ...`), else the base chosen from the overrides; one per line.
layers=$(CONFIG=${CONFIG:-} "$PY" -m megatron_rl.job.paths "$@") || exit 2
configs=(); config_args=()
while IFS= read -r c; do configs+=("$c"); config_args+=(--config "$c"); done <<< "$layers"
# parallel.device (docs/DESIGN.md section 11): the last override wins, else the config's `device:` line (only
# the parallel section has one). bootstrap.py applies and checks it in every rank; this is the early, friendly
# stop: cpu hides the GPUs from the ranks, otherwise NCCL needs one visible GPU per rank.
device=$(sed -n 's/^[[:space:]]*device:[[:space:]]*\([a-z]*\).*/\1/p' "${configs[@]}" 2>/dev/null | tail -n 1 || true)
for arg in "$@"; do case $arg in parallel.device=*) device=${arg#parallel.device=} ;; esac; done
if [ "${device:-auto}" = cpu ]; then
  export CUDA_VISIBLE_DEVICES=""
else
  gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null | tail -n 1 || echo 0)
  case $gpus in '' | *[!0-9]*) gpus=0 ;; esac
  if [ "$gpus" -gt 0 ] && [ "$NPROC" -gt "$gpus" ]; then
    echo "run_megatron.sh: NPROC=$NPROC ranks but $gpus visible CUDA GPU(s), and NCCL needs one GPU per rank:" \
      "use NPROC=$gpus (e.g. NPROC=1 CONFIG=configs/demo_gpu.yaml), or run the ranks on CPU with gloo by adding" \
      "the override parallel.device=cpu" >&2
    exit 2
  fi
fi
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
# One node: a free port unless MASTER_PORT is given (then it must be free: one line instead of torchrun's
# EADDRINUSE traceback). Several nodes share MASTER_PORT (default 29500).
port_free() { "$PY" -c 'import socket,sys; s=socket.socket(); s.bind(("", int(sys.argv[1])))' "$1" 2>/dev/null; }
if [ "$NNODES" = 1 ] && [ -z "${RDZV_ENDPOINT:-}" ]; then
  if [ -z "${MASTER_PORT:-}" ]; then
    MASTER_PORT=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')
  elif ! port_free "$MASTER_PORT"; then
    echo "run_megatron.sh: MASTER_PORT=$MASTER_PORT is in use by another process; unset MASTER_PORT (a single-node" \
      "run picks a free port) or choose another" >&2
    exit 2
  fi
fi
MASTER_PORT=${MASTER_PORT:-29500}
if [ -n "${RDZV_ENDPOINT:-}" ]; then
  launch=(--nnodes "$NNODES" --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "${RDZV_ID:-megatron_rl}")
else
  launch=(--nnodes "$NNODES" --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT")
fi
threads=$("$PY" -m megatron_rl.job.threads "$NPROC" "${config_args[@]}" "$@") || exit 2  # the cores left free
export OMP_NUM_THREADS=${threads%% *} OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}  # job/threads.py (env wins)
echo "run_megatron.sh: $NPROC process(es) per node x $NNODES node(s), $threads, config ${configs[*]}${*:+, overrides: $*}"
# Pre-flight on this node (no model, no process group): config valid for this world size, output and checkpoint
# directories writable, free space, a resume target of this model and algorithm; it prints the output and
# checkpoint directories of the config as resolved (overrides included). A failure is one line on stderr and
# exit code 2, before any rank starts.
world=(); [[ "$NPROC$NNODES" =~ ^[0-9]+$ ]] && world=(--world-size "$((NPROC * NNODES))")  # elastic MIN:MAX: skip
# The pre-flight (megatron_rl.job.preflight: exit 2 and one line when the run cannot start), then torchrun through
# megatron_rl.distributed.launch (an error the ranks report, a config or checkpoint mistake, is one line and its
# exit code instead of torchrun's failure report), in one process (megatron_rl/job/start.py: one torch import).
exec "$PY" -m megatron_rl.job.start "${config_args[@]}" "${world[@]}" "$@" --then-torchrun \
  --nproc-per-node "$NPROC" "${launch[@]}" -m megatron_rl.job.main "${config_args[@]}" "$@"
