"""Regeneration through vLLM against the in-process fused path, side by side in one run.

    python -m benchmarks.regen_vllm --data builtin:code --num-prompts 640 --out regen-bench/

Both answer the same prompts greedily with the same budget (the quickstart's: 128 new tokens):
- `hf`: draftsmith's own batched decoder (`data regenerate`, batch 64), capturing the features the
  recipe's drafter trains on (the quickstart's EAGLE-3 by default) in the same pass, as training does;
- `vllm`: a vLLM server of the same target (`data regenerate --engine vllm`), `--concurrency`
  requests in flight; its server start-up is timed apart from the answering.
Prints answers/s and wall for each, and the token agreement of the two greedy answer sets: the share
of prompts answered identically, and of answer tokens equal up to each pair's first difference. Both
run in `--dtype` (default float32, where the two should agree token for token). Writes regen.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from draftsmith.data.regenerate import regenerate, regenerate_vllm
from draftsmith.models.registry import drafter_family
from draftsmith.target import vllm_server
from draftsmith.target.load import fingerprint, load_target, resolve_target
from draftsmith.train.config import drafter_config, load_config
from draftsmith.util.precision import hardware


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Identical answers, and tokens equal before each pair's first difference over all tokens of `a`."""
    same_prefix = 0
    for x, y in zip(a, b):
        same_prefix += next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
    return {
        "identical_answers": sum(x == y for x, y in zip(a, b)),
        "answers": len(a),
        "token_agreement": round(same_prefix / max(sum(map(len, a)), 1), 4),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--recipe",
        default="recipes/cpu/eagle3-smollm2.yaml",
        help="its target and the features its drafter trains on (the in-process pass captures them, as in training)",
    )
    p.add_argument("--data", default="builtin:code")
    p.add_argument("--num-prompts", type=int, default=640)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=64, help="in-process batch")
    p.add_argument("--concurrency", type=int, default=64, help="vLLM requests in flight")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = load_config(args.recipe, [])
    args.target = cfg.target
    target, tok = load_target(args.target, args.dtype)
    names = drafter_family(cfg.drafter["type"]).feature_names(drafter_config(cfg), target.config)

    t = time.perf_counter()
    hf = regenerate(
        target,
        tok,
        args.data,
        out / "hf.jsonl",
        args.batch_size,
        args.max_new_tokens,
        max_examples=args.num_prompts,
        names=names,
        features_out=out / "hf-features",
        fingerprint=fingerprint(target),
    )
    hf_s = time.perf_counter() - t

    # started once; its start-up is not answering time. vLLM refuses a context past the target's own.
    context = min(2048, getattr(target.config, "max_position_embeddings", 2048))
    with vllm_server.serve(str(resolve_target(args.target)), dtype=args.dtype, max_model_len=context) as server:
        startup_s = time.perf_counter() - t - hf_s
        t = time.perf_counter()
        regenerate_vllm(
            str(resolve_target(args.target)),
            tok,
            args.data,
            out / "vllm.jsonl",
            args.max_new_tokens,
            max_examples=args.num_prompts,
            concurrency=args.concurrency,
            server=server.url,
        )
        vllm_s = time.perf_counter() - t

    def answers(path):
        return [json.loads(l)["completion_ids"] for l in path.read_text().splitlines()]

    a, b = answers(hf), answers(out / "vllm.jsonl")
    result = {
        "prompts": len(a),
        "max_new_tokens": args.max_new_tokens,
        "dtype": args.dtype,
        "hf": {
            "wall_s": round(hf_s, 1),
            "answers_per_s": round(len(a) / hf_s, 3),
            "tokens_per_s": round(sum(map(len, a)) / hf_s, 1),
            "batch_size": args.batch_size,
            "with_features": list(names),
        },
        "vllm": {
            "wall_s": round(vllm_s, 1),
            "startup_s": round(startup_s, 1),
            "answers_per_s": round(len(b) / vllm_s, 3),
            "tokens_per_s": round(sum(map(len, b)) / vllm_s, 1),
            "concurrency": args.concurrency,
            "version": server.version,
        },
        "agreement": agreement(a, b),
        **hardware(next(target.parameters()).device),
    }
    (out / "regen.json").write_text(json.dumps(result, indent=2))
    print(
        f"| engine | answers | wall s | answers/s | tokens/s |\n|---|---|---|---|---|\n"
        f"| in-process (batch {args.batch_size}, + features) | {len(a)} | {hf_s:.0f} | {len(a) / hf_s:.2f} | "
        f"{result['hf']['tokens_per_s']:.0f} |\n"
        f"| {server.version} (concurrency {args.concurrency}; start-up {startup_s:.0f} s apart) | {len(b)} | "
        f"{vllm_s:.0f} | {len(b) / vllm_s:.2f} | {result['vllm']['tokens_per_s']:.0f} |"
    )
    ag = result["agreement"]
    print(
        f"greedy agreement ({args.dtype}): {ag['identical_answers']}/{ag['answers']} answers identical, "
        f"{ag['token_agreement']:.1%} of tokens before the first difference; on {result['device_name']}"
    )


if __name__ == "__main__":
    main()
