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
        attention_mask=batch.get("attention_mask"),
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
