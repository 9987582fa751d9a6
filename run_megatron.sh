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
#   Slurm: launch.scheduler=slurm launch.nodes=N submits the run with sbatch; inside an allocation (salloc, sbatch)
#                this script starts itself once per node with srun and derives the settings above (docs/CLUSTER.md)
#   extra arguments: dotted key=value overrides, e.g. optimizer.lr=1e-4 logging.output_dir=outputs/x
# Set-up (the venv) is the README's job: this script installs nothing.
# Exit code: 0 when the run completed, or had already reached demo.num_steps (one line says so; nothing is
# rewritten); 2 for a usage error (config, directories, a checkpoint of another run: one line, before or after
# the ranks start); 1 for a full or read-only disk during a save; 3 when SIGUSR1 or SIGTERM (a scheduler's
# preemption) stopped it after it saved a checkpoint at the end of a step (one line: how far it got and the
# command that resumes; docs/PREEMPTION_AND_PLACEMENT.md); otherwise torchrun's (a crash keeps its report).
set -euo pipefail
# A preemption warning (SIGUSR1) while starting is kept and handed on (megatron_rl/early_signals.py), not fatal:
# this shell records it, the Python processes below record their own until the launcher's handler takes over.
early_stop=""
trap 'early_stop=SIGUSR1' USR1
export MEGATRON_RL_HOLD_STOP_SIGNALS=1
if [ -z "${MEGATRON_RL_COMMAND:-}" ]; then  # the command that resumes, quoted in the line of a preemption stop
  MEGATRON_RL_COMMAND=""
  for v in PY CONFIG NPROC NNODES NODE_RANK MASTER_ADDR MASTER_PORT RDZV_ENDPOINT; do
    [ -z "${!v:-}" ] || MEGATRON_RL_COMMAND+="$v=$(printf %q "${!v}") "
  done
  MEGATRON_RL_COMMAND+="bash $(printf %q "$0")"
  [ $# -eq 0 ] || MEGATRON_RL_COMMAND+=$(printf ' %q' "$@")
  export MEGATRON_RL_COMMAND
fi
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
# Where the launcher runs (megatron_rl/launch/plan.py, docs/CLUSTER.md): here (nothing to do, or NNODES from
# launch.nodes); inside a Slurm allocation, srun starts this script once per node (and there: NNODES/NODE_RANK from
# Slurm); with launch.scheduler=slurm, the job is submitted with sbatch; with rollout.engine_nodes=K the last K nodes
# run the engine host instead of torchrun (megatron_rl/launch/placement.py). A contradiction: one line, exit 2.
plan=$("$PY" -m megatron_rl.launch.plan "${config_args[@]}" "$@") || exit $?
eval "$plan"
# parallel.device (docs/DESIGN.md section 11) is applied by megatron_rl/job/start.py from the config layers (no YAML
# read here): cpu hides the GPUs from the ranks; otherwise NCCL needs one visible GPU per rank.
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
# One node: a free port unless MASTER_PORT is given (then it must be free: one line instead of torchrun's
# EADDRINUSE traceback). Several nodes share MASTER_PORT (default 29500).
bare_py() { (trap '' USR1; exec "$PY" "$@"); }  # a Python without megatron_rl (no handler): SIGUSR1 ignored
port_free() { bare_py -c 'import socket,sys; s=socket.socket(); s.bind(("", int(sys.argv[1])))' "$1" 2>/dev/null; }
if [ "$NNODES" = 1 ] && [ -z "${RDZV_ENDPOINT:-}" ]; then
  if [ -z "${MASTER_PORT:-}" ]; then
    MASTER_PORT=$(bare_py -c 'import socket; s=socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')
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
# exit code 2, before any rank reads the config (the ranks import torch meanwhile and wait for its verdict).
world=(); [[ "$NPROC$NNODES" =~ ^[0-9]+$ ]] && world=(--world-size "$((NPROC * NNODES))")  # elastic MIN:MAX: skip
# The pre-flight (megatron_rl.job.preflight: exit 2 and one line when the run cannot start), beside torchrun through
# megatron_rl.distributed.launch (an error the ranks report, a config or checkpoint mistake, is one line and its
# exit code instead of torchrun's failure report), in one process (megatron_rl/job/start.py: one torch import).
[ -z "$early_stop" ] || export MEGATRON_RL_EARLY_STOP=$early_stop
exec "$PY" -m megatron_rl.job.start "${config_args[@]}" "${world[@]}" "$@" --then-torchrun \
  --nproc-per-node "$NPROC" "${launch[@]}" -m megatron_rl.job.main "${config_args[@]}" "$@"
