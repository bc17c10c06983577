"""Any drafters, whatever their family, chain vs tree, greedy and sampled, side by side in one table.

    python -m benchmarks.drafters --drafter eagle=checkpoints/eagle-smollm2/final \\
        --drafter eagle3=checkpoints/eagle3-smollm2/final --drafter medusa=checkpoints/medusa1-smollm2/final \\
        --tree dynamic:depth=3,top_k=3,tokens=8 --tree medusa=static:recipes/trees/medusa-4heads.json

One process, one target, the same holdout prompts for every row. For each drafter: τ with a chain
of K drafts and with the draft tree, greedy (token-exact lossless check against target-only
decoding) and sampled (`--temperature`; exactness there is a distribution property, covered by the
chi-square tests in tests/engine/test_sampling.py and tests/engine/test_tree.py). Each row's speedup is measured
against target-only decoding of the same prompts in the same process, measured once per temperature
and shared by the rows the target verifies (a trained backbone, Medusa-2, gets its own). Then per drafter: trainable
parameters, draft vocabulary, measured drafting time per round vs one target forward, and the
per-token draft FLOPs as a fraction of the target's (2 x weights multiplied per token; attention
over the context is left out, which at these lengths is a few percent). Training time and peak RSS
come from the drafter's config.json (recorded by `draftsmith train`); eval peak RSS is this process's.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from draftsmith.data.load import encode_prompt, load_prompts
from draftsmith.engine.proposers import Proposer
from draftsmith.engine.speculative import target_decode
from draftsmith.eval.config import EvalConfig
from draftsmith.eval.drafters import Resolved
from draftsmith.eval.report import format_table
from draftsmith.eval.run import backbone_drift, evaluate, target_baseline
from draftsmith.models.registry import load_drafter, target_to_load_on
from draftsmith.target.features import target_features
from draftsmith.target.load import eos_ids, load_target
from draftsmith.util.precision import DTYPE_HELP, dtype_arg


class TimedProposer(Proposer):
    """Wraps a proposer and adds up the wall time spent drafting and the draft steps taken."""

    def __init__(self, proposer):
        self.inner, self.feature_names = proposer, proposer.feature_names
        # No max_depth: one K for every row; a drafter with fewer positions (Medusa: one per head)
        # drafts what it has, as it does in vLLM.
        self.drafts_trees = proposer.drafts_trees
        self.seconds, self.rounds, self.steps = 0.0, 0, 0

    def reset(self):
        self.inner.reset()

    def _timed(self, fn, *args, steps):
        t = time.perf_counter()
        draft = fn(*args)
        self.seconds += time.perf_counter() - t
        self.rounds += 1
        self.steps += steps
        return draft

    def propose(self, tokens, feats, k, sampler=None):
        return self._timed(self.inner.propose, tokens, feats, k, sampler, steps=k)

    def propose_tree(self, tokens, feats, spec):
        return self._timed(self.inner.propose_tree, tokens, feats, spec, steps=spec.depth)


def matmul_weights(family: nn.Module, skip: tuple[str, ...] = ()) -> int:
    return sum(
        m.weight.numel() for name, m in family.named_modules() if isinstance(m, nn.Linear) and not name.startswith(skip)
    )


def draft_flops_fraction(drafter, target) -> float:
    """Weights multiplied per draft token / per target token. EAGLE-1 applies fc every step and the
    target's full lm_head; EAGLE-3 applies fc only to verified features (once per accepted token,
    not per draft step) and its own reduced lm_head; Medusa runs each head once per round, one head
    per draft position."""
    if hasattr(drafter, "lm_heads"):  # Medusa
        per_step = matmul_weights(drafter) / len(drafter.lm_heads)
    elif hasattr(drafter, "lm_head"):  # EAGLE-3
        per_step = matmul_weights(drafter, skip=("fc",))
    else:
        per_step = matmul_weights(drafter) + target.get_output_embeddings().weight.numel()
    return per_step / matmul_weights(target)


def draft_vocab_size(drafter, target) -> int:
    heads = getattr(drafter, "lm_heads", None)  # empty for Medusa heads sharing the target's lm_head
    head = getattr(drafter, "lm_head", None) or (heads[0] if heads else None)
    return head.out_features if head is not None else target.config.vocab_size


def k_for(label: str, given: list[str]) -> int:
    """The chain length a drafter is benchmarked with: LABEL=K, else a plain K, else 5."""
    own = [g.split("=", 1)[1] for g in given if g.split("=", 1)[0] == label and "=" in g]
    plain = [g for g in given if "=" not in g]
    return int((own or plain or ["5"])[0])


# The tree each drafter type is benchmarked with unless --tree names one, by `drafter.type`: EAGLE-2's
# dynamic tree for heads that condition on their own drafts, static top-k per head for Medusa's.
DEFAULT_TREES = {
    "eagle": "dynamic:depth=3,top_k=3,tokens=8",
    "eagle3": "dynamic:depth=3,top_k=3,tokens=8",
    "medusa": "static:recipes/trees/medusa-4heads.json",
}


def tree_for(label: str, drafter_type: str, given: list[str]) -> str | None:
    """The tree a drafter is benchmarked with: LABEL=SPEC, else a plain SPEC, else its type's default."""
    own = [
        g.split("=", 1)[1] for g in given if g.split("=", 1)[0] == label and not g.startswith(("static:", "dynamic"))
    ]
    plain = [g for g in given if g.startswith(("static:", "dynamic"))]
    return (own or plain or [DEFAULT_TREES.get(drafter_type)])[0]


@torch.no_grad()
def draft_top1(proposer: Proposer, verifier, answers: list[tuple[int, list[int]]], k: int) -> list[float]:
    """Per draft position d (1..k): how often the chain draft d, proposed from the verifier's own prefix
    at every answer position, is the verifier's next token there. Nothing is verified: each position
    drafts from the true prefix, so this is the drafter's top-1 per position (for Medusa, each head's).
    answers: [(prompt length, prompt + greedy answer ids)]."""
    hits, counts = [0] * k, [0] * k
    device = next(verifier.parameters()).device
    for n_prompt, ids in answers:
        full = torch.tensor([ids], device=device)
        names = proposer.feature_names
        feats = target_features(verifier, {"input_ids": full}, names) if names else {}
        for t in range(n_prompt - 1, len(ids) - 1):  # the context ends at token t; drafts are t+1, t+2, ..
            proposer.reset()
            # The engine's contract: the features of every token but the newest.
            draft = proposer.propose(full[:, : t + 1], {n: f[:, :t] for n, f in feats.items()}, k)
            for d, token in enumerate(draft.tokens[: min(k, len(ids) - t - 1)]):
                hits[d] += int(token == ids[t + 1 + d])
                counts[d] += 1
    return [round(h / max(c, 1), 4) for h, c in zip(hits, counts)]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--drafter",
        action="append",
        metavar="LABEL=DIR",
        help="a trained drafter, repeatable (default: the eagle and eagle3 CPU recipes' outputs)",
    )
    p.add_argument("--data", default="builtin:code-holdout")
    p.add_argument(
        "--k",
        action="append",
        default=[],
        metavar="[LABEL=]K",
        help="chain length for every drafter (default 5), or LABEL=K for one (a block drafter drafts "
        "at most its block: DFlash B-1, P-EAGLE its depths)",
    )
    p.add_argument(
        "--tree",
        action="append",
        default=[],
        metavar="[LABEL=]SPEC",
        help="draft tree for every drafter, or LABEL=SPEC for one (Medusa needs a static tree); "
        "default dynamic:depth=3,top_k=3,tokens=8, and for Medusa heads "
        "static:recipes/trees/medusa-4heads.json",
    )
    p.add_argument("--temperature", type=float, default=0.7, help="sampled rows; 0 skips them")
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument(
        "--dtype",
        default="auto",
        type=dtype_arg,
        help="target and drafter precision, the same for target-only and speculative decoding: " + DTYPE_HELP,
    )
    p.add_argument("--out", default="", help="also write the results as JSON here")
    args = p.parse_args(argv)

    drafters = dict(
        d.split("=", 1)
        for d in args.drafter or ["eagle=checkpoints/eagle-smollm2/final", "eagle3=checkpoints/eagle3-smollm2/final"]
    )
    metas = {name: json.loads((Path(path) / "config.json").read_text()) for name, path in drafters.items()}
    target_name = next(iter(metas.values()))["target"]
    target, tok = load_target(target_name, args.dtype)
    base = EvalConfig(num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens)
    reports, costs, baselines = [], {}, {}

    def baseline(verifier, temperature: float):
        """Target-only decoding, measured once per temperature and shared by every drafter the
        target itself verifies (as `compare`); None (evaluate measures its own) for another verifier."""
        if verifier is not target:
            return None
        if temperature not in baselines:
            baselines[temperature] = target_baseline(target, tok, args.data, replace(base, temperature=temperature))
        return baselines[temperature]

    for name, meta in metas.items():
        # A family that trained the backbone (Medusa-2) gets its own copy of the target (its adapters
        # go into it) and is verified by that backbone, merged.
        own = target_to_load_on(target, drafters[name])
        family, dcfg, drafter = load_drafter(drafters[name], own)
        verifier = family.verifier(drafter, own)
        timed = TimedProposer(family.make_proposer(drafter, verifier, dcfg))
        tree = tree_for(name, meta["drafter"], args.tree)
        trees = [dict(tree=tree)] if tree and timed.drafts_trees else []  # a student drafts chains
        k = k_for(name, args.k)
        runs = [dict(k=k)] + trees
        if args.temperature > 0:
            runs += [dict(k=k, temperature=args.temperature)] + [{**t, "temperature": args.temperature} for t in trees]
        greedy_chain_seconds = None
        for run in runs:
            before = (timed.seconds, timed.rounds, timed.steps)
            r = evaluate(
                Resolved(name, timed, verifier, None),
                tok,
                args.data,
                None,
                replace(base, **run),
                target_name=target_name,
                baseline=baseline(verifier, run.get("temperature", 0.0)),
            )
            r["draft_ms_per_round"] = round(1e3 * (timed.seconds - before[0]) / max(timed.rounds - before[1], 1), 2)
            reports.append(r)
            if greedy_chain_seconds is None:
                greedy_chain_seconds = (timed.seconds - before[0]) / max(timed.steps - before[2], 1)
        heads = getattr(drafter, "heads", drafter)  # Medusa-2: the drafting part, without the backbone
        costs[name] = {
            "params": sum(p.numel() for p in heads.parameters()),
            "draft_vocab": draft_vocab_size(heads, target),
            "draft_ms_per_chain_step": round(1e3 * greedy_chain_seconds, 2),
            "draft_flops_fraction": round(draft_flops_fraction(heads, target), 4),
            "train_seconds": meta.get("train_seconds"),
            "train_steps": meta.get("steps"),
            "train_peak_rss_gb": meta.get("peak_rss_gb"),
        }

        eos = eos_ids(verifier, tok)
        answers = [
            (len(ids), ids + target_decode(verifier, ids, args.max_new_tokens, eos))
            for ids in (encode_prompt(tok, p) for p in load_prompts(args.data, args.num_prompts))
        ]
        fresh = family.make_proposer(drafter, verifier, dcfg)  # untimed: the figures above stay the eval's
        costs[name]["draft_top1"] = draft_top1(fresh, verifier, answers, min(k, fresh.max_depth or k))
        print(f"{name}: draft top-1 per position {costs[name]['draft_top1']}")
        if verifier is not own:
            with family.original(drafter, own) as original:
                costs[name]["drift"] = backbone_drift(
                    original,
                    verifier,
                    tok,
                    args.data,
                    family.make_proposer(drafter, verifier, dcfg),
                    replace(base, k=k),
                )
            print(f"{name}: backbone drift {costs[name]['drift']}")

    print(format_table(reports))
    print(
        f"\n{reports[0]['dtype']}: | drafter | draft | T | τ | draft ms/round | lossless (mismatching prompts, max logit gap) "
        "| speedup |\n|---|---|---|---|---|---|---|"
    )
    for r in reports:
        shape = f"tree {r['tree']}" if r["tree"] else f"chain K={r['k']}"
        exact = (
            "sampled"
            if r["lossless"] is None
            else (f"{r['lossless']} ({r['lossless_mismatches']}, {max(r['mismatch_logit_gaps'], default=0):.3f})")
        )
        print(
            f"| {r['drafter']} | {shape} | {r['temperature']} | {r['tau']:.2f} | {r['draft_ms_per_round']} | "
            f"{exact} | {r['speedup']:.2f}x |"
        )
    target_ms = 1e3 / reports[0]["target_tokens_per_s"]
    print(f"\ntarget-only decoding: {target_ms:.1f} ms per token (one forward with a KV cache)")
    print(
        "| drafter | params | draft vocab | draft ms/step | vs target forward | draft FLOPs/token vs target | "
        "train s (steps) | train peak RSS GB |\n|---|---|---|---|---|---|---|---|"
    )
    for name, c in costs.items():
        print(
            f"| {name} | {c['params'] / 1e6:.2f}M | {c['draft_vocab']} / {target.config.vocab_size} | "
            f"{c['draft_ms_per_chain_step']} | {c['draft_ms_per_chain_step'] / target_ms:.2f} | "
            f"{c['draft_flops_fraction']:.3f} | {c['train_seconds']} ({c['train_steps']}) | {c['train_peak_rss_gb']} |"
        )
    eval_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"peak RSS of this eval process: {eval_rss:.2f} GB")
    if args.out:
        Path(args.out).write_text(
            json.dumps({"reports": reports, "costs": costs, "eval_peak_rss_gb": eval_rss}, indent=2)
        )


if __name__ == "__main__":
    main()
