"""Training throughput, 1 vs 2 processes on this machine: plain DDP, DeepSpeed ZeRO-2 and ZeRO-3.

    python -m benchmarks.scaling --recipe recipes/cpu/eagle3-smollm2.yaml --steps 12 --out scaling/

Every row is a real `launch.sh` run of the recipe (the command a user types), `--steps` optimizer
steps with the eval stage off, on the same global batch: 2 processes get half the recipe's
per-process `optim.batch_size` each. The CPU's threads are split between the processes
(OMP_NUM_THREADS = cores / processes), as one GPU per process would be. Tokens/s comes from the
run's own train_log.jsonl (tokens are summed over ranks), leaving out the first logged window
(warm-up); "per process" divides it by the process count. Wall is the whole launch (start-up,
loading the target, DeepSpeed initialisation, the steps, saving). Peak RSS is rank 0's
(`final/config.json`).

Prints one table and writes scaling.json. On a CPU the processes share the same cores and memory
bandwidth, so 2 processes cannot beat 1 by much here: the table measures what the distributed
machinery costs (gradient all-reduce, ZeRO's partitioning and gathers), not the speedup of more GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from draftsmith.util import precision

ROOT = Path(__file__).resolve().parents[1]
SETUPS = {  # name -> launch.sh flags, given the process count
    "ddp": lambda n: ["--cpu-procs", str(n)] if n > 1 else [],
    "zero2": lambda n: ["--preset", "zero2", "--cpu-procs", str(n)],
    "zero3": lambda n: ["--preset", "zero3", "--cpu-procs", str(n)],
}


def run_one(recipe: str, setup: str, procs: int, steps: int, batch: int, out: Path, extra: list[str]) -> dict:
    name = f"{setup}-{procs}proc"
    overrides = [
        f"run={name}",
        f"output_dir={out}",
        f"optim.max_steps={steps}",
        "log_every=2",
        "save_every=0",
        "eval.enabled=false",
        f"optim.batch_size={batch // procs}",
        *extra,
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // procs)),
        # launch.sh runs `accelerate`: the one installed beside this Python, venv activated or not.
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    cmd = ["bash", str(ROOT / "launch.sh"), recipe, *SETUPS[setup](procs), "--main-port", "0", *overrides]
    print("$", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - t0
    logs = [json.loads(line) for line in (out / name / "train_log.jsonl").read_text().splitlines()]
    steady = logs[1:] or logs  # the first window holds the warm-up (first matmuls, DeepSpeed's first gathers)
    tok_s = statistics.median(entry["tok_per_s"] for entry in steady)
    meta = json.loads((out / name / "final" / "config.json").read_text())
    return {
        "setup": setup,
        "processes": procs,
        "tokens_per_s": tok_s,
        "tokens_per_s_per_process": tok_s / procs,
        "wall_s": wall,
        "train_s": meta["train_seconds"],
        "peak_rss_gb_rank0": meta["peak_rss_gb"],
        "final_loss": logs[-1]["loss"],
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="recipes/cpu/eagle3-smollm2.yaml")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=8, help="global examples per optimizer step")
    p.add_argument("--setups", default="ddp,zero2,zero3")
    p.add_argument("--procs", default="1,2", help="process counts to run each setup with")
    p.add_argument("--out", default="scaling")
    p.add_argument("overrides", nargs="*", help="more key=value overrides for every run")
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for setup in args.setups.split(","):
        for procs in map(int, args.procs.split(",")):
            rows.append(run_one(args.recipe, setup, procs, args.steps, args.batch_size, out, args.overrides))
    where = precision.describe(precision.hardware("cpu"))
    print(f"\n{args.recipe}, {args.steps} steps of {args.batch_size} examples, {where}")
    print(
        "| setup | processes | tokens/s | tokens/s per process | 2 vs 1 process (total) | wall s | peak RSS rank 0 GB |"
    )
    print("|---|---|---|---|---|---|---|")
    one = {r["setup"]: r["tokens_per_s"] for r in rows if r["processes"] == 1}
    for r in rows:
        ratio = f"{r['tokens_per_s'] / one[r['setup']]:.2f}x" if r["processes"] == 2 and r["setup"] in one else "-"
        print(
            f"| {r['setup']} | {r['processes']} | {r['tokens_per_s']:.0f} | {r['tokens_per_s_per_process']:.0f} | "
            f"{ratio} | {r['wall_s']:.0f} | {r['peak_rss_gb_rank0']:.2f} |"
        )
    (out / "scaling.json").write_text(json.dumps({"rows": rows, "args": vars(args), "hardware": where}, indent=1))


if __name__ == "__main__":
    main()
