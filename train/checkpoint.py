"""Resumable checkpoints: `step-NNNNNN/` = accelerate state (weights, optimizer, scheduler, RNG of
every rank) + trainer_state.json (step, data position, processes, ZeRO stage) + resolved config.
Written to a `.tmp` folder and renamed, so a crash never leaves a half-written `step-*` behind.
Under DeepSpeed the weights and optimizer state are the engine's own checkpoint (`pytorch_model/`,
one shard per rank under ZeRO); `save_final` gathers the full drafter for `final/` (from ZeRO's
partitions or FSDP's shards)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from accelerate.utils import DistributedType

from draftsmith import DraftsmithError
from draftsmith.models.folder import save_drafter

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
    return sorted(steps, key=lambda p: int(p.name.removeprefix("step-")))  # numeric: step-1000000 after 999999


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
    except json.JSONDecodeError as e:
        raise DraftsmithError(f"{path}: corrupt checkpoint, cannot resume ({STATE_FILE}: {e})") from None
    _check_layout(state, path, zero_stage(accelerator), accelerator.num_processes)
    try:
        accelerator.load_state(str(path))
    except Exception as e:
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise DraftsmithError(f"{path}: corrupt checkpoint, cannot resume ({type(e).__name__}: {first})") from None
    return state


def zero_stage(accelerator) -> int:
    """The DeepSpeed ZeRO stage this run trains with; 0 without DeepSpeed (DDP or one process)."""
    plugin = accelerator.state.deepspeed_plugin
    return int(plugin.deepspeed_config["zero_optimization"]["stage"]) if plugin is not None else 0


def _check_layout(state: dict, path: Path, zero: int, world: int) -> None:
    """A checkpoint resumes only under the layout that wrote it: DDP and DeepSpeed store different
    files, and ZeRO partitions the optimizer state (and under ZeRO-3 the weights) per rank, which
    DeepSpeed does not repartition for another world size. One line instead of a deep traceback."""

    def how(z: int) -> str:
        return f"under DeepSpeed ZeRO-{z}" if z else "without DeepSpeed"

    saved = state.get("zero_stage", 0)  # checkpoints from before DeepSpeed support are DDP ones
    if saved != zero:
        raise DraftsmithError(
            f"{path}: written {how(saved)}, but this run trains {how(zero)}; resume it with "
            "the setup it was written with (the same deepspeed= config or accelerate preset)"
        )
    n = state.get("processes", world)
    if zero and n != world:
        raise DraftsmithError(
            f"{path}: written by {n} processes under DeepSpeed ZeRO-{zero}, whose optimizer state is "
            f"partitioned {n} ways and DeepSpeed cannot repartition it; resume with {n} processes"
        )


def save_final(accelerator, drafter, out: Path, meta: dict) -> None:
    """Write `final/` (save_drafter's format, full fp32 weights); every rank calls it.

    DDP: rank 0 already holds everything. DeepSpeed: ZeRO-3 keeps 1/world of each parameter per rank
    (GatheredParameters gathers them, all ranks taking part), and under a bf16 config the module's
    weights are bf16 copies of fp32 masters that live, partitioned, in the optimizer
    (safe_get_full_fp32_param assembles them, again on all ranks). Rank 0 saves the module with the
    masters swapped in, so `final/` matches what a DDP run of the same recipe writes."""
    model, zero = accelerator.unwrap_model(drafter), zero_stage(accelerator)
    if accelerator.distributed_type == DistributedType.FSDP:  # FSDP2: each rank holds a shard of every tensor
        full = accelerator.get_state_dict(drafter)  # collective; the whole fp32 tensors land on rank 0
        if accelerator.is_main_process:
            save_drafter(model, out, meta, full)
        accelerator.wait_for_everyone()
        return
    if zero == 0:
        if accelerator.is_main_process:
            save_drafter(model, out, meta)
        return
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=zero == 3):
        masters = [safe_get_full_fp32_param(p) if p.requires_grad else None for p in params]
        if accelerator.is_main_process:
            kept = [p.data for p in params]
            for p, m in zip(params, masters):
                if m is not None:
                    p.data = m.view(p.shape)
            try:
                save_drafter(model, out, meta)
            finally:  # the gathered tensors go back before DeepSpeed re-partitions them on exit
                for p, d in zip(params, kept):
                    p.data = d
    accelerator.wait_for_everyone()
