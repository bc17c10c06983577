#!/usr/bin/env bash
# Set up (idempotent, vLLM's environment included), then run the whole suite in three timed phases:
# unit tests on tiny random models (in parallel), the `vllm` tests against a real vLLM server, and
# the `integration` tests on the real embedded smollm2-135m (a shortened quickstart), in the precision
# `auto` picks for this CPU. Arguments, if any, go to one plain pytest run.
set -euo pipefail
cd "$(dirname "$0")/.."
phase() {  # phase NAME CMD...: run CMD, then print how long it took
  local name=$1 start=$SECONDS
  shift
  "$@"
  echo "[time] $name: $((SECONDS - start)) s"
}
phase "set-up" bash scripts/setup.sh --vllm
if [ $# -gt 0 ]; then
  phase "pytest $*" .venv/bin/python -m pytest "$@"
else
  # Unit tests in parallel, one pytest-xdist worker per core, one torch thread per worker: the tiny
  # models are dominated by Python overhead, so two workers halve the time where two threads each
  # would only contend (on 2 cores: about 3.7 min against 8). Tests that launch 2 processes share
  # one worker (xdist_group "multiprocess"), so no two of them run at once.
  phase "unit tests" env OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q -n auto --dist loadgroup -m "not integration and not vllm"
  # A real vLLM server on loopback (.venv-vllm): EAGLE-3 end to end, a broken export, server clean-up,
  # regeneration. The other families' checks are `-m vllm_families` (about 6 more server starts).
  phase "vllm tests" .venv/bin/python -m pytest -q -m "vllm and not vllm_families"
  phase "integration tests" .venv/bin/python -m pytest -q -m integration
fi
