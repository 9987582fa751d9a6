#!/usr/bin/env bash
# Launch the megatron_rl main job with torchrun.
#   NPROC        processes per node (default 2)
#   CONFIG       YAML of config overrides (default configs/demo_cpu.yaml)
#   NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT   torchrun's multi-node settings (defaults: one node)
#   RDZV_ENDPOINT  use c10d rendezvous at host:port instead of MASTER_ADDR/PORT
#   extra arguments: dotted key=value overrides, e.g. optimizer.lr=1e-4 logging.output_dir=outputs/x
# Set-up (the venv) is the README's job: this script installs nothing.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || { echo "run_megatron.sh: $PY not found; run 'bash scripts/setup.sh' first (see README)"; exit 1; }
NPROC=${NPROC:-2}
CONFIG=${CONFIG:-configs/demo_cpu.yaml}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
if [ -n "${RDZV_ENDPOINT:-}" ]; then
  launch=(--nnodes "$NNODES" --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "${RDZV_ID:-megatron_rl}")
else
  launch=(--nnodes "$NNODES" --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT")
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
echo "run_megatron.sh: $NPROC process(es) per node x $NNODES node(s), config $CONFIG${*:+, overrides: $*}"
echo "run_megatron.sh: outputs (metrics.jsonl, tensorboard/, reward_loss.png, summary.txt, checkpoints/) go to" \
  "logging.output_dir of the config (configs/demo_cpu.yaml: outputs/demo_cpu); rank 0 prints the full path"
# Pre-flight on this node (no model, no process group): config valid for this world size, output and checkpoint
# directories writable, free space; a failure is one line on stderr and exit code 2, before any rank starts.
world=(); [[ "$NPROC$NNODES" =~ ^[0-9]+$ ]] && world=(--world-size "$((NPROC * NNODES))")  # elastic MIN:MAX: skip
"$PY" -m megatron_rl.demo.preflight --config "$CONFIG" "${world[@]}" "$@" || exit $?
exec "$PY" -m torch.distributed.run --nproc-per-node "$NPROC" "${launch[@]}" -m megatron_rl.demo.main --config "$CONFIG" "$@"
