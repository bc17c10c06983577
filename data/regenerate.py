"""Self-distillation data: the target answers the prompts itself, so the drafter learns the
distribution it will have to predict at serving time (EAGLE-3, Medusa self-distillation).

Batched, greedy or sampled. Resumable: finished answers go to `OUT.partial` as they are made;
a rerun skips them, and the file is renamed to OUT only when every prompt is answered.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tqdm import tqdm

from draftsmith.data.load import prompt_messages, read_records, to_messages, require_chat_template


def _done_ids(partial: Path) -> set[int]:
    if not partial.is_file():
        return set()
    done = set()
    for line in partial.read_text().splitlines():
        try:
            done.add(json.loads(line)["id"])
        except (json.JSONDecodeError, KeyError):
            break  # a line cut by an interruption: everything before it is kept
    return done


@torch.no_grad()
def regenerate(target, tok, data: str, out: Path, batch_size: int = 8, max_new_tokens: int = 128,
               temperature: float = 0.0, max_examples: int = 0, seed: int = 0) -> Path:
    require_chat_template(tok, "data regenerate")
    rows = read_records(data)[: max_examples or None]
    prompts = []
    for n, row in enumerate(rows):
        item = to_messages(row, f"{data}: record {n}")
        prompts.append([{"role": "user", "content": item}] if isinstance(item, str) else prompt_messages(item))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    done = _done_ids(partial)
    if done:  # rewrite without a possibly cut last line
        keep = [l for l in partial.read_text().splitlines() if l.strip() and _safe_id(l) in done]
        partial.write_text("".join(l + "\n" for l in keep))
    todo = [i for i in range(len(prompts)) if i not in done]
    side, tok.padding_side = tok.padding_side, "left"  # generation appends on the right: pad prompts on the left
    device = next(target.parameters()).device
    torch.manual_seed(seed)
    with open(partial, "a") as f:
        for s in tqdm(range(0, len(todo), batch_size), desc="regenerate", initial=0):
            ids = todo[s:s + batch_size]
            texts = [tok.apply_chat_template(prompts[i], tokenize=False, add_generation_prompt=True) for i in ids]
            enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            gen = target.generate(**enc, max_new_tokens=max_new_tokens, do_sample=temperature > 0,
                                  temperature=temperature if temperature > 0 else None, top_p=None, top_k=None,
                                  pad_token_id=tok.pad_token_id)
            for row, i in zip(gen[:, enc["input_ids"].shape[1]:], ids):
                answer = tok.decode(row, skip_special_tokens=True).strip()
                msgs = prompts[i] + [{"role": "assistant", "content": answer}]
                f.write(json.dumps({"id": i, "messages": msgs}) + "\n")
            f.flush()
    tok.padding_side = side
    partial.replace(out)
    return out


def _safe_id(line: str):
    try:
        return json.loads(line)["id"]
    except (json.JSONDecodeError, KeyError):
        return None


def cached_regeneration(target, tok, data: str, fingerprint: str, cache_dir: Path, max_examples: int,
                        max_new_tokens: int, batch_size: int) -> Path:
    """`data.regenerate=true` in a recipe: regenerate once per (target, data, size) and reuse it.
    An interrupted regeneration resumes from its `.partial` file on the next run."""
    import hashlib

    key = hashlib.sha256(json.dumps([fingerprint, data, max_examples, max_new_tokens]).encode()).hexdigest()[:16]
    out = Path(cache_dir) / "regenerated" / f"{key}.jsonl"
    if not out.is_file():
        regenerate(target, tok, data, out, batch_size, max_new_tokens, 0.0, max_examples)
    return out
