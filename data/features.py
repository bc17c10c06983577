"""Offline target features: run the frozen target once over the training set and store exactly
the tensors the drafter family's feature contract names (H values per token each, in the dtype the
target ran in), in safetensors shards. Size = H * (4 bytes fp32 | 2 bytes bf16) per token per
captured tensor, plus shard headers. Self-distilled data gets its cache from the regeneration pass
itself (data/regenerate.py); `write_cache` is the separate pass for any other data."""

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
from draftsmith.data.sharding import Shard

INDEX = "index.json"


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


class ShardWriter:
    """Writes feature shards into `OUT.tmp/` and renames the folder to OUT when finished.

    Each `write_shard` is one complete safetensors file (written to a temp name, then renamed), so
    an interrupted writer leaves only whole shards behind; with `resume=True` they are kept and a
    rerun adds the missing examples. Features keep the dtype they were computed in (fp32 features
    equal a fresh fp32 forward pass, tests/test_regenerate.py).
    """

    def __init__(self, out: Path, names, fingerprint: str, hidden_size: int, resume: bool = False, prefix: str = ""):
        # `prefix`: the ranks of a launch write their shares into the same folder under their own names.
        self.out, self.names, self.prefix = Path(out), tuple(names), prefix
        self.tmp = self.out.with_name(self.out.name + ".tmp")
        if not resume:
            shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.meta = {"features": list(self.names), "target_fingerprint": fingerprint, "hidden_size": hidden_size}

    def write_shard(self, examples: dict[int, dict[str, torch.Tensor]]) -> None:
        """examples: example idx -> {name: [n_tokens, H]} (real tokens only; padding is rebuilt on load)."""
        stem = f"shard-{self.prefix}{len(list(self.tmp.glob(f'shard-{self.prefix}[0-9]*.safetensors'))):05d}"
        tensors = {
            f"{name}.{idx}": t.cpu().contiguous() for idx, feats in examples.items() for name, t in feats.items()
        }
        save_file(tensors, self.tmp / f"{stem}.partial")
        (self.tmp / f"{stem}.partial").replace(self.tmp / f"{stem}.safetensors")

    def finish(self, num_examples: int) -> Path:
        shards, total, dtype = [], 0, None
        for path in sorted(self.tmp.glob("shard-*.safetensors")):
            with safe_open(str(path), framework="pt") as f:
                keys = [k for k in f.keys() if k.startswith(self.names[0] + ".")]
                total += sum(f.get_slice(k).get_shape()[0] for k in keys)
                dtype = dtype or (str(f.get_slice(keys[0]).get_dtype()) if keys else None)
            shards.append({"file": path.name, "examples": sorted(int(k.rsplit(".", 1)[1]) for k in keys)})
        index = {**self.meta, "num_examples": num_examples, "num_tokens": total, "dtype": dtype, "shards": shards}
        (self.tmp / INDEX).write_text(json.dumps(index, indent=1))
        shutil.rmtree(self.out, ignore_errors=True)
        self.tmp.replace(self.out)
        return self.out


def write_cache(
    target,
    dataset,
    names,
    out: Path,
    fingerprint: str,
    pad_id: int,
    batch_size: int = 8,
    shard_tokens: int = 2_000_000,
    shard: Shard = Shard(),
) -> Path:
    """One target pass over a tokenized dataset (data not regenerated by the target itself). Over
    the ranks of a launch (`shard`) each rank computes its share of the same batches and writes its
    own shards; rank 0 writes the index. Returns once the cache is complete, on every rank."""
    if shard.main:
        shutil.rmtree(Path(out).with_name(Path(out).name + ".tmp"), ignore_errors=True)
    shard.barrier()  # the folder is clean before any rank writes into it
    writer = ShardWriter(out, names, fingerprint, target.config.hidden_size, resume=True, prefix=f"r{shard.rank}-")
    device = next(target.parameters()).device
    current, n_tok = {}, 0
    starts = shard.mine(list(range(0, len(dataset), batch_size)))
    for s in tqdm(starts, desc="features", disable=not shard.main):
        rows = [dataset[i] for i in range(s, min(s + batch_size, len(dataset)))]
        batch = {k: v.to(device) for k, v in collate(rows, pad_id).items()}
        feats = target_features(target, batch, names)
        for b, row in enumerate(rows):
            n = len(row["input_ids"])
            current[row["idx"]] = {name: feats[name][b, :n] for name in names}
            n_tok += n
        if n_tok >= shard_tokens:
            writer.write_shard(current)
            current, n_tok = {}, 0
    if current:
        writer.write_shard(current)
    shard.barrier()  # every rank's shards are on disk
    if shard.main:
        writer.finish(len(dataset))
    shard.barrier()
    return Path(out)


class FeatureCache:
    """Reads cached features back as padded [B, T, H] tensors for a batch of example indices."""

    def __init__(self, path: str | Path, names: tuple[str, ...], fingerprint: str):
        self.path = Path(path)
        if not (self.path / INDEX).is_file():
            raise DraftsmithError(f"{self.path}: no {INDEX}; build the cache with `draftsmith data features`")
        self.index = json.loads((self.path / INDEX).read_text())
        if self.index["target_fingerprint"] != fingerprint:
            raise DraftsmithError(
                f"{self.path}: features were computed with another target (fingerprint "
                f"{self.index['target_fingerprint']}, expected {fingerprint})"
            )
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
            # A cached sequence may be longer than the (truncated) example: features of a prefix do
            # not depend on later tokens (causal), so its first tokens are exact.
            rows = [self._get(name, int(i))[:t] for i in batch["idx"]]
            padded = torch.zeros(len(rows), t, rows[0].shape[-1], dtype=rows[0].dtype)
            for b, r in enumerate(rows):
                padded[b, : r.shape[0]] = r
            out[name] = padded.to(batch["input_ids"].device)
        return out
