"""Where a training step's time goes, per drafter family and precision.

    python -m benchmarks.train_throughput [--target smollm2-135m] [--families eagle3,dflash,...]
        [--dtypes bfloat16,float32] [--steps 4] [--examples 64] [--features online|cache] [--packing]
        [--set key=value ...] [--out throughput.json]

For each family, its CPU recipe (the first `recipes/cpu/*.yaml` whose `drafter.type` it is; on a
target folder other than the embedded one, the family's tiny sizes from its record instead) trains
`--steps` micro-batches after one warm-up, exactly as `train/loop.py` steps them (the recipe's batch
size, length-grouped padded batches of the recipe's data read without regeneration, or with
`--packing` rows of `data.max_length` tokens packed with whole examples (data/packing.py), bf16 autocast around
the forward where the precision is bf16, AdamW over the family's parameter groups). Each step is
timed in parts, each with its own clock:

- `features`: the frozen target's forward that computes the features the family trains on, or with
  `--features cache` reading them from an offline feature cache built (untimed) before, as recipes
  with `data.offline_features: auto` train after their first pass (derived features such as
  `argmax` are taken in an untimed pass over the batches first: a later epoch's step);
- `drafter`: the family's forward (`compute_loss`) less the two parts below;
- `logits`: the output heads (the target's lm_head, a drafter's own `lm_head`/`lm_heads`), forward
  and backward, timed by module hooks;
- `loss`: the loss functions of `draftsmith/util/losses.py`, forward (their backward is in `backward`);
- `backward`: the rest of the backward pass;
- `optimizer`: clipping, AdamW's step and zeroing the gradients;
- `padding`: the share of the batch's positions that are padding (every part above computes them).

tokens/s counts real (unpadded) tokens per second of the whole step, `trained/s` the tokens that
carry loss. Printed as a table and written as JSON (`--out`), with the CPU named. Nothing else may run
beside it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch
import yaml

from draftsmith.data.batching import build_dataset
from draftsmith.data.features import FeatureCache, write_cache
from draftsmith.data.packing import collate_rows, epoch_rows
from draftsmith.models.registry import DRAFTERS
from draftsmith.target.features import DERIVED, target_features
from draftsmith.target.load import fingerprint, load_target
from draftsmith.train.config import drafter_config, load_config
from draftsmith.util import losses, precision

ROOT = Path(__file__).resolve().parents[1]
SHORT = {"bfloat16": "bf16", "float32": "fp32"}
PARTS = ("features", "drafter", "logits", "loss", "backward", "optimizer")


def recipe_of(family: str) -> Path:
    """The first CPU recipe (by name) that trains `family`."""
    for path in sorted((ROOT / "recipes" / "cpu").glob("*.yaml")):
        if yaml.safe_load(path.read_text())["drafter"]["type"] == family:
            return path
    raise SystemExit(f"train_throughput: no recipes/cpu/*.yaml trains {family}")


class Clock:
    """Seconds per part, accumulated over the timed steps."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.on = False
        self.in_step = False  # inside the family's forward or backward: head time counts as `logits` there only

    @contextmanager
    def part(self, name: str):
        start = time.perf_counter()
        yield
        if self.on:
            self.seconds[name] += time.perf_counter() - start


def time_heads(modules: list[torch.nn.Module], clock: Clock) -> list:
    """Forward and backward hooks that add each head's own time to `logits`; -> their handles."""
    handles: list = []
    started: dict = {}  # (head, fwd|bwd) -> when its current call began

    def pre(key):
        return lambda *_: started.__setitem__(key, time.perf_counter())

    def post(key):
        def hook(*_):
            if clock.on and clock.in_step and key in started:
                clock.seconds["logits" if key[1] == "fwd" else "logits_bwd"] += time.perf_counter() - started.pop(key)

        return hook

    for m in modules:
        handles += [m.register_forward_pre_hook(pre((id(m), "fwd"))), m.register_forward_hook(post((id(m), "fwd")))]
        handles += [
            m.register_full_backward_pre_hook(pre((id(m), "bwd"))),
            m.register_full_backward_hook(post((id(m), "bwd"))),
        ]
    return handles


@contextmanager
def timed_losses(clock: Clock):
    """Every function of draftsmith/util/losses.py timed as `loss`, wherever a family module holds it
    (its own imported name, or an entry of a table such as TOKEN_LOSSES)."""
    originals = {name: fn for name, fn in vars(losses).items() if callable(fn) and fn.__module__ == losses.__name__}

    depth = [0]  # a loss calling another (jensen_shannon -> _log_probs) is timed once, outermost

    def timed(fn):
        def wrapper(*args, **kwargs):
            depth[0] += 1
            try:
                if depth[0] > 1:
                    return fn(*args, **kwargs)
                with clock.part("loss"):
                    return fn(*args, **kwargs)
            finally:
                depth[0] -= 1

        return wrapper

    wrapped = {fn: timed(fn) for fn in originals.values()}
    modules = {sys.modules[f.build.__module__] for f in DRAFTERS.values()} | {losses}
    swapped = []  # (namespace, key, original) to put back
    for ns in [vars(m) for m in modules] + [t for t in vars(losses).values() if isinstance(t, dict)]:
        for key, value in list(ns.items()):
            if callable(value) and value in wrapped:
                swapped.append((ns, key, value))
                ns[key] = wrapped[value]
    try:
        yield
    finally:
        for ns, key, value in swapped:
            ns[key] = value


def heads_of(drafter: torch.nn.Module, target) -> list[torch.nn.Module]:
    """The modules that map hidden states to vocabulary logits: the target's lm_head and the drafter's own."""
    own = [m for n, m in drafter.named_modules() if n.split(".")[-1] in ("lm_head", "lm_heads")]
    heads = [target.get_output_embeddings(), *own]
    return list({id(m): m for m in heads}.values())  # one shared head is timed once


def measure(
    family_name: str, cfg, target, tok, dtype: str, steps: int, examples: int, cached: bool = False, derived=True
) -> dict:
    """One family in one precision: `steps` timed micro-batches after one warm-up -> the row.
    `derived=False` withholds derived features (`argmax`): the family computes what it needs from the
    target's full logits at every step, as before they existed (the ablation of --no-derived)."""
    family = DRAFTERS[family_name]
    dcfg = family.resolve(drafter_config(cfg), target.config)
    ds = build_dataset(cfg.data.train, tok, cfg.data.max_length, examples, split=cfg.data.split)
    batches = epoch_rows(ds["length"], cfg.data, cfg.optim.batch_size, cfg.optim.seed, 0)
    batches = [b for b in batches if len(b) == cfg.optim.batch_size][: steps + 1]
    packed = cfg.data.packing
    if len(batches) < steps + 1:
        raise SystemExit(f"train_throughput: {len(ds)} examples give fewer than {steps + 1} batches; raise --examples")
    torch.manual_seed(cfg.optim.seed)
    drafter = family.build(dcfg, target, ds).train()
    groups = family.param_groups(drafter, dcfg, cfg.optim.lr)
    optimizer = torch.optim.AdamW(groups, lr=cfg.optim.lr, betas=cfg.optim.betas)
    names = family.feature_names(dcfg, target.config)
    features = (lambda batch: target_features(target, batch, names)) if names else (lambda batch: {})
    if cached and names:  # an offline cache, as `data.offline_features: auto` builds one
        folder = Path(tempfile.mkdtemp(prefix="throughput-"))
        fp = fingerprint(target)
        features = FeatureCache(write_cache(target, ds, names, folder / "f", fp, tok.pad_token_id), names, fp, target)
        for rows in batches:  # an epoch before: what a cache derives once per example is there
            features(collate_rows(ds, rows, tok.pad_token_id, packed))
    if not derived:
        given = features
        features = lambda batch: {k: v for k, v in given(batch).items() if k not in DERIVED}  # noqa: E731
    bf16 = dtype == "bfloat16"
    clock, real, trained, positions, step_s = Clock(), 0, 0, 0, 0.0
    handles = time_heads(heads_of(drafter, target), clock)
    with timed_losses(clock):
        for i, rows in enumerate(batches):
            clock.on = i > 0  # the first step warms up: allocations, oneDNN's kernel choice
            batch = collate_rows(ds, rows, tok.pad_token_id, packed)
            start = time.perf_counter()
            with clock.part("features"), torch.no_grad():
                feats = features(batch)
            clock.in_step = True  # (a derived feature's lm_head pass above is the features' time)
            with clock.part("forward"), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss_sum, n_tok, _ = family.compute_loss(drafter, target, batch, feats, dcfg, step=i)
            with clock.part("backward_all"):
                (loss_sum / n_tok.clamp(min=1)).backward()
            clock.in_step = False
            with clock.part("optimizer"):
                if cfg.optim.clip_grad > 0:
                    torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.optim.clip_grad)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if clock.on:
                step_s += time.perf_counter() - start
                real += int(batch["attention_mask"].sum())
                trained += int(batch["loss_mask"].sum())
                positions += batch["attention_mask"].numel()
    for h in handles:
        h.remove()
    if cached and names:
        shutil.rmtree(folder, ignore_errors=True)
    s = clock.seconds
    parts = {
        "features": s["features"],
        "drafter": s["forward"] - s["logits"] - s["loss"],
        "logits": s["logits"] + s["logits_bwd"],
        "loss": s["loss"],
        "backward": s["backward_all"] - s["logits_bwd"],
        "optimizer": s["optimizer"],
    }
    return {
        "family": family_name,
        "dtype": dtype,
        "features": "cache" if cached and names else "online",
        "derived": derived,
        "steps": steps,
        "batch_size": cfg.optim.batch_size,
        "packing": packed,
        "step_ms": 1000 * step_s / steps,
        "tokens_per_s": real / step_s,
        "trained_tokens_per_s": trained / step_s,
        "share": {k: v / step_s for k, v in parts.items()},
        "padding": 1 - real / positions,
    }


def table(rows: list[dict]) -> str:
    head = "| family | dtype | step ms | tokens/s | trained/s | " + " | ".join(PARTS) + " | padding |"
    lines = [head, "|" + "---|" * (6 + len(PARTS))]
    for r in rows:
        shares = " | ".join(f"{r['share'][p]:.0%}" for p in PARTS)
        lines.append(
            f"| {r['family']} | {SHORT[r['dtype']]} | {r['step_ms']:.0f} | {r['tokens_per_s']:.0f} | "
            f"{r['trained_tokens_per_s']:.0f} | {shares} | {r['padding']:.0%} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--families", default=",".join(DRAFTERS))
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--examples", type=int, default=64)
    p.add_argument("--data", default="", help="training data instead of each recipe's")
    p.add_argument("--features", choices=["online", "cache"], default="online")
    p.add_argument("--no-derived", action="store_true", help="withhold derived features (argmax): the ablation")
    p.add_argument("--packing", action="store_true", help="packed rows of data.max_length (data.packing: true)")
    p.add_argument(
        "--set", nargs="*", default=[], metavar="KEY=VALUE", help="recipe overrides, e.g. data.max_length=96"
    )
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    tiny = Path(args.target).is_dir()  # a target folder (tests): every family at its tiny sizes
    rows = []
    machine = precision.describe(precision.hardware("cpu"))
    for dtype in args.dtypes.split(","):
        target, tok = load_target(args.target, dtype)
        for name in args.families.split(","):
            over = [f"data.train={args.data}"] * bool(args.data) + ["data.packing=true"] * args.packing + args.set
            cfg = load_config(recipe_of(name), over)
            if tiny:
                drafter = {k: v for k, v in cfg.drafter.items() if k == "type"} | DRAFTERS[name].tiny
                cfg = replace(cfg, drafter=drafter)
            cached = args.features == "cache"
            rows.append(measure(name, cfg, target, tok, dtype, args.steps, args.examples, cached, not args.no_derived))
            print(table(rows[-1:]).splitlines()[-1] if len(rows) > 1 else table(rows), flush=True)
    layout = "packed rows" if args.packing else "padded rows"
    print(f"\n{machine}; target {args.target}; features {args.features}; {layout}\n\n{table(rows)}")
    if args.out:
        out = {"machine": machine, "target": args.target, "steps": args.steps, "features": args.features}
        out |= {"packing": args.packing, "rows": rows}
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
