"""The explicit registry of drafter families: name -> the family's record (models/family.py).
Adding a family = one module ending in `FAMILY = Family(...)` (its `tiny` sizes too) + one line here + its
recipes; everything that runs every family (benchmarks/tiny_target.py, the tests, scripts/gpu-check.sh)
reads this dict. tests/architecture/test_registry.py checks that every family module is registered, every
record has the record's signatures and every recipe's `drafter.type` is registered; test_new_family.py
registers a throwaway family and runs it through train, eval and export."""

from __future__ import annotations

import copy
import difflib
import json
from pathlib import Path

from draftsmith import DraftsmithError
from draftsmith.models import dflash, dflash2, distill, dspark, eagle, eagle3, medusa, peagle
from draftsmith.models.family import INTERFACE, Family  # noqa: F401 (INTERFACE: what every family has)
from draftsmith.models.folder import check_fingerprint, load_state, read_drafter_meta
from draftsmith.target.load import fingerprint
from draftsmith.util.parse import from_dict

DRAFTERS: dict[str, Family] = {
    "eagle": eagle.FAMILY,
    "eagle3": eagle3.FAMILY,
    "peagle": peagle.FAMILY,
    "dflash": dflash.FAMILY,
    "dspark": dspark.FAMILY,
    "dflash2": dflash2.FAMILY,
    "medusa": medusa.FAMILY,
    "distill": distill.FAMILY,  # last: `recognises` any causal LM, so published heads are asked first
}
DEFAULT_DRAFTER = "eagle"  # a recipe that names no drafter.type


def drafter_family(name: str, where: str = "drafter.type") -> Family:
    if name not in DRAFTERS:
        close = difflib.get_close_matches(str(name), list(DRAFTERS), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise DraftsmithError(f"{where}: unknown drafter '{name}' (registered: {', '.join(DRAFTERS)}){hint}")
    return DRAFTERS[name]


def load_drafter(path: str | Path, target, allow_stale: bool = False):
    """A saved draftsmith drafter -> (family, drafter config, drafter); refuses drafters trained
    for another target unless `allow_stale` (measuring staleness after a target update)."""
    meta = read_drafter_meta(Path(path))
    family = drafter_family(meta["drafter"], f"{path}/config.json: drafter")
    if not allow_stale:
        check_fingerprint(meta, fingerprint(target), str(path))
    cfg = from_dict(
        family.DrafterConfig,
        {k: v for k, v in meta["drafter_config"].items() if k != "type"},
        f"{path}/config.json: drafter_config",
    )
    cfg = family.resolve(cfg, target.config)  # a folder written by hand may leave a default unsaid
    drafter = family.rebuild(meta, target)
    weights = load_state(Path(path))
    missing, unexpected = drafter.load_state_dict(weights, strict=False)
    own = drafter.state_dict()
    loaded = {own[k].data_ptr() for k in weights if k in own}
    missing = [k for k in missing if own[k].data_ptr() not in loaded]  # tied to a loaded weight (saved once)
    if missing or unexpected:
        raise DraftsmithError(
            f"{path}/model.safetensors: weights do not match a {meta['drafter']} drafter "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    param = next(target.parameters())
    return family, cfg, drafter.to(param.device, param.dtype).eval()


def target_to_load_on(target, path: str | Path):
    """The target object to load the drafter at `path` on: a drafter that trained the backbone
    (Medusa-2) injects its adapters into the target it is loaded on, so it gets its own copy."""
    meta = json.loads((Path(path) / "config.json").read_text())
    family = drafter_family(meta.get("drafter", ""), f"{path}/config.json: drafter")
    return copy.deepcopy(target) if family.trains_target(meta.get("drafter_config", {})) else target
