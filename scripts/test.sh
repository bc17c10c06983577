#!/usr/bin/env bash
# Set up (idempotent), then run the whole suite in two timed phases: unit tests on tiny random
# models, then the `integration` tests on the real embedded smollm2-135m (a shortened quickstart),
# both in the precision `auto` picks for this CPU. Arguments, if any, go to one plain pytest run.
set -euo pipefail
cd "$(dirname "$0")/.."
phase() {  # phase NAME CMD...: run CMD, then print how long it took
  local name=$1 start=$SECONDS
  shift
  "$@"
  echo "[time] $name: $((SECONDS - start)) s"
}
phase "set-up" bash scripts/setup.sh
if [ $# -gt 0 ]; then
  phase "pytest $*" .venv/bin/python -m pytest "$@"
else
  phase "unit tests" .venv/bin/python -m pytest -q -m "not integration"
  phase "integration tests" .venv/bin/python -m pytest -q -m integration
fi
