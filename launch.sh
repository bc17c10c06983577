#!/usr/bin/env bash
# One launcher for every scale. Wraps `accelerate launch`; the training code is the same everywhere.
#
#   ./launch.sh RECIPE.yaml [key=value ...]                      one process (CPU or one GPU)
#   ./launch.sh RECIPE.yaml --gpus 8 [key=value ...]             DDP on 8 local GPUs (NCCL)
#   ./launch.sh RECIPE.yaml --cpu-procs 2 [key=value ...]        2 CPU processes over gloo
#   ./launch.sh RECIPE.yaml --gpus 8 --nodes 2 --node-rank 0 --main-addr 10.0.0.1   multi-node
#   ./launch.sh RECIPE.yaml --accelerate-config recipes/accelerate/multi-gpu.yaml
#
# On SLURM, run one `./launch.sh ... --nodes $SLURM_NNODES --node-rank $SLURM_NODEID --main-addr $MASTER` per node.
set -euo pipefail

usage() { sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }
[ $# -ge 1 ] || usage 2
case "$1" in -h|--help) usage 0 ;; esac

recipe=$1; shift
gpus=0; cpu_procs=0; nodes=1; node_rank=0; main_addr=127.0.0.1; main_port=29500; acc_config=""; overrides=()
while [ $# -gt 0 ]; do
  case "$1" in
    --gpus) gpus=$2; shift 2 ;;
    --cpu-procs) cpu_procs=$2; shift 2 ;;
    --nodes) nodes=$2; shift 2 ;;
    --node-rank) node_rank=$2; shift 2 ;;
    --main-addr) main_addr=$2; shift 2 ;;
    --main-port) main_port=$2; shift 2 ;;
    --accelerate-config) acc_config=$2; shift 2 ;;
    -h|--help) usage 0 ;;
    --*) echo "launch.sh: error: unknown option $1" >&2; exit 2 ;;
    *) overrides+=("$1"); shift ;;
  esac
done
[ -f "$recipe" ] || { echo "launch.sh: error: recipe $recipe not found" >&2; exit 2; }

args=(--num_machines "$nodes" --machine_rank "$node_rank" --main_process_ip "$main_addr" --main_process_port "$main_port" --dynamo_backend no)
if [ -n "$acc_config" ]; then
  args=(--config_file "$acc_config" "${args[@]}")
  [ "$gpus" -gt 0 ] && args+=(--num_processes $((gpus * nodes)))
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
exec accelerate launch "${args[@]}" -m draftsmith.cli train "$recipe" "${overrides[@]}"
