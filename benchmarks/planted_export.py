"""An EAGLE-3 export with a planted, partial defect, for serve-check's planted-defect row (docs/verdicts.md).

    python -m benchmarks.planted_export FINAL OUT [--fraction 0.02] [--among 400] [--target smollm2-135m]
    draftsmith serve-check OUT --drafter FINAL --data builtin:code-holdout --k 3 --dtype float32

The drafter in FINAL is exported in the speculators format, then `fraction` of its d2t rows (draft id ->
target id) are swapped in pairs, all drawn (seed 0) from the `among` most frequent draft ids (the draft
vocabulary is ordered by frequency): the head then drafts the wrong target token exactly where it
would draft one of those ids, and is right everywhere else. Nothing is timed.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from draftsmith.ship.export import export
from draftsmith.target.load import load_target


def swap_d2t(d2t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """d2t with the target ids of rows (a0, b0, a1, b1, ...) exchanged pairwise; target = draft + d2t[draft]."""
    ids = torch.arange(len(d2t))
    targets = ids + d2t
    for a, b in zip(rows[::2], rows[1::2]):
        targets[a], targets[b] = targets[b].clone(), targets[a].clone()
    return (targets - ids).to(d2t.dtype).contiguous()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("final")
    ap.add_argument("out")
    ap.add_argument("--fraction", type=float, default=0.02)
    ap.add_argument("--among", type=int, default=400)
    ap.add_argument("--target", default="smollm2-135m")
    args = ap.parse_args()
    target, tok = load_target(args.target, "float32")
    exported = export(Path(args.final), target, "speculators", Path(args.out), tok)
    state = load_file(exported / "model.safetensors")
    candidates = list(range(min(args.among, len(state["d2t"]))))
    random.Random(0).shuffle(candidates)
    rows = candidates[: int(args.fraction * len(state["d2t"])) // 2 * 2]
    state["d2t"] = swap_d2t(state["d2t"], rows)
    save_file(state, exported / "model.safetensors", metadata={"format": "pt"})
    print(f"{exported}: {len(rows)} of {len(state['d2t'])} d2t rows swapped in pairs")


if __name__ == "__main__":
    main()
