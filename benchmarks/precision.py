"""fp32 vs bf16 on the machine at hand, and what `auto` picks here.

    python -m benchmarks.precision [--target smollm2-135m] [--matmul 1024]

Times, side by side in one run, for each dtype: one square matmul, one target forward over 1 and
over 16 new tokens on a 200-token KV cache (plain decoding vs a draft tree's verification), and one
EAGLE-3 training step (forward + backward, batch 4 x 128, features given). Prints bf16/fp32 ratios
(< 1 means bf16 is faster) and the hardware line every report records. On CPUs without native bf16
(AVX2 only) expect bf16 to be many times slower; that is why `auto` picks fp32 there.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from draftsmith.models.registry import drafter_family
from draftsmith.target.features import greedy_ids, stored_names
from draftsmith.target.load import load_target
from draftsmith.util import precision


def median_s(fn, reps: int) -> float:
    fn()  # warm-up: one-time allocations and kernel selection
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def matmul_s(n: int, dtype: torch.dtype) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return median_s(lambda: a @ b, 3)


@torch.no_grad()
def forward_s(target, new_tokens: int, context: int = 200) -> float:
    vocab = target.config.vocab_size
    ctx = torch.randint(0, vocab, (1, context), generator=torch.Generator().manual_seed(0))
    new = torch.randint(0, vocab, (1, new_tokens), generator=torch.Generator().manual_seed(1))

    def once():
        cache = DynamicCache()
        target(ctx, cache=cache, use_cache=True)
        t = time.perf_counter()
        target(new, cache=cache, use_cache=True)
        return time.perf_counter() - t

    once()
    return statistics.median(once() for _ in range(5))


def train_step_s(target, dtype: torch.dtype, batch: int = 4, length: int = 128) -> float:
    """One EAGLE-3 step (3 fused layers, 8192-token draft vocab, 3 TTT steps) under autocast, as the
    loop runs it with mixed precision; the target's features are given (offline cache)."""
    layers = target.config.num_hidden_layers
    family = drafter_family("eagle3")
    cfg = family.DrafterConfig(
        draft_vocab_size=min(8192, target.config.vocab_size),
        ttt_steps=3,
        aux_layers=None if layers >= 6 else [0, layers // 2, layers - 1],
    )
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.config.vocab_size, (batch, length), generator=g)
    rows = [{"input_ids": r.tolist(), "loss_mask": [0] * 32 + [1] * (length - 32)} for r in ids]
    drafter = family.build(
        cfg, target, {"input_ids": [r["input_ids"] for r in rows], "loss_mask": [r["loss_mask"] for r in rows]}
    )
    h = target.config.hidden_size
    names = family.feature_names(cfg, target.config)
    dtype_t = next(target.parameters()).dtype
    feats = {n: torch.randn(batch, length, h, generator=g).to(dtype_t) for n in stored_names(names)}
    if "argmax" in names:  # derived from last_hidden, once per example (as a feature cache does)
        feats["argmax"] = greedy_ids(target, feats["last_hidden"])
    b = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "loss_mask": torch.tensor([r["loss_mask"] for r in rows]),
    }

    def step():
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss, n, _ = family.compute_loss(drafter, target, b, feats, cfg)
        (loss / n).backward()

    return median_s(step, 2)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--matmul", type=int, default=1024, help="square matmul size (2048 takes ~1 min in bf16 on AVX2)")
    args = p.parse_args(argv)
    hw = precision.hardware("cpu")
    print(f"machine: {precision.describe(hw)}; auto picks {precision.resolve('auto', 'auto', 'cpu')}")
    rows = {}
    for name in ("float32", "bfloat16"):
        dtype = precision.TORCH[name]
        target, _ = load_target(args.target, name)
        rows[name] = {
            f"matmul {args.matmul}^3": matmul_s(args.matmul, dtype),
            "target forward, 1 new token": forward_s(target, 1),
            "target forward, 16 new tokens": forward_s(target, 16),
            "EAGLE-3 train step (4x128)": train_step_s(target, dtype),
        }
    print("\n| measurement | fp32 ms | bf16 ms | bf16 / fp32 |\n|---|---|---|---|")
    for key in rows["float32"]:
        a, b = rows["float32"][key], rows["bfloat16"][key]
        print(f"| {key} | {a * 1e3:.1f} | {b * 1e3:.1f} | {b / a:.2f} |")


if __name__ == "__main__":
    main()
