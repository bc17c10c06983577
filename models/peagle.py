"""P-EAGLE: parallel EAGLE (arXiv:2602.01469), the EAGLE-3 body drafting K tokens in ONE pass.

EAGLE-3 (models/eagle3.py) runs its layer once per draft token. P-EAGLE appends K-1 *mask slots*
to the bonus slot and reads all K drafts off one forward:

    slot        token input           hidden input                   position   predicts
    bonus       x_n (newest token)    fc(target features of x_{n-1})  n-1        x_{n+1}  (draft 1)
    mask d      embed(mask_token_id)  fc(mask_hidden), learned        n-1+d      x_{n+1+d} (draft d+1)

Attention is causal: a mask slot sees every real slot up to the bonus and the mask slots before it
(vLLM 0.32 serves it so: speculators `peagle`, method `eagle3` with `parallel_drafting`).
Training packs, per sequence, every real slot plus sampled chains of mask slots into one pass
(depth d keeps about n * max(r^d, r_min) anchors, r = 0.7, r_min = 0.2: deep drafts are rarer
and cheaper), all slots weighted alike; no training-time-test unroll.

`mask_hidden` lives in raw target-feature space [3H] (vLLM passes it through the same norm and fc
as real features). The mask token's embedding is the target's own, frozen: any id works, since
the learned part of a mask slot is mask_hidden. Default: the target's pad token, else its eos
(speculators' fallback when a tokenizer has no mask token; SmolLM2, Llama-3 and Qwen have none).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import partial

import torch
from torch import nn
from transformers import DynamicCache

from draftsmith import DraftsmithError
from draftsmith.engine.cache import crop_cache
from draftsmith.engine.drafts import Draft
from draftsmith.engine.proposers import Proposer
from draftsmith.models.eagle import unroll_activation_bytes
from draftsmith.models.eagle3 import (
    add_body,
    aux_features,
    aux_layers,
    decoder_step,
    draft_logits,
    exported_aux_layers,
    feature_names,
    fuse,
    label_mask,
    speculators_load_check,
    target_vocab_logits,
    teacher_rows,
    training_features,
    write_speculators,
)
from draftsmith.models.eagle3 import build as build_eagle3
from draftsmith.models.family import Family
from draftsmith.models.folder import load_state
from draftsmith.models.formats import from_exported_head, renamed
from draftsmith.models.training import mask_token
from draftsmith.target.features import draft_embeddings
from draftsmith.util.losses import TOKEN_LOSSES, check_loss
from draftsmith.util.masks import causal_mask, document_causal_mask, documents, positions, same_document

NAME = "peagle"


@dataclass
class DrafterConfig:
    aux_layers: list | None = None
    """0-based target layers whose outputs are fused (as EAGLE-3's; default [1, L//2 - 1, L - 4])."""
    draft_vocab_size: int = 32000
    depths: int = 4
    """K: drafts per pass (the bonus slot + K-1 mask slots); serve with num_speculative_tokens <= K."""
    keep_ratio: float = 0.7
    """Depth d (>= 1) trains on about n * max(keep_ratio^d, keep_min) of the n anchors of a sequence."""
    keep_min: float = 0.2
    loss: str = "ce"
    """Token loss per slot: ce, or the acceptance-targeting tvd, nla, lk_hybrid (draftsmith/util/losses.py)."""
    norm_before_fc: bool = False
    """EAGLE-3.1's RMSNorm over the concatenated target layers (vLLM's peagle loader reads no fc_norm)."""
    mask_token_id: int | None = None
    """The token fed at mask slots; default the target's pad token, else its eos."""

    def __post_init__(self):
        check_loss(self.loss, "drafter.loss", TOKEN_LOSSES)
        if self.depths < 2:
            raise DraftsmithError(f"drafter.depths: expected >= 2 parallel drafts (1 is EAGLE-3), got {self.depths}")
        if not 0 < self.keep_min <= self.keep_ratio <= 1:
            raise DraftsmithError(
                f"drafter.keep_ratio / keep_min: expected 0 < keep_min <= keep_ratio <= 1, got "
                f"{self.keep_ratio} / {self.keep_min}"
            )


def max_draft_depth(cfg: DrafterConfig) -> int | None:
    return cfg.depths  # one pass, one slot per draft position


class PEagleDrafter(nn.Module):
    """EAGLE-3's body (models/eagle3.py `add_body`: one decoder layer over [norm(embed); norm(hidden)],
    its draft vocabulary) plus the learned `mask_hidden` [1, 1, 3H], standard-normal as speculators and
    SpecForge start it; forward is the one parallel pass (`packed_inputs`), so DDP/FSDP see one forward
    per backward."""

    fc: nn.Linear  # add_body's, set at run time: mask_hidden is as wide as its input

    def __init__(self, config, draft_vocab: int, target_vocab: int, **switches):
        super().__init__()
        add_body(self, config, draft_vocab, target_vocab, **switches)
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, self.fc.in_features))

    def forward(self, aux, embeds, mask_embed, padding, chains, positions: torch.Tensor | None = None):
        return decoder_step(self, *packed_inputs(self, aux, embeds, mask_embed, padding, chains, positions))


def resolve(cfg: DrafterConfig, target_config, init_config: dict | None = None) -> DrafterConfig:
    """The config a run builds with and saves: the init_from head's fields, then the exact aux layers
    and mask token (the saved config names them)."""
    if init_config is not None:
        cfg = from_init(cfg, init_config, target_config)
    return replace(
        cfg, aux_layers=aux_layers(cfg, target_config), mask_token_id=mask_token(cfg.mask_token_id, target_config)
    )


def build(cfg: DrafterConfig, target, dataset=None) -> PEagleDrafter:
    return build_eagle3(resolve(cfg, target.config), target, dataset, drafter_class=PEagleDrafter)


def rebuild(meta: dict, target):
    return build(DrafterConfig(**{k: v for k, v in meta["drafter_config"].items() if k != "type"}), target)


def sample_chains(
    row_of: torch.Tensor, t: int, cfg: DrafterConfig, docs: torch.Tensor | None = None
) -> list[list[tuple[int, int]]]:
    """Per sequence, the (anchor a, depth d) mask slots to train this step (COD sampling, P-EAGLE
    sec. 3). A slot (a, d) predicts x_{a+d+2}, whose target distribution is label row a+d+1; it
    exists iff that row is trained (row_of >= 0) and, in a packed row (`docs` [B, T], data/packing.py),
    x_{a+d+2} is a's own example's. Chains are contiguous: depth d is drawn from the anchors that
    kept depth d-1, so every kept slot's chain is whole, as at inference. Each example of a row draws
    its own chains, as it would alone in a padded row."""
    chains = []
    for b, rows in enumerate(row_of.tolist()):
        # Without docs, one example whose labels may run to the row's end (row T-1).
        spans = [(0, len(rows) + 1)] if docs is None else document_spans(docs[b].tolist())
        chains.append([slot for start, end in spans for slot in example_chains(rows, start, min(end, t), end, cfg)])
    return chains


def document_spans(docs: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each example (a run of one nonzero document number) in a row."""
    spans: list[tuple[int, int]] = []
    for p, doc in enumerate(docs):
        if doc and (p == 0 or docs[p - 1] != doc):
            spans.append((p, p + 1))
        elif doc:
            spans[-1] = (spans[-1][0], p + 1)
    return spans


def example_chains(rows: list[int], start: int, stop: int, end: int, cfg: DrafterConfig) -> list[tuple[int, int]]:
    """One example's slots: anchors start..stop-1, labels x_{a+d+2} only before its `end` (the next
    example's tokens are no labels of its anchors)."""

    def trained(a: int, d: int) -> bool:
        return a + d + 2 < end and rows[a + d + 1] >= 0

    alive = [a for a in range(start, stop) if trained(a, 0)]  # anchors with a trained depth-0 label
    n, slots = len(alive), []
    for d in range(1, cfg.depths):
        pool = [a for a in alive if trained(a, d)]
        size = min(len(pool), int((n - d) * max(cfg.keep_ratio**d, cfg.keep_min)))
        if size <= 0:
            break
        alive = sorted(pool[i] for i in torch.randperm(len(pool))[:size].tolist())
        slots += [(a, d) for a in alive]
    return slots


def packed_inputs(core, aux, embeds, mask_embed, padding, chains, positions=None):
    """One pass's inputs: the t real slots of each sequence, then its mask slots (padded to the
    longest list) -> hidden [B, t+M, H], token embeds, positions [B, t+M], mask [B, 1, t+M, t+M].

    Real slot i: (fc(target features of x_i), embed(x_{i+1})) at position i, causal. Mask slot
    (a, d): (fc(mask_hidden), embed(mask)) at position a+d, seeing real slots <= a and its own
    chain's slots of depth <= d: exactly the causal view vLLM gives draft d+1 at serving time.
    padding [B, t]: the real slots' document numbers (0 = padding; a padding mask is one example a
    row): every slot sees its own example's real slots only, at positions[i] (i's position in its
    example; default i, a padded row) and positions[a]+d."""
    bsz, t, h = aux.shape[0], aux.shape[1], core.fc.out_features
    m = max((len(c) for c in chains), default=0)
    device = aux.device
    hidden = torch.cat([fuse(core, aux), fuse(core, core.mask_hidden).expand(bsz, m, h)], dim=1)
    tokens = torch.cat([embeds, mask_embed.expand(bsz, m, -1)], dim=1)
    real = torch.arange(t, device=device)[None].expand(bsz, -1) if positions is None else positions
    pos = torch.cat([real, torch.arange(t, t + m, device=device)[None].expand(bsz, -1)], dim=1)
    mask = torch.zeros(bsz, 1, t + m, t + m, dtype=torch.bool, device=device)
    mask[:, :, :t, :t] = document_causal_mask(padding)
    for b, slots in enumerate(chains):
        index = {s: t + j for j, s in enumerate(slots)}
        for j, (a, d) in enumerate(slots):
            q = t + j
            pos[b, q] = real[b, a] + d
            mask[b, 0, q, : a + 1] = padding[b, : a + 1] == padding[b, a]  # a's own example up to a
            for dd in range(1, d + 1):
                mask[b, 0, q, index[(a, dd)]] = True
        for q in range(t + len(slots), t + m):  # padding slots see themselves only (never a label)
            mask[b, 0, q, q] = True
    return hidden, tokens, pos, mask


def compute_loss(drafter, target, batch: dict, feats: dict, cfg: DrafterConfig, step: int = 0, forward=None):
    """Returns (loss_sum, n_tokens, metric_sums): the token loss summed over every trained slot, real
    and mask; n_tokens counts the real (depth-0) slots, so each depth weighs by its slot count (as
    speculators' plain average over slots, up to a constant). acc{d}: draft d+1's top-1 agreement."""
    forward = drafter if forward is None else forward  # the loop's distributed wrapper: its forward syncs gradients
    cfg = resolve(cfg, target.config)  # the exact mask token and layers (a no-op on a run's own config)
    ids, lmask, docs = batch["input_ids"], batch["loss_mask"], documents(batch)
    names = feature_names(cfg, target.config)
    t = ids.shape[1] - 1
    with torch.no_grad():
        labelled = label_mask(lmask, docs)  # no teacher row labels an example's first token
        row_of, draft_all, keep_all = teacher_rows(
            drafter, target.get_output_embeddings(), ids, labelled, feats["last_hidden"], feats.get("argmax")
        )
        chains = sample_chains(row_of, t, cfg, docs)  # per example: no chain runs into the next one
    embed = draft_embeddings(target)
    aux = aux_features(feats, names)[:, :t].to(drafter.fc.weight.dtype)
    mask_embed = embed(torch.tensor([[cfg.mask_token_id]], device=ids.device))
    out = forward(aux, embed(ids[:, 1:]), mask_embed, docs[:, :t], chains, positions(batch)[:, :t])
    # Depth 0: real slot i predicts x_{i+2} (label row i+1), counted iff x_{i+2} is i's own example's
    # (in a packed row it may be the next one's); slot (a, d) predicts label row a+d+1.
    own = same_document(torch.nn.functional.pad(docs, (0, 2)), 2)[:, :t]
    b0, i0 = ((row_of[:, 1:] >= 0) & own).nonzero(as_tuple=True)
    sel: list[tuple[torch.Tensor, ...]] = [(b0, i0, row_of[b0, i0 + 1], torch.zeros_like(b0))]
    rows_of = row_of.tolist()
    extra = [(b, t + j, rows_of[b][a + d + 1], d) for b, slots in enumerate(chains) for j, (a, d) in enumerate(slots)]
    if extra:
        sel.append(tuple(torch.tensor(c, device=ids.device) for c in zip(*extra)))
    b_idx, s_idx, rows, depth = (torch.cat(c) for c in zip(*sel))
    logits = draft_logits(drafter, out[b_idx, s_idx])
    t_draft, keep = draft_all[rows], keep_all[rows]
    loss = TOKEN_LOSSES[cfg.loss](logits, t_draft, keep)
    n0 = keep[depth == 0].sum()
    with torch.no_grad():
        # The loop divides metric sums by n0: depth d's hits are scaled by n0 / n_d so that acc{d}
        # reads as draft d+1's top-1 agreement on its own slots.
        hits = (logits.argmax(-1) == t_draft.argmax(-1)).float() * keep
        metrics = {
            ("acc" if d == 0 else f"acc{d}"): hits[depth == d].sum() * n0 / keep[depth == d].sum().clamp_min(1)
            for d in range(cfg.depths)
        }
    return loss, n0.long(), metrics


class ParallelProposer(Proposer):
    """P-EAGLE drafting: one drafter pass per round over the real pairs not cached yet, the bonus
    slot among them (pair (target features of x_{n-2}, x_{n-1}) at position n-2), and k-1 mask slots
    at positions n-1.., causal. The drafter's KV cache keeps the real pairs across rounds; the mask
    slots are cropped away before the next round. Chains only (one slot per depth): no
    `propose_tree`, so the engine refuses --tree with its one-line error and `compare` drafts chains."""

    def __init__(self, drafter, target, cfg: DrafterConfig):
        self.drafter, self.cfg = drafter.eval(), cfg
        self.feature_names = feature_names(cfg, target.config)
        self.embed = draft_embeddings(target)
        # out [1, t, H] -> target-vocabulary logits [1, t, V]; an attribute, as FeatureProposer's, so
        # `export --verify` can record every logits row the drafter computed (draftsmith/ship/publish.py Recorder).
        self.logits = partial(target_vocab_logits, drafter)
        self.max_depth = cfg.depths
        self.reset()

    def reset(self):
        self.cache, self.n_real = DynamicCache(), 0

    @torch.no_grad()
    def propose(self, tokens: torch.Tensor, feats: dict, k: int, sampler=None) -> Draft:
        d, device = self.drafter, tokens.device
        crop_cache(self.cache, self.n_real)  # drop last round's mask slots
        n_feats = next(iter(feats.values())).shape[1]
        new = {name: f[:, self.n_real :] for name, f in feats.items()}
        m = min(k, self.cfg.depths) - 1
        assert self.cfg.mask_token_id is not None  # the proposer's config is resolved (make_proposer)
        hidden = torch.cat([fuse(d, aux_features(new, self.feature_names)), fuse(d, d.mask_hidden).expand(1, m, -1)], 1)
        mask_ids = torch.full((1, m), self.cfg.mask_token_id, device=device)
        emb = self.embed(torch.cat([tokens[:, self.n_real + 1 : n_feats + 1], mask_ids], dim=1))
        t = n_feats - self.n_real + m
        pos = torch.arange(self.n_real, n_feats + m, device=device)[None]
        out = decoder_step(d, hidden.to(emb.dtype), emb, pos, causal_mask(t, n_feats + m, device=device), self.cache)
        self.n_real = n_feats
        draft = Draft()
        for i, logits in enumerate(self.logits(out[:, -(m + 1) :])[0]):  # bonus slot, then mask slots
            q = None if sampler is None else sampler.probs(logits)
            draft.add(int(logits.argmax()) if q is None else sampler.sample(q), i - 1, q)
        return draft


def make_proposer(drafter, target, cfg: DrafterConfig) -> ParallelProposer:
    return ParallelProposer(drafter, target, resolve(cfg, target.config))  # the exact mask token


# One module trained at optim.lr; the target stays frozen and is its own original.


def from_init(cfg: DrafterConfig, init_config: dict, target_config) -> DrafterConfig:
    """`init_from` a P-EAGLE head: its layers, its norm and its mask token (an export names them at
    the top level, a final/ in its drafter config)."""
    own = init_config["drafter_config"] if "draftsmith_format" in init_config else init_config
    ids = exported_aux_layers(init_config, target_config)
    if cfg.aux_layers and ids is not None and list(cfg.aux_layers) != ids:
        raise DraftsmithError(
            f"drafter.aux_layers: the recipe names {list(cfg.aux_layers)} but the init_from head "
            f"was trained on layers {ids} (layer outputs); drop the key or use {ids}"
        )
    return replace(
        cfg,
        aux_layers=ids or cfg.aux_layers,
        norm_before_fc=bool(own.get("norm_before_fc", False)),
        mask_token_id=own.get("mask_token_id", cfg.mask_token_id),
    )


# --- the speculators `peagle` format (vLLM 0.32: method eagle3 + parallel_drafting) -----------------
SERVE_FORMAT = "speculators"


def vllm_serving(export_dir, export_config: dict, k: int) -> tuple[dict, list[str]]:
    # Without parallel_drafting vLLM runs the head as plain EAGLE-3 (and skips mask_hidden with a warning).
    return {"method": "eagle3", "model": str(export_dir), "num_speculative_tokens": k, "parallel_drafting": True}, []


def write_peagle(drafter, cfg: DrafterConfig, target, meta: dict, tok, out, info: dict) -> None:
    import json
    from pathlib import Path

    write_speculators(drafter, cfg, target, {**meta, "k": cfg.depths}, tok, out, info)  # EAGLE-3's fields and tensors
    path = Path(out) / "config.json"
    config = json.loads(path.read_text())
    config.update(
        {
            "architectures": ["PEagleSpeculator"],
            "speculators_model_type": "peagle",
            # vLLM's peagle loader reads mask_token_id (its pard_token) and norm_before_fc, no other switch.
            "mask_token_id": cfg.mask_token_id,
            "norm_before_fc": cfg.norm_before_fc,
        }
    )
    for key in ("fc_norm", "norm_output"):
        config.pop(key, None)
    config["speculators_config"]["algorithm"] = "peagle"
    path.write_text(json.dumps(config, indent=2))


EXPORTS = {"speculators": write_peagle}


def recognises(config: dict, tensor_names: set[str]) -> bool:
    return (
        config.get("speculators_model_type") == "peagle"
        or (config.get("architectures") or ["?"])[0] == "PEagleSpeculator"
    )


def read_export(path, target) -> dict[str, torch.Tensor]:
    state = load_state(path)
    state.pop("embed_tokens.weight", None)  # the target's own embeddings
    state["mask_hidden"] = state["mask_hidden"].reshape(1, 1, -1)  # vLLM takes any shape of 3H elements
    return renamed(state, "layers.0.", "midlayer.")


def from_export(path, config: dict, cfg: DrafterConfig, target):
    cfg = replace(
        cfg,
        norm_before_fc=bool(config.get("norm_before_fc", False)),
        mask_token_id=config.get("mask_token_id", cfg.mask_token_id),
    )
    return from_exported_head(build(cfg, target), config, read_export(path, target))


def serving_snippet(fmt: str, repo_id: str, target: str, k: int) -> str:
    return (
        f"```bash\nvllm serve {repo_id}   # the speculators config names the verifier, {target}, and turns on "
        f"parallel drafting\n```"
    )


def consumer_check(exported, target, ours, prompt_ids) -> dict | None:
    """speculators' own loader on the export (every tensor arrives unchanged); its P-EAGLE forward
    is not run here (the vLLM serve-check runs the engine's)."""
    check, _ = speculators_load_check(exported)
    return {**check, "consumer": "speculators"}


def activation_bytes(cfg: DrafterConfig, tc, drafter, batch: int, length: int, elem: int) -> int:
    """`plan`: one pass over the real slots plus about n * sum_d max(r^d, r_min) mask slots."""
    slots = 1 + sum(max(cfg.keep_ratio**d, cfg.keep_min) for d in range(1, cfg.depths))
    return unroll_activation_bytes(tc, batch, length, elem, math.ceil(slots), cfg.draft_vocab_size or tc.vocab_size)


FAMILY = Family(
    NAME=NAME,
    DrafterConfig=DrafterConfig,
    feature_names=training_features,
    max_draft_depth=max_draft_depth,
    build=build,
    rebuild=rebuild,
    compute_loss=compute_loss,
    activation_bytes=activation_bytes,
    make_proposer=make_proposer,
    EXPORTS=EXPORTS,
    recognises=recognises,
    read_export=read_export,
    from_export=from_export,
    serving_snippet=serving_snippet,
    SERVE_FORMAT=SERVE_FORMAT,
    vllm_serving=vllm_serving,
    consumer_check=consumer_check,
    resolve=resolve,
    tiny={"aux_layers": [0, 1, 2], "draft_vocab_size": 60, "depths": 3},
)
