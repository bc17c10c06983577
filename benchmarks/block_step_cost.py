"""What share of a block drafter's whole-vocabulary training step its slots' logits take.

    python -m benchmarks.block_step_cost [--target smollm2-135m] [--families dspark,dflash2,dflash]
                                         [--data builtin:code] [--draft-vocab 8192] [--reps 3]

For each family, its CPU recipe's drafter (`recipes/cpu/FAMILY-smollm2.yaml`) on the whole
vocabulary (a recipe's `draft_vocab_size` set to 0), on one micro-batch of the recipe's size: the
whole training step (`compute_loss` forward and backward, in the precision `auto` picks, under bf16
autocast where that is bf16, as the loop runs it), then the part of it that scores every trained slot
against the vocabulary (the frozen lm_head and the cross-entropy, forward and backward, on as many
rows), over the full vocabulary and over a reduced draft vocabulary of `--draft-vocab` rows (what
DFlash's and DSpark's `draft_vocab_size` saves). Printed side by side, in seconds, from one process.
Nothing else may run beside it.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch
import torch.nn.functional as F

from draftsmith.data.batching import build_dataset, collate
from draftsmith.models.registry import drafter_family
from draftsmith.target.features import target_features
from draftsmith.target.load import load_target
from draftsmith.train.config import drafter_config, load_config
from draftsmith.util import precision


def timed(fn, reps: int) -> float:
    fn()  # warm-up: allocations, oneDNN's kernel choice
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def measure(family: str, dcfg, target, batch: dict, draft_vocab: int, reps: int = 3) -> dict:
    """-> seconds of one training step and of its slot logits over the full and the draft vocabulary."""
    fam = drafter_family(family)
    dcfg = fam.resolve(dcfg, target.config)
    if getattr(dcfg, "draft_vocab_size", 0):  # the step whose full-vocabulary logits are measured below
        dcfg = replace(dcfg, draft_vocab_size=0)
    torch.manual_seed(0)
    drafter = fam.build(dcfg, target).train()
    feats = target_features(target, batch, fam.feature_names(dcfg, target.config))
    bf16 = next(target.parameters()).dtype == torch.bfloat16

    def step() -> int:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, n, _ = fam.compute_loss(drafter, target, batch, feats, dcfg)
        (loss / n).backward()
        drafter.zero_grad(set_to_none=True)
        return int(n)

    drafts = fam.max_draft_depth(dcfg)  # a block family's K: B-1, or B for DSpark anchor-as-first
    assert drafts is not None, f"{family} is not a block family"
    rows = step() * drafts  # n counts blocks; each trains its K drafts
    whole = timed(step, reps)
    weight = target.get_output_embeddings().weight  # frozen: only the slots' outputs get a gradient

    def head(vocab: int):
        def run():
            h = torch.randn(rows, weight.shape[1], requires_grad=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logits = F.linear(h.to(weight.dtype), weight[:vocab]).float()
            F.cross_entropy(logits, torch.randint(0, vocab, (rows,))).backward()

        return run

    full = timed(head(weight.shape[0]), reps)
    small = timed(head(min(draft_vocab, weight.shape[0])), reps)
    return {"family": family, "slot_rows": rows, "step_s": whole, "full_vocab_s": full, "draft_vocab_s": small}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--families", default="dspark,dflash2,dflash")
    p.add_argument("--data", default="builtin:code")
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    target, tok = load_target(args.target, "auto")
    print(f"machine: {precision.describe(precision.hardware('cpu'))}; target {args.target}, data {args.data}")
    print(
        f"| family | slot rows | training step s | slot logits over {target.config.vocab_size:,} s (share) | over {args.draft_vocab:,} s |"
    )
    print("|---|---|---|---|---|")
    for family in args.families.split(","):
        cfg = load_config(f"recipes/cpu/{family}-smollm2.yaml", [f"data.train={args.data}"])
        ds = build_dataset(cfg.data.train, tok, cfg.data.max_length)
        batch = collate([ds[i] for i in range(cfg.optim.batch_size)], tok.pad_token_id)
        r = measure(family, drafter_config(cfg), target, batch, args.draft_vocab, args.reps)
        print(
            f"| {family} | {r['slot_rows']} | {r['step_s']:.2f} | {r['full_vocab_s']:.2f} "
            f"({r['full_vocab_s'] / r['step_s']:.0%}) | {r['draft_vocab_s']:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
