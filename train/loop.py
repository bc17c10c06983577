"""The training loop every drafter family shares, on Accelerate.

Read top to bottom: set up (target, data, drafter, optimizer), optionally resume, then one flat
loop of micro-steps. The data order is a pure function of (seed, epoch) and each *global*
micro-batch is cut into equal per-rank slices, so 1 process and N processes see the same global
batches and (with losses normalised by the global token count) reach the same weights: under DDP
and under DeepSpeed ZeRO-2/3 alike (the DeepSpeed and FSDP specifics are in train/distributed.py).
"""

from __future__ import annotations

import json
import math
import resource
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType, set_seed
from torch.optim.lr_scheduler import LambdaLR
from tqdm import tqdm
from transformers import (
    get_constant_schedule_with_warmup,
    get_cosine_schedule_with_warmup,
    get_linear_schedule_with_warmup,
)

from draftsmith import DraftsmithError
from draftsmith.data.features import FeatureCache
from draftsmith.data.packing import collate_rows, epoch_rows
from draftsmith.data.pipeline import training_data
from draftsmith.data.sharding import Shard

# Imported with the loop, not at the eval stage: the eval runs the code the training run started with.
from draftsmith.eval.report import format_table, require_rule_exact, write_before_after
from draftsmith.eval.run import evaluate_drafter
from draftsmith.models.family import Family
from draftsmith.models.readers import init_weights, read_config
from draftsmith.models.registry import drafter_family, load_drafter, target_to_load_on
from draftsmith.target.features import target_features
from draftsmith.target.load import fingerprint, load_target
from draftsmith.train import checkpoint
from draftsmith.train.config import Config, drafter_config, resolve_precision
from draftsmith.train.distributed import (
    autocast,
    deepspeed_backward,
    deepspeed_line,
    fill_deepspeed_config,
    fits_whole,
    fsdp_shard_target,
    make_accelerator,
    shard_target,
    whole_weights,
)
from draftsmith.train.optimizer import build_optimizer, check_sharding
from draftsmith.util.parse import save_yaml, to_dict
from draftsmith.util.precision import describe, hardware

SCHEDULES: dict[str, Callable[..., LambdaLR]] = {
    "cosine": get_cosine_schedule_with_warmup,
    "linear": get_linear_schedule_with_warmup,
    "constant": get_constant_schedule_with_warmup,
}


def global_batches(ds, cfg: Config, world: int, epoch: int) -> list[list[list[int]]]:
    """The global micro-batches of `epoch`: batch_size x world rows each, a row the examples it holds
    (one, padded; several, packed: data/packing.py). Those that cannot fill every rank are dropped
    (equal work on all ranks)."""
    g = cfg.optim.batch_size * world
    return [b for b in epoch_rows(ds["length"], cfg.data, g, cfg.optim.seed, epoch) if len(b) == g]


def micro_batches(ds, cfg: Config, world: int, rank: int, epoch: int, start: int, pad_id: int):
    """Yield (position, collated batch) for this rank from global micro-batch `start` of `epoch` on."""
    batches = global_batches(ds, cfg, world, epoch)
    for pos in range(start, len(batches)):
        mine = batches[pos][rank * cfg.optim.batch_size : (rank + 1) * cfg.optim.batch_size]
        yield pos, collate_rows(ds, mine, pad_id, cfg.data.packing)


def make_scheduler(cfg: Config, optimizer, total_steps: int) -> LambdaLR:
    """The recipe's schedule (warmup, then cosine/linear/constant) for every param group. A group
    with `start_step` s (Medusa-2's backbone after a heads-only stage) keeps lr 0 for s steps, then
    runs the whole schedule, warmup included, over the steps that remain."""

    def shape(steps: int):  # transformers' schedules are LambdaLRs: borrow the multiplier function
        probe = torch.optim.SGD([torch.zeros(1)], lr=1.0)
        kwargs = {} if cfg.optim.schedule == "constant" else {"num_training_steps": max(1, steps)}
        return SCHEDULES[cfg.optim.schedule](probe, num_warmup_steps=cfg.optim.warmup_steps, **kwargs).lr_lambdas[0]

    def delayed(start: int):
        fn = shape(total_steps - start)
        return lambda step: 0.0 if step < start else fn(step - start)

    return LambdaLR(optimizer, [delayed(g.get("start_step", 0)) for g in optimizer.param_groups])


@dataclass
class Run:
    """What the parts of one training run share, filled in the order train() calls them."""

    cfg: Config
    accelerator: Accelerator
    family: Family  # the drafter family's record (models/registry.py)
    dcfg: Any  # its config
    zero: int  # 0 = DDP (or one process), else DeepSpeed's ZeRO stage
    fsdp: bool
    phases: dict = field(default_factory=dict)  # wall seconds per phase, printed and saved at the end
    target: Any = None
    tok: Any = None
    fp: str = ""  # the target's fingerprint
    ds: Any = None
    features: Callable[[dict], dict] = lambda batch: {}  # batch -> the target tensors the family trains on
    drafter: Any = None
    init_state: dict | None = None  # the init_from weights, kept to evaluate them "before"
    optimizer: Any = None
    scheduler: Any = None
    sharded: Any = None  # ZeRO-3's engine of the target, if any
    total: int = 0  # optimizer steps of the run
    step: int = 0
    epoch: int = 0
    pos: int = 0  # global micro-batch of the epoch to continue from
    train_seconds: float = 0.0  # the loop's wall time (final/config.json)

    @property
    def world(self) -> int:
        return self.accelerator.num_processes

    @property
    def rank(self) -> int:
        return self.accelerator.process_index

    def state(self) -> dict:
        """Where a checkpoint resumes: the loop's position, and what it was trained with."""
        return {
            "step": self.step,
            "epoch": self.epoch,
            "position": self.pos + 1,
            "target_fingerprint": self.fp,
            "processes": self.world,
            "zero_stage": self.zero,
        }


def train(cfg: Config) -> Path:
    run = start(cfg)
    with phase(run, "data (load target, regenerate, features)"):
        load_target_and_data(run)
    with phase(run, "train"):
        build_drafter_and_optimizer(run)
        distribute(run)
        resume(run)
        train_steps(run)
        final = save(run)
    if not run.accelerator.is_main_process:
        # The eval stage runs on rank 0 alone: the other ranks leave now instead of waiting in a
        # barrier for as long as it takes (which a process-group timeout would fail).
        run.accelerator.end_training()
        return run.cfg.run_dir
    if run.cfg.eval.enabled:
        with phase(run, "eval"):
            eval_stage(
                run.cfg, run.accelerator, run.family, run.dcfg, run.drafter, run.target, run.tok, final, run.init_state
            )
    (run.cfg.run_dir / "timings.json").write_text(json.dumps({k: round(v, 1) for k, v in run.phases.items()}, indent=1))
    run.accelerator.print("wall time: " + " | ".join(f"{k} {v / 60:.1f} min" for k, v in run.phases.items()))
    run.accelerator.end_training()  # also tears down the process group, so it comes last
    return run.cfg.run_dir


@contextmanager
def phase(run: Run, name: str):
    t0 = time.perf_counter()
    yield
    run.phases[name] = time.perf_counter() - t0


def start(cfg: Config) -> Run:
    """The Accelerator for this launch, the precisions resolved on its device, per-rank seeds, and
    the run folder with the resolved config."""
    # accelerate keeps its state in a process-wide singleton; a second train() in one process
    # (tests, notebooks) with another precision must start from a clean one.
    AcceleratorState._reset_state()
    # `auto` precisions become what this hardware runs natively (bf16 only where it is native).
    cfg = resolve_precision(cfg)
    accelerator = make_accelerator(cfg)
    run = Run(
        cfg,
        accelerator,
        drafter_family(cfg.drafter["type"]),
        drafter_config(cfg),
        zero=checkpoint.zero_stage(accelerator),
        fsdp=accelerator.distributed_type == DistributedType.FSDP,
    )
    accelerator.print(
        f"precision: train {cfg.optim.mixed_precision}, target {cfg.target_dtype}, eval {cfg.eval.dtype} "
        f"on {describe(hardware(accelerator.device))}{deepspeed_line(accelerator, run.zero)}"
    )
    check_sharding(cfg.optim, sharded=bool(run.zero or run.fsdp))  # before the data phase, not after
    set_seed(cfg.optim.seed + run.rank)  # per-rank noise streams; data order is seeded separately
    if accelerator.is_main_process:
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        save_yaml(to_dict(cfg), cfg.run_dir / "resolved_config.yaml")
    return run


def load_target_and_data(run: Run) -> None:
    """The frozen target on every rank, then the training set and its features (online or cached)."""
    cfg, accelerator, family = run.cfg, run.accelerator, run.family
    # Every rank loads the target (a file lock guards the embedded target's one-time dequantization).
    # Under ZeRO-3 and FSDP it is loaded whole into CPU RAM and sharded onto the devices after the
    # drafter is prepared: a 70B target does not fit one GPU. It runs on the GPU until then
    # (regeneration, the feature cache) when it fits there.
    sharded_target = run.zero == 3 or run.fsdp
    with whole_weights(accelerator):
        target, tok = load_target(
            cfg.target, cfg.target_dtype, cfg.cache_dir, "cpu" if sharded_target else accelerator.device
        )
    if sharded_target and fits_whole(target, accelerator.device):
        target.to(accelerator.device)
    run.target, run.tok, run.fp = target, tok, fingerprint(target)
    # The exact config this run builds, trains and saves: the target's defaults made explicit, and
    # with init_from the fields of the drafter it starts from (an EAGLE-3 head's aux layers).
    run.dcfg = family.resolve(run.dcfg, target.config, read_config(cfg.init_from) if cfg.init_from else None)
    # The target tensors this family trains on; none for families that compute them with gradients
    # from a backbone they train (Medusa-2).
    names = family.feature_names(run.dcfg, target.config)
    # Regeneration and feature caching are split over the ranks (data/sharding.py): no rank waits in
    # a collective while another works alone.
    run.ds, cache = training_data(
        cfg.data,
        target,
        tok,
        run.fp,
        names,
        Shard(run.rank, run.world, accelerator.wait_for_everyone),
        target_name=cfg.target,
        target_dtype=cfg.target_dtype,
        cache_dir=cfg.cache_dir,
        run_dir=cfg.run_dir,
        eval_sampling=(cfg.eval.temperature, cfg.eval.top_p),
    )
    if cache:
        # A sharded target's lm_head is gathered by all ranks together: no per-example derivation there.
        run.features = FeatureCache(cache, names, run.fp, None if sharded_target else target)
    else:
        run.features = (lambda batch: target_features(target, batch, names)) if names else (lambda batch: {})


def build_drafter_and_optimizer(run: Run) -> None:
    """The family's drafter (from `init_from` when fine-tuning), the optimizer over its param groups, and the
    schedule over the run's optimizer steps."""
    cfg, accelerator, family = run.cfg, run.accelerator, run.family
    # A family that trains the target (Medusa-2) wraps it here: adapters injected, or a trainable copy.
    # The same initial drafter on every rank: DDP and DeepSpeed broadcast rank 0's, but FSDP2 keeps
    # each rank's own slice of what it built. Then back to per-rank streams (feature noise).
    set_seed(cfg.optim.seed)
    with whole_weights(accelerator):
        run.drafter = family.build(run.dcfg, run.target, run.ds).to(accelerator.device)
        if cfg.init_from:  # domain fine-tuning: start from a trained drafter; kept to evaluate it "before"
            init_weights(run.drafter, family.NAME, cfg.init_from, run.target, allow_stale=cfg.init_from_stale)
            run.init_state = {k: v.detach().clone() for k, v in run.drafter.state_dict().items()}
            accelerator.print(f"initialised from {cfg.init_from}")
    set_seed(cfg.optim.seed + run.rank)
    groups = family.param_groups(run.drafter, run.dcfg, cfg.optim.lr)  # e.g. heads and backbone at their own lrs
    run.optimizer = build_optimizer(run.drafter, groups, cfg.optim)
    # Packed, a batch's row count is fixed and its example count is not: count epoch 0's batches.
    per_epoch = len(global_batches(run.ds, cfg, run.world, 0)) // cfg.optim.grad_accum
    if per_epoch == 0 and not cfg.optim.max_steps:
        rows = " packed rows" if cfg.data.packing else ""
        raise DraftsmithError(
            f"{cfg.data.train}: {len(run.ds)} examples cannot fill one optimizer step "
            f"(global batch {cfg.optim.batch_size * run.world * cfg.optim.grad_accum}{rows})"
        )
    run.total = cfg.optim.max_steps or max(1, math.ceil(cfg.optim.epochs * per_epoch))
    # The scheduler is stepped by hand once per optimizer step (accelerate's prepared scheduler
    # would step once per process); registering it (distribute) puts its state in every checkpoint.
    run.scheduler = make_scheduler(cfg, run.optimizer, run.total)


def distribute(run: Run) -> None:
    """accelerate.prepare (DDP, DeepSpeed or FSDP) for the drafter and optimizer, and the frozen
    target sharded the same way under ZeRO-3 and FSDP (train/distributed.py)."""
    accelerator, target = run.accelerator, run.target
    if run.zero:
        fill_deepspeed_config(accelerator, run.cfg, target.config.get_text_config().hidden_size)
    # Medusa-2's LoRA backbone and a Medusa head sharing lm_head hold target weights: the drafter's
    # engine shards those with the drafter, and the rest of the target stays whole.
    shares_target = bool({id(p) for p in run.drafter.parameters()} & {id(p) for p in target.parameters()})
    run.drafter, run.optimizer = accelerator.prepare(run.drafter, run.optimizer)
    accelerator.register_for_checkpointing(run.scheduler)
    run.sharded = shard_target(accelerator, target, shares_target) if run.zero == 3 else None
    if run.fsdp:
        fsdp_shard_target(accelerator, target, shares_target)


def resume(run: Run) -> None:
    """Continue from a checkpoint (`resume`), start the trackers, and say what trains."""
    cfg, accelerator = run.cfg, run.accelerator
    resume_from = checkpoint.find_resume(cfg.run_dir, cfg.resume)
    if resume_from:
        state = checkpoint.load(accelerator, resume_from)
        run.step, run.epoch, run.pos = state["step"], state["epoch"], state["position"]
        accelerator.print(f"resumed from {resume_from} at step {run.step}")
    if cfg.tracker != "none":
        accelerator.init_trackers(cfg.run, config=_flat(to_dict(cfg)))
    n_params = sum(p.numel() for p in run.drafter.parameters() if p.requires_grad)
    accelerator.print(
        f"drafter {run.family.NAME}: {n_params / 1e6:.2f}M trainable params | {len(run.ds)} examples | "
        f"{run.total} steps | {run.world} process(es) | target fingerprint {run.fp}"
    )
    groups = run.optimizer.param_groups
    if len(groups) > 1:
        accelerator.print(
            "param groups: "
            + ", ".join(
                f"{g['name']} lr {g['initial_lr']:g}" + (f" from step {g['start_step']}" if g.get("start_step") else "")
                for g in groups
            )
        )


def train_steps(run: Run) -> None:
    """The loop: micro-batches of this rank's slice, the loss normalised by the global token count,
    an optimizer step every grad_accum micro-batches, logs and checkpoints."""
    cfg, accelerator, family, drafter, optimizer, scheduler = (
        run.cfg,
        run.accelerator,
        run.family,
        run.drafter,
        run.optimizer,
        run.scheduler,
    )
    world, zero, total = run.world, run.zero, run.total
    # Families get the drafter itself and call the wrapper (DDP, DeepSpeed; FSDP2 wraps in place) as
    # their forward: the wrapper's forward is what syncs gradients and gathers ZeRO-3 shards.
    core = accelerator.unwrap_model(drafter)
    bar = tqdm(total=total, initial=run.step, disable=not accelerator.is_local_main_process, desc="train")
    sums: dict[str, float] = {}
    t0, micro, t_start = time.perf_counter(), 0, time.perf_counter()
    last_good = checkpoint.list_steps(cfg.run_dir)[-1:] if accelerator.is_main_process else []
    while run.step < total:
        for run.pos, cpu_batch in micro_batches(run.ds, cfg, world, run.rank, run.epoch, run.pos, run.tok.pad_token_id):
            batch = {k: v.to(accelerator.device) for k, v in cpu_batch.items()}
            sync = (micro + 1) % cfg.optim.grad_accum == 0
            with autocast(accelerator, cfg, zero), accelerator.no_sync(drafter) if not sync else nullcontext():
                loss_sum, n_tok, metrics = family.compute_loss(
                    core, run.target, batch, run.features(batch), run.dcfg, step=run.step, forward=drafter
                )
                # Normalise by the global token count of this micro-batch (all ranks): DDP averages
                # gradients over ranks, so multiply back by world size.
                n_global = accelerator.reduce(n_tok.float().detach(), "sum").clamp(min=1)
                loss = loss_sum * world / n_global / cfg.optim.grad_accum
                # Checked across ranks, so every rank stops together instead of hanging in all-reduce.
                if accelerator.reduce((~torch.isfinite(loss.detach())).float(), "sum") > 0:
                    where = f"; last good checkpoint: {last_good[-1]}" if last_good else ""
                    raise DraftsmithError(f"step {run.step}: loss is {loss.item()} (nan/inf), training stopped{where}")
                if zero:  # the engine accumulates, clips and steps (see deepspeed_backward)
                    deepspeed_backward(drafter, loss, sync, run.sharded)
                else:
                    accelerator.backward(loss)
            for k, v in {"loss": loss_sum.detach(), "tokens": n_tok.float(), **metrics}.items():
                sums[k] = sums.get(k, 0.0) + accelerator.reduce(v.float(), "sum").item()
            micro += 1
            if not sync:
                continue
            # Under DeepSpeed these three are no-ops: the engine clipped and stepped in deepspeed_backward.
            if cfg.optim.clip_grad > 0:
                accelerator.clip_grad_norm_(drafter.parameters(), cfg.optim.clip_grad)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            run.step += 1
            bar.update(1)
            if run.step % cfg.log_every == 0 or run.step == total:
                log = _summarise(sums, time.perf_counter() - t0, scheduler.get_last_lr()[0])
                bar.set_postfix({k: f"{v:.3g}" for k, v in log.items() if k != "lr"})
                accelerator.log(log, step=run.step)
                if accelerator.is_main_process:
                    with open(cfg.run_dir / "train_log.jsonl", "a") as f:
                        f.write(json.dumps({"step": run.step, **log}) + "\n")
                sums, t0 = {}, time.perf_counter()
            if cfg.save_every and run.step % cfg.save_every == 0 and run.step < total:
                last_good = [checkpoint.save(accelerator, cfg.run_dir, run.step, run.state(), cfg.keep_last)]
            if run.step >= total:
                break
        else:  # epoch exhausted
            run.epoch, run.pos = run.epoch + 1, 0
            continue
        break
    bar.close()
    run.train_seconds = time.perf_counter() - t_start


def save(run: Run) -> Path:
    """The last resumable checkpoint, then `final/`: the drafter alone with what it was trained for."""
    cfg, accelerator = run.cfg, run.accelerator
    checkpoint.save(accelerator, cfg.run_dir, run.step, run.state(), cfg.keep_last)
    final = cfg.run_dir / "final"
    # The family's config with every default resolved (build may fill some in from the target).
    meta = {
        "drafter": run.family.NAME,
        "drafter_config": {"type": run.family.NAME, **asdict(run.dcfg)},
        "target": cfg.target,
        "target_fingerprint": run.fp,
        "steps": run.step,
        "train_data": cfg.data.train,
        "train_seconds": round(run.train_seconds, 1),
        "processes": run.world,
        # ru_maxrss is in KiB on Linux: this rank's peak, target and data included.
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
    }
    checkpoint.save_final(accelerator, run.drafter, final, meta)  # every rank takes part under DeepSpeed
    accelerator.print(f"saved drafter to {final}")
    return final


def eval_stage(cfg: Config, accelerator, family: Family, dcfg, drafter, target, tok, final: Path, init_state) -> dict:
    """The run's eval on its domain holdout (rank 0 alone), written to RUN/eval/; after a fine-tune
    (`init_state`: the init's weights) also before/after on the domain and the general holdout."""
    zero, fsdp = checkpoint.zero_stage(accelerator), accelerator.distributed_type == DistributedType.FSDP
    with whole_weights(accelerator):
        # Under ZeRO-3 and FSDP this rank holds a shard of the target: load it whole. Under
        # DeepSpeed and FSDP the drafter is sharded (or bf16 copies of fp32 masters): evaluate final/.
        if zero == 3 or fsdp or cfg.eval.dtype != cfg.target_dtype:  # e.g. trained on bf16 features, evaluated in fp32
            target, _ = load_target(cfg.target, cfg.eval.dtype, cfg.cache_dir, accelerator.device)
        drafter = (
            load_drafter(final, target_to_load_on(target, final))[2]
            if zero or fsdp
            else accelerator.unwrap_model(drafter)
        )
    drafter = drafter.to(next(target.parameters()).dtype).eval()
    # The eval stage's settings are the recipe's `eval:` section (eval/config.py EvalConfig).
    options = dict(target_name=cfg.target, split=cfg.data.holdout_split or cfg.data.split)
    report = evaluate_drafter(
        family, drafter, dcfg, target, tok, cfg.data.holdout, cfg.run_dir / "eval", cfg.eval, **options
    )
    accelerator.print(format_table([report]))
    if init_state is not None:  # fine-tuned: the init's τ and ours, on the domain and the general holdout
        holdouts = [cfg.data.holdout] + [h for h in [cfg.eval.general_holdout] if h and h != cfg.data.holdout]
        rows = [("after", report)] + [
            ("after", evaluate_drafter(family, drafter, dcfg, target, tok, h, None, cfg.eval, **options))
            for h in holdouts[1:]
        ]
        drafter.load_state_dict(init_state)
        rows += [
            ("before", evaluate_drafter(family, drafter, dcfg, target, tok, h, None, cfg.eval, **options))
            for h in holdouts
        ]
        accelerator.print(write_before_after(rows, cfg.run_dir / "eval"))
    require_rule_exact(report, str(cfg.run_dir / "eval"))  # after everything is written: the evidence stays
    return report


def _summarise(sums: dict, seconds: float, lr: float) -> dict:
    n = max(sums.get("tokens", 0.0), 1.0)
    out = {
        "loss": sums["loss"] / n,
        "acc": sums.get("acc", 0.0) / n,
        "lr": lr,
        "tok_per_s": sums.get("tokens", 0.0) / max(seconds, 1e-9),
    }
    out.update({k: v / n for k, v in sums.items() if k not in ("loss", "tokens")})  # per-token means
    return out


def _flat(d: dict, prefix: str = "") -> dict:
    """Nested config -> {"optim.lr": 1e-3, ...} with scalar values, as trackers' hparams want."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return out
