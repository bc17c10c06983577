"""`draftsmith plan RECIPE --gpus N`: per-rank memory of a recipe under each launch preset, from the
target's and the drafter's configs alone (both are built on the meta device: no weights loaded).

Assumptions, stated once: the target is held in its training dtype (bf16 on GPUs that run it; the
recipe's `target_dtype` when explicit); it is a full copy on every rank except under ZeRO-3 and FSDP,
which shard it (and ZeRO-3-offload, which moves it to CPU RAM; see PRESETS). Trainable
weights are fp32 with autocast (accelerate), AdamW keeps two fp32 moments, gradients are fp32.
Activations are what is live at the step's peak for a micro-batch of full-length rows: each decoder
layer keeps e*(10 H + 4 I) bytes per token for backward (e = 2 under bf16 autocast, 4 in fp32;
flash/SDPA attention), plus the fp32 [tokens, vocabulary] buffers each family's loss holds, counted
in its compute_loss, plus the target features it reads. benchmarks/memory.py checks all of it
against the allocations torch's profiler records in a real training step on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM

from draftsmith import DraftsmithError
from draftsmith.models.known import model_config
from draftsmith.models.registry import drafter_family
from draftsmith.target.features import feature_width
from draftsmith.train.config import Config, drafter_config
from draftsmith.util import precision

# Which of (target weights, drafter weights, gradients, optimizer state) each preset shards over the
# ranks, and which it moves to CPU RAM. ZeRO-3 shards the frozen target too (train/distributed.py
# `shard_target`, an optimizer-less DeepSpeed engine), and so does FSDP (`fsdp_shard_target`, FSDP2).
PRESETS: dict[str, dict[str, tuple[str, ...]]] = {
    "single-gpu": {"shard": (), "offload": ()},
    "multi-gpu": {"shard": (), "offload": ()},
    "multi-node": {"shard": (), "offload": ()},
    "zero2": {"shard": ("grads", "optimizer"), "offload": ()},
    "zero3": {"shard": ("target", "weights", "grads", "optimizer"), "offload": ()},
    "zero3-offload": {
        "shard": ("target", "weights", "grads", "optimizer"),
        "offload": ("target", "weights", "optimizer"),
    },
    "fsdp": {"shard": ("target", "weights", "grads", "optimizer"), "offload": ()},
}
GiB = 2**30


def target_bytes(cfg: Config) -> int:
    """Bytes per target parameter: 4 when the recipe pins fp32, else 2 (bf16 on GPUs that run it)."""
    return 4 if precision.canonical(cfg.target_dtype, "target_dtype") == "float32" else 2


def target_config(name: str, cache_dir: str = ""):
    return model_config(name, cache_dir, "target")


@dataclass
class Sizes:
    target_params: int
    drafter_params: int  # the drafter's own (not the target's, which a LoRA backbone shares)
    trainable_params: int
    activation_bytes: int
    feature_bytes_per_token: int


def sizes(cfg: Config, tc) -> Sizes:
    family = drafter_family(cfg.drafter["type"])
    dcfg = family.resolve(drafter_config(cfg), tc)  # the target's defaults, as a run resolves them
    with torch.device("meta"):
        target = AutoModelForCausalLM.from_config(tc).requires_grad_(False)
        drafter = family.build(dcfg, target)  # on the meta device: from configs alone
    target_ids = {id(p) for p in target.parameters()}
    own = [p for p in drafter.parameters() if id(p) not in target_ids]
    trainable = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    b_t = target_bytes(cfg)
    B, T = cfg.optim.batch_size, cfg.data.max_length
    n = B * T  # tokens per micro-batch per rank, every row full length
    # Activations in the autocast dtype (`auto` is bf16 on the GPUs this plans for); every loss casts
    # its logits to fp32.
    e = 4 if precision.canonical(cfg.optim.mixed_precision, "optim.mixed_precision") == "float32" else 2
    names = family.feature_names(dcfg, tc)
    feat_dims = sum(feature_width(x, tc.hidden_size) for x in names)
    # What is live at the step's peak: the [n, vocab] fp32 buffers of the family's loss (counted in its
    # compute_loss; benchmarks/memory.py measures them) plus the activations of the layers it trains.
    act = family.activation_bytes(dcfg, tc, drafter, B, T, e)
    act += n * b_t * feat_dims  # the target's features the family reads (online or from the cache)
    return Sizes(
        sum(p.numel() for p in target.parameters()), sum(p.numel() for p in own), trainable, act, feat_dims * b_t
    )


def per_rank(s: Sizes, preset: str, world: int, b_target: int) -> dict[str, float]:
    """Bytes per rank (GPU) for one preset."""
    p = PRESETS[preset]

    def part(name: str, total: float) -> float:
        if name in p["offload"]:
            return 0.0
        return total / world if name in p["shard"] else total

    out = {
        "target weights": part("target", s.target_params * b_target),
        "drafter weights": part("weights", s.drafter_params * 4),
        "gradients": part("grads", s.trainable_params * 4),
        "optimizer": part("optimizer", s.trainable_params * 8),
        "activations": s.activation_bytes,
    }
    out["total"] = sum(out.values())
    return out


def plan(cfg: Config, gpus: int, nodes: int = 1, preset: str | None = None, gpu_memory_gib: float = 80.0) -> str:
    if preset is not None and preset not in PRESETS:
        raise DraftsmithError(f"--preset {preset}: unknown (valid: {', '.join(PRESETS)})")
    tc = target_config(cfg.target, cfg.cache_dir)
    s = sizes(cfg, tc)
    world, b_t = gpus * nodes, target_bytes(cfg)
    tokens = (cfg.data.max_examples or 0) * cfg.data.max_length
    lines = [
        f"{cfg.drafter['type']} drafter for {cfg.target}: target {s.target_params / 1e9:.2f}B params, drafter "
        f"{s.drafter_params / 1e6:.1f}M own / {s.trainable_params / 1e6:.1f}M trainable; {world} rank(s); "
        f"micro-batch {cfg.optim.batch_size} x {cfg.data.max_length} tokens",
        f"offline feature cache: {s.feature_bytes_per_token} bytes/token"
        + (
            f" x {tokens:,} tokens (max_examples x max_length) = {s.feature_bytes_per_token * tokens / GiB:.1f} GiB"
            if tokens
            else f" = {s.feature_bytes_per_token * 1e9 / GiB:.0f} GiB per billion tokens"
        ),
        "",
        "| preset (GiB per rank) | target | drafter | grads | optimizer | activations | total | fits "
        f"{gpu_memory_gib:g} GiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in [preset] if preset else PRESETS:
        r = per_rank(s, name, world if name not in ("single-gpu",) else 1, b_t)
        fits = "yes" if r["total"] <= gpu_memory_gib * GiB else "no"
        lines.append(
            f"| {name} | "
            + " | ".join(
                f"{r[k] / GiB:.2f}"
                for k in ("target weights", "drafter weights", "gradients", "optimizer", "activations", "total")
            )
            + f" | {fits} |"
        )
    return "\n".join(lines)
