"""How often a verification pass and a one-token decode step disagree on the target's own argmax.

    python -m benchmarks.near_ties [--target smollm2-135m] [--dtypes float32,bfloat16] [--k 3]

For each holdout prompt, the target decodes greedily one token per pass (the reference; the engine's
target-only path). Then the same tokens are scored again the way speculative decoding scores them: the
last verified token plus the next K reference tokens as a chain draft, one pass of K+1 rows with the
verification mask, every draft accepted (teacher forcing, so one flip does not shift what follows).
Each row's argmax is compared with the reference token it predicts. A disagreement is a *flip*: the
same target on the same prefix picks another token only because the pass had another shape. Printed
per 1,000 scored tokens, with the logit gap between the two tokens at each flip, per dtype. Nothing
is timed, so nothing may run beside it without changing a figure.
"""

from __future__ import annotations

import argparse

import torch
from transformers import DynamicCache

from draftsmith.data.load import encode_prompt, load_prompts
from draftsmith.engine.drafts import Draft
from draftsmith.engine.speculative import target_decode, verification_forward
from draftsmith.engine.verify import verification_inputs
from draftsmith.target.load import load_target
from draftsmith.util import precision
from draftsmith.util.kernels import packed_linears


@torch.no_grad()
def flips(target, prompt: list[int], ref: list[int], k: int) -> tuple[int, int, list[float]]:
    """Teacher-forced verification passes of K+1 rows along `ref` -> (scored tokens, flips, gaps).
    Row j of the pass over [ref[i-1], ref[i..i+K-1]] predicts ref[i+j] (the root's row predicts the
    first draft's token); the prefill row that gave ref[0] is the same computation in both runs."""
    device = next(target.parameters()).device
    cache = DynamicCache()
    verification_forward(target, prompt, cache, device)
    scored, flipped, gaps, i = 0, 0, [], 1
    while i < len(ref):
        chain = ref[i : i + k]
        prefix = len(prompt) + i - 1  # the cache holds the prompt and ref[:i-1]; ref[i-1] is the root
        mask, positions = verification_inputs(Draft.chain(chain), prefix, device)
        _, logits = verification_forward(target, [ref[i - 1]] + chain, cache, device, (), mask, positions)
        for j, row in enumerate(logits[0, : len(ref) - i].float()):
            want, got = ref[i + j], int(row.argmax())
            scored += 1
            if got != want:
                flipped += 1
                gaps.append(round(float(row[got] - row[want]), 4))
        i += len(chain) + 1  # every row accepted: the next root is the token the last row predicted
    return scored, flipped, gaps


def measure(target_name: str, dtype: str, holdout: str, prompts: int, max_new: int, k: int) -> dict:
    target, tok = load_target(target_name, dtype)
    scored, flipped, gaps = 0, 0, []
    with packed_linears(target):  # the eval's kernels (fp32 only; bf16 keeps torch's)
        for item in load_prompts(holdout, prompts):
            prompt = encode_prompt(tok, item)
            ref = target_decode(target, prompt, max_new, set())  # no EOS: every prompt scores max_new tokens
            s, f, g = flips(target, prompt, ref, k)
            scored, flipped, gaps = scored + s, flipped + f, gaps + g
    return {
        "dtype": dtype,
        "k": k,
        "scored": scored,
        "flips": flipped,
        "per_1000": round(1000 * flipped / max(scored, 1), 2),
        "max_gap": max(gaps, default=0.0),
        "gaps": gaps,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--data", default="builtin:code-holdout")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=3, help="draft tokens per verification pass (K+1 rows)")
    args = p.parse_args(argv)
    print(
        f"machine: {precision.describe(precision.hardware('cpu'))}; target {args.target}, {args.prompts} prompts of "
        f"{args.data} x {args.max_new_tokens} tokens, verification passes of {args.k + 1} rows"
    )
    print("| dtype | tokens scored | flips | per 1,000 tokens | largest logit gap at a flip |")
    print("|---|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        r = measure(
            args.target, precision.check(dtype, "--dtypes"), args.data, args.prompts, args.max_new_tokens, args.k
        )
        print(f"| {r['dtype']} | {r['scored']} | {r['flips']} | {r['per_1000']} | {r['max_gap']} |", flush=True)
        if r["gaps"]:
            print(f"  gaps: {r['gaps']}")


if __name__ == "__main__":
    main()
