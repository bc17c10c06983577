"""Batched generation: the one loop that answers prompts with a causal LM on its own, for
regeneration (data/regenerate.py: the target, with the features of every token fed), the engine's
target-only batch baseline (draftsmith/engine/batched.py `target_decode_batch`) and distillation's
on-policy data (models/distill.py `on_policy_batch`: the student answers)."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from draftsmith.target.features import target_features


@torch.no_grad()
def generate_batch(
    target,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos: set[int],
    pad_id: int,
    names: tuple[str, ...] = (),
    temperature: float = 0.0,
    generator=None,
) -> list[tuple[list[int], dict[str, torch.Tensor]]]:
    """Answer a batch of tokenized prompts, greedy (temperature 0) or sampled; capture the `names`
    features of every token fed.

    Returns, per prompt, (completion_ids, {name: [len(prompt) + len(completion), H]}): the answer
    (ending with an EOS token if the target produced one, at most `max_new_tokens` long) and the
    features of prompt + answer. A row that finished leaves the batch (its cache rows too), after
    one more pass for the features of its last token when `names` asks for them.
    """
    if not prompts:
        return []
    device = next(target.parameters()).device
    width, bsz = max(len(p) for p in prompts), len(prompts)
    # Left padding puts every row's newest token in the last column, so a decode step feeds [B, 1].
    feed = torch.full((bsz, width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros(bsz, width, dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        feed[b, width - len(p) :] = torch.tensor(p, device=device)
        mask[b, width - len(p) :] = 1
    cache = DynamicCache()
    answers: list[list[int]] = [[] for _ in prompts]
    kept: list[dict[str, list[torch.Tensor]]] = [{n: [] for n in names} for _ in prompts]
    rows = list(range(bsz))  # the prompt of each batch row
    done: set[int] = set()  # prompts whose answer is complete
    while rows:
        # Positions count real tokens only, as if each row had been fed unpadded.
        pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, -feed.shape[1] :]
        feats = target_features(
            target,
            {"input_ids": feed, "attention_mask": mask, "position_ids": pos},
            tuple(dict.fromkeys(names + ("last_hidden",))),
            cache,
        )
        real = mask[:, -feed.shape[1] :].bool()  # the fed columns that are tokens, not padding
        for i, b in enumerate(rows):
            for n in names:
                kept[b][n].append(feats[n][i, real[i]])
        logits = target.get_output_embeddings()(feats["last_hidden"][:, -1]).float()
        if temperature > 0:
            nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator)[:, 0]
        else:
            nxt = logits.argmax(-1)
        for i, b in enumerate(rows):
            if b not in done:
                answers[b].append(int(nxt[i]))
                if answers[b][-1] in eos or len(answers[b]) == max_new_tokens:
                    done.add(b)  # with `names`: fed once more, for its last token's features
        # Rows that leave: those already fed their last token, and, without `names`, those just done.
        stay = [i for i, b in enumerate(rows) if b not in done or (names and len(kept[b][names[0]]) == len(answers[b]))]
        if len(stay) < len(rows):
            index = torch.tensor(stay, dtype=torch.long, device=device)
            cache.batch_select_indices(index)
            nxt, mask = nxt[index], mask[index]
            rows = [rows[i] for i in stay]
        feed = nxt[:, None]
        mask = torch.cat([mask, torch.ones_like(feed)], dim=1)
    return [(a, {n: torch.cat(k[n]) for n in names}) for a, k in zip(answers, kept)]
