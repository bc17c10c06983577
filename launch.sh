#!/usr/bin/env bash
# One launcher for every scale. Wraps `accelerate launch`; the training code is the same everywhere.
#
#   ./launch.sh RECIPE.yaml [key=value ...]                              one process (CPU or one GPU)
#   ./launch.sh RECIPE.yaml --gpus 8 [key=value ...]                     DDP on 8 local GPUs (NCCL)
#   ./launch.sh RECIPE.yaml --preset zero2 --gpus 8                      a preset from recipes/accelerate/
#   ./launch.sh RECIPE.yaml --cpu-procs 2 [key=value ...]                2 CPU processes over gloo
#   ./launch.sh RECIPE.yaml --preset zero3 --cpu-procs 2                 DeepSpeed ZeRO-3 on 2 CPU processes
#   ./launch.sh RECIPE.yaml --gpus 8 --nodes 2 --node-rank 0 --main-addr 10.0.0.1   multi-node, per node
#   srun --nodes 2 --ntasks-per-node 1 ./launch.sh RECIPE.yaml --preset multi-node   SLURM (reads SLURM_*)
#   ./launch.sh ... --dry-run                                            print the command, run nothing
#
# Presets: single-gpu multi-gpu multi-node zero2 zero3 zero3-offload fsdp cpu-2proc (recipes/accelerate/).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
usage() { sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }
[ $# -ge 1 ] || usage 2
case "$1" in -h|--help) usage 0 ;; esac

recipe=$1; shift
gpus=0; cpu_procs=0; nodes=1; node_rank=0; main_addr=127.0.0.1; main_port=29500; acc_config=""; preset=""
dry_run=0; overrides=(); set_nodes=0; set_rank=0; set_addr=0
while [ $# -gt 0 ]; do
  case "$1" in
    --gpus) gpus=$2; shift 2 ;;
    --cpu-procs) cpu_procs=$2; shift 2 ;;
    --nodes) nodes=$2; set_nodes=1; shift 2 ;;
    --node-rank) node_rank=$2; set_rank=1; shift 2 ;;
    --main-addr) main_addr=$2; set_addr=1; shift 2 ;;
    --main-port) main_port=$2; shift 2 ;;
    --preset) preset=$2; shift 2 ;;
    --accelerate-config) acc_config=$2; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) usage 0 ;;
    --*) echo "launch.sh: error: unknown option $1" >&2; exit 2 ;;
    *) overrides+=("$1"); shift ;;
  esac
done
[ -f "$recipe" ] || { echo "launch.sh: error: recipe $recipe not found" >&2; exit 2; }

if [ -n "$preset" ]; then
  acc_config="$here/recipes/accelerate/$preset.yaml"
  if [ ! -f "$acc_config" ]; then
    valid=$(cd "$here/recipes/accelerate" && ls *.yaml | sed 's/\.yaml$//' | tr '\n' ' ')
    echo "launch.sh: error: unknown preset '$preset' (valid: ${valid% })" >&2; exit 2
  fi
fi

# Under SLURM (srun/sbatch), one launcher per node: nodes, this node's rank, the first node as the
# rendezvous host and the GPUs per node come from SLURM_* unless given as flags.
if [ -n "${SLURM_JOB_ID:-}" ]; then
  [ "$set_nodes" = 1 ] || nodes=${SLURM_NNODES:-${SLURM_JOB_NUM_NODES:-1}}
  [ "$set_rank" = 1 ] || node_rank=${SLURM_NODEID:-0}
  if [ "$set_addr" = 0 ]; then
    if [ -n "${MASTER_ADDR:-}" ]; then main_addr=$MASTER_ADDR
    elif command -v scontrol >/dev/null && [ -n "${SLURM_JOB_NODELIST:-}" ]; then
      main_addr=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    fi
  fi
  if [ "$gpus" = 0 ] && [ -n "${SLURM_GPUS_ON_NODE:-}" ]; then gpus=$SLURM_GPUS_ON_NODE; fi
fi

# Checked after SLURM's values are in: every count a whole number in range, or a one-line error.
count() {  # count FLAG VALUE MIN: VALUE must be a whole number >= MIN
  [[ "$2" =~ ^[0-9]+$ ]] && [ "$2" -ge "$3" ] || { echo "launch.sh: error: $1: expected a whole number >= $3, got '$2'" >&2; exit 2; }
}
count --gpus "$gpus" 0; count --cpu-procs "$cpu_procs" 0; count --nodes "$nodes" 1; count --main-port "$main_port" 0
count --node-rank "$node_rank" 0
[ "$node_rank" -lt "$nodes" ] || { echo "launch.sh: error: --node-rank: expected 0..$((nodes - 1)) for --nodes $nodes, got $node_rank" >&2; exit 2; }
args=(--num_machines "$nodes" --machine_rank "$node_rank" --main_process_ip "$main_addr" --main_process_port "$main_port" --dynamo_backend no)
if [ -n "$acc_config" ]; then
  args=(--config_file "$acc_config" "${args[@]}")
  # A DeepSpeed preset names its JSON relative to this folder: pass it absolute so any cwd works.
  ds_json=$(sed -n 's/^ *deepspeed_config_file: *//p' "$acc_config")
  if [ -n "$ds_json" ] && [ "${ds_json#/}" = "$ds_json" ]; then args+=(--deepspeed_config_file "$here/$ds_json"); fi
  if [ "$gpus" -gt 0 ]; then args+=(--num_processes $((gpus * nodes)))
  elif [ "$cpu_procs" -gt 0 ]; then
    # DeepSpeed presets run on CPUs too (gloo; see make_accelerator in train/loop.py).
    args+=(--num_processes "$cpu_procs")
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  fi
elif [ "$gpus" -gt 0 ]; then
  args+=(--multi_gpu --num_processes $((gpus * nodes)))
elif [ "$cpu_procs" -gt 1 ]; then
  # accelerate's `--cpu --num_processes N` starts one process; the multi-GPU launcher on a CUDA-less
  # machine starts N ranks, and draftsmith joins them over gloo.
  args+=(--multi_gpu --num_processes "$cpu_procs")
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
else
  args+=(--num_processes 1)
fi
cmd=(accelerate launch "${args[@]}" -m draftsmith.cli train "$recipe" "${overrides[@]}")
if [ "$dry_run" = 1 ]; then
  printf '%q ' "${cmd[@]}"; echo
  exit 0
fi
exec "${cmd[@]}"
