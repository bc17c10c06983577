"""Functions every drafter family shares: masks, the standalone save/load format, small checks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from draftsmith import DraftsmithError

FORMAT_VERSION = 1


def causal_mask(q_len: int, kv_len: int, padding: torch.Tensor | None = None, device=None) -> torch.Tensor:
    """Boolean attention mask [B|1, 1, q_len, kv_len]; True = may attend.

    The q_len queries are the *last* q_len positions of the kv_len keys (a KV cache may hold
    kv_len - q_len earlier positions), so query i sits at absolute position kv_len - q_len + i.
    `padding` [B, kv_len] marks real (1) vs padded (0) keys.
    """
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    mask = (k_pos <= q_pos)[None, None]
    if padding is not None:
        mask = mask & padding[:, None, None, :].bool()
    # A fully padded query row would make softmax NaN; let it see itself (its loss is masked).
    eye = (k_pos == q_pos)[None, None]
    return mask | eye


def save_drafter(module: torch.nn.Module, out: Path, meta: dict) -> Path:
    """Write `config.json` + `model.safetensors` to a temp folder, then rename into place."""
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {k: v.detach().to("cpu").contiguous() for k, v in module.state_dict().items()}
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps({"draftsmith_format": FORMAT_VERSION, **meta}, indent=2))
    if out.exists():
        shutil.rmtree(out)
    tmp.replace(out)
    return out


def read_drafter_meta(path: Path) -> dict:
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file() or not (path / "model.safetensors").is_file():
        raise DraftsmithError(f"{path}: not a draftsmith drafter folder (expected config.json and model.safetensors)")
    try:
        meta = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise DraftsmithError(f"{cfg_file}: invalid JSON ({e})") from None
    for key in ("drafter", "target", "target_fingerprint", "drafter_config"):
        if key not in meta:
            raise DraftsmithError(f"{cfg_file}: missing key '{key}'")
    return meta


def load_state(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(Path(path) / "model.safetensors")
    except Exception as e:  # safetensors raises several types for truncated files
        raise DraftsmithError(f"{path}/model.safetensors: cannot read weights ({e})") from None


def check_fingerprint(meta: dict, fp: str, where: str) -> None:
    if meta["target_fingerprint"] != fp:
        raise DraftsmithError(
            f"{where}: drafter was trained for target '{meta['target']}' (fingerprint {meta['target_fingerprint']}), "
            f"but the given target has fingerprint {fp}; retrain or fine-tune the drafter for this target"
        )


def crop_cache(cache, length: int) -> None:
    """Keep the first `length` positions of a transformers Cache (its `crop` takes a count to remove)."""
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


class ChainProposer:
    """Chain drafting for feature-space drafters (EAGLE-1, EAGLE-3), with the drafter's KV cache.

    The engine passes all tokens x_0..x_{n-1} and the target features of x_0..x_{n-2} (everything
    the target has verified). Pair i = (hidden from target features at i, token x_{i+1}) is *real*
    for i <= n-2 and stays cached across rounds. Draft steps feed the drafter's own output instead;
    they are cropped away before the next round, when real features replace them.

    to_hidden(feats) -> [1, t, H] drafter input from target features; step(hidden, embeds, pos,
    mask, cache) -> out [1, t, H]; logits(out [1, 1, H]) -> logits over the *target* vocabulary.
    With a `sampler` (temperature > 0), drafts are sampled and their distributions kept in `self.q`
    for the rejection rule; otherwise drafts are the argmax.
    """

    def __init__(self, drafter, target, feature_names, to_hidden, step, logits):
        self.drafter = drafter.eval()
        self.feature_names = tuple(feature_names)
        self.embed = target.get_input_embeddings()
        self.to_hidden, self.step, self.logits = to_hidden, step, logits
        self.reset()

    def reset(self):
        from transformers import DynamicCache

        self.cache, self.n_real, self.q = DynamicCache(), 0, []

    def _run(self, hidden, tokens, start):
        t = hidden.shape[1]
        pos = torch.arange(start, start + t, device=tokens.device)[None]
        return self.step(hidden, self.embed(tokens), pos, causal_mask(t, start + t, device=tokens.device), self.cache)

    @torch.no_grad()
    def propose(self, tokens: torch.Tensor, feats: dict, k: int, sampler=None) -> list[int]:
        crop_cache(self.cache, self.n_real)
        n_feats = next(iter(feats.values())).shape[1]
        new = {name: f[:, self.n_real:] for name, f in feats.items()}
        out = self._run(self.to_hidden(new), tokens[:, self.n_real + 1 : n_feats + 1], self.n_real)
        self.n_real = n_feats
        draft, self.q = [], []
        for i in range(k):
            logits = self.logits(out[:, -1:])[0, 0]
            if sampler is None:
                nxt = int(logits.argmax())
            else:
                q = sampler.probs(logits)
                nxt = sampler.sample(q)
                self.q.append(q)
            draft.append(nxt)
            if i + 1 < k:
                # The next pair is (own output for the position just predicted, that token).
                out = self._run(out[:, -1:], torch.tensor([[nxt]], device=tokens.device), n_feats + i)
        return draft
