#!/usr/bin/env bash
# Every feature-space and block family on the same rows and epochs, as speculators publishes its
# comparison (docs/user_guide/training_metrics.md there): each CPU recipe trained for 160 optimizer
# steps at batch 8 (2 epochs over the quickstart's 640 regenerated code answers and its cached
# features), then one `draftsmith compare` of all of them on the built-in code holdout, chains of
# K=3 for every family (one shared target-only baseline), greedy.
#   bash benchmarks/equal_data.sh [OUT]      (nothing else running)
# A run whose OUT/<run>/final exists is not trained again (e.g. the folders `draftsmith bakeoff
# --steps 160` trained from the same recipes). Prints, per family: training seconds, τ, per-position
# acceptance (conditional: P(draft k accepted | drafts 1..k-1 were)), prefix agreement (unconditional:
# P(drafts 1..k all accepted), speculators' metric) and speedup.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-equal-data}
mkdir -p "$out"
train() {  # train RUN RECIPE key=value...
  local run=$1 recipe=$2
  shift 2
  [ -d "$out/$run/final" ] && return 0
  # AdamW, as the published table was measured (the recipes train with Muon since; a row's keys win)
  .venv/bin/draftsmith train "recipes/cpu/$recipe.yaml" run="$run" output_dir="$out" optim.max_steps=160 \
    eval.enabled=false optim.optimizer=adamw "$@" > "$out/$run.log" 2>&1 ||
    { echo "equal_data.sh: $run failed (log: $out/$run.log)" >&2; exit 1; }
}
train eagle3-smollm2 eagle3-smollm2 drafter.draft_vocab_size=8192  # the recipe's vocabulary when measured (now 4096)
train peagle-smollm2 peagle-smollm2
train dflash-smollm2 dflash-smollm2 drafter.block_size=8  # the recipe's block when measured (now 4)
train dspark-smollm2 dspark-smollm2
train dspark-fillin-smollm2 dspark-smollm2 drafter.sample_from_anchor=false drafter.block_size=8
train dflash2-smollm2 dflash2-smollm2
runs=(eagle3-smollm2 peagle-smollm2 dflash-smollm2 dspark-smollm2 dspark-fillin-smollm2 dflash2-smollm2)
drafters=()
for run in "${runs[@]}"; do drafters+=(--drafter "$out/$run/final"); done
.venv/bin/draftsmith compare "${drafters[@]}" --data builtin:code-holdout --k 3 --num-prompts 20 \
  --out "$out/compare" > "$out/compare.log" 2>&1 ||
  { echo "equal_data.sh: compare failed (log: $out/compare.log)" >&2; exit 1; }
.venv/bin/python - "$out" <<'PY'
import json, math, sys
from pathlib import Path

out = Path(sys.argv[1])
print("| drafter | train s | τ | per-position | prefix agreement | speedup | lossless |")
print("|---|---|---|---|---|---|---|")
for r in json.loads((out / "compare" / "compare.json").read_text()):
    folder = Path(r["drafter_path"])
    seconds = json.loads((folder / "config.json").read_text())["train_seconds"]
    pp = r["per_position"]
    prefix = [math.prod(pp[: k + 1]) for k in range(len(pp))]
    cells = (" ".join(f"{p:.2f}" for p in xs) for xs in (pp, prefix))
    print(f"| {folder.parent.name} | {seconds:.0f} | {r['tau']:.2f} | {' | '.join(cells)} | {r['speedup']:.2f}x | {r['lossless']} |")
print(f"{r['device_name']}, {r['threads']} threads, {r['dtype']}, native bf16: {r['native_bf16']}")
PY
