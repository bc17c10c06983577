"""Read drafter folders and exports back: the readers beside the registry (`load_drafter`) and the
drafter folder (models/folder.py), so training (`init_from`) and shipping (`export --verify`,
serve-check, publish) share them as peers.

Each family module owns its formats: `recognises` (is a folder without draftsmith's section one of its
heads, published by others?), `read_export` (its weights under draftsmith's names) and `from_export`
(the drafter rebuilt from an export's files alone). This module runs them: which family an export
holds, its weights, the drafter rebuilt, and `init_from` (fine-tuning a trained or published drafter).
The writers stay in draftsmith/ship/export.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from draftsmith import DraftsmithError
from draftsmith.models.folder import check_fingerprint, load_state, read_drafter_meta
from draftsmith.models.registry import DRAFTERS, drafter_family
from draftsmith.target.load import fingerprint
from draftsmith.util.parse import from_dict


def export_family(path: str | Path) -> str:
    """Which drafter family an exported folder holds: its `draftsmith` section, else the first family
    (in registry order) that `recognises` its config and tensor names: heads published for a target
    by others, in the formats the engines load."""

    path = Path(path)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DraftsmithError(f"{path}/config.json: cannot read an exported drafter's config ({e})") from None
    if "draftsmith" in config:
        return config["draftsmith"]["drafter"]
    names = set(load_file(path / "model.safetensors").keys()) if (path / "model.safetensors").is_file() else set()
    for family in DRAFTERS.values():
        if family.recognises(config, names):
            return family.NAME
    raise DraftsmithError(
        f"{path}/config.json: unknown export format (architectures {config.get('architectures')}); "
        f"expected an export of one of {', '.join(DRAFTERS)}"
    )


def read_export(path: str | Path, family: str, target) -> dict[str, torch.Tensor]:
    """An exported folder's weights under draftsmith's own tensor names for `family`."""

    return drafter_family(family).read_export(Path(path), target)


def import_export(path: str | Path, target):
    """An exported folder -> (family, drafter config, drafter) in draftsmith's own layout, rebuilt
    from the exported files alone (their config and weights) on `target`."""

    config = json.loads((Path(path) / "config.json").read_text())
    info = config.get("draftsmith")
    if not info:
        raise DraftsmithError(f"{path}/config.json: not exported by draftsmith (no 'draftsmith' section)")
    family = drafter_family(info["drafter"])
    cfg = from_dict(family.DrafterConfig, {k: v for k, v in info["drafter_config"].items() if k != "type"}, str(path))
    param = next(target.parameters())
    drafter = family.from_export(Path(path), config, cfg, target)
    return family, cfg, drafter.to(param.device, param.dtype).eval()


def read_config(path: str | Path) -> dict:
    """The config.json of a drafter folder (`init_from`): a draftsmith final/ or any export."""
    try:
        return json.loads((Path(path) / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DraftsmithError(f"init_from {path}: not a drafter folder (cannot read config.json: {e})") from None


def init_weights(drafter, family: str, path: str | Path, target, allow_stale: bool = False) -> None:
    """`init_from`: load a draftsmith drafter folder (final/) or any exported format into the freshly
    built `drafter` of `family`, before training (domain fine-tuning). Imported buffers come along,
    so an EAGLE-3 head keeps its draft vocabulary (d2t/t2d). Another family, another target or
    other shapes fail with the tensor and both shapes named; another target is allowed with
    `allow_stale` (a refresh after the target was updated)."""

    path = Path(path)
    if not (path / "config.json").is_file():
        raise DraftsmithError(f"init_from {path}: not a drafter folder (no config.json)")
    native = "draftsmith_format" in json.loads((path / "config.json").read_text())  # a final/ folder
    if native:
        meta = read_drafter_meta(path)
        if not allow_stale:
            check_fingerprint(meta, fingerprint(target), f"init_from {path}")
    found = meta["drafter"] if native else export_family(path)
    if found != family:
        raise DraftsmithError(f"init_from {path}: holds a {found} drafter, but this recipe trains {family}")
    state = load_state(path) if native else read_export(path, family, target)
    # The weights may be those of one part of this drafter: a Medusa-2 run may start from Medusa-1
    # heads (the two stages as two runs). Then they load into the child module they all fit.
    whole = drafter.state_dict()
    parts = [m for n, m in drafter.named_children() if all(f"{n}.{k}" in whole for k in state)]
    dest = parts[0] if parts and not all(k in whole for k in state) else drafter
    own = dest.state_dict()
    for name, tensor in state.items():
        if name not in own:
            raise DraftsmithError(
                f"init_from {path}: tensor '{name}' has no place in a {family} drafter built from "
                f"this recipe (e.g. {next(iter(own))})"
            )
        if own[name].shape != tensor.shape:
            raise DraftsmithError(
                f"init_from {path}: tensor '{name}' is {tuple(tensor.shape)} there but "
                f"{tuple(own[name].shape)} in this recipe's drafter; match the drafter keys of the init"
            )
    loaded = {own[k].data_ptr() for k in state}
    missing = [k for k in own if own[k].data_ptr() not in loaded and "lora_" not in k]
    if missing:
        raise DraftsmithError(f"init_from {path}: no weights for {missing[:3]} of this recipe's {family} drafter")
    dest.load_state_dict(state, strict=False)
