"""Export drafters in the formats serving engines load (anchors.md, section 4).

Each family module owns its writers, `EXPORTS` (format -> writer). This module runs them: temp folders
renamed into place and the `draftsmith` section of every export's config. The readers (which family an
export holds, its weights, the drafter rebuilt, `init_from`) live in models/readers.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from draftsmith import DraftsmithError
from draftsmith.models.registry import load_drafter


def export(drafter_dir: str | Path, target, fmt: str, out: str | Path, tok=None) -> Path:
    """Write `out/` in format `fmt` through the family's writer (`EXPORTS[fmt]`): into a temp folder,
    renamed into place when complete. `tok`: the target's tokenizer, for formats that ship one (a
    student's folder, a Medusa-2 export's trained backbone)."""

    family, cfg, drafter = load_drafter(drafter_dir, target)  # checks the target fingerprint
    if fmt not in family.EXPORTS:
        raise DraftsmithError(
            f"--format {fmt}: a {family.NAME} drafter exports to {', '.join(family.EXPORTS) or 'nothing yet'}"
        )
    meta = json.loads((Path(drafter_dir) / "config.json").read_text())
    # Where the export came from, in its config.json (engines ignore unknown keys).
    info = {
        "drafter": family.NAME,
        "format": fmt,
        "target": meta["target"],
        "target_fingerprint": meta["target_fingerprint"],
        "drafter_config": meta["drafter_config"],
    }
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    family.EXPORTS[fmt](drafter, cfg, target, meta, tok, tmp, info)
    shutil.rmtree(out, ignore_errors=True)
    tmp.replace(out)
    return out
