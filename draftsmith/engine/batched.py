"""Batched greedy decoding: B prompts decoded together, target-only or speculatively with chain drafts.

Why: speculative decoding trades spare compute for fewer target passes. At batch size 1 a small
target's forward is bound by reading its weights, so scoring 1 + K tokens costs little more than 1;
as the batch grows the same pass does more arithmetic per weight read and the spare compute shrinks,
so the speedup falls with B. `batch_curve` measures that curve on one machine.

Scope: greedy only (the output must equal target-only greedy, token for token) and chain drafts
(a proposer's `propose`, no trees). Verification and target-only decoding are batched; drafting
runs row by row, one proposer per row from `make_proposer()`, because proposers such as
FeatureProposer keep a KV cache of their own sequence.

Layout of the shared target cache (one transformers DynamicCache holding every open row):
- Prompts are left-padded, so each row's newest column is the last one. `valid` [B', L] marks, per
  row, which cache columns hold its real tokens; the attention mask is `causal_mask` with `valid` as
  its padding (draftsmith/util/masks.py), and position ids count real tokens only, as if each row were fed
  unpadded (as in draftsmith/target/generate.py `generate_batch`).
- Each round every open row feeds [its last token, its draft tokens] as one [B', 1 + max K_row]
  block; a row that drafted fewer tokens is padded at the right end of its block and those columns
  are not valid (masked as keys; as queries they see the row's own block, so they stay finite).
- After greedy verification row b keeps the root and its accepted drafts: 1 + a_b of the block's
  columns. The rejected columns are not left in place as holes: `_keep` compacts the cache (one
  gather per layer) so each row's real columns are right-aligned again, and rows that finished (EOS
  or budget) are dropped from the cache and from the batch. After every round the cache therefore
  has the layout of a fresh left-padded prefill over each row's verified tokens (all but the
  newest), its width is the longest row's count, and finished rows cost nothing.
  Moving a column is exact: rotary positions are applied before keys are cached.
- Features for row b's proposer (the `feature_names` contract of `speculative_decode`: target
  features of every verified token but the newest) are the prompt columns of the prefill plus, each
  round, the block columns that row kept.

Stats pool over rows exactly as over prompts at batch size 1: `Stats.record` once per row per round,
so `passes` counts row verifications (not batched forward calls) and τ stays tokens per row per pass.

Adaptive verification (optional) is vLLM 0.32's batch rule as it stands: one token budget for the
whole batch, the drafts of largest survival admitted across rows, each row verifying a prefix
(draftsmith/engine/verify.py `adaptive_prefixes`). Rows whose drafter gives no confidences count
theirs as certain (c = 1), so they keep every draft.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from draftsmith import DraftsmithError
from draftsmith.engine.drafts import Draft
from draftsmith.engine.proposers import proposer_modules
from draftsmith.engine.speculative import Stats, _truncate, target_decode, timed
from draftsmith.engine.verify import AdaptiveCosts, adaptive_prefixes, verify_tree_greedy
from draftsmith.target.features import target_features
from draftsmith.target.generate import generate_batch
from draftsmith.util.kernels import packed_linears
from draftsmith.util.masks import causal_mask

BATCH_SIZES_HELP = "positive integers separated by commas, e.g. 1,2,4,8"


def parse_batch_sizes(text: str, flag: str = "--batch-sizes") -> list[int]:
    """'1,2,4' -> [1, 2, 4] (the `--batch-sizes` option, and serve-check's `--concurrency`)."""
    items = [s.strip() for s in str(text).split(",")]
    if not all(s.isdigit() for s in items):  # rejects '', '-1', '1.5', 'a'
        raise DraftsmithError(f"{flag}: expected {BATCH_SIZES_HELP}; got '{text}'")
    return check_batch_sizes([int(s) for s in items], flag)


def check_batch_sizes(sizes, flag: str = "--batch-sizes") -> list[int]:
    sizes = list(sizes)
    if not sizes or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in sizes):
        raise DraftsmithError(f"{flag}: expected {BATCH_SIZES_HELP}; got {sizes}")
    return sizes


@dataclass
class _Batch:
    """The shared target cache and, per open row (in cache order), which columns are its real tokens."""

    cache: DynamicCache
    valid: torch.Tensor  # [B', L] bool
    rows: list[int]  # the prompt index of each cache row


def _left_pad(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """-> ids [B, W] and real [B, W] bool, each prompt right-aligned."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=device)
    real = torch.zeros(len(prompts), width, dtype=torch.bool, device=device)
    for b, p in enumerate(prompts):
        ids[b, width - len(p) :] = torch.tensor(p, device=device)
        real[b, width - len(p) :] = True
    return ids, real


def _feed(target, batch: _Batch, ids: torch.Tensor, real: torch.Tensor, names=(), all_logits: bool = False):
    """Append ids [B', T] (real [B', T]: which are tokens, not padding) to every row and run the target
    -> (features {name: [B', T, *]}, logits [B', T or 1, V])."""
    batch.valid = torch.cat([batch.valid, real], dim=1)
    t, kv = ids.shape[1], batch.valid.shape[1]
    mask = causal_mask(t, kv, batch.valid, device=ids.device)
    # A token's position = the number of real tokens before it in its row (padding and gaps do not count).
    pos = (batch.valid.long().cumsum(-1) - 1).clamp(min=0)[:, -t:]
    feats = target_features(
        target,
        {"input_ids": ids, "attention_mask": mask, "position_ids": pos},
        tuple(dict.fromkeys(tuple(names) + ("last_hidden",))),
        batch.cache,
    )
    hidden = feats["last_hidden"] if all_logits else feats["last_hidden"][:, -1:]
    return feats, target.get_output_embeddings()(hidden)


def _keep(batch: _Batch, alive: list[int]) -> None:
    """Keep the cache rows `alive` (indices into batch.rows) and only their valid columns, right-aligned."""
    batch.rows = [batch.rows[i] for i in alive]
    if not alive:
        return  # every row finished: the cache is not read again
    valid = batch.valid[alive]
    count = valid.sum(-1)
    width = int(count.max())
    aligned = torch.arange(width, device=valid.device)[None] >= (width - count)[:, None]
    if len(alive) == len(batch.valid) and valid.shape[1] == width and torch.equal(valid, aligned):
        return  # nothing rejected, nobody finished: the cache is already compact
    # A stable sort puts each row's invalid columns first and its valid ones after them, in order.
    order = torch.sort(valid.to(torch.uint8), dim=-1, stable=True).indices[:, valid.shape[1] - width :]
    rows = torch.tensor(alive, dtype=torch.long, device=valid.device)
    for layer in batch.cache.layers:
        for name in ("keys", "values"):
            kv = getattr(layer, name)[rows]  # [B', heads, L, head_dim]
            setattr(layer, name, kv.gather(2, order[:, None, :, None].expand(-1, kv.shape[1], -1, kv.shape[3])))
    batch.valid = aligned


def _prefill(target, prompts: list[list[int]], pad_id: int, names=()):
    device = next(target.parameters()).device
    batch = _Batch(
        DynamicCache(), torch.zeros(len(prompts), 0, dtype=torch.bool, device=device), list(range(len(prompts)))
    )
    ids, real = _left_pad(prompts, pad_id, device)
    feats, logits = _feed(target, batch, ids, real, names)
    return batch, feats, logits[:, -1].argmax(-1).tolist(), real


def target_decode_batch(
    target, prompts: list[list[int]], max_new: int, eos: set[int], pad_id: int = 0
) -> list[list[int]]:
    """Greedy target-only decoding of B prompts together (draftsmith/target/generate.py); row b equals
    `target_decode(prompts[b])`. A row stops at EOS (kept) or after max_new tokens, and leaves the batch then."""
    return [answer for answer, _ in generate_batch(target, prompts, max_new, eos, pad_id)]


def _propose(proposer, tokens: list[int], feats: dict, k: int, device) -> Draft:
    if proposer is None or not k:
        return Draft()
    draft = proposer.propose(torch.tensor([tokens], device=device), feats, k)
    if draft.parents != list(range(-1, len(draft.tokens) - 1)):
        raise DraftsmithError("batched speculative decoding verifies chain drafts only; this proposer drafted a tree")
    return draft


def _adaptive(drafts: list[Draft], costs: AdaptiveCosts | None) -> list[Draft]:
    """Each row's draft cut to the prefix the batch's budget admits (a row without confidences: c = 1)."""
    if costs is None or all(d.confidence is None for d in drafts):
        return drafts
    confidences = [d.confidence if d.confidence is not None else [1.0] * len(d.tokens) for d in drafts]
    return [d.prefix(b) for d, b in zip(drafts, adaptive_prefixes(confidences, costs))]


def _blocks(tokens: list[list[int]], drafts: list[Draft], rows: list[int], pad_id: int, device):
    """Per open row [last token, draft tokens], right-padded -> ids [B', T], real [B', T]."""
    width = 1 + max(len(d.tokens) for d in drafts)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long, device=device)
    real = torch.zeros(len(rows), width, dtype=torch.bool, device=device)
    for i, (b, d) in enumerate(zip(rows, drafts)):
        ids[i, : 1 + len(d.tokens)] = torch.tensor(tokens[b][-1:] + d.tokens, device=device)
        real[i, : 1 + len(d.tokens)] = True
    return ids, real


@torch.no_grad()
def speculative_decode_batch(
    target,
    make_proposer,
    prompts: list[list[int]],
    k: int,
    max_new: int,
    eos: set[int],
    stats: Stats | None = None,
    pad_id: int = 0,
    adaptive: AdaptiveCosts | None = None,
) -> list[list[int]]:
    """Greedy speculative decoding of B prompts together with chain drafts of up to k tokens; row b
    equals `target_decode(prompts[b])`. make_proposer: a factory (called once per row) or None for
    target-only rounds. Each row accepts its own number of drafts per round (module docstring).
    adaptive: verify the prefixes vLLM 0.32's budget admits (module docstring); None = every draft."""
    if not prompts:
        return []
    proposers = [make_proposer() if make_proposer is not None else None for _ in prompts]
    names = () if proposers[0] is None else tuple(proposers[0].feature_names)
    batch, feats, first, real = _prefill(target, prompts, pad_id, names)
    device = batch.valid.device
    tokens = [list(p) + [t] for p, t in zip(prompts, first)]
    # Target features of every token the target has processed (all but the newest one), per row.
    row_feats = [{n: feats[n][b : b + 1, real[b]] for n in names} for b in range(len(prompts))]
    for p in proposers:
        if p is not None:
            p.reset()

    def is_open(b: int) -> bool:
        return len(tokens[b]) - len(prompts[b]) < max_new and tokens[b][-1] not in eos

    _keep(batch, [i for i, b in enumerate(batch.rows) if is_open(b)])
    while batch.rows:
        drafts = _adaptive([_propose(proposers[b], tokens[b], row_feats[b], k, device) for b in batch.rows], adaptive)
        ids, real = _blocks(tokens, drafts, batch.rows, pad_id, device)
        feats, logits = _feed(target, batch, ids, real, names, all_logits=True)
        kept = torch.zeros_like(real)
        for i, (b, draft) in enumerate(zip(batch.rows, drafts)):
            row_logits = logits[i, : 1 + len(draft.tokens)]  # row 0: after the root, 1 + j: after draft j
            path, new = verify_tree_greedy(draft, row_logits)
            # The root and the accepted drafts (block columns 0..len(path)) join the row's verified tokens.
            kept[i, : 1 + len(path)] = True
            row_feats[b] = {n: torch.cat([row_feats[b][n], feats[n][i : i + 1, : 1 + len(path)]], dim=1) for n in names}
            new = _truncate(new[: max_new - (len(tokens[b]) - len(prompts[b]))], eos)
            if proposers[b] is not None:  # as in speculative_decode (lookahead's Jacobi step)
                proposers[b].observe(draft, row_logits, path, new)
            tokens[b] += new
            if stats is not None:
                accepted = min(len(path), len(new))
                stats.record(len(draft.tokens), accepted, len(new), draft.max_depth)
                stats.record_confidence(draft.confidence, len(draft.tokens), accepted, len(new))
        batch.valid[:, -ids.shape[1] :] = kept
        _keep(batch, [i for i, b in enumerate(batch.rows) if is_open(b)])
    return [t[len(p) :] for t, p in zip(tokens, prompts)]


def _timed_batches(decode, prompts: list[list[int]], size: int) -> tuple[list[list[int]], float]:
    """decode(batch of prompts) over consecutive batches of `size` -> (outputs in prompt order, total seconds)."""
    outputs, seconds = [], 0.0
    for s in range(0, len(prompts), size):
        out, sec = timed(decode, prompts[s : s + size])
        outputs += out
        seconds += sec
    return outputs, seconds


def batch_curve(
    target,
    tok,
    proposer_factory,
    prompts: list[list[int]],
    batch_sizes,
    k: int,
    max_new: int,
    eos: set[int],
    kernels: bool = True,
) -> list[dict]:
    """For each batch size B: batched target-only and batched speculative greedy decoding of the same
    prompts (in batches of B, the last one possibly smaller), timed in this process -> one dict per B
    with batch_size, tau, target_tokens_per_s, spec_tokens_per_s, speedup, lossless (every speculative
    row equals the unbatched `target_decode` of its prompt) and the counts behind them.
    proposer_factory: a zero-argument factory of proposers (one per row), or None."""
    sizes = check_batch_sizes(batch_sizes)
    pad = tok.pad_token_id if tok is not None and tok.pad_token_id is not None else 0
    probe = proposer_factory() if proposer_factory is not None else None
    if probe is not None and probe.max_depth is not None and k > probe.max_depth:  # e.g. Medusa: one head per position
        raise DraftsmithError(
            f"--k: drafts {k} deep, but this drafter drafts at most {probe.max_depth} tokens per round"
        )
    k = k if probe is not None else 0
    curve = []
    with packed_linears(target, *proposer_modules(probe), enabled=kernels):
        refs = [target_decode(target, p, max_new, eos) for p in prompts]
        # Warm up both paths once so one-time allocation costs do not bias the first timing.
        target_decode_batch(target, [p[:8] for p in prompts[:2]], max_new, eos, pad)
        speculative_decode_batch(target, proposer_factory, [p[:8] for p in prompts[:2]], k, max_new, eos, None, pad)
        for size in sizes:
            plain, t_s = _timed_batches(lambda ps: target_decode_batch(target, ps, max_new, eos, pad), prompts, size)
            stats = Stats(k=max(k, 1))
            spec, s_s = _timed_batches(
                lambda ps: speculative_decode_batch(target, proposer_factory, ps, k, max_new, eos, stats, pad),
                prompts,
                size,
            )
            n_plain, n_spec = sum(map(len, plain)), sum(map(len, spec))
            mismatches = sum(a != r for a, r in zip(spec, refs))
            curve.append(
                {
                    "batch_size": size,
                    "tau": round(stats.tau, 4),
                    "acceptance_rate": round(stats.acceptance_rate, 4),
                    "target_tokens_per_s": round(n_plain / t_s, 2),
                    "spec_tokens_per_s": round(n_spec / s_s, 2),
                    "speedup": round((n_spec / s_s) / (n_plain / t_s), 3),
                    "lossless": mismatches == 0,
                    "lossless_mismatches": mismatches,
                    # Batched target-only rows that differ from unbatched ones: batching numerics, not drafting.
                    "target_mismatches": sum(a != r for a, r in zip(plain, refs)),
                    "num_prompts": len(prompts),
                    "new_tokens": n_spec,
                    "k": k,
                }
            )
    return curve
