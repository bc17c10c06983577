"""Last-turn vs every-turn regeneration on multi-turn chats, on the tiny pattern target.

    python -m benchmarks.multiturn [--out multiturn] [--steps 150] [--family eagle3]

Writes 3-turn conversations (96 to train on, 12 held out, other walks), trains the same drafter twice
on the same budget from the target's own answers (`data.turns=last`, then `all`), evaluates both on
the held-out conversations (each prompt: the conversation up to its last assistant turn, so the
earlier turns are in the context), and prints the data steps' accounting and τ side by side. The
target and drafters are tiny: the figures compare the two settings on this target, nothing more.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import decoders

from benchmarks.tiny_target import TINY_DRAFTERS, make_tokenizer, pattern_chat, train_pattern_target
from draftsmith.models.known import tiny_config
from draftsmith.train.config import load_config
from draftsmith.train.loop import train
from draftsmith.util import precision


def conversation(i: int) -> list[dict]:
    """Three pattern chats in a row: three user turns, each answered by an alphabet walk."""
    return pattern_chat(i) + pattern_chat(i + 7) + pattern_chat(i + 13)


def write(path: Path, ids) -> str:
    path.write_text("".join(json.dumps({"messages": conversation(i)}) + "\n" for i in ids))
    return str(path)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="multiturn")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--family", default="eagle3", choices=sorted(TINY_DRAFTERS))
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer()
    # Decoded text re-reads as the same tokens (the test tokenizer's default decoder spaces characters
    # apart), as with real BPE tokenizers: a conversation's answers then share one training sequence.
    tok.backend_tokenizer.decoder = decoders.Fuse()
    target = out / "target"
    if not (target / "config.json").is_file():
        train_pattern_target(target, tiny_config("Qwen/Qwen3-8B", len(tok), layers=4, tie_word_embeddings=True), tok)
    data, holdout = write(out / "train.jsonl", range(96)), write(out / "holdout.jsonl", range(300, 312))
    rows = []
    for turns in ("last", "all"):
        overrides = {
            "target": str(target),
            "output_dir": str(out / "runs"),
            "cache_dir": str(out / "cache"),
            "run": f"{args.family}-{turns}",
            "data.train": data,
            "data.holdout": holdout,
            "data.regenerate": "true",
            "data.turns": turns,
            "data.max_length": 512,
            "drafter.type": args.family,
            **{k: json.dumps(v) for k, v in TINY_DRAFTERS[args.family].items()},
            "optim.max_steps": args.steps,
            "optim.batch_size": 8,
            "optim.lr": "3e-3",
            "log_every": 50,
            "eval.num_prompts": 12,
            "eval.max_new_tokens": 40,
            "eval.k": 3,
        }
        run = train(load_config(None, [f"{k}={v}" for k, v in overrides.items()]))
        report = json.loads((run / "eval" / "report.json").read_text())
        stats = json.loads((run / "data.json").read_text())
        rows.append((turns, stats, report))
    print(
        f"\n{args.family} on the tiny pattern target, {args.steps} steps, {precision.describe(precision.hardware('cpu'))}"
    )
    print(
        "| data.turns | conversations | answers regenerated | records | examples | tokens | with loss | dropped | τ | per-position |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for turns, stats, r in rows:
        g, d = stats["regenerated"], stats["dataset"]
        dropped = sum(v["count"] for v in d["dropped"].values())
        per_pos = " ".join(f"{a:.2f}" for a in r["per_position"])
        print(
            f"| {turns} | {g['conversations']} | {g['answers']} | {d['records']} | {d['examples']} | {d['tokens']:,} | "
            f"{d['loss_tokens']:,} | {dropped} | {r['tau']:.2f} | {per_pos} |"
        )


if __name__ == "__main__":
    main()
