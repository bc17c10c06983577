#!/usr/bin/env bash
# Set up (idempotent, vLLM's environment included), then run the whole suite: the unit tests on tiny
# random models (in parallel), and beside them the `vllm` tests against a real vLLM server followed by
# the `integration` tests on the real embedded smollm2-135m (a shortened quickstart), in the precision
# `auto` picks for this CPU. Each phase prints its wall time. Arguments, if any, go to one plain pytest run.
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
  exit
fi

# Second lane, in the background. A vLLM server start is three Python processes importing vLLM one
# after another, so the vLLM tests keep about 0.8 of a core busy (160 s of CPU in 214 s on a 2-core
# Xeon): they run beside the unit tests rather than after them. Before them, DeepSpeed's two CPU ops
# (CPU Adam and the shared-memory comm op, about 2.5 min of compiler on a fresh machine, cached in
# ~/.cache/torch_extensions) are built here, not inside the chain of 2-process tests that sets the unit
# phase's wall time; a test that needs an op first waits on torch's build lock.
lane=$(mktemp -d)
(
  rc=0
  # Not fatal here: without a compiler the DeepSpeed tests fail and say so themselves.
  phase "DeepSpeed CPU ops" env DS_ACCELERATOR=cpu .venv/bin/python -c "from deepspeed.accelerator import get_accelerator as a
for op in ('CPUAdamBuilder', 'ShareMemCommBuilder'): a().create_op_builder(op).load(verbose=False)" || true
  # -p no:cacheprovider in both lanes: two pytest runs at once would race on .pytest_cache.
  phase "vllm tests" .venv/bin/python -m pytest -q -p no:cacheprovider -m "vllm and not vllm_families" || rc=1
  phase "integration tests" .venv/bin/python -m pytest -q -p no:cacheprovider -m integration || rc=1
  exit "$rc"
) >"$lane/log" 2>&1 &
lane_pid=$!
trap 'kill "$lane_pid" 2>/dev/null || true' EXIT

# Unit tests in parallel, one pytest-xdist worker per core, one torch thread per worker: the tiny
# models are dominated by Python overhead, so two workers halve the time where two threads each would
# only contend. Tests that launch 2 processes share one worker (xdist_group "multiprocess"), so no two
# of them run at once. The other families' vLLM checks are `-m vllm_families` (about 8 more server starts).
unit=0
phase "unit tests" env OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q -n auto --dist loadgroup -p no:cacheprovider \
  -m "not integration and not vllm" || unit=$?
lane_rc=0
wait "$lane_pid" || lane_rc=$?
trap - EXIT
echo "--- beside the unit tests: DeepSpeed ops, vllm tests, integration tests ---"
cat "$lane/log"
rm -rf "$lane"
[ "$unit" -eq 0 ] && [ "$lane_rc" -eq 0 ]
