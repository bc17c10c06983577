"""EAGLE-3 drafter (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language
Models via Training-Time Test", arXiv:2503.01840).

Differences from EAGLE-1 (models/eagle.py):
- input: hidden states of three target layers (low, mid, high) fused by fc(3H -> H, no bias);
- the decoder layer ("midlayer") attends over [RMSNorm(embed(t)); RMSNorm(hidden)] (2H wide);
- its own lm_head over a reduced *draft vocabulary* (the N most frequent trained target tokens),
  with `d2t` (draft id -> target id offset) and `t2d` (target id in draft vocab?) maps;
- training-time test (TTT): T unrolled steps, each feeding the drafter's own hidden states, with
  loss sum_j 0.8^j * softCE_j; no feature regression loss.
EAGLE-3.1's normalisation switches (speculators' names, which vLLM 0.32 reads from the top level of
a speculators config): `norm_before_fc`, one RMSNorm over the 3H concat before fc; `fc_norm`, one
RMSNorm per fused layer before the concat (exclusive with norm_before_fc: speculators refuses the
pair); `norm_output`, the next step is fed norm(out), the tensor lm_head reads, instead of out.
Tensor names follow the official/SGLang `LlamaForCausalLMEagle3` checkpoint.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import Field, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeVar, overload

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from draftsmith import DraftsmithError
from draftsmith.engine.proposers import FeatureProposer
from draftsmith.models.eagle import layer_config, sglang_snippet, unroll_activation_bytes
from draftsmith.models.family import Family
from draftsmith.models.folder import load_state
from draftsmith.models.formats import (
    from_exported_head,
    llama_dims,
    logit_diff,
    renamed,
    vllm_method,
    vllm_snippet,
    write_tensors,
)
from draftsmith.models.training import draft_vocab, label_rows, target_label_rows, to_target_vocab
from draftsmith.target.features import draft_embeddings, target_features, whole_weight
from draftsmith.target.load import resolve_target, served_name
from draftsmith.util.losses import TOKEN_LOSSES, check_loss, topk_distillation_loss
from draftsmith.util.masks import causal_mask, documents, positions, same_document, ttt_mask
from draftsmith.util.precision import keep_rope_fp32

NAME = "eagle3"


@dataclass
class DrafterConfig:
    aux_layers: list | None = None
    """0-based target decoder layers whose *outputs* are fused; default [1, L//2 - 1, L - 4], the
    layers SpecForge and vLLM tap (`default_aux_layers`)."""
    draft_vocab_size: int = 32000
    """Size of the drafter's own lm_head: the most frequent target tokens in the loss-masked training data."""
    ttt_steps: int = 7
    """Training-time-test unroll depth: step j trains the prediction j+1 tokens past the last real feature."""
    step_decay: float = 0.8
    """Loss weight of step j is step_decay ** j."""
    hass: bool = False
    """HASS top-k distillation on every TTT step (the TTT unroll already is HASS's context alignment)."""
    hass_topk: int = 10
    hass_topk_weight: float = 1.0
    loss: str = "ce"
    """Token loss of every TTT step against the target's draft-vocabulary distribution: ce (EAGLE-3's),
    or the acceptance-targeting tvd, nla, lk_hybrid (draftsmith/util/losses.py)."""
    # --- EAGLE-3.1 (speculators PR #610 defaults norm_before_fc and norm_output on) --------------
    norm_before_fc: bool = False
    """One RMSNorm over the concatenated target layers [3H] before fc."""
    fc_norm: bool = False
    """One RMSNorm per fused target layer [H] before the concat; not with norm_before_fc."""
    norm_output: bool = False
    """Feed the next draft step the final-normed hidden state (what lm_head reads) instead of the pre-norm one."""

    def __post_init__(self):
        check_loss(self.loss, "drafter.loss", TOKEN_LOSSES)
        if self.fc_norm and self.norm_before_fc:
            raise DraftsmithError(
                "drafter.fc_norm and drafter.norm_before_fc: choose one (speculators refuses both; "
                "norm_before_fc normalises the concat, fc_norm each layer)"
            )


SWITCHES = ("norm_before_fc", "fc_norm", "norm_output")  # EAGLE-3.1, under speculators' and vLLM's names


class BodyConfig(Protocol):
    """The fields of a config on EAGLE-3's body that the shared functions here read (`aux_layers`,
    `feature_names`, `build`, `write_speculators`): EAGLE-3's DrafterConfig and P-EAGLE's
    (models/peagle.py), which is no subclass of it (no TTT fields, other switches: read with getattr).
    A dataclass: `replace` makes the resolved copy."""

    __dataclass_fields__: ClassVar[dict[str, Field[Any]]]
    aux_layers: list | None
    draft_vocab_size: int


BodyConfigT = TypeVar("BodyConfigT", bound=BodyConfig)
Body = Any  # an nn.Module that `add_body` filled in (EAGLE-3's or P-EAGLE's head): its parts (fc, midlayer,
# lm_head, d2t, t2d ...) are set at run time, so they type as Any.
DrafterT = TypeVar("DrafterT", bound=nn.Module)  # build's drafter_class: P-EAGLE's head on the same body


def default_aux_layers(n: int) -> list[int]:
    """The low, mid and high layers of an n-layer target that SpecForge and vLLM fuse by default.

    They name them as the *inputs* of layers (2, n//2, n-3): vLLM's `eagle_aux_hidden_state_layer_ids`,
    the hidden state entering that layer, i.e. `output_hidden_states[i]`. draftsmith names the
    *output* of a layer (`hidden.a` = output_hidden_states[a + 1]), so the same states are the outputs
    of layers (2 - 1, n//2 - 1, n - 3 - 1) = (1, n//2 - 1, n - 4). Exports write both conventions
    (draftsmith/ship/export.py), so the engines tap exactly these.
    """
    return [1, n // 2 - 1, n - 4]


def aux_layers(cfg: BodyConfig, target_config) -> list[int]:
    n = target_config.num_hidden_layers
    layers = list(cfg.aux_layers) if cfg.aux_layers else default_aux_layers(n)
    bad = [a for a in layers if not isinstance(a, int) or not 0 <= a < n]
    # In layer order: vLLM collects the tapped layers' states in layer order whatever order the config
    # lists them in, so a drafter that fused them in another order would silently get other features.
    # (A repeated id, which only tiny test targets need, fails loudly there: one state short.)
    if bad or len(layers) != 3 or layers != sorted(layers):
        default = (
            "" if cfg.aux_layers else f" (the default for {n} layers; set drafter.aux_layers for so shallow a target)"
        )
        raise DraftsmithError(
            f"drafter.aux_layers: expected 3 layer ids in [0, {n - 1}], in increasing order, for "
            f"this target (vLLM concatenates them in layer order), got {layers}{default}"
        )
    return layers


def exported_aux_layers(config: dict, target_config) -> list[int] | None:
    """The aux layers (draftsmith's convention: layer outputs) an EAGLE-3 folder was trained on, from
    its config.json: a draftsmith `final/` names them; an export says what the engines read (SGLang's
    nested ids are layer outputs, vLLM's and speculators' top-level ids layer inputs); a published
    head that names none was trained on the engines' default."""
    if "draftsmith_format" in config:
        ids = config["drafter_config"].get("aux_layers")
        if ids is None and config["draftsmith_format"] < 2:  # saved before defaults were resolved into it
            raise DraftsmithError(
                "an EAGLE-3 final/ of draftsmith format 1 names no aux_layers: its default layers "
                "were [2, L//2, L-3]; write them into drafter_config.aux_layers of its config.json"
            )
        return None if ids is None else list(ids)
    nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if nested is not None:
        return list(nested)
    top = config.get("eagle_aux_hidden_state_layer_ids")
    return [i - 1 for i in top] if top is not None else default_aux_layers(target_config.num_hidden_layers)


def exported_switches(config: dict) -> dict:
    """EAGLE-3.1's switches of a drafter folder: a final/'s drafter config, or an export's top-level
    keys (where vLLM reads them; absent = off)."""
    own = config["drafter_config"] if "draftsmith_format" in config else config
    return {k: bool(own.get(k, False)) for k in SWITCHES}


def from_init(cfg: DrafterConfig, init_config: dict, target_config) -> DrafterConfig:
    """`init_from` an EAGLE-3 head: fine-tuning feeds it the layers it was trained on, through the
    norms it was trained with. A recipe that names no aux layers takes the head's; one that names
    other layers, or switches on a norm the head lacks, is an error naming both."""
    switches = exported_switches(init_config)
    extra = [k for k in SWITCHES if getattr(cfg, k) and not switches[k]]
    if extra:
        raise DraftsmithError(f"drafter.{extra[0]}: the init_from head was trained without it; drop the key")
    cfg = replace(cfg, **switches)
    ids = exported_aux_layers(init_config, target_config)
    if ids is None:
        return cfg
    if cfg.aux_layers and list(cfg.aux_layers) != ids:
        raise DraftsmithError(
            f"drafter.aux_layers: the recipe names {list(cfg.aux_layers)} but the init_from head "
            f"was trained on layers {ids} (layer outputs); drop the key or use {ids}"
        )
    cfg = replace(cfg, aux_layers=ids)
    aux_layers(cfg, target_config)  # ids outside this target's layers fail here
    return cfg


def feature_names(cfg: BodyConfig, target_config) -> tuple[str, ...]:
    # The three fused layers, plus the last (post-norm) hidden state whose lm_head gives the
    # target distribution the loss matches.
    return tuple(f"hidden.{a}" for a in aux_layers(cfg, target_config)) + ("last_hidden",)


def training_features(cfg: BodyConfig, target_config) -> tuple[str, ...]:
    """What training reads (the record's `feature_names`): the drafting features, plus the target's
    greedy tokens (`argmax`, derived once per example) that tell which labels are in the draft
    vocabulary. Drafting reads `feature_names` alone."""
    return feature_names(cfg, target_config) + ("argmax",)


def add_body(
    module: Body,
    config,
    draft_vocab: int,
    target_vocab: int,
    n_aux: int = 3,
    norm_before_fc: bool = False,
    fc_norm: bool = False,
    norm_output: bool = False,
) -> None:
    """Register EAGLE-3's body on `module` under vLLM's and speculators' tensor names: fc over the
    fused target layers, one decoder layer reading [norm(embed); norm(hidden)], the final norm and the
    draft-vocabulary lm_head with its d2t/t2d maps. EAGLE-3's head and P-EAGLE's (models/peagle.py) are
    each this body plus their own forward; the functions below act on either."""
    h, eps = config.hidden_size, config.rms_norm_eps
    module.config = config
    # EAGLE-3.1: vLLM's tensor names (`input_norm`, `fc_norm.{i}`); absent when the switch is off.
    if norm_before_fc:
        module.input_norm = LlamaRMSNorm(n_aux * h, eps=eps)
    if fc_norm:
        module.fc_norm = nn.ModuleList(LlamaRMSNorm(h, eps=eps) for _ in range(n_aux))
    module.norm_output = norm_output
    module.fc = nn.Linear(n_aux * h, h, bias=False)
    module.midlayer = LlamaDecoderLayer(config, layer_idx=0)
    attn = module.midlayer.self_attn
    for name in ("q_proj", "k_proj", "v_proj"):  # attention reads [norm(embed); norm(hidden)]: 2H wide
        old = getattr(attn, name)
        setattr(attn, name, nn.Linear(2 * h, old.out_features, bias=old.bias is not None))
    module.midlayer.hidden_norm = LlamaRMSNorm(h, eps=eps)
    module.norm = LlamaRMSNorm(h, eps=eps)
    module.lm_head = nn.Linear(h, draft_vocab, bias=False)
    module.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
    module.register_buffer("t2d", torch.zeros(target_vocab, dtype=torch.bool))
    module.rotary = keep_rope_fp32(LlamaRotaryEmbedding(config))


def fuse(body, aux):
    """Target features [..., 3H] (fused layers in layer order) -> the drafter's hidden input [..., H]:
    fc, after EAGLE-3.1's norms when switched on (only target features pass them, as in vLLM)."""
    if hasattr(body, "input_norm"):
        aux = body.input_norm(aux)
    if hasattr(body, "fc_norm"):
        aux = torch.cat([norm(part) for norm, part in zip(body.fc_norm, aux.chunk(len(body.fc_norm), dim=-1))], -1)
    return body.fc(aux)


def carry(body, out):
    """What the next draft step is fed: out, or norm(out) under norm_output (vLLM's second output)."""
    return body.norm(out) if body.norm_output else out


def decoder_step(body, hidden, token_embeds, position_ids, attention_mask, cache=None):
    """One drafter pass. hidden: fused target features or the drafter's own previous output
    [B, T, H]; token_embeds: [B, T, H] -> output hidden [B, T, H]."""
    layer = body.midlayer
    x = torch.cat([layer.input_layernorm(token_embeds), layer.hidden_norm(hidden)], dim=-1)
    attn, _ = layer.self_attn(
        x, position_embeddings=body.rotary(hidden, position_ids), attention_mask=attention_mask, cache=cache
    )
    h = hidden + attn  # the residual stream is the hidden state, not the embedding
    return h + layer.mlp(layer.post_attention_layernorm(h))


def draft_logits(body, carried):
    """Draft-vocab logits from a step's carried output: lm_head always reads norm(out)."""
    return body.lm_head(carried if body.norm_output else body.norm(carried))


def to_target_ids(body, draft_ids):
    return draft_ids + body.d2t[draft_ids]


def target_vocab_logits(body, out):
    """Draft-vocab logits scattered into the target vocabulary (-inf outside the draft vocab)."""
    return to_target_vocab(draft_logits(body, out), body.d2t, body.t2d.shape[0])


class Eagle3Drafter(nn.Module):
    """EAGLE-3's head: `add_body`'s parts, run autoregressively over its own outputs."""

    def __init__(self, config, draft_vocab: int, target_vocab: int, **switches):
        super().__init__()
        add_body(self, config, draft_vocab, target_vocab, **switches)

    def forward(self, aux, embeds, padding, selections, positions: torch.Tensor | None = None):
        """The whole training-time-test unroll in one call (one forward per backward for DDP/FSDP).

        aux: [B, t, 3H] target features of roots r = 0..t-1; embeds: [B, t + steps, H] embeddings of
        tokens 1..; padding: [B, t] the roots' document numbers (0 = padding; a padding mask is one
        example a row); selections[j] = (batch idx, root idx) whose step-j logits count; positions:
        [B, t] root r's position in its example (default r: a padded row).
        Returns the draft-vocab logits of every step at its selected positions.
        """
        bsz, t = padding.shape
        if positions is None:
            positions = torch.arange(t, device=padding.device)[None].expand(bsz, -1)
        hidden, cache, logits = fuse(self, aux), DynamicCache(), []
        for j, (b_idx, r_idx) in enumerate(selections):
            # Step j of chain r: input token t_{r+j+1} at position positions[r]+j, predicting t_{r+j+2}.
            out = carry(
                self,
                decoder_step(
                    self,
                    hidden,
                    embeds[:, j : j + t],
                    positions + j,
                    ttt_mask(t, j, padding),
                    cache=cache,
                ),
            )
            logits.append(draft_logits(self, out[b_idx, r_idx]))
            hidden = out  # the next step feeds the drafter's own output, as at inference
        return logits


def resolve(cfg: DrafterConfig, target_config, init_config: dict | None = None) -> DrafterConfig:
    """The config a run builds with and saves: the init_from head's layers and switches, then the
    exact aux layers (the saved config names them, whatever the default is when it is read back)."""
    if init_config is not None:
        cfg = from_init(cfg, init_config, target_config)
    return exact_aux_layers(cfg, target_config)


def exact_aux_layers(cfg: BodyConfigT, target_config) -> BodyConfigT:
    """`cfg` naming its exact aux layers: all `resolve` does without an init_from head, and all `build`
    does, which P-EAGLE's config (resolved by its own family) passes through too."""
    return replace(cfg, aux_layers=aux_layers(cfg, target_config))


# The head's type follows drafter_class: EAGLE-3's own, or the class P-EAGLE passes (PEagleDrafter).
@overload
def build(cfg: BodyConfig, target, dataset=None, drafter_class: None = None) -> Eagle3Drafter: ...
@overload
def build(cfg: BodyConfig, target, dataset=None, *, drafter_class: type[DrafterT]) -> DrafterT: ...
def build(cfg: BodyConfig, target, dataset=None, drafter_class=None):
    """The head, its draft vocabulary from `dataset` and lm_head warm-started from the target's rows.
    `drafter_class`: P-EAGLE's, another module on the same body (`add_body`) with another forward."""
    tc = target.config
    cfg = exact_aux_layers(cfg, tc)  # = resolve(cfg, tc): no init_from head here
    drafter: Body = (drafter_class or Eagle3Drafter)(
        layer_config(tc),
        min(cfg.draft_vocab_size, tc.vocab_size),
        tc.vocab_size,
        **{k: getattr(cfg, k, False) for k in SWITCHES},
    )
    if dataset is not None:
        ids = draft_vocab(dataset, tc.vocab_size, cfg.draft_vocab_size)
        drafter.d2t.copy_(ids - torch.arange(len(ids)))  # target id = draft id + d2t[draft id]
        drafter.t2d.zero_()
        drafter.t2d[ids] = True
        with torch.no_grad():  # warm start: the target's own output rows for the draft vocabulary
            drafter.lm_head.weight.copy_(target.get_output_embeddings().weight[ids].float())
    return drafter


def rebuild(meta: dict, target) -> Eagle3Drafter:
    cfg = DrafterConfig(**{k: v for k, v in meta["drafter_config"].items() if k != "type"})
    return build(cfg, target)


def aux_features(feats: dict, names: tuple[str, ...]) -> torch.Tensor:
    """Concatenate the fused layers' features in `names` order: [..., 3H], the input of fc."""
    return torch.cat([feats[n] for n in names if n.startswith("hidden.")], dim=-1)


def teacher_rows(core, lm_head, ids, lmask, last, argmax=None):
    """The target's draft-vocabulary logits at every position that is some draft's label (position p
    is the label position of token p+1, counted iff lmask[p+1]) -> (row_of [B, T]: position -> row or
    -1, logits [rows, V_draft], keep [rows]: 1 where the target's argmax is in the draft vocabulary,
    where EAGLE-3 trains). With the `argmax` feature [B, T] (the target's greedy tokens, taken once
    per example) only the draft vocabulary's rows of lm_head are multiplied, V_draft wide instead of V
    (6x fewer for 8,192 of SmolLM2's 49,152: a cached EAGLE-3 step 1.19x faster in bf16,
    docs/benchmarks.md); without it, or on a sharded lm_head, the full vocabulary is scored in chunks
    and cut down, as the argmax needs."""
    need = torch.nn.functional.pad(lmask[:, 1:].bool(), (0, 1))  # [B, T]: the last position labels nothing
    weight = whole_weight(lm_head)
    if argmax is None or weight is None:
        row_of, (logits, keep) = target_label_rows(
            lm_head, last, need, lambda full: (full[:, core.t2d], core.t2d[full.argmax(-1)].float())
        )
        return row_of, logits, keep
    nb, np_, row_of = label_rows(need)
    rows, draft_rows = last[nb, np_].to(weight.dtype), weight[core.t2d]  # t2d: draft ids in target-id order
    chunks = range(0, max(len(rows), 1), 4096)  # one call on no rows: an empty [0, V_draft]
    logits = torch.cat([F.linear(rows[c : c + 4096], draft_rows).float() for c in chunks])
    return row_of, logits, core.t2d[argmax[nb, np_]].float()


def label_mask(lmask: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
    """The loss mask [B, T] of tokens that are the label of the position before them: each example's
    first token is no label (in a packed row the position before it is the previous example's), as
    a padded row's position 0 never is one. `teacher_rows` scores only these labels."""
    return lmask * torch.nn.functional.pad(same_document(docs, 1)[:, :-1], (1, 0))


def compute_loss(drafter, target, batch: dict, feats: dict, cfg: DrafterConfig, step: int = 0, forward=None):
    """Returns (loss_sum, n_tokens, metric_sums); n_tokens counts step-0 positions.

    batch: input_ids, attention_mask, loss_mask [B, T]; feats: `feature_names` -> [B, T, H].
    """
    forward = drafter if forward is None else forward  # the loop's distributed wrapper: its forward syncs gradients
    ids, lmask, docs = batch["input_ids"], batch["loss_mask"], documents(batch)
    names = feature_names(cfg, target.config)
    seq, t = ids.shape[1], ids.shape[1] - 1
    roots = torch.arange(t, device=ids.device)
    last = feats["last_hidden"]
    lm_head = target.get_output_embeddings()
    # Tokens and mask past the end are padding: those chain steps have no label and are masked.
    ids_ext = torch.nn.functional.pad(ids, (0, cfg.ttt_steps + 1))
    lmask_ext = torch.nn.functional.pad(lmask, (0, cfg.ttt_steps + 1))
    docs_ext = torch.nn.functional.pad(docs, (0, cfg.ttt_steps + 1))
    with torch.no_grad():
        labelled = label_mask(lmask, docs)  # no teacher row labels an example's first token
        row_of, draft_all, keep_all = teacher_rows(drafter, lm_head, ids, labelled, last, feats.get("argmax"))
        selections, labels = [], []
        for j in range(cfg.ttt_steps):
            # Step j of chain r predicts t_{r+j+2}: counted iff that token exists, is trained (loss
            # mask) and is r's own example's (in a packed row it may be the next example's); its
            # target distribution is the target's lm_head at position r+j+1.
            own = same_document(docs_ext, j + 2)[:, :t]
            valid = (roots + j + 2 < seq)[None] & lmask_ext[:, j + 2 : j + 2 + t].bool() & own
            b_idx, r_idx = valid.nonzero(as_tuple=True)
            r = row_of[b_idx, r_idx + j + 1]
            selections.append((b_idx, r_idx))
            labels.append((draft_all[r], keep_all[r]))
    aux = aux_features(feats, names)[:, :t]
    embeds = draft_embeddings(target)(ids_ext[:, 1:])
    # Roots attend within their own example, at its own positions (0..t-1 in a padded row).
    logits = forward(aux.to(drafter.fc.weight.dtype), embeds, docs[:, :t], selections, positions(batch)[:, :t])
    total: float | torch.Tensor = 0.0  # a Tensor once step 0's loss is added
    metrics: dict[str, torch.Tensor] = {}
    for j, (s_logits, (t_draft, keep)) in enumerate(zip(logits, labels)):
        loss = TOKEN_LOSSES[cfg.loss](s_logits, t_draft, keep)
        if cfg.hass:  # the target's top-k among draft-vocab tokens
            loss = loss + cfg.hass_topk_weight * topk_distillation_loss(s_logits, t_draft, keep, cfg.hass_topk)
        total = total + cfg.step_decay**j * loss
        hits = ((s_logits.argmax(-1) == t_draft.argmax(-1)).float() * keep).sum().detach()
        metrics["acc" if j == 0 else f"acc{j}"] = hits
    return total, labels[0][1].sum().long(), metrics


def make_proposer(drafter, target, cfg: DrafterConfig) -> FeatureProposer:
    names = feature_names(cfg, target.config)
    return FeatureProposer(
        drafter,
        target,
        names,
        to_hidden=lambda feats: fuse(drafter, aux_features(feats, names)),
        # The proposer keeps each node's carried output: its children's hidden input and its logits.
        step=lambda *args: carry(drafter, decoder_step(drafter, *args)),
        logits=partial(target_vocab_logits, drafter),
    )


# The drafter is one module trained at optim.lr, and the target it reads stays frozen.
# from_init (above): a fine-tune reads the aux layers of the head it starts from.


# vLLM serves this family's `speculators` export as speculative method `eagle3` (draftsmith/ship/serve_check.py).
SERVE_FORMAT, vllm_serving = "speculators", vllm_method("eagle3")


# --- formats --------------------------------------------------------------------------------------
# `sglang` (= `vllm`): the official EAGLE-3 / SGLang / vLLM `LlamaForCausalLMEagle3` checkpoint;
# `speculators`: vLLM speculators' `Eagle3Speculator`, which vLLM serves on its own.


def write_sglang(drafter, cfg: DrafterConfig, target, meta: dict, tok, out, info: dict) -> None:
    on = [k for k in SWITCHES if getattr(cfg, k)]
    if on:  # SGLang's `norm_output` means something else (where the final norm sits), and it has no norm_before_fc
        raise DraftsmithError(
            f"export: an EAGLE-3.1 head ({', '.join(on)}) exports only as --format speculators, "
            "whose config vLLM reads the switches from"
        )
    ids = aux_layers(cfg, target.config)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        **llama_dims(drafter),
        "draft_vocab_size": drafter.lm_head.out_features,
        "tie_word_embeddings": False,
        "target_hidden_size": drafter.config.hidden_size,
        # SGLang reads the nested ids (layer outputs) and adds 1; vLLM reads top-level ids as
        # layer *inputs* with no +1. Top-level = nested + 1 makes both tap the same layers.
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in ids],
        "draftsmith": info,
    }
    write_tensors(out, config, drafter.state_dict())


def write_speculators(drafter, cfg: BodyConfig, target, meta: dict, tok, out, info: dict) -> None:

    state = renamed(drafter.state_dict(), "midlayer.", "layers.0.")
    # vLLM keeps a drafter's own embed_tokens when it differs from the target's, so ship the
    # target's own (never random) embeddings.
    state["embed_tokens.weight"] = target.get_input_embeddings().weight.detach()
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "draft_vocab_size": drafter.lm_head.out_features,
        "norm_before_residual": False,
        # Top level: vLLM reads the switches only here (inside transformer_layer_config they
        # are reset to False, and an input_norm tensor is then dropped without an error).
        **{k: getattr(cfg, k, False) for k in SWITCHES},
        "target_hidden_size": drafter.config.hidden_size,
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in aux_layers(cfg, target.config)],  # layer inputs
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": meta.get("k", 5),
                    "accept_tolerance": 0.0,
                    "verifier_accept_k": 1,
                }
            ],
            # A name vLLM and speculators resolve, never draftsmith's own alias.
            "verifier": {
                "name_or_path": served_name(meta["target"]),
                "architectures": list(target.config.architectures or []),
            },
        },
        "transformer_layer_config": llama_dims(drafter),
        "draftsmith": info,
    }
    write_tensors(out, config, state)


EXPORTS = {"sglang": write_sglang, "vllm": write_sglang, "speculators": write_speculators}


def recognises(config: dict, tensor_names: set[str]) -> bool:
    return (config.get("architectures") or ["?"])[0] in ("LlamaForCausalLMEagle3", "Eagle3Speculator")


def read_export(path, target) -> dict[str, torch.Tensor]:
    state = load_state(path)
    state.pop("embed_tokens.weight", None)  # EAGLE heads use the target's embeddings
    return renamed(state, "layers.0.", "midlayer.")


def from_export(path, config: dict, cfg: DrafterConfig, target) -> Eagle3Drafter:
    return from_exported_head(
        build(replace(cfg, **exported_switches(config)), target), config, read_export(path, target)
    )


# The target is never trained: it is its own original (Medusa-2 differs).


def serving_snippet(fmt: str, repo_id: str, target: str, k: int) -> str:
    if fmt == "speculators":
        return f"```bash\nvllm serve {repo_id}   # the speculators config names the verifier, {target}\n```"
    return (
        sglang_snippet("EAGLE3", repo_id, target, k) if fmt == "sglang" else vllm_snippet("eagle3", repo_id, target, k)
    )


def activation_bytes(cfg: DrafterConfig, tc, drafter, batch: int, length: int, elem: int) -> int:
    """`plan`: bytes live at a training step's peak for a micro-batch of full rows (fp32 loss buffers)."""
    return unroll_activation_bytes(tc, batch, length, elem, cfg.ttt_steps, cfg.draft_vocab_size or tc.vocab_size)


# --- the speculators format's own consumer (`export --verify`, `publish`) ---------------------------
SPECULATORS_TOL = 1e-4


def consumer_check(exported: Path, target, ours, prompt_ids: list[list[int]]) -> dict | None:
    """speculators' own loader, then its own forward next to our drafter (`ours`, a FeatureProposer).
    Only EAGLE-3 exports to speculators: draftsmith has no EAGLE-1 speculators format, and
    speculators 0.9.0 has no EAGLE-1 model class. None for the other formats (no consumer runs here)."""
    if not json.loads((Path(exported) / "config.json").read_text()).get("speculators_model_type"):
        return None
    check, model = speculators_load_check(exported)
    check["consumer"] = "speculators"
    if model is not None:
        check["forward"] = speculators_forward_check(model, target, ours, prompt_ids)
        check["passed"] = check["passed"] and check["forward"]["passed"]
    return check


def speculators_load_check(exported: Path) -> tuple[dict, object]:
    """Load a speculators-format folder with speculators' own `SpeculatorModel.from_pretrained`, and
    check that every tensor of model.safetensors arrived unchanged under its name -> (result, the
    loaded model or None). Skipped (and said so) when speculators is not installed. Its verifier is
    named by hub id in the config; a local folder for it (draftsmith's embedded target) is put in a
    temporary copy of the config, so the check runs offline. Install without letting pip replace the CPU torch or transformers:
    `pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0 && pip install loguru openai
    pydantic-settings aiohttp` (speculators 0.9.0 declares transformers<=5.19 and torchvision)."""
    import importlib.util
    import tempfile

    if importlib.util.find_spec("speculators") is None:
        return {"checked": False, "why": "speculators is not installed"}, None
    from importlib.metadata import version

    from safetensors.torch import load_file
    from speculators import SpeculatorModel

    config = json.loads((exported / "config.json").read_text())
    local = resolve_target(config["draftsmith"]["target"])
    with tempfile.TemporaryDirectory() as tmp:
        config["speculators_config"]["verifier"]["name_or_path"] = str(local)
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        (Path(tmp) / "model.safetensors").symlink_to((exported / "model.safetensors").resolve())
        try:
            model = SpeculatorModel.from_pretrained(tmp)
        except Exception as e:  # the consumer refuses the folder: that is the finding
            return {
                "checked": True,
                "version": version("speculators"),
                "passed": False,
                "error": f"{type(e).__name__}: {str(e).splitlines()[0]}",
            }, None
    loaded, stored = model.state_dict(), load_file(exported / "model.safetensors")
    unused = sorted(set(stored) - set(loaded))
    diff = max(
        ((loaded[n].float() - t.float()).abs().max().item() for n, t in stored.items() if n in loaded), default=0.0
    )
    return {
        "checked": True,
        "version": version("speculators"),
        "class": type(model).__name__,
        "tensors": len(stored),
        "unused_tensors": unused,
        "max_abs_diff": diff,
        "from_verifier": sorted(set(loaded) - set(stored)),
        "passed": not unused and diff == 0.0,
    }, model


@torch.no_grad()
def speculators_forward_check(model, target, ours, prompt_ids: list[list[int]]) -> dict:
    """Run speculators' own `Eagle3DraftModel.forward` on real target features of each prompt and
    compare its first-draft-step logits at every prompt position with our drafter's (`ours`, an fp32
    FeatureProposer), in the target vocabulary. Its aux ids index transformers' hidden_states (entry
    0 = embeddings) and are read from its own config, so a wrong id in the export shows here."""
    device = next(target.parameters()).device
    model, theirs, mine = model.float().to(device).eval(), [], []
    for p in prompt_ids:
        x, t = torch.tensor([p], device=device), len(p) - 1
        pos, nxt = torch.arange(t, device=device)[None], x[:, 1:]  # row r: feature of x_r, token x_{r+1}
        # One target pass gives both sides their layers: speculators' id i is transformers'
        # hidden_states[i], i.e. the output of layer i-1 (`hidden.{i-1}`; 0 is the embeddings).
        ids = model.config.eagle_aux_hidden_state_layer_ids
        names = tuple(dict.fromkeys([*ours.feature_names, *(f"hidden.{i - 1}" for i in ids if i > 0)]))
        feats = {n: f.float() for n, f in target_features(target, {"input_ids": x[:, :t]}, names).items()}
        aux = torch.cat(
            [feats[f"hidden.{i - 1}"] if i > 0 else target.get_input_embeddings()(x[:, :t]).float() for i in ids],
            dim=-1,
        )
        try:
            small = _speculators_first_step(model, aux, nxt, pos)
        except Exception as e:  # speculators cannot run the folder: that is the finding
            return {"passed": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
        mine.append(
            ours.logits(
                ours.step(ours.to_hidden(feats), ours.embed(nxt).float(), pos, causal_mask(t, t, device=device), None)
            )[0]
        )
        theirs.append(to_target_vocab(small, model.d2t, mine[-1].shape[-1]))  # speculators' d2t is ours
    a, b = torch.cat(mine), torch.cat(theirs)
    diff, top_a, top_b = logit_diff(a, b), a.argmax(-1), b.argmax(-1)
    argmax = (top_a == top_b).float().mean().item()
    # A flip between two logits closer than 2 * tol is a tie that rounding within the tolerance may
    # break either way (an untrained head has many); beyond it the two drafters rank tokens differently.
    gap = (a.gather(-1, top_a[:, None]) - a.gather(-1, top_b[:, None])).squeeze(-1)
    flips = int(((top_a != top_b) & (gap > 2 * SPECULATORS_TOL)).sum())
    why = []
    if flips:
        why.append(f"argmax differs on {flips} rows whose top two logits are more than {2 * SPECULATORS_TOL:.0e} apart")
    if not diff <= SPECULATORS_TOL:  # nan fails too
        why.append(f"max |Δ logits| {diff:.1e} > {SPECULATORS_TOL:.0e}")
    return {
        "rows": len(a),
        "max_abs_logit_diff": diff,
        "logit_argmax_agreement": round(argmax, 4),
        "argmax_flips_beyond_ties": flips,
        "tolerance": SPECULATORS_TOL,
        "passed": not why,
        **({"why": "; ".join(why)} if why else {}),
    }


def _speculators_first_step(model, aux: torch.Tensor, next_ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """speculators' forward with ttt_steps=1 (EAGLE-3's first draft step; more steps need flex
    attention lengths that are multiples of 128) -> its draft-vocab logits [T, V_draft]. The forward
    returns draft tokens, not logits, so a hook on its lm_head takes them."""
    grab = []
    hook = model.lm_head.register_forward_hook(lambda m, args, out: grab.append(out[0]))
    try:
        with warnings.catch_warnings():  # flex attention without torch.compile: slow, not wrong
            warnings.simplefilter("ignore")
            model(
                hidden_states=aux,
                input_ids=next_ids,
                document_ids=torch.zeros_like(next_ids),
                position_ids=pos,
                ttt_steps=1,
            )
    finally:
        hook.remove()
    return grab[0]


FAMILY = Family(
    NAME=NAME,
    DrafterConfig=DrafterConfig,
    feature_names=training_features,
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
    tiny={"aux_layers": [0, 1, 2], "draft_vocab_size": 60},
)
