"""EAGLE-1 feature-space drafter (Li et al. 2024, "EAGLE: Speculative Sampling Requires
Rethinking Feature Uncertainty", arXiv:2401.15077).

The drafter autoregresses on the target's *features* f (post-norm last hidden states):

    x_i  = fc([embed(t_{i+1}); f_i])          fc: 2H -> H, no bias (vLLM's EAGLE fc has none)
    f̂_{i+1} = DecoderLayer(x_{0..i})           one Llama layer, no input_layernorm (as vLLM loads it)
    logits for t_{i+2} = target.lm_head(f̂_{i+1})

Embeddings and lm_head are the target's own, frozen and shared; only fc + the layer train.
With `hass: true`, training also unrolls the drafter on its own features (HASS context alignment,
Zhang et al. 2024, arXiv:2408.15766) and adds a top-k distillation loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from draftsmith.engine.proposers import FeatureProposer
from draftsmith.models.family import Family
from draftsmith.models.folder import load_state
from draftsmith.models.formats import from_exported_head, llama_dims, renamed, vllm_method, vllm_snippet, write_tensors
from draftsmith.models.training import layer_activation_bytes
from draftsmith.target.features import draft_embeddings
from draftsmith.util.losses import smooth_l1_feature_loss, soft_cross_entropy, topk_distillation_loss
from draftsmith.util.masks import documents, positions, same_document, ttt_mask
from draftsmith.util.precision import keep_rope_fp32

NAME = "eagle"
# Feature contract: which target tensors this family trains on. The online loop computes them
# under no_grad; `draftsmith data features` caches exactly these (bf16, H values per token each).
FEATURES = ("last_hidden",)


@dataclass
class DrafterConfig:
    feature_loss_weight: float = 1.0
    """Weight of SmoothL1(f̂, f) (EAGLE-1: 1.0)."""
    token_loss_weight: float = 0.1
    """Weight of the soft cross-entropy against the target's next-token distribution (EAGLE-1: 0.1)."""
    feature_noise: float = 0.1
    """Uniform noise U(-a, a) added to input features in training, so the drafter tolerates its own errors."""
    hass: bool = False
    """HASS (arXiv:2408.15766): context alignment (unroll `hass_steps` passes on the drafter's own
    features, as at inference) plus top-k distillation. Off = plain EAGLE-1."""
    hass_steps: int = 3
    """Forward passes per batch with `hass` (HASS's forward_num_total); pass j trains draft step j+1."""
    hass_topk: int = 10
    hass_topk_weight: float = 1.0
    """Weight of the top-k distillation loss (HASS: 1.0 in its second stage)."""


def target_rope(config) -> dict:
    """The RoPE a drafter's full-attention layer takes from the target: its own, or, for a target with
    one RoPE per layer type (Gemma-3: `sliding_attention` at rope_local_base_freq, `full_attention`
    at rope_theta), that of its global layers, which see the whole context as the drafter's layer does."""
    rope = getattr(config, "rope_parameters", None) or {
        "rope_type": "default",
        "rope_theta": getattr(config, "rope_theta", 10000.0),
    }
    return dict(rope.get("full_attention", rope))


def dense_intermediate_size(config) -> int:
    """The MLP width of a drafter's own decoder layer, always a dense Llama MLP (the experts of an
    MoE target are never copied: engines build the exported head as a Llama layer). A dense target's
    `intermediate_size`. An MoE target (Qwen3-MoE, DeepSeek, Mixtral) has no one dense MLP: its
    `intermediate_size` where the config has one (the width of its dense layers, 6144 for
    Qwen3-30B-A3B; speculators 0.9.0 sizes its drafts the same way), else the width a token passes
    through, `num_experts_per_tok` experts of `moe_intermediate_size` (8 x 768 = 6144 there too).
    One expert's width alone (768) would starve the layer."""
    if getattr(config, "intermediate_size", None):
        return config.intermediate_size
    return config.num_experts_per_tok * config.moe_intermediate_size


def layer_config(target_config) -> LlamaConfig:
    """A one-layer Llama config with the target's dimensions (what vLLM/SGLang EAGLE heads use)."""
    c = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    heads = c.num_attention_heads
    rope = target_rope(c)
    cfg = LlamaConfig(
        hidden_size=c.hidden_size,
        intermediate_size=dense_intermediate_size(c),
        num_attention_heads=heads,
        num_key_value_heads=getattr(c, "num_key_value_heads", heads) or heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
        rms_norm_eps=getattr(c, "rms_norm_eps", 1e-6),
        max_position_embeddings=getattr(c, "max_position_embeddings", 4096),
        vocab_size=c.vocab_size,
        rope_parameters=dict(rope),
        num_hidden_layers=1,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
    )
    cfg._attn_implementation = "sdpa"
    return cfg


class EagleDrafter(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        h = config.hidden_size
        self.config = config
        # The EAGLE-1 paper's fc has a bias, but vLLM's EagleLlama loads fc.weight only and skips
        # fc.bias: without one, the exported head computes exactly what draftsmith evaluated.
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layer = LlamaDecoderLayer(config, layer_idx=0)
        # EAGLE feeds fc's output straight into attention; vLLM's EagleLlama layer 0 has no input_layernorm.
        # (transformers types the slot LlamaRMSNorm; this layer deliberately holds an Identity there.)
        self.layer.input_layernorm = nn.Identity()  # type: ignore[assignment]
        self.rotary = keep_rope_fp32(LlamaRotaryEmbedding(config))

    def step(self, features, token_embeds, position_ids, attention_mask, cache=None):
        """One drafter pass. features, token_embeds: [B, T, H] (pair i = f_i with embed(t_{i+1}));
        returns f̂ [B, T, H]."""
        # Both inputs come from the target (its embeddings, its hidden states) in the target's dtype;
        # the drafter may be in another (an fp32 drafter beside a bf16 target), so cast to fc's.
        dtype = self.fc.weight.dtype
        x = self.fc(torch.cat([token_embeds.to(dtype), features.to(dtype)], dim=-1))
        pos_emb = self.rotary(x, position_ids)
        return self.layer(
            x,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=cache is not None,
            position_embeddings=pos_emb,
        )

    def forward(self, features, embeds, padding, steps: int = 1, positions: torch.Tensor | None = None):
        """The training pass, unrolled `steps` times in one call (one forward per backward for DDP).

        features: [B, t, H] target features f_0..f_{t-1}; embeds: [B, t + steps - 1, H] embeddings of
        tokens 1..; padding: [B, t] the pairs' document numbers (0 = padding; a padding mask is one
        example a row); positions: [B, t] pair r's position in its example (default r: a padded row).
        Step j of chain r feeds (f_r if j = 0, else step j-1's output at r) with token t_{r+j+1} at
        position positions[r]+j, and predicts f_{r+j+1}. Step 0 alone is EAGLE-1; more steps are HASS
        context alignment. Returns [out_0, ..], each [B, t, H].
        """
        bsz, t = padding.shape
        if positions is None:
            positions = torch.arange(t, device=padding.device)[None].expand(bsz, -1)
        cache = DynamicCache() if steps > 1 else None
        hidden, outs = features, []
        for j in range(steps):
            hidden = self.step(hidden, embeds[:, j : j + t], positions + j, ttt_mask(t, j, padding), cache)
            outs.append(hidden)
        return outs


def feature_names(cfg: DrafterConfig, target_config) -> tuple[str, ...]:
    return FEATURES


def build(cfg: DrafterConfig, target, dataset=None) -> EagleDrafter:
    return EagleDrafter(layer_config(target.config))


def rebuild(meta: dict, target) -> EagleDrafter:
    return EagleDrafter(layer_config(target.config))


def compute_loss(drafter, target, batch: dict, feats: dict, cfg: DrafterConfig, step: int = 0, forward=None):
    """Returns (loss_sum, n_tokens, metric_sums) over the tokens the loss mask keeps; n_tokens
    counts step-0 positions.

    batch: input_ids, attention_mask, loss_mask [B, T]; feats["last_hidden"]: [B, T, H].
    """
    forward = drafter if forward is None else forward  # the loop's distributed wrapper: its forward syncs gradients
    ids, lmask, docs = batch["input_ids"], batch["loss_mask"], documents(batch)
    f = feats["last_hidden"]
    steps = cfg.hass_steps if cfg.hass else 1
    seq, t = ids.shape[1], ids.shape[1] - 1
    # EAGLE pairs feature i with token i+1: position i sees f_i and embed(t_{i+1}) and must
    # predict f_{i+1}, whose lm_head distribution is the target's prediction of t_{i+2}.
    f_in = f[:, :-1]
    if drafter.training and cfg.feature_noise > 0:
        f_in = f_in + (torch.rand_like(f_in) * 2 - 1) * cfg.feature_noise
    # Unrolled steps read tokens, features and mask past the end: padding, masked out below.
    ids_ext = torch.nn.functional.pad(ids, (0, steps - 1))
    f_ext = torch.nn.functional.pad(f, (0, 0, 0, steps - 1))
    lmask_ext = torch.nn.functional.pad(lmask, (0, steps))
    docs_ext = torch.nn.functional.pad(docs, (0, steps + 1))
    embed, lm_head = draft_embeddings(target), target.get_output_embeddings()
    # Pair i (f_i, t_{i+1}) is a real key iff t_{i+1} is its own example's token (a padded row: the
    # attention mask from 1 on); the pair across two examples of a packed row is padding.
    pair_docs = docs[:, :t] * same_document(docs, 1)[:, :t]
    # A packed row's pairs sit at their own example's positions; a padded row's are the forward's 0..t-1.
    at = {"positions": positions(batch)[:, :t]} if "position_ids" in batch else {}
    outs = forward(f_in, embed(ids_ext[:, 1:]), pair_docs, steps, **at)
    roots = torch.arange(t, device=ids.device)
    total: float | torch.Tensor = 0.0  # a Tensor once step 0's loss is added
    metrics: dict[str, torch.Tensor] = {}
    for j, out in enumerate(outs):
        # Step j of chain r predicts f_{r+j+1}, i.e. the target's distribution for t_{r+j+2}:
        # counted iff that token exists, is trained (an assistant token) and is r's own example's
        # (in a packed row t_{r+j+2} may be the next example's: no label of chain r).
        own = same_document(docs_ext, j + 2)[:, :t]
        sel = (roots + j + 2 < seq)[None] & lmask_ext[:, j + 2 : j + 2 + t].bool() & own
        pred, true = out[sel], f_ext[:, j + 1 : j + 1 + t][sel]
        ones = torch.ones(pred.shape[0], device=pred.device)
        # The target's lm_head scores both in its own dtype; the feature loss compares in the drafter's.
        s_logits, t_logits = lm_head(pred.to(true.dtype)), lm_head(true)
        true = true.to(out.dtype)
        l_feat = smooth_l1_feature_loss(pred, true, ones)
        l_tok = soft_cross_entropy(s_logits, t_logits, ones)
        loss = cfg.feature_loss_weight * l_feat + cfg.token_loss_weight * l_tok
        if cfg.hass:
            loss = loss + cfg.hass_topk_weight * topk_distillation_loss(s_logits, t_logits, ones, cfg.hass_topk)
        total = total + loss
        acc = (s_logits.argmax(-1) == t_logits.argmax(-1)).sum().detach()
        if j == 0:
            n_tokens = sel.sum()
            metrics.update(feat_loss=l_feat.detach(), token_loss=l_tok.detach(), acc=acc)
        else:
            metrics[f"acc{j}"] = acc
    return total, n_tokens, metrics


def make_proposer(drafter, target, cfg: DrafterConfig) -> FeatureProposer:
    return FeatureProposer(
        drafter,
        target,
        FEATURES,
        to_hidden=lambda feats: feats["last_hidden"],
        step=drafter.step,
        logits=target.get_output_embeddings(),
    )


# The drafter is one module trained at optim.lr, and the target it reads stays frozen.


# vLLM serves this family's `vllm` export as speculative method `eagle` (draftsmith/ship/serve_check.py).
SERVE_FORMAT, vllm_serving = "vllm", vllm_method("eagle")


# --- formats: vLLM `EagleLlamaForCausalLM` and SGLang `LlamaForCausalLMEagle` load the same folder ---


def write_export(drafter, cfg: DrafterConfig, target, meta: dict, tok, out, info: dict) -> None:
    """A one-layer Llama checkpoint: fc + layers.0.* (no input_layernorm, no embeddings, no lm_head:
    the engines take the target's)."""
    state = renamed(drafter.state_dict(), "layer.", "layers.0.")
    # SGLang's EAGLE fc has a bias; vLLM's does not (and skips fc.bias). A zero bias serves both.
    state["fc.bias"] = torch.zeros(drafter.config.hidden_size)
    config = {
        "architectures": ["LlamaForCausalLM"],
        **llama_dims(drafter),
        "bias": False,
        "tie_word_embeddings": False,
        "draftsmith": info,
    }
    write_tensors(out, config, state)


EXPORTS = {"vllm": write_export, "sglang": write_export}


def recognises(config: dict, tensor_names: set[str]) -> bool:
    """The engines' EAGLE-1 architectures, or a one-layer Llama with an `fc` (how EAGLE-1 heads are published)."""
    arch = (config.get("architectures") or ["?"])[0]
    return arch in ("EagleLlamaForCausalLM", "LlamaForCausalLMEagle") or (
        arch.endswith("ForCausalLM") and "fc.weight" in tensor_names
    )


def read_export(path, target) -> dict[str, torch.Tensor]:
    state = load_state(path)
    state.pop("embed_tokens.weight", None)  # EAGLE heads use the target's embeddings
    state.pop("fc.bias", None)  # the zero bias written for SGLang
    return renamed(state, "layers.0.", "layer.")


def from_export(path, config: dict, cfg: DrafterConfig, target) -> EagleDrafter:
    return from_exported_head(build(cfg, target), config, read_export(path, target))


# The target is never trained: it is its own original (Medusa-2 differs).


def serving_snippet(fmt: str, repo_id: str, target: str, k: int) -> str:
    if fmt == "sglang":
        return sglang_snippet("EAGLE", repo_id, target, k)
    return vllm_snippet("eagle", repo_id, target, k)


def activation_bytes(cfg: DrafterConfig, tc, drafter, batch: int, length: int, elem: int) -> int:
    """`plan`: bytes live at a training step's peak for a micro-batch of full rows (fp32 loss buffers)."""
    return unroll_activation_bytes(tc, batch, length, elem, 1, tc.vocab_size)


def unroll_activation_bytes(tc, batch: int, length: int, elem: int, steps: int, vocab: int) -> int:
    """A feature-space head unrolled `steps` times (TTT / HASS), its logits over `vocab` tokens."""
    n, f = batch * length, 4
    layer = layer_activation_bytes(tc.hidden_size, dense_intermediate_size(tc), elem)
    # the target's draft-vocab distribution and one copy per step's labels; per step the logits,
    # softmax, log-softmax kept for backward; one transient product; the TTT masks (one [t, t(j+1)]
    # block row per step, materialised in the activation dtype by SDPA)
    unroll = (
        n * f * vocab * (2 + 4 * steps) + n * steps * layer + elem * batch * length * length * steps * (steps + 1) // 2
    )
    # ... unless the teacher's pass before it is higher: one full-vocabulary chunk of 4096 rows
    return max(unroll, f * (min(n, 4096) * tc.vocab_size + 2 * n * vocab))


def sglang_snippet(algorithm: str, repo_id: str, target: str, k: int) -> str:
    return (
        f"```bash\npython -m sglang.launch_server --model {target} --speculative-algorithm {algorithm} \\\n"
        f"  --speculative-draft-model-path {repo_id} --speculative-num-steps {k} \\\n"
        f"  --speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}\n```"
    )


FAMILY = Family(
    NAME=NAME,
    DrafterConfig=DrafterConfig,
    feature_names=feature_names,
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
)
