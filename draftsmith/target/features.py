"""The target's features: what a drafter family reads of the frozen target (its feature contract),
computed online, incrementally with a KV cache, or for the offline cache."""

from __future__ import annotations

import torch

from draftsmith import DraftsmithError


@torch.no_grad()
def target_features(target, batch: dict, names: tuple[str, ...], cache=None) -> dict[str, torch.Tensor]:
    """The feature contract, computed online (training) or incrementally with a KV cache (eval).

    - `last_hidden`: the post-final-norm hidden state, the input of the target's lm_head (what
      vLLM/SGLang hand EAGLE heads at serving time);
    - `hidden.N`: the output of decoder layer N (0-based), i.e. `hidden_states[N + 1]` in
      transformers, whose entry 0 is the embedding output;
    - `logits_topk.K`: the target's K largest next-token logits, their token ids and the log-sum-exp
      over the whole vocabulary, packed as [..., 2K+1] fp32 (`topk_logits`): what a distilled student
      needs of the teacher when its last hidden state (H numbers) is more than 2K+1.
    """
    aux = [int(n.split(".")[1]) for n in names if n.startswith("hidden.")]
    topk = [n for n in names if n.startswith("logits_topk.")]
    unknown = [n for n in names if n != "last_hidden" and not n.startswith(("hidden.", "logits_topk."))]
    if unknown:
        raise DraftsmithError(f"feature contract: unknown target features {unknown}")
    out = target.get_decoder()(
        input_ids=batch["input_ids"],
        attention_mask=layer_masks(target.config, batch.get("attention_mask")),
        position_ids=batch.get("position_ids"),
        cache=cache,
        use_cache=cache is not None,
        output_hidden_states=bool(aux),
    )
    feats = {"last_hidden": out.last_hidden_state}
    for a in aux:
        feats[f"hidden.{a}"] = out.hidden_states[a + 1]
    for name in topk:
        feats[name] = topk_logits(target.get_output_embeddings()(out.last_hidden_state), int(name.split(".")[1]))
    return feats if set(names) == set(feats) else {n: feats[n] for n in names}


def draft_embeddings(target):
    """What a drafter embeds its tokens with: the rows of the target's embedding table as they are.
    For most targets that is the embedding module itself. Gemma-3's (`Gemma3TextScaledWordEmbedding`)
    multiplies the rows by sqrt(hidden_size) in its forward, a scale the serving engines do not give
    a drafter: vLLM applies it in the Gemma model's forward, not in the `embed_tokens` it shares with
    EAGLE, EAGLE-3, P-EAGLE and the DFlash family's heads, and speculators trains heads on the
    verifier's table as is. A head trained on the scaled rows would be served rows sqrt(H) times
    smaller (34x for Gemma-3-1B). The module is still what is called (FSDP's hooks gather its
    weight), with its scale set to 1 for the call: exact in any dtype."""
    emb = target.get_input_embeddings()
    if not isinstance(getattr(emb, "embed_scale", None), torch.Tensor):
        return emb
    return lambda ids: torch.func.functional_call(emb, {"embed_scale": torch.ones_like(emb.embed_scale)}, (ids,))


def layer_masks(config, mask):
    """What a target's layers read of one of draftsmith's own 4-D boolean masks [B, 1, q, kv] (the
    engine's tree and chain verification masks, the batched engine's padded ones): transformers
    uses a 4-D mask as given, in every layer, so a target with sliding-window layers (Gemma-3's
    local layers, Mistral, Qwen2 with use_sliding_window) would let them see past their window,
    unlike target-only decoding, once the context outgrows it. Their mask keeps only the last
    `sliding_window` keys each query attends (transformers' overlay: k > q - window): the keys a row
    of these masks attends are its own sequence, in order, ending with itself. Returned per layer
    type where the config names them (the dict Gemma-3 and Qwen2/3 models take), else one mask."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if mask is None or mask.dim() != 4 or mask.dtype != torch.bool or not window:
        return mask
    if types is not None and "sliding_attention" not in types:
        return mask
    # The number of attended keys at or after each column: a key is in the window iff it is <= window.
    sliding = mask & (mask.flip(-1).cumsum(-1).flip(-1) <= window)
    return {"full_attention": mask, "sliding_attention": sliding} if types is not None else sliding


def topk_logits(logits: torch.Tensor, k: int) -> torch.Tensor:
    """[..., V] logits -> [..., 2k+1] fp32: top-k values, their ids (exact in fp32 below 2^24) and
    logsumexp over all V, so log p of each top-k token is value - lse and p(rest) = 1 - their sum."""
    logits = logits.float()
    values, ids = logits.topk(min(k, logits.shape[-1]), dim=-1)
    return torch.cat([values, ids.float(), torch.logsumexp(logits, dim=-1, keepdim=True)], dim=-1)


def unpack_topk(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `topk_logits`: (values [..., k], ids [..., k] long, lse [..., 1])."""
    k = (packed.shape[-1] - 1) // 2
    return packed[..., :k], packed[..., k : 2 * k].long(), packed[..., 2 * k :]
