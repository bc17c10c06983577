#!/usr/bin/env bash
# Set up (idempotent, vLLM's environment included), then run the whole suite in three phases: unit
# tests on tiny random models (in parallel), the `vllm` tests against a real vLLM server, and the
# `integration` tests on the real embedded smollm2-135m (a shortened quickstart), in the precision `auto`
# picks for this CPU. Each phase prints its wall time; a failure fails the run after every phase has run.
# Arguments, if any, go to one plain pytest run.
set -euo pipefail
cd "$(dirname "$0")/.."
phase() {  # phase NAME CMD...: run CMD, print how long it took, return its status
  local name=$1 start=$SECONDS rc=0
  shift
  "$@" || rc=$?  # (a bare "$@" would lose a failure: `phase ... || failed=1` switches set -e off in here)
  echo "[time] $name: $((SECONDS - start)) s"
  return "$rc"
}
phase "set-up" bash scripts/setup.sh --vllm
if [ $# -gt 0 ]; then
  phase "pytest $*" .venv/bin/python -m pytest "$@"
  exit
fi

# Unit tests in parallel, one pytest-xdist worker per core, one torch thread per worker: the tiny
# models are dominated by Python overhead, so two workers halve the time where two threads each would
# only contend. Tests that launch 2 processes share one worker (xdist_group "multiprocess"), so no two
# of them run at once. The phases run one after another: the vLLM tests beside the unit tests made both
# 2.5-3x slower on a 2-core Xeon (vLLM's worker is pinned to a core, the 2-process tests' waits spin).
failed=0
phase "unit tests" env OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q -n auto --dist loadgroup \
  -m "not integration and not vllm" --durations=10 || failed=1
# A real vLLM server on loopback (.venv-vllm): EAGLE-3 end to end, a broken export, server clean-up,
# regeneration. The other families' checks are `-m vllm_families` (about 8 more server starts).
phase "vllm tests" .venv/bin/python -m pytest -q -m "vllm and not vllm_families" --durations=5 || failed=1
phase "integration tests" .venv/bin/python -m pytest -q -m integration || failed=1
exit "$failed"
