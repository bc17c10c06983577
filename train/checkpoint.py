"""Resumable checkpoints: `step-NNNNNN/` = accelerate state (weights, optimizer, scheduler, RNG of
every rank) + trainer_state.json (step, data position) + resolved config. Written to a `.tmp`
folder and renamed, so a crash never leaves a half-written `step-*` behind."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from draftsmith import DraftsmithError

STEP_RE = re.compile(r"^step-(\d{6,})$")
STATE_FILE = "trainer_state.json"


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / f"step-{step:06d}"


def save(accelerator, run_dir: Path, step: int, state: dict, keep_last: int) -> Path:
    out = step_dir(run_dir, step)
    tmp = out.with_name(out.name + ".tmp")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shutil.copy(run_dir / "resolved_config.yaml", tmp / "resolved_config.yaml")
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=2))  # written last: marks completeness
        shutil.rmtree(out, ignore_errors=True)
        tmp.replace(out)
        for old in list_steps(run_dir)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return out


def list_steps(run_dir: Path) -> list[Path]:
    if not run_dir.is_dir():
        return []
    steps = [p for p in run_dir.iterdir() if p.is_dir() and STEP_RE.match(p.name)]
    return sorted(steps, key=lambda p: int(STEP_RE.match(p.name).group(1)))


def find_resume(run_dir: Path, resume: str) -> Path | None:
    if resume in ("false", "", "none"):
        return None
    if resume == "true":
        steps = list_steps(run_dir)
        if not steps:
            raise DraftsmithError(f"resume=true: no step-NNNNNN checkpoint in {run_dir}")
        return steps[-1]
    path = Path(resume)
    if not path.is_dir():
        raise DraftsmithError(f"resume={resume}: checkpoint folder not found")
    return path


def load(accelerator, path: Path) -> dict:
    """Restore accelerate state and return trainer_state; corrupt checkpoints give one clear error."""
    state_file = path / STATE_FILE
    if not state_file.is_file():
        raise DraftsmithError(f"{path}: incomplete checkpoint (no {STATE_FILE}); pass resume=PATH to an earlier step")
    try:
        state = json.loads(state_file.read_text())
        accelerator.load_state(str(path))
    except Exception as e:
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise DraftsmithError(f"{path}: corrupt checkpoint, cannot resume ({type(e).__name__}: {first})") from None
    return state
