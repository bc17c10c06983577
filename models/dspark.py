"""DSpark: DFlash's block drafter with a low-rank Markov head and a confidence head (DeepSeek 2026,
"DSpark", arXiv:2607.05147), as vLLM 0.32 serves it (method `dspark`, `qwen3_dspark.py`).

The backbone is DFlash's, shared as functions (models/dflash.py: `add_backbone`, `context_kv`,
`block_pass`, the packed training blocks and the per-slot token loss): one pass over the block
[x_a, m, ..., m] (B slots at positions a .. a+B-1, attending to the ctx strictly before the anchor a
and to the whole block) gives the outputs of every slot at once, so the slots of a block are drafted
independently of each other. Two layouts read them (`sample_from_anchor`, vLLM's and speculators' key):

    anchor-as-first (true, the default; DeepSeek's, speculators' default, vLLM's DSparkSpeculator):
        slot 0 holds the anchor's real token x_a and drafts x_{a+1}; mask slot k (1 <= k < B) drafts
        x_{a+k+1}, the token after its own position: draft d = slot d-1, K = B drafts per pass.
        At inference a round of k drafts feeds k queries [bonus, m x (k-1)] (vLLM's N query tokens).
    fill-in (false; DFlash's layout): slot 0 holds the bonus x_a and drafts nothing; mask slot k
        drafts x_{a+k}, the token at its own position: draft d = slot d, K = B-1 drafts per pass.
        A round of k drafts feeds k+1 queries [bonus, m x k] (vLLM's 1+N).

Either way draft d is x_{a+d}, labelled by the target at position a+d-1, and the block inputs of a
training step are the same; what differs is which slot drafts it (and so how many drafts a block
has). DSpark adds a sequential stage on top of the pass, per draft d (h_d: its slot's output):

    z_d   = lm_head(h_d)                          the target's lm_head (DFlash's logits), [V]
    e_d   = W1[prev_d]                            markov_head.markov_w1: an embedding [V, r] of TARGET ids
    l_d   = z_d + W2 e_d                          markov_head.markov_w2 [V, r]: a rank-r transition bias
    c_d   = sigmoid(w . [h_d ; e_d] + b)          confidence_head.proj [1, H+r] (or [1, H]), fp32

prev_1 is the anchor's (bonus) real token x_a in both layouts; prev_d for d > 1 is the token before
draft d: at inference the draft d-1 (left to right, one W2 row-product per draft), in training the
data token x_{a+d-1} (teacher forcing, as speculators and SpecForge train it). c_d estimates P(draft d
is accepted | drafts < d were accepted), which vLLM's adaptive verification multiplies into survival
probabilities to choose how many drafts to verify.

Objective (draftsmith/util/losses.py): DFlash's token loss on l_d (ce on the target's argmax, or a
soft loss) weighted per draft (decay: exp(-(d-1)/gamma), draft 1 weighs 1 in both layouts, as
speculators' dflash_loss_decay; or D-PACE over the K drafts) + confidence_weight * BCE(c_d, a_d),
where the label a_d = sum_x min(softmax l_d, softmax target_d) = 1 - TV is the soft acceptance
probability of draft d, computed under no_grad. As in both peers, the BCE's gradient also reaches the
backbone through h_d.

W2 starts at zero, so a fresh DSpark drafter drafts exactly as its DFlash backbone (in its layout).
The export writes `sample_from_anchor` explicitly (vLLM's update_dspark defaults it to false,
speculators to true) and speculative_tokens = K. On the whole vocabulary the export ships no embed_tokens / lm_head / d2t, vLLM shares the target's;
with `draft_vocab_size` (as DFlash's) z_k, W2 and the draft live on the draft tokens and ship lm_head
and d2t / t2d, while W1 still embeds target ids (vLLM's `DSparkMarkovHead`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith import DraftsmithError
from draftsmith.engine.drafts import Draft
from draftsmith.engine.proposers import Proposer
from draftsmith.models import dflash
from draftsmith.models.family import Family
from draftsmith.models.formats import vllm_method, vllm_snippet, write_tensors
from draftsmith.util.losses import confidence_bce, soft_acceptance

NAME = "dspark"
OWN_KEYS = ("markov_rank", "enable_confidence_head", "confidence_head_with_markov", "sample_from_anchor")


@dataclass
class DrafterConfig:
    aux_layers: list | None = None
    """0-based target layers whose *outputs* form the ctx features (as dflash's; default
    [1, L//2 - 1, L - 4])."""
    num_layers: int = 1
    """Draft decoder layers (1 on CPU, see models/dflash.py; the published drafters have 5)."""
    block_size: int = 8
    """B: the anchor slot + B-1 mask slots; K = B drafts per pass anchor-as-first (B-1 fill-in):
    serve with num_speculative_tokens <= K (vLLM's default: block_size)."""
    mask_token_id: int | None = None
    """Token fed at mask slots; default the target's pad token, else its eos."""
    loss: str = "ce"
    """Per-slot loss on the Markov-corrected logits: ce, tvd, nla, lk_hybrid (as dflash's)."""
    position_weighting: str = "decay"
    """decay: w_k = exp(-(k-1)/gamma); dpace: D-PACE; uniform (as dflash's)."""
    gamma: float = 4.0
    dpace_alpha: float = 0.5
    num_anchors: int = 512
    """Blocks per sequence per step, drawn at random among the trained positions."""
    draft_vocab_size: int = 0
    """0: the whole vocabulary; n > 0: the n most frequent trained tokens (as dflash's)."""
    markov_rank: int = 256
    """r of the Markov head's W1 [V, r] and W2 [V_d, r] (speculators' default 256); vLLM requires >= 1."""
    enable_confidence_head: bool = True
    """Train the confidence head (its c_k go on every draft: adaptive verification, ECE)."""
    confidence_head_with_markov: bool = True
    """The confidence head reads [h_k ; W1[prev_k]] (else h_k alone): it sees which token came before."""
    confidence_weight: float = 1.0
    """alpha_conf: the weight of the confidence BCE beside the token loss (both peers: 1.0)."""
    sample_from_anchor: bool = True
    """true: anchor-as-first (DeepSeek's layout, speculators' default): slot 0 holds the anchor's token
    and drafts the next one, slot k drafts x_{a+k+1}, K = B drafts. false: DFlash's fill-in layout
    (slot 0 = the bonus, drafts nothing; slot k drafts x_{a+k}; K = B-1). See the module docstring."""

    def __post_init__(self):
        dflash.check_block_config(self)
        if not isinstance(self.markov_rank, int) or self.markov_rank < 1:
            raise DraftsmithError(
                f"drafter.markov_rank: expected an integer >= 1 (vLLM's DSpark always has a Markov head), "
                f"got {self.markov_rank}"
            )
        if not self.confidence_weight >= 0:
            raise DraftsmithError(f"drafter.confidence_weight: expected >= 0, got {self.confidence_weight}")
        if not isinstance(self.sample_from_anchor, bool):
            raise DraftsmithError(
                f"drafter.sample_from_anchor: expected true (anchor-as-first) or false (fill-in), "
                f"got {self.sample_from_anchor!r}"
            )


def drafts(cfg: DrafterConfig) -> int:
    """K, the drafts of one block pass: B anchor-as-first (slot 0 drafts too), B-1 fill-in."""
    return cfg.block_size if cfg.sample_from_anchor else cfg.block_size - 1


def draft_slots(blocks: dflash.Blocks, cfg: DrafterConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Where drafts 1..K of every block sit in the packed forward's output [Bz, M, H] (block j of
    sequence b fills query slots j*B .. j*B+B-1, dflash.block_inputs): draft d is slot d-1
    anchor-as-first, slot d fill-in (dflash.slot_index). -> (sequence [N, 1], query slot [N, K])."""
    first = 0 if cfg.sample_from_anchor else 1
    k = torch.arange(first, first + drafts(cfg), device=blocks.pos.device)
    return blocks.blk_b[:, None], blocks.blk_j[:, None] * cfg.block_size + k


def _per_draft(cfg: DrafterConfig) -> DrafterConfig:
    """The config dflash.slot_token_loss weighs K drafts with: it indexes a block's drafts 1..B-1 after
    a bonus slot 0 of weight 0, so anchor-as-first's K = B drafts are that view of a block one slot
    longer (draft d weighs exp(-(d-1)/gamma) either way; D-PACE runs over the K drafts)."""
    return cfg if not cfg.sample_from_anchor else replace(cfg, block_size=cfg.block_size + 1)


class MarkovHead(nn.Module):
    """markov_w1: an embedding of the previous TARGET-vocabulary token, [V, r]; markov_w2: its
    projection to a logit bias over the draft vocabulary, [V_d, r] (V_d = V on the whole vocabulary).
    W2 starts at zero."""

    def __init__(self, vocab: int, draft_vocab: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        nn.init.normal_(self.markov_w1.weight, std=0.01)
        self.markov_w2 = nn.Linear(rank, draft_vocab, bias=False)
        nn.init.zeros_(self.markov_w2.weight)


class ConfidenceHead(nn.Module):
    """proj: Linear [1, in] with bias; evaluated in fp32 (as vLLM keeps it)."""

    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, 1)


class DSparkDrafter(nn.Module):
    """DFlash's backbone (`dflash.add_backbone`, the same tensor names) + markov_head + confidence_head:
    vLLM's `Qwen3DSparkModel` names. `forward` is the whole training pass (one forward per backward
    for DDP/FSDP): the packed blocks, the selected slots' outputs, their Markov bias and confidence."""

    d2t: torch.Tensor  # dflash.add_draft_vocab's buffer, only on a reduced vocabulary (hasattr tells)

    def __init__(self, config, n_aux: int, target_hidden: int, cfg: DrafterConfig):
        super().__init__()
        dflash.add_backbone(self, config, n_aux, target_hidden)
        dflash.add_draft_vocab(self, cfg.draft_vocab_size, config.vocab_size, config.hidden_size)
        self.with_markov = cfg.confidence_head_with_markov
        draft_vocab = len(self.d2t) if hasattr(self, "d2t") else config.vocab_size
        self.markov_head = MarkovHead(config.vocab_size, draft_vocab, cfg.markov_rank)
        width = config.hidden_size + (cfg.markov_rank if cfg.confidence_head_with_markov else 0)
        self.confidence_head = ConfidenceHead(width) if cfg.enable_confidence_head else None

    def markov_embed(self, prev: torch.Tensor) -> torch.Tensor:
        """e = W1[prev]: [...] target ids -> [..., r]."""
        return self.markov_head.markov_w1(prev)

    def markov_bias(self, e: torch.Tensor) -> torch.Tensor:
        """W2 e: [..., r] -> the logit bias [..., V_d]."""
        w2 = self.markov_head.markov_w2
        return w2(e.to(w2.weight.dtype))

    def confidence_logits(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """The confidence head's pre-sigmoid output [...] from h [..., H] and e [..., r], in fp32 even
        under autocast (vLLM keeps the head's parameters fp32)."""
        assert self.confidence_head is not None  # its callers run it only with the head (enable_confidence_head)
        proj = self.confidence_head.proj
        x = (torch.cat([h, e.to(h.dtype)], -1) if self.with_markov else h).float()
        with torch.autocast(device_type=x.device.type, enabled=False):
            if proj.weight.dtype == torch.float32:  # training (fp32 masters): the module call, so
                return proj(x)[..., 0]  # ZeRO-3 / FSDP hooks gather its weights
            # A drafter cast to a bf16 target's dtype for eval: the head still runs in fp32.
            return F.linear(x, proj.weight.float(), proj.bias.float())[..., 0]

    def forward(self, aux, ctx_pos, embeds, pos, mask, slots, prev):
        """-> (h [N, K, H]: the outputs at `slots` (draft_slots), W2 W1[prev] [N, K, V], the
        confidence logits [N, K] or None)."""
        h = dflash.block_pass(self, embeds, pos, dflash.context_kv(self, aux, ctx_pos), mask)[slots]
        e = self.markov_embed(prev)
        conf = None if self.confidence_head is None else self.confidence_logits(h, e)
        return h, self.markov_bias(e), conf


def resolve(cfg: DrafterConfig, target_config, init_config: dict | None = None) -> DrafterConfig:
    """The config a run builds with and saves: the init_from drafter's fields, then DFlash's defaults."""
    if init_config is not None:
        cfg = from_init(cfg, init_config, target_config)
    return dflash.block_defaults(cfg, target_config)


def build(cfg: DrafterConfig, target, dataset=None) -> DSparkDrafter:
    """The drafter; on a reduced vocabulary its draft tokens from `dataset` (dflash.build's rule)."""
    cfg = resolve(cfg, target.config)
    assert cfg.aux_layers is not None  # resolve named the exact layers
    config = dflash.backbone_config(cfg, target)
    drafter = DSparkDrafter(config, len(cfg.aux_layers), config.hidden_size, cfg)
    if dataset is not None:
        dflash.fill_draft_vocab(drafter, target, dataset)
    return drafter


def rebuild(meta: dict, target) -> DSparkDrafter:
    return build(DrafterConfig(**{k: v for k, v in meta["drafter_config"].items() if k != "type"}), target)


# --- training ----------------------------------------------------------------------------------------


def compute_loss(drafter, target, batch: dict, feats: dict, cfg: DrafterConfig, step: int = 0, forward=None):
    """Returns (loss_sum, n_blocks, metric_sums): DFlash's per-draft token loss on the Markov-corrected
    logits l_d = z_d + W2 W1[x_{a+d-1}] (dflash.slot_token_loss; acc{d-1} = draft d's top-1 agreement,
    K of them) + confidence_weight * the confidence BCE towards the soft acceptance of l_d, summed over
    trained drafts. Metrics also hold conf_bce, accept (the mean soft acceptance a_d) and confidence
    (the mean c_d), per trained draft."""
    forward = drafter if forward is None else forward  # the loop's distributed wrapper: its forward syncs gradients
    cfg = resolve(cfg, target.config)  # the exact mask token and layers (a no-op on a run's own config)
    ids = batch["input_ids"]
    t = ids.shape[1]
    # The confidence label needs the target's full distribution, whatever the token loss.
    t2d = getattr(drafter, "t2d", None)  # a reduced vocabulary: labels in draft ids, soft targets its log-probs
    # Labels x_{a+1} .. x_{a+K}: the same blocks in both layouts, one more label anchor-as-first.
    keep_soft = cfg.loss != "ce" or cfg.enable_confidence_head
    blocks = dflash.block_targets(target, batch, feats, cfg, keep_soft, t2d, from_anchor=cfg.sample_from_anchor)
    # Teacher forcing: draft d drafts x_{a+d} (blocks.lab = a+d) in both layouts, so its previous token
    # is the data token x_{a+d-1}: the anchor's real token for draft 1 (slot 0 anchor-as-first, slot 1
    # fill-in), then the token draft d-1 was trained to draft. Drafts past the sequence end read a
    # clamped position; their weight is 0.
    prev = ids[blocks.blk_b[:, None], (blocks.lab - 1).clamp(max=t - 1)]
    inputs = dflash.forward_inputs(drafter, target, feats, cfg, blocks)
    h, bias, conf_logits = forward(*inputs, draft_slots(blocks, cfg), prev)
    logits = dflash.draft_logits(drafter, target, h).float() + bias.float()  # [N, K, V_d]
    loss, n, metrics = dflash.slot_token_loss(_per_draft(cfg), logits, blocks)
    if conf_logits is None:
        return loss, n, metrics
    keep = blocks.valid.float().flatten()
    assert blocks.soft is not None  # the confidence head: block_targets kept the target's logits (keep_soft)
    soft = blocks.soft[blocks.rows.flatten()]
    accept = soft_acceptance(logits.flatten(0, 1), soft, target_logprobs=t2d is not None)  # [N*K], no grad
    bce = confidence_bce(conf_logits.flatten(), accept, keep)
    with torch.no_grad():
        # The loop divides metric sums by n (blocks): scaled by n / (trained slots), each reads per slot.
        per_slot = n / keep.sum().clamp_min(1)
        metrics["conf_bce"] = bce.detach() * per_slot
        metrics["accept"] = (accept * keep).sum() * per_slot
        metrics["confidence"] = (torch.sigmoid(conf_logits.flatten()) * keep).sum() * per_slot
    return loss + cfg.confidence_weight * bce, n, metrics


def activation_bytes(cfg: DrafterConfig, tc, drafter, batch: int, length: int, elem: int) -> int:
    """`plan`: DFlash's estimate, plus the Markov bias and the corrected logits of K drafts per anchor
    and the target's kept distribution of each (fp32)."""
    slots = batch * min(cfg.num_anchors, length) * drafts(cfg)
    vocab = cfg.draft_vocab_size or tc.vocab_size
    return dflash.activation_bytes(cfg, tc, drafter, batch, length, elem) + 3 * 4 * vocab * slots


# --- inference ---------------------------------------------------------------------------------------


class MarkovProposer(Proposer):
    """DSpark drafting as vLLM's DSparkSpeculator: DFlash's one backbone pass per round (a
    dflash.BlockProposer, with its ctx K/V cache) in the drafter's layout (k drafts: the k queries
    [bonus, m x (k-1)] anchor-as-first, slots 0..k-1 drafting; [bonus, m x k] fill-in, slots 1..k),
    then the Markov stage left to right: draft i is drawn from l_i = z_i + W2 W1[prev_i], prev_1 = the
    bonus token, prev_{i+1} = draft i (greedy: its argmax; with a `sampler`: a sample, whose q is the
    Markov-corrected distribution). Each draft carries c_i = sigmoid(confidence head) in
    `draft.confidence`. Chains only, like DFlash."""

    max_depth: int  # K: B anchor-as-first, B-1 fill-in

    def __init__(self, drafter, target, cfg: DrafterConfig):
        # The drafter lives in the block proposer only (`drafter` below), so the modules the engine
        # prepacks (proposer_modules) hold it once.
        self.blocks = dflash.BlockProposer(drafter, target, cfg)
        self.feature_names, self.max_depth = self.blocks.feature_names, drafts(cfg)
        self.from_anchor = cfg.sample_from_anchor
        self.drafts_confidence = cfg.enable_confidence_head
        # (z_i [V], e_i [r]) -> l_i [V] (fp32); an attribute, so `export --verify` records every
        # Markov-corrected row (draftsmith/ship/publish.py Recorder).
        self.logits = lambda step: step[0].float() + self.drafter.markov_bias(step[1]).float()

    @property
    def drafter(self) -> DSparkDrafter:
        return self.blocks.drafter

    def reset(self):
        self.blocks.reset()

    @torch.no_grad()
    def propose(self, tokens: torch.Tensor, feats: dict, k: int, sampler=None) -> Draft:
        d, m = self.drafter, min(k, self.max_depth)
        h = self.blocks.block_hidden(tokens, feats, m, self.from_anchor)  # [m, H]: drafts 1..m, one pass
        z = self.blocks.logits(h)  # [m, V_d]: the draft-vocabulary logits, all slots at once
        n_feats = next(iter(feats.values())).shape[1]
        prev = tokens[0, n_feats]  # the bonus x_{n-1}, the block's slot 0 (as BlockProposer feeds it)
        draft, confidence = Draft(), []
        for i in range(m):
            e = d.markov_embed(prev)
            # Markov-corrected in draft space (as vLLM), then over the target's vocabulary: -inf off the draft one.
            logits = dflash.target_vocab(d, self.logits((z[i], e)))
            q = None if sampler is None else sampler.probs(logits)
            token = int(logits.argmax()) if q is None else sampler.sample(q)
            draft.add(token, i - 1, q)
            if d.confidence_head is not None:
                confidence.append(float(torch.sigmoid(d.confidence_logits(h[i], e))))
            prev = torch.tensor(token, device=tokens.device)
        draft.confidence = confidence if d.confidence_head is not None else None
        return draft


def make_proposer(drafter, target, cfg: DrafterConfig) -> MarkovProposer:
    return MarkovProposer(drafter, target, resolve(cfg, target.config))  # the exact mask token


# --- init_from and the speculators `dspark` format (vLLM 0.32: method dspark) -------------------------


def _init_fields(config: dict) -> dict:
    """The fields a DSpark folder's config.json fixes: a draftsmith final/ or a speculators `dspark`
    export (draftsmith's or a peer's: speculators, whose sample_from_anchor defaults to true). The
    layout is the weights' own: an init_from drafter keeps it."""
    if "draftsmith_format" in config:
        own = config["drafter_config"]
        keys = ("aux_layers", "block_size", "mask_token_id", "num_layers", "draft_vocab_size", *OWN_KEYS)
        return {k: own[k] for k in keys if k in own}
    kind = config.get("markov_head_type", "vanilla")
    if kind != "vanilla":
        raise DraftsmithError(
            f"init_from: a DSpark drafter with markov_head_type '{kind}'; draftsmith and vLLM 0.32 run 'vanilla' only"
        )
    return {
        **dflash.speculators_init_fields(config),
        "markov_rank": config.get("markov_rank"),
        "enable_confidence_head": config.get("enable_confidence_head"),
        "confidence_head_with_markov": config.get("confidence_head_with_markov"),
        "sample_from_anchor": config.get("sample_from_anchor", True),  # speculators' default
    }


def from_init(cfg: DrafterConfig, init_config: dict, target_config) -> DrafterConfig:
    """`init_from` a DSpark drafter: its ctx layers, block size, mask token, depth and heads."""
    return dflash.with_init_fields(cfg, _init_fields(init_config), target_config)


SERVE_FORMAT, vllm_serving = "speculators", vllm_method("dspark")


def write_speculators(drafter, cfg: DrafterConfig, target, meta: dict, tok, out, info: dict) -> None:
    # vLLM's update_dspark copies these to the model config; markov_rank is required there, and
    # sample_from_anchor must be explicit: vLLM defaults it to false, speculators to true. vLLM sets
    # dspark_bonus_anchor = not sample_from_anchor and its DSparkSpeculator feeds N queries (anchor
    # + N-1 masks, every one sampled, each drafting the next token) when true, 1 + N when false.
    own = {
        "markov_rank": cfg.markov_rank,
        "markov_head_type": "vanilla",  # the only Markov head vLLM's Qwen3 DSpark runs
        "enable_confidence_head": cfg.enable_confidence_head,
        "confidence_head_with_markov": cfg.confidence_head_with_markov,
        "sample_from_anchor": cfg.sample_from_anchor,  # replaces the shared writer's false
    }
    # speculators' architecture name; vLLM maps any name it does not know to Qwen3DSparkModel.
    config = dflash.speculators_block_config(drafter, cfg, target, meta, info, "dspark", ["DSparkSpeculator"], own)
    # K drafts per pass (speculators writes block_size when sampling from the anchor, B-1 otherwise).
    config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = drafts(cfg)
    write_tensors(out, config, drafter.state_dict())  # no embed_tokens; lm_head + d2t/t2d only on a reduced vocabulary


EXPORTS = {"speculators": write_speculators}


def recognises(config: dict, tensor_names: set[str]) -> bool:
    arch = (config.get("architectures") or ["?"])[0]
    return config.get("speculators_model_type") == "dspark" or arch in ("DSparkSpeculator", "Qwen3DSparkModel")


def from_export(path, config: dict, cfg: DrafterConfig, target) -> DSparkDrafter:
    return dflash.from_block_export(path, config, cfg, target, _init_fields, build)


def serving_snippet(fmt: str, repo_id: str, target: str, k: int) -> str:
    return vllm_snippet("dspark", repo_id, target, k)


FAMILY = Family(
    NAME=NAME,
    DrafterConfig=DrafterConfig,
    feature_names=dflash.feature_names,
    max_draft_depth=drafts,
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
    tiny={"aux_layers": [0, 1], "block_size": 4, "markov_rank": 8},
)
