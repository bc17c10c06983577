#!/usr/bin/env bash
# DFlash's depth per training minute on the quickstart's data: the CPU recipe
# (recipes/cpu/dflash-smollm2.yaml at block 8 and with AdamW, as measured in docs/benchmarks.md; BLOCK=4
# for the recipe's own block; 32 anchors per example, 8,192-token draft vocabulary,
# 2 epochs over the 640 regenerated code answers, the features EAGLE-3's quickstart cached) trained at
# 1, 2, 3 and 5 draft layers, each followed by its eval stage (chain K=3, 20 held-out code prompts).
#   bash benchmarks/block_depth.sh [OUT] [LAYERS...]   (default layers: 1 2 3 5; nothing else running)
# Prints one row per depth: training seconds, τ, per-position acceptance, speedup, and τ - 1 (the
# tokens a round gains over target-only decoding) per training minute.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-block-depth}
shift || true
layers=("$@")
[ ${#layers[@]} -gt 0 ] || layers=(1 2 3 5)
mkdir -p "$out"
for n in "${layers[@]}"; do
  .venv/bin/draftsmith train recipes/cpu/dflash-smollm2.yaml run="dflash-l$n" output_dir="$out" \
    drafter.num_layers="$n" drafter.block_size="${BLOCK:-8}" optim.optimizer=adamw > "$out/dflash-l$n.log" 2>&1 ||
    { echo "block_depth.sh: $n layers failed (log: $out/dflash-l$n.log)" >&2; exit 1; }
done
.venv/bin/python - "$out" "${layers[@]}" <<'PY'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
print("| layers | train s | τ | per-position | speedup | (τ - 1) per train minute |")
print("|---|---|---|---|---|---|")
for n in sys.argv[2:]:
    r = json.loads((out / f"dflash-l{n}" / "eval" / "report.json").read_text())
    seconds = json.loads((out / f"dflash-l{n}" / "final" / "config.json").read_text())["train_seconds"]
    positions = " ".join(f"{p:.2f}" for p in r["per_position"])
    per_minute = (r["tau"] - 1) / (seconds / 60)
    print(f"| {n} | {seconds:.0f} | {r['tau']:.2f} | {positions} | {r['speedup']:.2f}x | {per_minute:.3f} |")
print(f"{r['device_name']}, {r['threads']} threads, {r['dtype']}, native bf16: {r['native_bf16']}")
PY
