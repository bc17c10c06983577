#!/usr/bin/env bash
# Set up (idempotent, vLLM's environment included), then run the whole suite: unit tests on tiny
# random models (in parallel), then the `vllm` tests against a real vLLM server with, beside them, the
# `integration` tests on the real embedded smollm2-135m (a shortened quickstart, in the precision
# `auto` picks for this CPU), the `chi_square` sampling tests and the `script` tests. Each phase
# prints its wall time; a failure fails the run after every phase has run.
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
# Each module not yet compiled is compiled once, by the first process that imports it, and cached in
# the venv, instead of again in every process (setup.sh: nothing is compiled at install).
unset PYTHONDONTWRITEBYTECODE
# Lint and format first (a second): pyflakes' undefined and unused names, import order, and the tree
# as `ruff format` writes it (pyproject.toml [tool.ruff]; `.venv/bin/ruff format .` fixes the latter).
phase "lint" bash -c ".venv/bin/ruff check . && .venv/bin/ruff format --check ." || exit 1
# Types: mypy over the package as the wheel lays it out (scripts/typecheck.py resolves pyproject's
# package-dir mapping; settings in [tool.mypy]). About a minute on 2 cores with no cache, as in CI.
phase "type check" .venv/bin/python scripts/typecheck.py || exit 1
if [ $# -gt 0 ]; then
  phase "pytest $*" .venv/bin/python -m pytest "$@"
  exit
fi

# Unit tests in parallel, one pytest-xdist worker per core, one torch thread per worker: the tiny
# models are dominated by Python overhead, so two workers halve the time where two threads each would
# only contend. Tests that launch 2 processes share one worker (xdist_group "multiprocess"), so no two
# of them run at once. DeepSpeed's CPU Adam op (the zero3-offload preset as shipped) is left out: its
# JIT build alone is 150-250 CPU-seconds; `bash scripts/test.sh -m cpu_adam` runs its two tests.
failed=0
phase "unit tests" env OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q -n auto --dist loadgroup \
  -m "not integration and not vllm and not chi_square and not script and not cpu_adam" --durations=25 || failed=1

# A real vLLM server on loopback (.venv-vllm): EAGLE-3 end to end, a broken export, regeneration
# (multi-turn too), feature capture. The other families' checks and the real server's Ctrl-C clean-up
# are `-m vllm_families` (about 10 more server starts).
# A vLLM server and the test waiting on it take turns, so these keep about one core busy; beside them
# run, in one pytest run (one interpreter start), the integration tests (the real embedded
# smollm2-135m, a shortened quickstart), the chi-square sampling tests and the script tests
# (gpu-check.sh's CPU dry path), so that both lanes take about as long.
# Each runs in one torch thread: with two threads each, OpenMP's spinning waits made vLLM and
# integration side by side take twice as long as one after the other.
export OMP_NUM_THREADS=1
side_by_side=$SECONDS
beside_log=$(mktemp)
phase "integration, chi-square and script tests" .venv/bin/python -m pytest -q \
  -m "integration or (chi_square and not vllm) or script" --durations=5 > "$beside_log" 2>&1 &
beside_pid=$!
phase "vllm tests" env DRAFTSMITH_REQUIRE_VLLM=1 .venv/bin/python -m pytest -q \
  -m "vllm and not vllm_families" --durations=5 || failed=1
wait "$beside_pid" || failed=1
cat "$beside_log"
rm -f "$beside_log"
echo "[time] vllm tests with the integration, chi-square and script tests beside them: $((SECONDS - side_by_side)) s"
exit "$failed"
