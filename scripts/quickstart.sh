#!/usr/bin/env bash
# Set up, train an EAGLE-3 drafter for the embedded SmolLM2-135M on CPU, print the eval table.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/draftsmith train recipes/cpu/eagle3-smollm2.yaml "$@"
