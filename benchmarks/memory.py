"""The memory planner (`draftsmith plan`) against memory measured on this CPU.

    python -m benchmarks.memory                       # every case below
    python -m benchmarks.memory --case smollm2-eagle3 --out memory/

Each case builds what the training loop builds (the target in its resolved dtype, the drafter, the
recipe's AdamW), runs one warm-up optimizer step on a micro-batch of `optim.batch_size` random
sequences of exactly `data.max_length` tokens (the planner's assumption: full-length rows, every
position in the loss), then measures a second step under torch's profiler, which records every
CPU allocation and free of the torch allocator (`profile_memory=True`). Measured are:

- weights and optimizer state: the bytes of the real tensors;
- step peak: the most memory live at any moment of that step above what was live when it began
  (activations kept for backward, the target's features, gradients, the loss's logits, transients
  such as the optimizer's foreach buffers). The planner's counterpart is activations + gradients;
- total: what was live when the step began (weights, optimizer state, the batch) plus step peak,
  against the planner's single-GPU total.

The planner is run on the same resolved config (on a CPU without native bf16: fp32 everywhere),
so both sides count the same dtype. Prints one table, writes memory.json. Allocations are counted,
not resident pages: RSS adds the allocator's caching and the Python heap (printed once, at the end).
"""

from __future__ import annotations

import argparse
import json
import resource
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile
from torch.profiler._memory_profiler import MemoryProfileTimeline
from transformers import AutoModelForCausalLM, LlamaConfig

from draftsmith.models.registry import drafter_family
from draftsmith.target.features import target_features
from draftsmith.target.load import freeze, load_target
from draftsmith.train.config import Config, drafter_config, load_config, resolve_precision
from draftsmith.train.plan import per_rank, sizes, target_bytes
from draftsmith.util import precision

MiB = 2**20
ROOT = Path(__file__).resolve().parents[1]
# A tiny Llama (random weights, built from its config: no files) and the 135M embedded target.
TINY = dict(
    vocab_size=2048,
    hidden_size=64,
    intermediate_size=192,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=True,
)
TINY_RUN = ["optim.batch_size=4", "data.max_length=256", "data.offline_features=", "target_dtype=auto"]
CASES = {  # name -> (recipe, overrides); target "tiny" means the TINY config above
    "tiny-eagle3": (
        None,
        [
            "target=tiny",
            "drafter.type=eagle3",
            "drafter.aux_layers=[0,1,2]",
            "drafter.draft_vocab_size=512",
            "drafter.ttt_steps=3",
            *TINY_RUN,
        ],
    ),
    "tiny-medusa2": (
        None,
        [
            "target=tiny",
            "drafter.type=medusa",
            "drafter.num_heads=3",
            "drafter.backbone=lora",
            "drafter.backbone_lr=1e-4",
            "drafter.lora_rank=8",
            "eval.k=3",
            *TINY_RUN,
        ],
    ),
    "tiny-distill": (None, ["target=tiny", "drafter.type=distill", "drafter.num_layers=2", *TINY_RUN]),
    # The CPU recipes as they train (regeneration off: the batch is random tokens anyway).
    **{
        f"smollm2-{recipe.removesuffix('-smollm2')}": (
            f"recipes/cpu/{recipe}.yaml",
            ["data.offline_features=", "data.regenerate=false"],
        )
        for recipe in ("eagle3-smollm2", "medusa1-smollm2", "distill-smollm2")
    },
}


def build(cfg: Config):
    if cfg.target == "tiny":
        torch.manual_seed(0)
        target = freeze(AutoModelForCausalLM.from_config(LlamaConfig(**TINY), dtype=precision.TORCH[cfg.target_dtype]))
    else:
        target, _ = load_target(cfg.target, cfg.target_dtype, cfg.cache_dir)
    family, dcfg = drafter_family(cfg.drafter["type"]), drafter_config(cfg)
    batch = full_batch(cfg, target.config.vocab_size)
    # The batch stands in for the dataset (an EAGLE-3 / Medusa draft vocabulary is counted on it).
    drafter = family.build(dcfg, target, {k: batch[k].tolist() for k in ("input_ids", "loss_mask")})
    groups = family.param_groups(drafter, dcfg, cfg.optim.lr)
    optimizer = torch.optim.AdamW(groups, lr=cfg.optim.lr, betas=cfg.optim.betas, weight_decay=cfg.optim.weight_decay)
    return family, dcfg, target, drafter, optimizer, batch


def full_batch(cfg: Config, vocab: int) -> dict:
    """optim.batch_size rows of exactly data.max_length random tokens, every position in the loss."""
    g = torch.Generator().manual_seed(0)
    shape = (cfg.optim.batch_size, cfg.data.max_length)
    return {
        "input_ids": torch.randint(0, vocab, shape, generator=g),
        "loss_mask": torch.ones(shape, dtype=torch.long),
        "attention_mask": torch.ones(shape, dtype=torch.long),
        "idx": torch.arange(shape[0]),
    }


def measure(cfg: Config) -> dict:
    family, dcfg, target, drafter, optimizer, batch = build(cfg)
    names = family.feature_names(dcfg, target.config)
    trainable = [p for g in optimizer.param_groups for p in g["params"]]
    autocast = torch.autocast(
        "cpu", dtype=precision.TORCH[cfg.optim.mixed_precision], enabled=cfg.optim.mixed_precision != "float32"
    )

    def step(n: int):  # the loop's micro-step and optimizer step, one process, no accumulation
        with autocast:
            loss_sum, n_tok, _ = family.compute_loss(
                drafter, target, batch, target_features(target, batch, names) if names else {}, dcfg, step=n
            )
        (loss_sum / n_tok.clamp(min=1)).backward()
        torch.nn.utils.clip_grad_norm_(trainable, cfg.optim.clip_grad or float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step(0)  # allocates the optimizer state
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        step(1)
    # Live bytes by category after each allocation event; row 0 holds what existed before the step.
    _, by_category = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline("cpu")
    live = np.asarray(by_category).sum(axis=1)
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    target_ids = {id(p) for p in target.parameters()}
    measured = {
        "target weights": nbytes(target.parameters()),
        "drafter weights": nbytes(p for p in drafter.parameters() if id(p) not in target_ids),
        "optimizer": nbytes(v for st in optimizer.state.values() for k, v in st.items() if k != "step"),
        "batch": nbytes(batch.values()),
        "step peak": int(live.max() - live[0]),
    }
    measured["total"] = sum(measured.values())
    planned = per_rank(sizes(cfg, target.config), "single-gpu", 1, target_bytes(cfg))
    planned["step peak"] = planned["activations"] + planned["gradients"]
    return {"planned": planned, "measured": measured}


def case_config(name: str) -> Config:
    recipe, overrides = CASES[name]
    return resolve_precision(load_config(str(ROOT / recipe) if recipe else None, overrides))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", action="append", choices=list(CASES), help="repeatable; default: every case")
    ap.add_argument("--out", default="memory", help="folder for memory.json")
    args = ap.parse_args(argv)
    rows = []
    print(f"on {precision.describe(precision.hardware())}")
    print("| case | tokens | part | planned MiB | measured MiB | measured / planned |\n|---|---|---|---|---|---|")
    for name in args.case or list(CASES):
        cfg = case_config(name)
        r = measure(cfg)
        rows.append({"case": name, "dtype": cfg.optim.mixed_precision, **r})
        for part in ("target weights", "drafter weights", "optimizer", "step peak", "total"):
            p, m = r["planned"][part], r["measured"][part]
            print(
                f"| {name} | {cfg.optim.batch_size} x {cfg.data.max_length} | {part} | {p / MiB:.2f} | {m / MiB:.2f} "
                f"| {m / p:.2f} |"
                if p
                else f"| {name} | | {part} | 0 | {m / MiB:.2f} | - |",
                flush=True,
            )
    # ru_maxrss is KiB on Linux; one figure for the whole process, all cases.
    print(
        f"peak RSS of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GB "
        "(allocator caching, Python, tokenizer included)"
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
