"""Self-speculative decoding by layer skipping (Draft & Verify, Zhang et al. 2024, arXiv:2309.08168;
SWIFT, Xia et al. 2024): the draft model is the target itself with some decoder layers skipped. It
shares every weight with the target, needs no training, and keeps its own KV cache.

`calibrate` chooses the layers for a domain, maximising the estimated speedup τ / (1 + K·c) on a few
holdout prompts: it ranks the layers by the τ left when each is skipped alone, then skips the n
least harmful ones together for n = 1, 2, ... and keeps the best n (at least one layer; at most
`budget` candidates scored, L - 1 of them for the ranking). c is the draft's share of the target's matmul weights (embeddings/lm_head included, which
skipping never removes) and τ is the greedy K-chain τ, computed without decoding: the target's
greedy answers are decoded once; then one teacher-forced pass of the skipping model over
[prompt + answer] tells, at every answer position, whether its argmax equals the target's token.
While drafts are accepted the draft model's context *is* the target's answer, so a round starting
at position p accepts the run of agreements from p (at most K) and emits one more token; replaying
the rounds over the agreement sequence gives exactly the τ greedy speculative decoding measures
(tested), at the cost of one forward per candidate instead of a decode. Layer 0 is never skipped:
the draft's cache reads its length there. The estimate ignores that verification costs more than one
target forward; `draftsmith eval`/`compare` on the saved choice measure the real speedup.
The choice is saved as a drafter folder (`layerskip.json`) that `draftsmith eval`/`compare` load.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from draftsmith import DraftsmithError
from draftsmith.engine.proposers import StudentProposer
from draftsmith.engine.speculative import Stats, speculative_decode, target_decode
from draftsmith.target.load import eos_ids, fingerprint

FILE = "layerskip.json"


def check_skip(skip, num_layers: int, where: str = "layer skip") -> list[int]:
    skip = sorted(set(int(i) for i in skip))
    if any(i < 0 or i >= num_layers for i in skip):
        raise DraftsmithError(f"{where}: layers must be in 0..{num_layers - 1}, got {skip}")
    if 0 in skip or len(skip) >= num_layers:
        raise DraftsmithError(
            f"{where}: {skip} would skip layer 0 or every layer; the draft keeps layer 0 and at least one more"
        )
    return skip


class SkipLayers(nn.Module):
    """The target minus `skip` decoder layers, sharing its weights. Each forward swaps the decoder's
    layer list for the kept layers and back, so the target itself is untouched between calls (the
    kept layers keep their indices, so the draft's own cache holds only the layers it runs)."""

    def __init__(self, target, skip: list[int]):
        super().__init__()
        object.__setattr__(self, "target", target)  # shared, not a submodule: nothing is copied
        self.skip = check_skip(skip, target.config.num_hidden_layers)

    @contextmanager
    def _skipping(self):
        decoder = self.target.get_decoder()
        full = decoder.layers
        decoder.layers = nn.ModuleList([layer for i, layer in enumerate(full) if i not in self.skip])
        try:
            yield
        finally:
            decoder.layers = full

    def forward(self, **kwargs):
        with self._skipping():
            return self.target(**kwargs)

    def eval(self):  # the target is already frozen and in eval mode
        return self


def layer_skip_proposer(target, skip: list[int]) -> StudentProposer:
    """Chain drafting with the skipping target, with its own KV cache (as a distilled student's)."""
    return StudentProposer(SkipLayers(target, skip))


def cost_fraction(target, skip: list[int]) -> float:
    """The draft's share of the target's matmul weights per token: what skipping saves."""
    layer = sum(p.numel() for p in target.get_decoder().layers[0].parameters())
    total = sum(p.numel() for p in target.parameters())
    return (total - layer * len(skip)) / total


@torch.no_grad()
def measure_tau(target, tok, prompts: list, skip: list[int], k: int, max_new_tokens: int) -> float:
    """τ of greedy K-chain speculative decoding with the skipping draft, decoded for real."""
    stats, eos = Stats(k=k), eos_ids(target, tok)
    proposer = layer_skip_proposer(target, skip)
    for p in prompts:
        speculative_decode(target, proposer, p, k, max_new_tokens, eos, None, stats)
    return stats.tau


@torch.no_grad()
def agreement(target, skip: list[int], prompt: list[int], answer: list[int]) -> list[bool]:
    """Teacher-forced: at each answer position j, does the skipping model's argmax after
    prompt + answer[:j] equal answer[j]? (Row len(prompt)-1+j of the logits predicts answer[j].)"""
    ids = torch.tensor([prompt + answer[:-1]], device=next(target.parameters()).device)
    logits = SkipLayers(target, skip)(input_ids=ids, logits_to_keep=len(answer)).logits[0]
    return (logits.argmax(-1).cpu() == torch.tensor(answer)).tolist()


def replay_tau(agree: list[bool], k: int) -> tuple[int, int]:
    """Greedy K-chain rounds over one answer -> (tokens emitted, target passes). A round at position
    p accepts the drafts while they agree (at most k) and adds the target's own token; the last round
    may stop early at the end of the answer, as decoding stops at its budget or EOS."""
    p, passes = 0, 0
    while p < len(agree):
        accepted = 0
        while accepted < k and p + accepted < len(agree) and agree[p + accepted]:
            accepted += 1
        p += accepted + 1
        passes += 1
    return len(agree), passes


def calibrate(
    target,
    tok,
    prompts: list[list[int]],
    holdout: str,
    k: int = 4,
    max_new_tokens: int = 32,
    budget: int = 300,
    log=print,
) -> dict:
    """Layer search (see the module docstring) -> {"skip", "tau", "cost_fraction", "estimated_speedup", "evaluations"}.
    `prompts`: the holdout's prompts as token ids (the caller reads and renders them: data/load.py
    load_prompts, encode_prompt); `holdout`: its name, recorded with the choice."""
    n_layers, eos = target.config.num_hidden_layers, eos_ids(target, tok)
    # The first emitted token comes from the prefill, not from a verification pass: rounds start after it.
    answers = [target_decode(target, p, max_new_tokens, eos) for p in prompts]
    pairs = [(p + a[:1], a[1:]) for p, a in zip(prompts, answers) if len(a) > 1]

    def score(skip):
        runs = [replay_tau(agreement(target, skip, p, a), k) for p, a in pairs]
        tau = sum(e for e, _ in runs) / max(sum(n for _, n in runs), 1)
        return tau / (1 + k * cost_fraction(target, skip)), tau

    # 1. Importance: τ with each layer skipped alone (the least harmful layers come first).
    candidates = list(range(1, n_layers))[:budget]
    alone = {layer: score([layer])[1] for layer in candidates}
    order = sorted(candidates, key=lambda layer: -alone[layer])
    evaluations = len(candidates)
    # 2. Skip the n least harmful layers together, n = 1, 2, ...; keep the n with the best estimated
    # speedup. One layer at a time rarely pays for itself (it saves 1/L of the cost and loses some
    # τ), so the search walks the whole order instead of stopping at the first step that does not help.
    skip, best_tau = order[:1], alone[order[0]]
    best = best_tau / (1 + k * cost_fraction(target, skip))
    for n in range(2, len(order)):
        if evaluations >= budget:
            break
        estimate, tau = score(order[:n])
        evaluations += 1
        if estimate > best:
            best, best_tau, skip = estimate, tau, sorted(order[:n])
            log(f"skip {skip}: τ {tau:.2f}, estimated speedup {estimate:.3f} ({evaluations} evaluations)")
    return {
        "skip": skip,
        "tau": round(best_tau, 4),
        "cost_fraction": round(cost_fraction(target, skip), 4),
        "estimated_speedup": round(best, 4),
        "evaluations": evaluations,
        "k": k,
        "holdout": holdout,
        "num_prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
    }


def save(choice: dict, target, target_name: str, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (FILE + ".tmp")
    tmp.write_text(
        json.dumps(
            {"drafter": "layerskip", "target": target_name, "target_fingerprint": fingerprint(target), **choice},
            indent=2,
        )
    )
    tmp.replace(out / FILE)
    return out


def load(path: str | Path, target) -> StudentProposer:
    """A saved layer-skip choice -> its proposer; refuses another target."""
    meta = json.loads((Path(path) / FILE).read_text())
    if meta["target_fingerprint"] != fingerprint(target):
        raise DraftsmithError(f"{path}: layers were chosen for target '{meta['target']}', not this one")
    return layer_skip_proposer(target, meta["skip"])
