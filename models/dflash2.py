"""DFlash2: DFlash's block drafter with a grouped dynamic causal convolution around every draft
sublayer and a low-rank path selector over each slot's top-k candidates (z-lab's DFlash2,
inco.ai/blog/dflash2; speculators `dflash2`, PR #1006), as vLLM 0.32 serves it (method `dflash`,
architecture `DFlash2DraftModel`, `qwen3_dflash2.py`).

The backbone is DFlash's, shared as functions (models/dflash.py: `add_backbone`, `context_kv`,
`block_pass`, the packed training blocks and the per-slot token loss). Each draft layer wraps its
attention and its MLP (`block_pass`'s `around`) in one GroupedCausalConv:

    a            = RMSNorm(x)                              the sublayer input
    [d0 ; d1]    = kernel_projection(a)                    [N, 2, T, H/G]: dynamic kernels, per group
    y            = Sublayer(Conv(a; base[0], d0))          attention's q/k/v read the convolved input
    out          = Conv(y; base[1], d1)                    both kernels from the sublayer's INPUT
    Conv(x)[n,c] = sum_{t<T, t<=slot(n)} (base[t,c] + d[n,t,c//G]) * x[n-t,c]

The convolution runs along the block's slots only, causally back to the block's slot 0 (the bonus),
per channel; its dynamic part is shared by each group of G channels and indexed by the output row.
The ctx K/V never pass through it (vLLM projects them as DFlash does). Then the selector:

    (u_k, C_k) = top-k of z_k = lm_head(h_k)                   the unary candidates of slot k
    s_k[c]     = u_k[c] + < P[prev_k] * (W_hp h_k), S[C_k[c]] >   P, S: [V, r] codebooks, W_hp: [r, H]

walked greedily left to right at inference (prev_1 = the bonus token, prev_{k+1} = draft k, draft k =
C_k[argmax s_k]); sampled, draft k is drawn from softmax(s_k) over C_k (vLLM's Gumbel-max at the
request temperature), which is the q its draft carries, so the chain stays lossless. In training,
prev_k is the data token x_{a+k-1} (teacher forcing, as speculators).

Objective (draftsmith/util/losses.py): DFlash's unary token loss on z_k + selector_loss_weight * the
selector's k-way CE, the gold (the target's argmax) injected at the last candidate when the unary
top-k misses it (for the loss only), weighted per slot as the unary loss (speculators 0.9.0).

Identity init (as speculators): base_kernel[:, 0] = 1, the rest 0, kernel_projection 0, so each
convolution is the identity; and W_hp = 0 (the codebooks random), so s_k = u_k: a fresh DFlash2
drafts exactly as its DFlash backbone. Full vocabulary only (vLLM's selector reads lm_head's top-k
with no d2t, and its codebooks have V rows): the export ships no embed_tokens / lm_head / d2t.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith import DraftsmithError
from draftsmith.engine.drafts import Draft
from draftsmith.engine.proposers import Proposer
from draftsmith.models import dflash
from draftsmith.models.family import Family
from draftsmith.models.formats import vllm_method, vllm_snippet, write_tensors
from draftsmith.util.losses import selector_candidates, selector_cross_entropy

NAME = "dflash2"
OWN_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


@dataclass
class DrafterConfig:
    aux_layers: list | None = None
    """0-based target layers whose *outputs* form the ctx features (as dflash's; default
    [1, L//2 - 1, L - 4])."""
    num_layers: int = 1
    """Draft decoder layers (1 on CPU, see models/dflash.py; the published drafters have 5)."""
    block_size: int = 8
    """B: the bonus slot + B-1 mask slots; serve with num_speculative_tokens <= B-1."""
    mask_token_id: int | None = None
    """Token fed at mask slots; default the target's pad token, else its eos."""
    loss: str = "ce"
    """Unary per-slot loss: ce, tvd, nla, lk_hybrid (as dflash's)."""
    position_weighting: str = "decay"
    """decay: w_k = exp(-(k-1)/gamma); dpace: D-PACE; uniform (as dflash's); the selector's CE too."""
    gamma: float = 4.0
    dpace_alpha: float = 0.5
    num_anchors: int = 512
    """Blocks per sequence per step, drawn at random among the trained positions."""
    conv_kernel_size: int = 2
    """T: the convolution's taps (slot n reads slots n-T+1..n of its block); speculators' default 2."""
    conv_group_size: int = 16
    """G: channels sharing one dynamic kernel; must divide the hidden size (speculators' default 16)."""
    selector_rank: int = 256
    """r of the selector's codebooks [V, r] and hidden projection [r, H] (speculators' default 256)."""
    selector_top_k: int = 16
    """k: the unary candidates per slot the selector reranks (speculators' default 16)."""
    selector_loss_weight: float = 1.0
    """alpha_sel: the weight of the selector's CE beside the unary loss (speculators' default 1.0)."""

    def __post_init__(self):
        dflash.check_block_config(self)
        if not isinstance(self.conv_kernel_size, int) or not 1 <= self.conv_kernel_size <= self.block_size:
            raise DraftsmithError(
                f"drafter.conv_kernel_size: expected an integer in [1, block_size = {self.block_size}] "
                f"(taps never leave the block), got {self.conv_kernel_size}"
            )
        for key in ("conv_group_size", "selector_rank", "selector_top_k"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise DraftsmithError(f"drafter.{key}: expected an integer >= 1, got {value}")
        if not self.selector_loss_weight >= 0:
            raise DraftsmithError(f"drafter.selector_loss_weight: expected >= 0, got {self.selector_loss_weight}")


def block_conv(x: torch.Tensor, base: torch.Tensor, delta: torch.Tensor, block: int) -> torch.Tensor:
    """The grouped dynamic causal convolution along the slots: x [..., N, H] (rows = slots of blocks
    packed back to back, `block` rows each, as dflash.block_inputs packs them; one block at inference),
    base [T, H], delta [..., N, T, H/G] -> y [..., N, H] with
    y[n, c] = sum_{t < T, t <= n mod block} (base[t, c] + delta[n, t, c // G]) * x[n - t, c]."""
    n, taps = x.shape[-2], base.shape[0]
    # Channel c takes its group's dynamic tap: groups are G consecutive channels (vLLM's unflatten).
    coef = base + delta.repeat_interleave(x.shape[-1] // delta.shape[-1], dim=-1)  # [..., N, T, H]
    slot = torch.arange(n, device=x.device) % block  # the row's slot within its block
    y = coef[..., 0, :] * x
    for t in range(1, taps):
        # x[n - t]: shift the rows down by t (zeros on top); a tap reaching before the block's slot 0
        # (the bonus) is cut, so blocks packed side by side never read each other.
        shifted = F.pad(x, (0, 0, t, 0))[..., :n, :]
        y = y + coef[..., t, :] * shifted * (slot >= t)[:, None].to(x.dtype)
    return y


class GroupedCausalConv(nn.Module):
    """One sublayer's pair of convolutions (vLLM's `DFlashGroupedConv` names): base_kernel [2, T, H]
    (side 0 before the sublayer, side 1 after) and kernel_projection [2*T*H/G, H], which gives both
    sides' dynamic kernels from the sublayer's input. Identity at init (speculators' reset). Both sides
    go through `forward` (a module call), so ZeRO-3 / FSDP hooks gather base_kernel."""

    def __init__(self, hidden: int, taps: int, group: int, block: int):
        super().__init__()
        self.taps, self.groups, self.block = taps, hidden // group, block
        self.base_kernel = nn.Parameter(torch.zeros(2, taps, hidden))
        with torch.no_grad():
            self.base_kernel[:, 0] = 1.0
        self.kernel_projection = nn.Linear(hidden, 2 * taps * self.groups, bias=False)
        nn.init.zeros_(self.kernel_projection.weight)

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None = None):
        """Side 0 (delta None): the sublayer input [..., N, H] -> (its convolution, the output side's
        dynamic kernel [..., N, T, H/G]); side 1: the sublayer output and that kernel -> its convolution."""
        if delta is not None:
            return block_conv(x, self.base_kernel[1], delta, self.block)
        # Output features are laid out [side, tap, group] (vLLM's reshape to [N, 2, T, H/G]).
        both = self.kernel_projection(x).unflatten(-1, (2, self.taps, self.groups))
        return block_conv(x, self.base_kernel[0], both[..., 0, :, :], self.block), both[..., 1, :, :]

    def prepare(self, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self(a)

    def finish(self, out: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return self(out, delta)


def convs(layer) -> tuple:
    """`block_pass`'s `around` for a DFlash2 layer: its attention's and its MLP's convolutions."""
    return layer.attention_conv, layer.mlp_conv


class CandidateSelector(nn.Module):
    """predecessor_codebook P [V, r], successor_codebook S [V, r], hidden_projection W_hp [r, H]
    (vLLM's names). Codebooks ~ N(0, 0.02) as speculators; W_hp starts at zero (s = u: DFlash's drafts)."""

    def __init__(self, vocab: int, hidden: int, rank: int):
        super().__init__()
        self.predecessor_codebook = nn.Parameter(torch.randn(vocab, rank) * 0.02)
        self.successor_codebook = nn.Parameter(torch.randn(vocab, rank) * 0.02)
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)
        nn.init.zeros_(self.hidden_projection.weight)

    def forward(self, h: torch.Tensor, prev: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The transition scores < P[prev] * (W_hp h), S[ids] >: h [..., H], prev [...] (the token
        before the slot), ids [..., k] (its candidates) -> [..., k] fp32. A module call, so ZeRO-3 /
        FSDP hooks gather the codebooks."""
        context = self.predecessor_codebook[prev] * self.hidden_projection(h).to(self.predecessor_codebook.dtype)
        return (context[..., None, :] * self.successor_codebook[ids]).sum(-1).float()


class DFlash2Drafter(nn.Module):
    """DFlash's backbone (`dflash.add_backbone`) + per layer attention_conv / mlp_conv +
    candidate_selector: vLLM's `DFlash2Qwen3Model` names. `forward` is the whole training pass (one
    forward per backward for DDP/FSDP): the packed blocks, the selected slots' unary logits and the
    selector's scores of their training candidates."""

    layers: nn.ModuleList  # dflash.add_backbone's decoder layers, set at run time

    def __init__(self, config, n_aux: int, target_hidden: int, cfg: DrafterConfig):
        super().__init__()
        h = config.hidden_size
        if h % cfg.conv_group_size:
            raise DraftsmithError(f"drafter.conv_group_size: {cfg.conv_group_size} does not divide the hidden size {h}")
        if cfg.selector_top_k > config.vocab_size:
            raise DraftsmithError(
                f"drafter.selector_top_k: {cfg.selector_top_k} exceeds the vocabulary ({config.vocab_size})"
            )
        dflash.add_backbone(self, config, n_aux, target_hidden)
        for layer in self.layers:
            layer.attention_conv = GroupedCausalConv(h, cfg.conv_kernel_size, cfg.conv_group_size, cfg.block_size)
            layer.mlp_conv = GroupedCausalConv(h, cfg.conv_kernel_size, cfg.conv_group_size, cfg.block_size)
        self.candidate_selector = CandidateSelector(config.vocab_size, h, cfg.selector_rank)
        self.top_k = cfg.selector_top_k

    def forward(self, aux, ctx_pos, embeds, pos, mask, slots, prev, gold, lm_head):
        """slots: dflash.slot_index; prev [N, K]: the token before each slot (teacher-forced); gold
        [N, K]: the target's argmax there; lm_head: the target's. -> (unary logits [N, K, V] fp32, the
        selector's scores [N, K, k] of the training candidates, their labels [N, K], covered [N, K])."""
        kv = dflash.context_kv(self, aux, ctx_pos)
        h = dflash.block_pass(self, embeds, pos, kv, mask, around=convs)[slots]
        unary = lm_head(h.to(lm_head.weight.dtype)).float()
        ids, label, covered = selector_candidates(unary.detach().topk(self.top_k, -1).indices, gold)
        scores = unary.gather(-1, ids) + self.candidate_selector(h, prev, ids)
        return unary, scores, label, covered


def resolve(cfg: DrafterConfig, target_config, init_config: dict | None = None) -> DrafterConfig:
    """The config a run builds with and saves: the init_from drafter's fields, then DFlash's defaults."""
    if init_config is not None:
        cfg = from_init(cfg, init_config, target_config)
    return dflash.block_defaults(cfg, target_config)


def build(cfg: DrafterConfig, target, dataset=None) -> DFlash2Drafter:
    cfg = resolve(cfg, target.config)
    assert cfg.aux_layers is not None  # resolve named the exact layers
    config = dflash.backbone_config(cfg, target)
    return DFlash2Drafter(config, len(cfg.aux_layers), config.hidden_size, cfg)


def rebuild(meta: dict, target) -> DFlash2Drafter:
    return build(DrafterConfig(**{k: v for k, v in meta["drafter_config"].items() if k != "type"}), target)


# --- training ----------------------------------------------------------------------------------------


def compute_loss(drafter, target, batch: dict, feats: dict, cfg: DrafterConfig, step: int = 0, forward=None):
    """Returns (loss_sum, n_blocks, metric_sums): DFlash's unary per-slot loss (dflash.slot_token_loss;
    acc{d} as dflash's) + selector_loss_weight * the selector's CE over each slot's training
    candidates (gold injected), weighted per slot as the unary loss. Metrics also hold sel_ce, sel_acc
    (the selector ranks the gold first among the serving top-k, teacher-forced) and coverage (the
    gold is in the unary top-k), per trained slot."""
    forward = drafter if forward is None else forward  # the loop's distributed wrapper: its forward syncs gradients
    cfg = resolve(cfg, target.config)  # the exact mask token and layers (a no-op on a run's own config)
    ids = batch["input_ids"]
    t = ids.shape[1]
    blocks = dflash.block_targets(target, batch, feats, cfg, keep_soft=cfg.loss != "ce")
    # Teacher forcing: slot k drafts x_{a+k} (blocks.lab = a+k), so the token before it is the data
    # token x_{a+k-1}: the anchor (the bonus) for slot 1. Slots past the end read a clamped position
    # (weight 0).
    prev = ids[blocks.blk_b[:, None], (blocks.lab - 1).clamp(max=t - 1)]
    gold = blocks.top[blocks.rows]  # [N, B-1]: the target's argmax at each slot's label position
    inputs = dflash.forward_inputs(drafter, target, feats, cfg, blocks)
    slots = dflash.slot_index(blocks, cfg.block_size)
    unary, scores, label, covered = forward(*inputs, slots, prev, gold, target.get_output_embeddings())
    loss, n, metrics = dflash.slot_token_loss(cfg, unary, blocks)
    keep = blocks.valid.float()
    with torch.no_grad():
        conf = torch.ones(keep.shape[0], cfg.block_size, device=keep.device)
        if cfg.position_weighting == "dpace":  # the selector's probability of its label
            conf[:, 1:] = torch.log_softmax(scores, -1).gather(-1, label[..., None])[..., 0].exp()
        # Column 0 is the bonus slot (never trained): slot_weights works on whole blocks [N, B].
        w = dflash.slot_weights(cfg, conf, F.pad(keep, (1, 0)))[:, 1:]
    sel = selector_cross_entropy(scores.flatten(0, 1), label.flatten(), w.flatten())
    with torch.no_grad():
        # The loop divides metric sums by n (blocks): scaled by n / (trained slots), each reads per slot.
        per_slot = n / keep.sum().clamp_min(1)
        first = (scores.argmax(-1) == label) & covered
        metrics["sel_ce"] = selector_cross_entropy(scores.flatten(0, 1), label.flatten(), keep.flatten()) * per_slot
        metrics["sel_acc"] = (first.float() * keep).sum() * per_slot
        metrics["coverage"] = (covered.float() * keep).sum() * per_slot
    return loss + cfg.selector_loss_weight * sel, n, metrics


def activation_bytes(cfg: DrafterConfig, tc, drafter, batch: int, length: int, elem: int) -> int:
    """`plan`: DFlash's estimate, plus the convolutions' four extra activations per layer and slot
    (their inputs and outputs) and the selector's [k, r] successor rows per slot (fp32)."""
    slots = batch * min(cfg.num_anchors, length) * cfg.block_size
    conv = 4 * slots * cfg.num_layers * tc.hidden_size * elem
    return (
        dflash.activation_bytes(cfg, tc, drafter, batch, length, elem)
        + conv
        + 4 * 2 * slots * cfg.selector_top_k * cfg.selector_rank
    )


# --- inference ---------------------------------------------------------------------------------------


class SelectorProposer(Proposer):
    """DFlash2 drafting as vLLM's DFlash2Speculator: one backbone pass per round with the
    convolutions (a dflash.BlockProposer with `around`, its ctx K/V cache), the unary top-k of every
    slot, then the selector walked left to right: draft i = C_i[argmax s_i] (greedy), or drawn from
    q_i = softmax(s_i) on C_i (0 elsewhere) with a `sampler`; prev_1 = the bonus, prev_{i+1} = draft i.
    Chains only, like DFlash."""

    max_depth: int  # the block proposer's: B-1 mask slots

    def __init__(self, drafter, target, cfg: DrafterConfig):
        # The drafter lives in the block proposer only, so the modules the engine prepacks hold it once.
        self.blocks = dflash.BlockProposer(drafter, target, cfg, around=convs)
        self.feature_names, self.max_depth = self.blocks.feature_names, self.blocks.max_depth
        # One walk step (u_i [k], C_i [k], h_i [H], prev) -> s_i [k] (fp32); an attribute, so
        # `export --verify` records every realized score row (draftsmith/ship/publish.py Recorder).
        self.logits = lambda step: step[0].float() + self.drafter.candidate_selector(step[2], step[3], step[1])

    @property
    def drafter(self) -> DFlash2Drafter:
        return self.blocks.drafter

    def reset(self):
        self.blocks.reset()

    @torch.no_grad()
    def propose(self, tokens: torch.Tensor, feats: dict, k: int, sampler=None) -> Draft:
        d, m = self.drafter, min(k, self.max_depth)
        h = self.blocks.block_hidden(tokens, feats, m)  # [m, H]: slots 1..m, one backbone pass
        unary = self.blocks.logits(h).float()  # [m, V]: the target's lm_head
        u, cand = unary.topk(d.top_k, -1)  # [m, k] each, best first (vLLM's get_top_k_tokens)
        n_feats = next(iter(feats.values())).shape[1]
        prev = tokens[0, n_feats]  # the bonus x_{n-1}, the block's slot 0 (as BlockProposer feeds it)
        draft = Draft()
        for i in range(m):
            s = self.logits((u[i], cand[i], h[i], prev))
            if sampler is None:
                token, q = int(cand[i, s.argmax()]), None
            else:  # the draft distribution: softmax of the realized scores on C_i, -inf elsewhere
                q = sampler.probs(torch.full_like(unary[i], float("-inf")).scatter(0, cand[i], s))
                token = sampler.sample(q)
            draft.add(token, i - 1, q)
            prev = torch.tensor(token, device=tokens.device)
        return draft


def make_proposer(drafter, target, cfg: DrafterConfig) -> SelectorProposer:
    return SelectorProposer(drafter, target, resolve(cfg, target.config))  # the exact mask token


# --- init_from and the speculators `dflash2` format (vLLM 0.32: method dflash) ------------------------


def _init_fields(config: dict) -> dict:
    """The fields a DFlash2 folder's config.json fixes: a draftsmith final/, a speculators `dflash2`
    export (draftsmith's or a peer's), or a native z-lab checkpoint (`dflash_config` holds them all)."""
    if "draftsmith_format" in config:
        own = config["drafter_config"]
        keys = ("aux_layers", "block_size", "mask_token_id", "num_layers", *OWN_KEYS)
        return {k: own[k] for k in keys if k in own}
    if config.get("speculators_model_type") == "dflash2":
        fields = dflash.speculators_init_fields(config)
        if fields.pop("draft_vocab_size") is not None:  # speculators and vLLM refuse one too
            raise DraftsmithError(
                "init_from: a DFlash2 drafter with a reduced draft_vocab_size; DFlash2 needs the whole "
                "vocabulary (vLLM 0.32's selector codebooks and candidates span it)"
            )
        return {**fields, **{k: config.get(k) for k in OWN_KEYS}}
    native = config.get("dflash_config") or {}
    return {
        "aux_layers": native.get("target_layer_ids"),  # already layer outputs
        "mask_token_id": native.get("mask_token_id"),
        "block_size": native.get("block_size", config.get("block_size")),
        "num_layers": config.get("num_hidden_layers"),
        **{k: native.get(k) for k in OWN_KEYS},
    }


def from_init(cfg: DrafterConfig, init_config: dict, target_config) -> DrafterConfig:
    """`init_from` a DFlash2 drafter: its ctx layers, block size, mask token, depth, conv and selector."""
    return dflash.with_init_fields(cfg, _init_fields(init_config), target_config)


# vLLM maps speculators_model_type dflash2 to method dflash ("dflash2" is no method it accepts).
SERVE_FORMAT, vllm_serving = "speculators", vllm_method("dflash")


def write_speculators(drafter, cfg: DrafterConfig, target, meta: dict, tok, out, info: dict) -> None:
    # vLLM's update_dflash2 copies the four keys into dflash_config, where the model requires them;
    # it forces architectures to DFlash2DraftModel (speculators' name too).
    own = {k: getattr(cfg, k) for k in OWN_KEYS}
    config = dflash.speculators_block_config(drafter, cfg, target, meta, info, "dflash2", ["DFlash2DraftModel"], own)
    write_tensors(out, config, drafter.state_dict())  # no embed_tokens / lm_head / d2t: vLLM shares the target's


EXPORTS = {"speculators": write_speculators}


def recognises(config: dict, tensor_names: set[str]) -> bool:
    arch = (config.get("architectures") or ["?"])[0]
    return config.get("speculators_model_type") == "dflash2" or arch == "DFlash2DraftModel"


def from_export(path, config: dict, cfg: DrafterConfig, target) -> DFlash2Drafter:
    return dflash.from_block_export(path, config, cfg, target, _init_fields, build)


def serving_snippet(fmt: str, repo_id: str, target: str, k: int) -> str:
    return vllm_snippet("dflash", repo_id, target, k)


FAMILY = Family(
    NAME=NAME,
    DrafterConfig=DrafterConfig,
    feature_names=dflash.feature_names,
    max_draft_depth=dflash.max_draft_depth,
    build=build,
    rebuild=rebuild,
    compute_loss=compute_loss,
    activation_bytes=activation_bytes,
    make_proposer=make_proposer,
    EXPORTS=EXPORTS,
    recognises=recognises,
    read_export=dflash.read_export,
    from_export=from_export,
    serving_snippet=serving_snippet,
    SERVE_FORMAT=SERVE_FORMAT,
    vllm_serving=vllm_serving,
    consumer_check=dflash.consumer_check,  # speculators' loader; vLLM's: the vllm_families test
    resolve=resolve,
    tiny={"aux_layers": [0, 1], "block_size": 4, "selector_rank": 8, "selector_top_k": 4},
)
