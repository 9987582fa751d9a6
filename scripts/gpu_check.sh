#!/usr/bin/env bash
# The GPU check (issue 11): does every stage run on CUDA? For a CUDA machine that may have no registry and no venv.
#   bash scripts/gpu_check.sh [--quick] [--require-gpu]
# Steps: the `gpu` tests; the rest of the suite (`not gpu`; its multi-rank tests run on gloo/CPU); the main job on
# configs/demo_gpu.yaml for 20 steps (NPROC=1), then a resume to step 25; bench/bench_gpu.py --small. Then one
# table (step, result, seconds); logs in $OUT_DIR (default outputs/gpu_check). Exit 1 if any step failed.
# --quick: for a short GPU slot (15 minutes in all, start-up included): the `gpu` tests, the 20-step main job with
# its resume and bench_gpu.py --small, without the rest of the suite (which runs on CPU anyway); target < 6 minutes
# on one H100 (not yet measured on one).
# Without CUDA it prints "no CUDA: skipped" and exits 0 (so it runs anywhere), or 1 with --require-gpu.
#   PY       the interpreter (default .venv/bin/python if present, else python3); it needs megatron-core,
#            mbridge and the test packages importable (README "On a GPU": wheels on an offline machine)
#   OUT_DIR  where the logs and the main job's outputs go
set -uo pipefail
cd "$(dirname "$0")/.."
require_gpu=0
quick=0
for arg in "$@"; do
  case "$arg" in
    --require-gpu) require_gpu=1 ;;
    --quick) quick=1 ;;
    *) echo "gpu_check.sh: unknown argument '$arg' (options: --quick, --require-gpu)"; exit 2 ;;
  esac
done
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
command -v "$PY" >/dev/null || { echo "gpu_check.sh: interpreter '$PY' not found; set PY=python3 or a venv's python"; exit 1; }
export PY PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null | tail -n 1)
case $gpus in '' | *[!0-9]*) gpus=0 ;; esac
if [ "$gpus" -eq 0 ]; then
  echo "gpu_check.sh: no CUDA: skipped ($PY cannot import torch, or its torch sees no GPU)"
  exit "$require_gpu"
fi
# Without `pip install -e .` the package_dir mapping of setup.py (megatron_rl.patches -> patches/) is missing.
"$PY" -c 'import megatron_rl.patches' 2>/dev/null || ln -sfn ../patches megatron_rl/patches
OUT_DIR=${OUT_DIR:-outputs/gpu_check}
mkdir -p "$OUT_DIR"
rm -rf "$OUT_DIR/main_job"
job=(demo.baseline_episodes=200 logging.progress_bar=false checkpoint.save_interval=10
     "logging.output_dir=$OUT_DIR/main_job")
rows=()
failed=0

step() {  # step NAME COMMAND...: run, log to $OUT_DIR/NAME.log, record result and seconds
  local name=$1 start end rc
  shift
  echo "gpu_check.sh: $name ..."
  start=$(date +%s.%N)
  "$@" >"$OUT_DIR/$name.log" 2>&1
  rc=$?
  end=$(date +%s.%N)
  if [ "$rc" -eq 0 ]; then result=ok; else result="FAILED (exit $rc, $OUT_DIR/$name.log)"; failed=1; fi
  rows+=("$(printf '%-16s %-48s %8.1f' "$name" "$result" "$(awk "BEGIN { print $end - $start }")")")
  tail -n 3 "$OUT_DIR/$name.log"
}

main_job() { NPROC=1 CONFIG=configs/demo_gpu.yaml bash run_megatron.sh "${job[@]}" "$@"; }

step gpu_tests "$PY" -m pytest tests -m gpu -q -rP -p no:cacheprovider  # -rP: the measured differences they print
if [ "$quick" -eq 1 ]; then
  rows+=("$(printf '%-16s %-48s %8s' suite "skipped (--quick)" -)")
else
  step suite "$PY" -m pytest tests -m "not gpu" -q -p no:cacheprovider
fi
step main_job main_job demo.num_steps=20
step resume main_job demo.num_steps=25
grep -q "resuming after step 20" "$OUT_DIR/resume.log" || {
  rows[-1]="$(printf '%-16s %-48s %8s' resume "FAILED (did not resume from step 20)" -)"
  failed=1
}
if [ -f bench/bench_gpu.py ]; then
  step bench_small "$PY" bench/bench_gpu.py --small
else
  rows+=("$(printf '%-16s %-48s %8s' bench_small "skipped (no bench/bench_gpu.py)" -)")
fi

device=$("$PY" -c 'import torch; print(torch.cuda.get_device_name(0), "| torch", torch.__version__)' 2>/dev/null)
echo
echo "gpu_check.sh summary ($device; logs in $OUT_DIR)"
printf '%-16s %-48s %8s\n' step result seconds
printf '%s\n' "${rows[@]}"
exit "$failed"
