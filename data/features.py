"""Offline target features: run the frozen target once over the training set and store exactly
the tensors the drafter family's feature contract names (bf16, H values per token each), in
safetensors shards. Size = 2 * H bytes per token per captured tensor, plus shard headers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from draftsmith import DraftsmithError
from draftsmith.data.batching import collate

INDEX = "index.json"


@torch.no_grad()
def target_features(target, batch: dict, names: tuple[str, ...], cache=None) -> dict[str, torch.Tensor]:
    """The feature contract, computed online (training) or incrementally with a KV cache (eval).

    - `last_hidden`: the post-final-norm hidden state, the input of the target's lm_head (what
      vLLM/SGLang hand EAGLE heads at serving time);
    - `hidden.N`: the output of decoder layer N (0-based), i.e. `hidden_states[N + 1]` in
      transformers, whose entry 0 is the embedding output.
    """
    aux = [int(n.split(".")[1]) for n in names if n.startswith("hidden.")]
    unknown = [n for n in names if n != "last_hidden" and not n.startswith("hidden.")]
    if unknown:
        raise DraftsmithError(f"feature contract: unknown target features {unknown}")
    out = target.get_decoder()(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                               position_ids=batch.get("position_ids"), cache=cache, use_cache=cache is not None, output_hidden_states=bool(aux))
    feats = {"last_hidden": out.last_hidden_state}
    for a in aux:
        feats[f"hidden.{a}"] = out.hidden_states[a + 1]
    return feats if set(names) == set(feats) else {n: feats[n] for n in names}


def write_cache(target, dataset, names, out: Path, fingerprint: str, pad_id: int,
                batch_size: int = 8, shard_tokens: int = 2_000_000) -> Path:
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    device = next(target.parameters()).device
    shards, current, n_tok, total = [], {}, 0, 0

    def flush():
        nonlocal current, n_tok
        if current:
            name = f"shard-{len(shards):05d}.safetensors"
            save_file(current, tmp / name)
            shards.append({"file": name, "examples": sorted({int(k.split(".")[-1]) for k in current})})
        current, n_tok = {}, 0

    for s in tqdm(range(0, len(dataset), batch_size), desc="features"):
        rows = [dataset[i] for i in range(s, min(s + batch_size, len(dataset)))]
        batch = {k: v.to(device) for k, v in collate(rows, pad_id).items()}
        feats = target_features(target, batch, names)
        for b, row in enumerate(rows):
            n = len(row["input_ids"])  # only real tokens are stored; padding is rebuilt on load
            for name in names:
                current[f"{name}.{row['idx']}"] = feats[name][b, :n].to(torch.bfloat16).cpu().contiguous()
            n_tok += n
            total += n
        if n_tok >= shard_tokens:
            flush()
    flush()
    index = {"features": list(names), "target_fingerprint": fingerprint, "num_examples": len(dataset),
             "num_tokens": total, "hidden_size": target.config.hidden_size, "dtype": "bfloat16", "shards": shards}
    (tmp / INDEX).write_text(json.dumps(index, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.replace(out)
    return out


class FeatureCache:
    """Reads cached features back as padded [B, T, H] tensors for a batch of example indices."""

    def __init__(self, path: str | Path, names: tuple[str, ...], fingerprint: str):
        self.path = Path(path)
        if not (self.path / INDEX).is_file():
            raise DraftsmithError(f"{self.path}: no {INDEX}; build the cache with `draftsmith data features`")
        self.index = json.loads((self.path / INDEX).read_text())
        if self.index["target_fingerprint"] != fingerprint:
            raise DraftsmithError(f"{self.path}: features were computed with another target (fingerprint "
                                  f"{self.index['target_fingerprint']}, expected {fingerprint})")
        missing = [n for n in names if n not in self.index["features"]]
        if missing:
            raise DraftsmithError(f"{self.path}: cache lacks features {missing} needed by this drafter")
        self.names = names
        self.where = {i: s["file"] for s in self.index["shards"] for i in s["examples"]}
        self.handles = {}

    def _get(self, key: str, idx: int) -> torch.Tensor:
        if idx not in self.where:
            raise DraftsmithError(f"{self.path}: example {idx} is not in the cache (rebuild it for this dataset)")
        f = self.where[idx]
        if f not in self.handles:
            self.handles[f] = safe_open(str(self.path / f), framework="pt")
        return self.handles[f].get_tensor(f"{key}.{idx}")

    def __call__(self, batch: dict) -> dict[str, torch.Tensor]:
        t = batch["input_ids"].shape[1]
        out = {}
        for name in self.names:
            rows = [self._get(name, int(i)) for i in batch["idx"]]
            padded = torch.zeros(len(rows), t, rows[0].shape[-1], dtype=torch.bfloat16)
            for b, r in enumerate(rows):
                padded[b, : r.shape[0]] = r
            out[name] = padded.to(batch["input_ids"].device)
        return out
