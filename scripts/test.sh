#!/usr/bin/env bash
# Set up (idempotent), then run the whole suite: unit tests on tiny random models plus the
# `integration` tests on the real embedded smollm2-135m (a shortened quickstart).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest "$@"
