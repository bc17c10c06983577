"""Distributed plumbing of the training loop (train/loop.py): the Accelerator for a launch, and what
accelerate does not do for this loop under DeepSpeed ZeRO and FSDP, each with why. The loop calls
these helpers; nothing here knows a drafter family."""

from __future__ import annotations

import os
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin, DistributedType, InitProcessGroupKwargs

from draftsmith import DraftsmithError
from draftsmith.train.config import Config
from draftsmith.util.precision import ACCELERATE, TORCH

# --- DeepSpeed ------------------------------------------------------------------------------------
# accelerate runs DeepSpeed for `accelerate launch --config_file recipes/accelerate/zero{2,3}.yaml`
# (env ACCELERATE_USE_DEEPSPEED) or when given a DeepSpeedPlugin (the recipe's `deepspeed:` key, for
# torchrun launches). What it does not do for this loop is below, each with why.


def make_accelerator(cfg: Config) -> Accelerator:
    """The Accelerator for this launch: DDP / one process, or DeepSpeed."""
    # How long a rank may wait in one collective before the run fails (torch's default is 10 min for
    # NCCL, 30 for gloo): the recipe's, since long phases never sit inside one (data/sharding.py).
    timeout = timedelta(minutes=cfg.dist_timeout_minutes)
    kwargs: dict[str, Any] = dict(
        mixed_precision=ACCELERATE[cfg.optim.mixed_precision],
        project_dir=str(cfg.run_dir),
        log_with=None if cfg.tracker == "none" else cfg.tracker,
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timeout)],
    )
    use_ds = bool(cfg.deepspeed) or os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    if cfg.deepspeed:
        # zero3_init_flag=False: the target is loaded whole and sharded explicitly (shard_target).
        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(hf_ds_config=cfg.deepspeed, zero3_init_flag=False)
    if use_ds:  # what accelerate would adopt from the DeepSpeed config anyway, minus its mismatch warning
        kwargs["gradient_accumulation_steps"] = cfg.optim.grad_accum
    cpu = not torch.cuda.is_available()
    if cpu and use_ds:
        # accelerate enables DeepSpeed only with cpu=False, and without CUDA it then finds no process
        # group backend and counts the world as 1. Naming gloo (what DeepSpeed's CPU accelerator uses
        # too) gives it the real world size; each rank still needs a launcher (torchrun) to exist.
        if "LOCAL_RANK" not in os.environ:
            raise DraftsmithError(
                "DeepSpeed without CUDA needs a distributed launcher: torchrun --nproc_per_node N "
                "-m draftsmith.cli train ... (or launch.sh --preset zero3 --cpu-procs N)"
            )
        kwargs["kwargs_handlers"] = [InitProcessGroupKwargs(backend="gloo", timeout=timeout)]
        cpu = False
        _without_deepspeed_shm_op()
    if cpu and os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        # accelerate enables FSDP only on accelerators and otherwise prepares bare modules: every rank
        # would train on its own, silently. (tests/train/test_fsdp.py runs this loop under FSDP on CPUs by
        # giving the Accelerator the state it has on GPUs.)
        raise DraftsmithError(
            "the fsdp preset needs GPUs: accelerate enables FSDP only on accelerators; on CPUs "
            "use --preset zero3 (which shards the target too) or zero2"
        )
    # Otherwise, without CUDA, cpu=True makes a multi-process launch (torchrun / accelerate --multi_gpu)
    # form a gloo process group instead of N independent single-process runs.
    accelerator = Accelerator(cpu=cpu, **kwargs)
    if use_ds and accelerator.distributed_type != DistributedType.DEEPSPEED:  # e.g. ACCELERATE_USE_CPU=1 wins
        raise DraftsmithError(
            f"DeepSpeed was asked for, but accelerate set up {accelerator.distributed_type.value} "
            "(is ACCELERATE_USE_CPU set?)"
        )
    return accelerator


def _without_deepspeed_shm_op() -> None:
    """DeepSpeed's CPU backend JIT-compiles its shared-memory all-reduce op as it starts (70 s on a
    2-core Xeon, once per machine and environment), yet only DeepSpeed-inference's tensor-parallel
    layers call it (`inference_all_reduce`); training's collectives are gloo's. Marking the op
    unavailable is DeepSpeed's own fallback (what it does off Linux), and its ops table is meant to
    be edited: it is cached once per process so that edits persist."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def fill_deepspeed_config(accelerator: Accelerator, cfg: Config, hidden: int) -> None:
    """Under DeepSpeed the engine accumulates gradients and clips them, so its config must say what the
    recipe says: `auto` (or absent) takes the recipe's value, and a different number is an error
    rather than a silent override (accelerate would fill `auto` clipping with 1.0, and it cannot
    size micro-batches without a prepared DataLoader). ZeRO's `auto` bucket sizes come from the
    target's hidden size (accelerate's formulas; it looks for a `.config` drafters need not have)."""
    ds, o = accelerator.state.deepspeed_plugin.deepspeed_config, cfg.optim
    zero = ds.setdefault("zero_optimization", {})
    for key, value in {
        "reduce_bucket_size": hidden * hidden,
        "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
        "stage3_param_persistence_threshold": 10 * hidden,
    }.items():
        if zero.get(key) == "auto":
            zero[key] = value
    source = cfg.deepspeed or os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "the DeepSpeed config")
    wanted = {
        "gradient_accumulation_steps": ("optim.grad_accum", o.grad_accum),
        "gradient_clipping": ("optim.clip_grad", o.clip_grad),
        "train_micro_batch_size_per_gpu": ("optim.batch_size", o.batch_size),
        "train_batch_size": (
            "optim.batch_size x processes x optim.grad_accum",
            o.batch_size * accelerator.num_processes * o.grad_accum,
        ),
    }
    for key, (name, value) in wanted.items():
        have = ds.get(key, "auto")
        if have == "auto":
            ds[key] = value
        elif float(have) != float(value):
            raise DraftsmithError(
                f'{source}: {key} is {have} but {name} is {value}; set it to "auto" '
                "(filled from the recipe) or to the same value"
            )


@contextmanager
def whole_weights(accelerator: Accelerator):
    """Load models whole. accelerate registers a ZeRO-3 config with transformers (whatever
    zero3_init_flag says), and from_pretrained then builds every model partitioned under
    deepspeed.zero.Init. But the target's fingerprint, feature cache, regeneration and the drafter's
    initialisation (lm_head rows, layer copies) read its weights on one rank, and the eval stage
    runs on rank 0 alone. The registration comes back afterwards: generate() reads it to keep
    ZeRO-3 ranks in step (on-policy distillation)."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None or plugin.zero_stage != 3:
        yield
        return
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        plugin.set_deepspeed_weakref()


def deepspeed_line(accelerator: Accelerator, zero: int) -> str:
    """The start-up line's DeepSpeed part: the ZeRO stage, and where an offloaded optimizer steps
    (accelerate swaps the loop's AdamW for DeepSpeed's CPU Adam unless the JSON sets
    `zero_force_ds_cpu_optimizer: false`)."""
    if not zero:
        return ""
    ds = accelerator.state.deepspeed_plugin.deepspeed_config
    device = ds.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none")
    if device == "none":
        return f" | DeepSpeed ZeRO-{zero}"
    adam = "DeepSpeed's CPU Adam" if ds.get("zero_force_ds_cpu_optimizer", True) else "torch's AdamW"
    return f" | DeepSpeed ZeRO-{zero}, optimizer offloaded to {device} ({adam})"


def shard_target(accelerator: Accelerator, target, shares_weights: bool = False):
    """ZeRO-3: partition the frozen target over the ranks too, as TRL does for reference models. An
    engine without an optimizer keeps 1/world of each parameter per rank and gathers a module's
    weights only while it runs (forward, and backward through it: EAGLE's loss goes through the
    target's lm_head); nothing requires grad, so there are no gradients or optimizer state. Returns
    that engine, or None when the target's weights already belong to the drafter's engine (Medusa-2's
    LoRA backbone, a Medusa head sharing the lm_head): the rest of the target then stays whole."""
    import deepspeed

    if shares_weights:
        accelerator.print("target: its weights are part of the drafter, sharded with it by the drafter's engine")
        return None
    ds, h = accelerator.state.deepspeed_plugin.deepspeed_config, target.config.get_text_config().hidden_size
    dtype, full = next(target.parameters()).dtype, _held_bytes(target)
    zero = {
        "stage": 3,
        "stage3_param_persistence_threshold": 10 * h,  # accelerate's sizes for `auto`:
        "stage3_prefetch_bucket_size": int(0.9 * h * h),
        "reduce_bucket_size": h * h,
    }  # norms stay whole
    if "offload_param" in ds["zero_optimization"]:  # zero3-offload: the target's shards go to CPU RAM too
        zero["offload_param"] = ds["zero_optimization"]["offload_param"]
    config = {
        "train_micro_batch_size_per_gpu": ds["train_micro_batch_size_per_gpu"],
        "gradient_accumulation_steps": ds["gradient_accumulation_steps"],
        "zero_optimization": zero,
        # the target keeps target_dtype whatever precision the drafter trains in
        "bf16": {"enabled": dtype == torch.bfloat16},
        "fp16": {"enabled": dtype == torch.float16},
    }
    # Partition each parameter onto this rank's device, one at a time (from CPU RAM for a target too
    # big for one GPU); the engine then leaves placement alone, so the buffers (rotary) move here.
    deepspeed.zero.Init(module=target, config_dict_or_path=config, mem_efficient_linear=False)
    for buffer in target.buffers():
        buffer.data = buffer.data.to(accelerator.device)
    engine = deepspeed.initialize(model=target, config=config)[0]
    held = accelerator.gather(torch.tensor([_held_bytes(target)], device=accelerator.device)).tolist()
    accelerator.print(
        f"target sharded by ZeRO-3: {' / '.join(f'{b / 2**20:.2f}' for b in held)} MiB per rank "
        f"of {full / 2**20:.2f} MiB (per-rank bytes {held}, full {full})"
    )
    return engine


def fits_whole(model, device: torch.device) -> bool:
    """Whether a whole copy of `model` fits in half of the device's free memory (CPU RAM: it is there)."""
    if device.type != "cuda":
        return True
    return _held_bytes(model) < 0.5 * torch.cuda.mem_get_info(device)[0]


def _held_bytes(model) -> int:
    """Parameter bytes this rank holds: its ZeRO-3 / FSDP shard plus whatever is whole (persistent or
    gathered parameters, or all of them before sharding)."""

    def local(p):  # an FSDP2 parameter is a DTensor: its local shard; a ZeRO-3 one keeps ds_tensor
        return p.to_local() if hasattr(p, "to_local") else p.data

    return sum(
        (local(p).numel() + (p.ds_tensor.numel() if hasattr(p, "ds_tensor") else 0)) * p.element_size()
        for p in model.parameters()
    )


# --- FSDP -----------------------------------------------------------------------------------------
# accelerate's FSDP plugin (recipes/accelerate/fsdp.yaml, FSDP2) shards the drafter it prepares; the
# frozen target is not prepared (nothing to optimise), so it is sharded here with the same engine.


def fsdp_shard_target(accelerator: Accelerator, target, shares_weights: bool = False) -> None:
    """Shard the frozen target with torch's FSDP2 (`fully_shard`): each rank keeps 1/world of every
    parameter and a unit's weights are all-gathered only while it runs. Nothing requires grad, so
    there are no gradients or optimizer state, but gradients flow through it (EAGLE's loss goes
    through the target's lm_head). The loop calls the target's parts separately (its decoder for
    features, lm_head for teacher distributions, input embeddings for EAGLE's token inputs), so each
    is a unit of its own: every decoder layer, the final norm, and the embeddings with lm_head as one
    group (they may be one tied tensor). The decoder is not a unit: fully_shard swaps a module's
    class, and transformers finds what a model can record (output_hidden_states) by its class. The
    model is, as FSDP's root (one forward on one token initialises it). A target whose weights
    belong to the drafter (Medusa-2's LoRA backbone, heads sharing lm_head) stays as prepared."""
    if shares_weights:
        accelerator.print("target: its weights are part of the drafter, sharded with it by FSDP")
        return
    from torch.distributed.fsdp import fully_shard

    full, decoder = _held_bytes(target), target.get_decoder()
    for layer in decoder.layers:
        fully_shard(layer)
    fully_shard(decoder.norm)
    fully_shard([target.get_input_embeddings(), target.get_output_embeddings()])
    fully_shard(target)
    with torch.no_grad():  # one root forward (every rank): initialises FSDP with the model as its root
        target(input_ids=torch.zeros(1, 1, dtype=torch.long, device=accelerator.device))
    held = accelerator.gather(torch.tensor([_held_bytes(target)], device=accelerator.device)).tolist()
    accelerator.print(
        f"target sharded by FSDP: {' / '.join(f'{b / 2**20:.2f}' for b in held)} MiB per rank "
        f"of {full / 2**20:.2f} MiB (per-rank bytes {held}, full {full})"
    )


def autocast(accelerator: Accelerator, cfg: Config, zero: int):
    """The recipe's mixed precision around forward and loss. accelerate leaves it to DeepSpeed, whose
    engine casts the drafter's weights to bf16/fp16 (fp32 masters in the optimizer) but autocasts
    nothing, while the target's features and the losses around the drafter are the same tensors as
    under DDP (fp32 with an fp32 target): torch's autocast makes them meet as under DDP."""
    if not zero or cfg.optim.mixed_precision == "float32":
        return accelerator.autocast()
    return torch.autocast(accelerator.device.type, dtype=TORCH[cfg.optim.mixed_precision])


def deepspeed_backward(engine, loss: torch.Tensor, sync: bool, sharded=None) -> None:
    """Backward through the DeepSpeed engine and, at the end of an accumulation, its optimizer step.

    accelerate's backward takes the accumulation boundary from its own GradientState, which this
    loop's manual accumulation does not drive, and would step every micro-batch; the boundary is
    set here from the loop's counter instead. The loss is already divided by grad_accum as for DDP,
    hence scale_wrt_gas=False; the engine averages gradients over ranks as DDP does, clips them to
    gradient_clipping (= optim.clip_grad) and steps at the boundary (lr: the loop's scheduler, which
    sets the same param-group dicts). The sharded target's submodules are called directly, never
    its top-level forward whose hook ends ZeRO-3's fetch trace, so this pass is ended here."""
    engine.set_gradient_accumulation_boundary(sync)
    engine.backward(loss, scale_wrt_gas=False)
    if sync:
        engine.step()
    if sharded is not None:
        sharded.optimizer.get_param_coordinator().reset_step()
