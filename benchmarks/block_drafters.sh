#!/usr/bin/env bash
# DFlash, DSpark and DFlash2 side by side on the tiny pattern target (a 4-layer Qwen3-shaped target
# trained on a learnable pattern: benchmarks/tiny_target.py), the same data, budget and block, fp32,
# greedy; plus DSpark before training (a fresh drafter: its confidence head's calibration at init).
#   bash benchmarks/block_drafters.sh [OUT]      (about 4 minutes on 2 cores; nothing else running)
# Prints, per drafter: τ, per-position acceptance, speedup, rule_exact, identity, and for DSpark the
# ECE of its confidences and adaptive verification beside full-block verification (eval/report.json).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-block-drafters}
py=.venv/bin/python
export OMP_NUM_THREADS=1
rm -rf "$out" && mkdir -p "$out"
"$py" -m benchmarks.tiny_target "$out/target" --arch Qwen/Qwen3-8B --layers 4 --steps 300
echo "{}" > "$out/recipe.yaml"
common=(target="$out/target" output_dir="$out/runs" data.train="$out/target/train.jsonl"
        data.holdout="$out/target/holdout.jsonl" data.max_length=96 optim.batch_size=16 optim.warmup_steps=5
        eval.num_prompts=12 eval.max_new_tokens=48 eval.k=3
        optim.mixed_precision=no target_dtype=float32 eval.dtype=float32 "drafter.aux_layers=[0,1,2]" drafter.block_size=4)
train() {  # train RUN STEPS LR key=value...
  local run=$1 steps=$2 lr=$3
  shift 3
  "$py" -m draftsmith.cli train "$out/recipe.yaml" run="$run" optim.max_steps="$steps" optim.lr="$lr" "${common[@]}" "$@" \
    > "$out/$run.log" 2>&1 || { echo "block_drafters.sh: $run failed (log: $out/$run.log)" >&2; exit 1; }
}
train dspark-init 1 1e-12 drafter.type=dspark drafter.markov_rank=8  # one step at lr 1e-12: the fresh drafter
train dspark 300 3e-3 drafter.type=dspark drafter.markov_rank=8
train dflash 300 3e-3 drafter.type=dflash
train dflash2 300 3e-3 drafter.type=dflash2
"$py" - "$out/runs" <<'PY'
import json, sys
from pathlib import Path

runs = Path(sys.argv[1])
print("| drafter | τ | per-position | speedup | rule_exact | identical | train s | ECE (n) | adaptive: verified/round, τ |")
print("|---|---|---|---|---|---|---|---|---|")
for name in ("dspark-init", "dspark", "dflash", "dflash2"):
    r = json.loads((runs / name / "eval" / "report.json").read_text())
    meta = json.loads((runs / name / "final" / "config.json").read_text())
    cal, ad = r.get("calibration"), r.get("adaptive")
    ece = f"{cal['ece']:.3f} ({cal['n']})" if cal else "-"
    adaptive = f"{ad['adaptive']['verified_per_round']} of 3, {ad['adaptive']['tau']:.2f}" if ad else "-"
    positions = " ".join(f"{p:.2f}" for p in r["per_position"])
    print(
        f"| {name} | {r['tau']:.2f} | {positions} | {r['speedup']:.2f}x | {r['rule_exact']} | {r['lossless']} "
        f"| {meta.get('train_seconds')} | {ece} | {adaptive} |"
    )
print(f"target-only: {r['target_tokens_per_s']} tokens/s on {r['device_name']} ({r['threads']} threads)")
PY
