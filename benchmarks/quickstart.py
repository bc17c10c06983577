"""Benchmark the quickstart drafter against target-only decoding and prompt lookup, side by side.

    python -m benchmarks.quickstart --drafter checkpoints/eagle3-smollm2/final [--tree SPEC]

Same process, same prompts, same target: target-only (none), n-gram prompt lookup, the trained
drafter. Prints the eval table, speedups relative to target-only, the drafter's training time
(recorded in its config.json), and this process's peak RSS. Optionally measures the offline
feature cache's bytes per token (--feature-cache DIR).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
from pathlib import Path

from draftsmith.eval.config import EvalConfig
from draftsmith.eval.drafters import Resolved, make_baseline
from draftsmith.eval.report import format_table
from draftsmith.eval.run import evaluate
from draftsmith.models.registry import load_drafter
from draftsmith.target.load import load_target
from draftsmith.util import precision


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", default="checkpoints/eagle3-smollm2/final")
    p.add_argument("--tree", default=None, help="evaluate the drafter with this draft tree instead of a K chain")
    p.add_argument("--data", default="builtin:code-holdout")
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--feature-cache", default="")
    p.add_argument("--out", default="", help="also write the results as JSON here")
    args = p.parse_args(argv)

    meta = json.loads((Path(args.drafter) / "config.json").read_text())
    target, tok = load_target(meta["target"])
    family, dcfg, drafter = load_drafter(args.drafter, target)
    cfg = EvalConfig(k=args.k, num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens)
    drafters = [
        Resolved("none", make_baseline("none"), target, None),
        Resolved("ngram", make_baseline("ngram"), target, None),
        Resolved(family.NAME, family.make_proposer(drafter, target, dcfg), target, args.tree),
    ]
    reports = [evaluate(d, tok, args.data, None, cfg, target_name=meta["target"]) for d in drafters]
    print(
        f"measured on {precision.describe(precision.hardware(next(target.parameters()).device))}, {reports[0]['dtype']}"
    )
    print(format_table(reports))
    base = reports[0]["spec_tokens_per_s"]
    for r in reports[1:]:
        print(
            f"{r['drafter']}: tau {r['tau']:.2f}, {r['spec_tokens_per_s'] / base:.2f}x target-only tokens/s "
            f"(same-pass ratio {r['speedup']:.2f}x), lossless={r['lossless']}"
        )
    print(
        f"drafter training: {meta.get('train_seconds')} s over {meta.get('steps')} steps "
        f"on {meta.get('processes', 1)} process(es)"
    )
    print(f"peak RSS of this eval process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    result = {"reports": reports, "train_seconds": meta.get("train_seconds")}
    if args.feature_cache:
        index = json.loads((Path(args.feature_cache) / "index.json").read_text())
        size = sum(os.path.getsize(Path(args.feature_cache) / s["file"]) for s in index["shards"])
        per = size / index["num_tokens"] / len(index["features"])
        width = {"F32": 4, "BF16": 2, "F16": 2}[index["dtype"]]
        print(
            f"feature cache: {size / 2**20:.1f} MiB for {index['num_tokens']} tokens = {per:.1f} B/token/tensor "
            f"({width}*H = {width * index['hidden_size']}, {index['dtype']})"
        )
        result["feature_bytes_per_token_per_layer"] = per
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
