#!/usr/bin/env bash
# Set up (idempotent, vLLM's environment included), then run the whole suite: the `vllm` tests against
# a real vLLM server, beside them the `integration` tests on the real embedded smollm2-135m (a shortened
# quickstart, in the precision `auto` picks for this CPU), then the unit tests on tiny random models (in
# parallel). Each phase prints its wall time; any failure fails the run, after every phase has run.
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

# vLLM first, with a second lane beside it. A vLLM server start is three Python processes importing
# vLLM one after another, so the vLLM tests keep about 0.8 of a core busy (173 s of CPU in 214 s on a
# 2-core Xeon). The other core builds DeepSpeed's two CPU ops meanwhile (CPU Adam and the shared-memory
# comm op: about 2.5 min of compiler on a fresh machine, cached in ~/.cache/torch_extensions), which the
# 2-process unit tests would otherwise build inside the chain that sets the unit phase's wall time, and
# then runs the integration tests. The unit tests do not run beside vLLM: with vLLM's worker pinned to
# one core, the 2-process tests' spinning waits made both phases 2.5-3x slower (unit 788 s, vLLM 604 s).
# -p no:cacheprovider in both lanes: two pytest runs at once would race on .pytest_cache.
lane=$(mktemp -d)
(
  rc=0
  # Not fatal here: without a compiler the DeepSpeed tests fail and say so themselves.
  phase "DeepSpeed CPU ops" env DS_ACCELERATOR=cpu .venv/bin/python -c "from deepspeed.accelerator import get_accelerator as a
for op in ('CPUAdamBuilder', 'ShareMemCommBuilder'): a().create_op_builder(op).load(verbose=False)" || true
  phase "integration tests" .venv/bin/python -m pytest -q -p no:cacheprovider -m integration || rc=1
  exit "$rc"
) >"$lane/log" 2>&1 &
lane_pid=$!
trap 'kill "$lane_pid" 2>/dev/null || true' EXIT
failed=0
phase "vllm tests" .venv/bin/python -m pytest -q -p no:cacheprovider -m "vllm and not vllm_families" || failed=1
wait "$lane_pid" || failed=1
trap - EXIT
cat "$lane/log"
rm -rf "$lane"

# Unit tests in parallel, one pytest-xdist worker per core, one torch thread per worker: the tiny
# models are dominated by Python overhead, so two workers halve the time where two threads each would
# only contend. Tests that launch 2 processes share one worker (xdist_group "multiprocess"), so no two
# of them run at once. The other families' vLLM checks are `-m vllm_families` (about 8 more server starts).
phase "unit tests" env OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q -n auto --dist loadgroup -p no:cacheprovider \
  -m "not integration and not vllm" || failed=1
exit "$failed"
