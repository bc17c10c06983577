#!/usr/bin/env bash
# The GPU check: every family trained in bf16 on one CUDA GPU through `./launch.sh --preset single-gpu`,
# its eval stage (greedy, the verification rule checked round by round: `rule_exact`), its export
# with `--verify` in bf16, and one table of tokens/s per family. For a machine whose image has torch,
# transformers, accelerate and peft but no package index: draftsmith installs from this tree with
# --no-deps, anything else it needs from --wheels DIR (pip download them here first:
# `pip download -d wheels datasets ...`), and the target is a tiny real-architecture one built from
# a config and trained on the GPU in seconds (benchmarks/tiny_target.py), not the 98 MB GGUF.
#
#   bash scripts/gpu-check.sh [--wheels DIR] [--out DIR] [--steps N]   on the GPU machine (about 3-5 min)
#   bash scripts/gpu-check.sh --cpu-dry [--out DIR]                    CI: the same steps on CPU, small
#
# --cpu-dry builds the target, prints every family's launch command (launch.sh --dry-run), then runs
# one family end to end on CPU in the precision `auto` picks there. Exit status: non-zero if any
# family fails a step; the table says which.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-$(command -v python3)}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && python=.venv/bin/python
export PATH="$(cd "$(dirname "$python")" && pwd):$PATH"  # launch.sh runs this environment's `accelerate`
out=gpu-check; wheels=""; steps=60; dry=0
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) wheels=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --cpu-dry) dry=1; shift ;;
    -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu-check.sh: error: unknown argument $1" >&2; exit 2 ;;
  esac
done
[[ "$steps" =~ ^[1-9][0-9]*$ ]] || { echo "gpu-check.sh: error: --steps: expected a positive whole number, got '$steps'" >&2; exit 2; }

# draftsmith itself, with no index: its own files, plus whatever --wheels holds.
if ! "$python" -c "import draftsmith.cli" 2>/dev/null; then
  [ -z "$wheels" ] || "$python" -m pip install -q --no-index --find-links "$wheels" "$wheels"/*.whl
  "$python" -m pip install -q --no-index --no-deps --no-build-isolation -e .
fi
missing=$("$python" -c 'import importlib.util as u; print(" ".join(m for m in ["torch", "transformers", "accelerate",
  "peft", "datasets", "safetensors", "huggingface_hub", "gguf", "yaml", "tqdm", "rich", "filelock", "matplotlib"] if not u.find_spec(m)))')
[ -z "$missing" ] || { echo "gpu-check.sh: error: missing $missing (bring them as wheels: --wheels DIR)" >&2; exit 1; }
"$python" -c "import draftsmith.cli" || { echo "gpu-check.sh: error: draftsmith does not import (its error is above)" >&2; exit 1; }
if [ "$dry" = 0 ]; then
  "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || { echo "gpu-check.sh: error: no CUDA GPU visible to torch (on CPU use --cpu-dry)" >&2; exit 1; }
  mode_args=(target_dtype=bf16 optim.mixed_precision=bf16 eval.dtype=bf16); dtype=bf16; preset=(--preset single-gpu)
else
  mode_args=(eval.num_prompts=3 eval.max_new_tokens=16); dtype=auto; preset=(); steps=2
fi
export DRAFTSMITH_VLLM_PYTHON=none  # vLLM is not part of this image; the serve-check runs where it is

# The families, as the package lists them (models/registry.py), no copy here: per line, a family's name,
# the format vLLM serves it from and its tiny run's overrides (its record's `tiny`; eval.k at most 3).
listing=$("$python" -m benchmarks.tiny_target --families 3)
all=(); declare -A extra=() format=()
while read -r f fmt args; do all+=("$f"); format[$f]=$fmt; extra[$f]=$args; done <<< "$listing"
if [ "$dry" = 0 ]; then families=("${all[@]}"); else families=(eagle3); fi  # --cpu-dry: one family end to end

rm -rf "$out" && mkdir -p "$out"
start=$SECONDS
"$python" -m benchmarks.tiny_target "$out/target" --arch Qwen/Qwen3-8B --layers 4 --steps "$([ "$dry" = 1 ] && echo 20 || echo 300)"
echo "[time] target: $((SECONDS - start)) s"

recipe="$out/recipe.yaml"
echo "{}" > "$recipe"  # everything comes as key=value below
common=(target="$out/target" output_dir="$out/runs" data.train="$out/target/train.jsonl"
        data.holdout="$out/target/holdout.jsonl" data.max_length=96 optim.batch_size=16 optim.max_steps="$steps"
        optim.warmup_steps=5 optim.lr=3e-3 eval.num_prompts=12 eval.max_new_tokens=48 "${mode_args[@]}")  # mode_args last: its keys win
if [ "$dry" = 1 ]; then
  for f in "${all[@]}"; do
    # shellcheck disable=SC2086
    ./launch.sh "$recipe" --preset single-gpu --dry-run run="$f" ${extra[$f]} "${common[@]}" >/dev/null
  done
  echo "launch commands: every family's parses (launch.sh --dry-run)"
fi

rows=(); failed=0
for f in "${families[@]}"; do
  t0=$SECONDS; trained=ok; verified=ok
  # shellcheck disable=SC2086
  ./launch.sh "$recipe" "${preset[@]}" run="$f" ${extra[$f]} "${common[@]}" > "$out/$f-train.log" 2>&1 \
    || { trained=FAILED; failed=1; }
  t_train=$((SECONDS - t0)); t0=$SECONDS
  if [ "$trained" = ok ]; then
    "$python" -m draftsmith.cli export "$out/runs/$f/final" --format "${format[$f]}" --out "$out/exports/$f" --verify \
      --data "$out/target/holdout.jsonl" --dtype "$dtype" > "$out/$f-export.log" 2>&1 || { verified=FAILED; failed=1; }
  else
    verified=skipped
  fi
  rows+=("$("$python" - "$out/runs/$f/eval/report.json" "$f" "$trained" "$verified" "$t_train" "$((SECONDS - t0))" <<'EOF'
import json, sys
from pathlib import Path
path, family, trained, verified, t_train, t_export = sys.argv[1:]
r = json.loads(Path(path).read_text()) if Path(path).is_file() else None
if r is None:
    print(f"| {family} | {trained} ({t_train} s) | - | - | - | - | - | - | {verified} ({t_export} s) |")
else:
    from draftsmith.eval.report import lossless_cell
    print(f"| {family} | {trained} ({t_train} s) | {r['dtype']} | {r['tau']:.2f} | {lossless_cell(r)} | "
          f"{r['target_tokens_per_s']:.1f} | {r['spec_tokens_per_s']:.1f} | {r['speedup']:.2f}x | {verified} ({t_export} s) |")
EOF
)")
done

"$python" - <<'EOF'
import torch
from draftsmith.util import precision
dev = "cuda" if torch.cuda.is_available() else "cpu"
print(f"\ngpu-check on {precision.describe(precision.hardware(dev))}, torch {torch.__version__}")
EOF
echo "| family | train | dtype | τ | lossless (rule_exact) | target tok/s | spec tok/s | speedup | export --verify |"
echo "|---|---|---|---|---|---|---|---|---|"
printf '%s\n' "${rows[@]}"
echo "[time] gpu-check: $((SECONDS - start)) s (logs in $out/)"
exit "$failed"
