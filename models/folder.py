"""A trained drafter's folder (`final/`, checkpoints): config.json with draftsmith's metadata
and model.safetensors, written atomically, read back with the target fingerprint checked."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from draftsmith import DraftsmithError

FORMAT_VERSION = 2  # 2: every family config is saved with its defaults resolved (EAGLE-3 aux layers)


def save_drafter(module: torch.nn.Module, out: Path, meta: dict, state: dict | None = None) -> Path:
    """Write `config.json` + `model.safetensors` to a temp folder, then rename into place. `state`:
    the module's full tensors when it holds shards (FSDP gathers them on rank 0)."""
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # Tied weights (a student's lm_head = its embeddings) are stored once, under their first name:
    # named_parameters() lists a shared parameter once.
    unique = {n for n, _ in module.named_parameters()} | {n for n, _ in module.named_buffers()}
    full = module.state_dict() if state is None else state
    state = {k: v.detach().to("cpu").contiguous() for k, v in full.items() if k in unique}
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
            f"but the given target has fingerprint {fp}; retrain or fine-tune the drafter for this target "
            f"(init_from_stale=true starts that fine-tune from this drafter)"
        )
