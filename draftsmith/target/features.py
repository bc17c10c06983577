"""The target's features: what a drafter family reads of the frozen target (its feature contract),
computed online, incrementally with a KV cache, or for the offline cache."""

from __future__ import annotations

import torch

from draftsmith import DraftsmithError
from draftsmith.util.masks import model_inputs


@torch.no_grad()
def target_features(target, batch: dict, names: tuple[str, ...], cache=None) -> dict[str, torch.Tensor]:
    """The feature contract, computed online (training) or incrementally with a KV cache (eval).

    - `last_hidden`: the post-final-norm hidden state, the input of the target's lm_head (what
      vLLM/SGLang hand EAGLE heads at serving time);
    - `hidden.N`: the output of decoder layer N (0-based), i.e. `hidden_states[N + 1]` in
      transformers, whose entry 0 is the embedding output;
    - `logits_topk.K`: the target's K largest next-token logits, their token ids and the log-sum-exp
      over the whole vocabulary, packed as [..., 2K+1] fp32 (`topk_logits`): what a distilled student
      needs of the teacher when its last hidden state (H numbers) is more than 2K+1;
    - `argmax`: the target's greedy next token at each position [B, T] (long), its lm_head's argmax
      over `last_hidden`: a training label, derived (`DERIVED`): caches store `last_hidden` only and
      their reader derives it once per example (data/features.py FeatureCache).
    """
    aux = [int(n.split(".")[1]) for n in names if n.startswith("hidden.")]
    topk = [n for n in names if n.startswith("logits_topk.")]
    known = ("last_hidden", *DERIVED)
    unknown = [n for n in names if n not in known and not n.startswith(("hidden.", "logits_topk."))]
    if unknown:
        raise DraftsmithError(f"feature contract: unknown target features {unknown}")
    inputs = model_inputs(batch)  # a packed batch (data/packing.py): each example attends only to itself
    out = target.get_decoder()(
        input_ids=batch["input_ids"],
        attention_mask=layer_masks(target.config, inputs["attention_mask"]),
        position_ids=inputs["position_ids"],
        cache=cache,
        use_cache=cache is not None,
        output_hidden_states=bool(aux),
    )
    feats = {"last_hidden": out.last_hidden_state}
    for a in aux:
        feats[f"hidden.{a}"] = out.hidden_states[a + 1]
    for name in topk:
        feats[name] = topk_logits(target.get_output_embeddings()(out.last_hidden_state), int(name.split(".")[1]))
    if "argmax" in names:
        feats["argmax"] = greedy_ids(target, out.last_hidden_state)
    return feats if set(names) == set(feats) else {n: feats[n] for n in names}


# Features derived from a stored one rather than stored: name -> the feature it is computed from.
# An EAGLE-3 head's loss needs, at every trained position, whether the target's choice is in its
# draft vocabulary, i.e. the argmax over all V logits: a pure function of the example, so it is taken
# once per example (the first epoch) instead of a V-wide lm_head pass at every step of every epoch.
DERIVED = {"argmax": "last_hidden"}


def stored_names(names) -> tuple[str, ...]:
    """What a feature cache holds for `names`: the derived ones replaced by what they derive from."""
    out = [n for n in names if n not in DERIVED]
    return tuple(out + [DERIVED[n] for n in names if n in DERIVED and DERIVED[n] not in out])


def max_over_ranks(n: int, device: torch.device) -> int:
    """The largest n of all ranks when a process group runs (n itself in one process)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return n
    t = torch.tensor([n], device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return int(t.item())


def whole_weight(module: torch.nn.Module) -> torch.Tensor | None:
    """`module.weight` where this process holds all of it; None where it is sharded (DeepSpeed ZeRO-3
    partitions it, FSDP2 makes it a DTensor): there only the module's own call, made by every rank
    together, gathers it (models/training.py target_label_rows)."""
    w = module.weight
    return None if hasattr(w, "ds_id") or type(w.data).__name__ == "DTensor" else w


@torch.no_grad()
def greedy_ids(target, last: torch.Tensor, chunk: int = 4096, all_ranks: bool = True) -> torch.Tensor:
    """The `argmax` feature: last_hidden [..., T, H] -> the target's greedy token [..., T] (long),
    `chunk` rows at a time through its lm_head module. `all_ranks` (every rank of a launch calls it
    together, as target_features is called in training): each rank makes as many calls as the rank
    with the most chunks, since a sharded lm_head (ZeRO-3, FSDP) is gathered by all of them per call.
    A call made by one rank alone (`all_ranks=False`) is for a target each rank holds whole."""
    head = target.get_output_embeddings()
    rows = last.reshape(-1, last.shape[-1]).to(head.weight.dtype)
    n = -(-rows.shape[0] // chunk)
    calls = max(max_over_ranks(n, rows.device) if all_ranks else n, 1)  # one call on no rows: empty
    ids = [head(rows[c * chunk : (c + 1) * chunk]).argmax(-1) for c in range(calls)]
    return torch.cat(ids).reshape(last.shape[:-1])


def feature_width(name: str, hidden_size: int) -> int:
    """Numbers per token of a feature: H for hidden states, 2K+1 for `logits_topk.K`, 1 for `argmax`."""
    if name.startswith("logits_topk."):
        return int(name.split(".")[1]) * 2 + 1
    return 1 if name in DERIVED else hidden_size


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
