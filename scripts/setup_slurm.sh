#!/usr/bin/env bash
# Install Slurm and munge for the Slurm tests (tests/cluster: a two-node test cluster on this machine), if missing.
# Idempotent: a quick no-op when slurmctld, slurmd and munged are on PATH. Needs root and apt (Debian's slurm-wlm).
# scripts/test.sh runs it in the background beside the engine's set-up. Exit 1 with one line when it cannot install.
set -euo pipefail
have() { command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null && command -v sbatch >/dev/null; }
if have; then exit 0; fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "setup_slurm: Slurm is not installed and this is not root with apt-get: install slurm-wlm and munge" \
    "(e.g. sudo apt-get install -y slurm-wlm munge), or run the tests without the slurm marker (-m 'not slurm')" >&2
  exit 1
fi
log=$(mktemp)
if ! { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge; } >"$log" 2>&1; then
  tail -n 20 "$log" >&2
  echo "setup_slurm: apt-get install slurm-wlm munge failed (above); the Slurm tests need it" >&2
  rm -f "$log"; exit 1
fi
rm -f "$log"
have || { echo "setup_slurm: slurm-wlm installed but slurmctld/slurmd/munged/sbatch are not on PATH" >&2; exit 1; }
echo "setup_slurm: slurm-wlm and munge installed"
