"""Staleness: what a drafter loses when its target is updated, and what a short refresh buys back.

    python -m benchmarks.staleness --drafter checkpoints/eagle3-smollm2/final \\
        --recipe recipes/cpu/eagle3-smollm2.yaml --out staleness/

1. **update**: the target is fine-tuned with LoRA (peft) on another domain's answers (`--update-data`,
   default `builtin:chat`), the adapters are merged and the result is saved as a plain transformers
   folder: the "updated target", as a fine-tune or an RLHF round would ship it. Its drift from the
   original on the holdout is measured (eval/run.py `backbone_drift`).
2. **stale**: the drafter's τ and speedup on the original target, then on the updated one (what
   `draftsmith eval --target UPDATED --allow-stale` reports; the report is marked stale).
3. **refresh**: `draftsmith train RECIPE target=UPDATED init_from=DRAFTER init_from_stale=true` with a small budget
   (`--refresh-examples` prompts answered by the updated target, `--refresh-epochs`): the drafter is
   fine-tuned on data the updated target regenerated, and evaluated on the updated target.

Prints one table (τ, acceptance, speedup, lossless per row) and writes staleness.json. All three
evaluations use the same holdout prompts, greedy, batch 1, on the machine at hand.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from draftsmith.data.batching import collate
from draftsmith.data.load import read_records, to_messages, tokenize_example
from draftsmith.eval.config import EvalConfig
from draftsmith.eval.drafters import Resolved
from draftsmith.eval.report import format_table
from draftsmith.eval.run import backbone_drift, evaluate
from draftsmith.models.registry import load_drafter
from draftsmith.target.load import fingerprint, load_target
from draftsmith.util import precision


def update_target(
    target,
    tok,
    data: str,
    out: Path,
    steps: int,
    batch_size: int,
    lr: float,
    rank: int,
    max_length: int = 256,
    seed: int = 0,
) -> Path:
    """LoRA fine-tune of `target` (a copy) on `data`'s chat records, merged and saved to `out`."""
    import copy

    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(
        copy.deepcopy(target).train(), LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear")
    )
    rows = [
        tokenize_example(tok, to_messages(r, f"{data}: record {n}"), max_length, data)
        for n, r in enumerate(read_records(data))
    ]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    for step in range(steps):
        picks = torch.randint(len(rows), (batch_size,)).tolist()
        batch = collate([{**rows[i], "idx": i} for i in picks], tok.pad_token_id)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        # Token t+1 is predicted at position t; only assistant tokens carry loss.
        mask = batch["loss_mask"][:, 1:].float()
        nll = torch.nn.functional.cross_entropy(
            logits.transpose(1, 2).float(), batch["input_ids"][:, 1:], reduction="none"
        )
        loss = (nll * mask).sum() / mask.sum().clamp(min=1)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 10 == 0 or step == steps - 1:
            print(f"update step {step}: loss {loss.item():.3f}")
    merged = model.merge_and_unload().eval()
    tmp = out.with_name(out.name + ".tmp")
    merged.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", default="checkpoints/eagle3-smollm2/final")
    p.add_argument(
        "--recipe", default="recipes/cpu/eagle3-smollm2.yaml", help="the drafter's recipe, rerun for the refresh"
    )
    p.add_argument("--data", default="builtin:code-holdout")
    p.add_argument("--tree", default="dynamic:depth=3,top_k=3,tokens=8")
    p.add_argument("--num-prompts", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--update-data", default="builtin:chat")
    p.add_argument("--update-steps", type=int, default=60)
    p.add_argument("--update-lr", type=float, default=5e-4)
    p.add_argument("--update-rank", type=int, default=16)
    p.add_argument("--refresh-examples", type=int, default=192)
    p.add_argument("--refresh-epochs", type=int, default=1)
    p.add_argument("--out", default="staleness")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    meta = json.loads((Path(args.drafter) / "config.json").read_text())
    target, tok = load_target(meta["target"], "auto")
    updated_dir = out / "updated-target"
    t0 = time.perf_counter()
    if not updated_dir.is_dir():
        update_target(
            target, tok, args.update_data, updated_dir, args.update_steps, 8, args.update_lr, args.update_rank
        )
    update_s = time.perf_counter() - t0
    updated, _ = load_target(str(updated_dir), "auto")
    cfg = EvalConfig(num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens, tree=args.tree)

    family, dcfg, drafter = load_drafter(args.drafter, target)
    rows = [
        (
            "original target",
            evaluate(
                Resolved("original target", family.make_proposer(drafter, target, dcfg), target, None),
                tok,
                args.data,
                None,
                cfg,
                target_name=meta["target"],
            ),
        )
    ]
    drift = backbone_drift(target, updated, tok, args.data, family.make_proposer(drafter, target, dcfg), cfg)
    stale = {"trained_for": meta["target_fingerprint"], "evaluated_on": fingerprint(updated)}
    family, dcfg, drafter = load_drafter(args.drafter, updated, allow_stale=True)
    rows.append(
        (
            "updated target, stale drafter",
            evaluate(
                Resolved("stale", family.make_proposer(drafter, updated, dcfg), updated, None),
                tok,
                args.data,
                None,
                cfg,
                target_name=str(updated_dir),
                stale=stale,
            ),
        )
    )

    # The refresh is the command a user would run (a subprocess: benchmarks sit below the trainer).
    run_dir = out / f"refresh-{int(time.time())}"
    t0 = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "draftsmith.cli",
            "train",
            args.recipe,
            f"target={updated_dir}",
            f"init_from={args.drafter}",
            "init_from_stale=true",
            f"run={run_dir.name}",
            f"output_dir={out}",
            f"data.max_examples={args.refresh_examples}",
            f"optim.epochs={args.refresh_epochs}",
            "eval.enabled=false",
        ],
        check=True,
    )
    refresh_s = time.perf_counter() - t0
    family, dcfg, drafter = load_drafter(run_dir / "final", updated)
    rows.append(
        (
            "updated target, refreshed drafter",
            evaluate(
                Resolved("refreshed", family.make_proposer(drafter, updated, dcfg), updated, None),
                tok,
                args.data,
                None,
                cfg,
                target_name=str(updated_dir),
            ),
        )
    )

    where = precision.describe(precision.hardware("cpu"))
    print(f"\nStaleness on {args.data} ({args.num_prompts} prompts, {args.tree}), {where}, {rows[0][1]['dtype']}")
    print(
        f"update: LoRA r={args.update_rank} on {args.update_data}, {args.update_steps} steps ({update_s:.0f} s); "
        f"drift: {drift['unchanged_fraction']:.0%} of prompts unchanged, token agreement {drift['token_agreement']:.1%}"
    )
    print(
        f"refresh: {args.refresh_examples} regenerated examples x {args.refresh_epochs} epoch(s), {refresh_s:.0f} s "
        f"(regeneration + training)"
    )
    print(format_table([{**r, "drafter": label} for label, r in rows]))
    result = {
        "rows": [{"setting": label, **r} for label, r in rows],
        "drift": drift,
        "update_seconds": update_s,
        "refresh_seconds": refresh_s,
        "args": vars(args),
    }
    (out / "staleness.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
