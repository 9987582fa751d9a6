#!/usr/bin/env bash
# Set up .venv if needed, then run the whole test suite. Extra arguments go to pytest.
# Exit code is pytest's: non-zero on any failure, and 5 (also a failure) when no test ran.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest tests "$@"
