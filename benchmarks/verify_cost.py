"""What one target verification pass costs as the draft grows: the budget a draft tree spends.

    python -m benchmarks.verify_cost --dtypes float32 bfloat16

For each precision and each set of kernels (torch's default, and the prepacked oneDNN linears the
eval stage decodes with in fp32 on CPU, draftsmith/util/kernels.py): the wall time of one target forward over
n new tokens on top of a 200-token KV cache, for n = 1 (plain decoding) up to 32 (a large tree),
median of 7, and its ratio to n = 1. Speculation pays only while tau grows faster than this ratio
plus the drafting time.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from draftsmith.target.load import load_target
from draftsmith.util.kernels import packed_linears
from draftsmith.util.precision import describe, dtype_arg, hardware


@torch.no_grad()
def forward_ms(target, context: torch.Tensor, n: int, reps: int = 7) -> float:
    times = []
    for _ in range(reps):
        cache = DynamicCache()
        target(context, cache=cache, use_cache=True)
        new = torch.randint(0, target.config.vocab_size, (1, n))
        t = time.perf_counter()
        target(new, cache=cache, use_cache=True)
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument(
        "--dtypes",
        nargs="+",
        default=["float32", "bfloat16"],
        type=dtype_arg,
        help="precisions to compare side by side (auto, float32/no, bf16, ...)",
    )
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 6, 8, 12, 16, 24, 32])
    p.add_argument("--context", type=int, default=200)
    args = p.parse_args(argv)
    print(f"Measured on {describe(hardware('cpu'))}")
    print(f"| dtype, kernels | {' | '.join(f'n={n}' for n in args.tokens)} |\n|---|{'---|' * len(args.tokens)}")
    for dtype in args.dtypes:
        target, _ = load_target(args.target, dtype)
        context = torch.randint(
            0, target.config.vocab_size, (1, args.context), generator=torch.Generator().manual_seed(0)
        )
        for kernels in ("default", "packed"):
            with packed_linears(target, enabled=kernels == "packed") as patched:
                if kernels == "packed" and not patched:
                    continue  # nothing to pack (not fp32, or a torch without oneDNN)
                ms = [forward_ms(target, context, n) for n in args.tokens]
            print(f"| {dtype}, {kernels} ms | {' | '.join(f'{m:.1f}' for m in ms)} |")
            print(f"| {dtype}, {kernels} / n=1 | {' | '.join(f'{m / ms[0]:.2f}' for m in ms)} |")


if __name__ == "__main__":
    main()
