"""The eval stage: run after every training run and standalone as `draftsmith eval`."""

from __future__ import annotations

import copy
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from transformers import DynamicCache

from draftsmith import DraftsmithError
from draftsmith.data.load import encode_prompt, load_prompts, thinking_kwargs
from draftsmith.engine.batched import batch_curve
from draftsmith.engine.cache import crop_cache
from draftsmith.engine.drafts import Draft, TreeSpec, parse_tree
from draftsmith.engine.lookahead import HybridProposer
from draftsmith.engine.proposers import NgramProposer, proposer_modules
from draftsmith.engine.speculative import (
    Sampler,
    Stats,
    speculative_decode,
    target_decode,
    timed,
    verification_forward,
)
from draftsmith.engine.verify import AdaptiveCosts, verification_inputs
from draftsmith.eval.config import EvalConfig
from draftsmith.eval.drafters import Resolved
from draftsmith.eval.report import write_report
from draftsmith.models.family import Family
from draftsmith.target.load import eos_ids
from draftsmith.util.calibration import calibration
from draftsmith.util.kernels import packed_linears
from draftsmith.util.precision import hardware


@torch.no_grad()
def divergence_gap(target, prompt: list[int], ref: list[int], generated: list[int]) -> float:
    """Where two greedy decodings of one prompt first differ, the target's logit gap between the two
    tokens, from one plain forward over the prompt and the common prefix. In fp32 any mismatch is a
    bug; in bf16 the target's logits depend on how many tokens one forward processes (kernel
    blocking), and a gap near bf16 resolution marks a numerical near-tie, not a wrong rule."""
    i = next((i for i, (a, b) in enumerate(zip(ref, generated)) if a != b), min(len(ref), len(generated)) - 1)
    logits = target(torch.tensor([prompt + ref[:i]], device=next(target.parameters()).device)).logits[0, -1].float()
    return abs(float(logits[ref[i]] - logits[generated[i]]))


@dataclass
class Decoded:
    """The raw measurements of one drafter on the holdout prompts (`decode_holdout`), before the
    report (`eval_report`) rounds and names them."""

    name: str  # the drafter's label
    k: int  # draft depth: the chain's k, the tree's depth, 0 target-only
    tree: str | None  # the tree decoded with; None: chains
    num_prompts: int
    stats: Stats  # the speculative run: τ, acceptance, tokens, seconds, rule breaks
    target_seconds: float  # the target-only run, measured here or the shared baseline's
    target_tokens: int
    mismatches: int  # prompts whose speculative output differs from the target-only one
    gaps: list[float]  # greedy: the target's logit gap where each such output first parts
    own: dict  # the proposer's own counters (a cascade's levels, a hybrid's drafts by source)
    adaptive: dict | None  # `adaptive_section`; None: the drafter states no confidences
    batch_curve: list[dict] | None  # `batch_curve`; None: not asked for
    dtype: str  # the verifier's
    device: torch.device
    beside: "Decoded | None" = None  # `decode_holdout(beside=...)`: the second drafter, same baseline
    # eval.timing_runs beyond the first: (target tokens, target seconds, tokens, seconds) of each
    more_runs: list[tuple[int, float, int, float]] = field(default_factory=list)

    @property
    def target_tps(self) -> float:
        """Target-only tokens/s, the speedup's denominator (the adaptive run's too)."""
        return self.target_tokens / self.target_seconds


def evaluate(
    drafter: Resolved,
    tok,
    holdout: str,
    out: Path | None,
    cfg: EvalConfig,
    *,
    target_name: str = "",
    baseline: list[tuple[list[int], float]] | None = None,
    stale: dict | None = None,
    kernels: bool = True,
    batch_sizes: list[int] | None = None,
    split: str = "train",
    adaptive_costs: AdaptiveCosts | None = None,
    beside: Resolved | None = None,
) -> dict:
    """Decode each holdout prompt target-only and speculatively; measure τ, acceptance, speed.
    drafter: what decodes, as eval/drafters.py resolves a spec: its label, its proposer (None:
    target-only, k becomes 0), the model that verifies (the target, or a backbone the drafter trained)
    and its own tree (a spec's `@TREE`), which wins over cfg.tree.
    cfg: the eval stage's settings (eval/config.py): k, num_prompts, max_new_tokens, temperature, top_p,
    tree (draftsmith/engine/drafts.py, instead of a chain of k drafts; k then reports the tree depth).
    baseline: target-only (output, seconds) per prompt from `target_baseline`, measured once and shared
    by several drafters (`draftsmith compare`); by default it is measured here, prompt by prompt.
    kernels: decode on prepacked oneDNN linears in fp32 on CPU (draftsmith/util/kernels.py); False = torch's default.
    batch_sizes: also measure the batch-size curve (draftsmith/engine/batched.py: greedy, chain drafts of k tokens).
    A proposer that `drafts_confidence` (chains) also gets, under the report keys "calibration" and
    "adaptive": the calibration of its confidences on the verified drafts of this run, and the same
    prompts decoded again with adaptive verification beside this full-block run (`adaptive_section`).
    adaptive_costs: that run's cost model; None = measured here (`measure_costs`).
    beside: a second drafter with the same verifier, decoded on each prompt right after `drafter` and
    against the same target-only run (`decode_holdout`); its report is returned under "beside"."""
    decoded = decode_holdout(
        drafter,
        tok,
        holdout,
        cfg,
        baseline=baseline,
        kernels=kernels,
        batch_sizes=batch_sizes,
        split=split,
        adaptive_costs=adaptive_costs,
        beside=beside,
    )
    report = eval_report(decoded, holdout, cfg, target_name=target_name, stale=stale)
    if decoded.beside is not None:
        report["beside"] = eval_report(decoded.beside, holdout, cfg, target_name=target_name, stale=stale)
    if out is not None:
        write_report(report, out)
    return report


def draft_shape(
    drafter: Resolved, cfg: EvalConfig, batch_sizes: list[int] | None
) -> tuple[int, str | None, TreeSpec | None]:
    """-> (k, tree, parsed tree or None) a drafter decodes with, after refusing what it cannot draft.
    k is the chain length, the tree's depth with a tree, 0 target-only."""
    name, proposer = drafter.label, drafter.proposer
    # A spec's own `@k=N` (a chain) or `@TREE` wins over the run's --k / --tree.
    k, tree = (drafter.k, None) if drafter.k else (cfg.k, drafter.tree or cfg.tree)
    spec = parse_tree(tree) if tree else None
    if batch_sizes and (spec is not None or cfg.temperature > 0):
        raise DraftsmithError(
            "--batch-sizes: batched decoding is greedy with chain drafts; drop --tree and --temperature"
        )
    if spec is not None and (proposer is None or not proposer.drafts_trees):
        raise DraftsmithError(f"--tree: drafter '{name}' proposes chains only; drop --tree or use a trained drafter")
    depth = spec.depth if spec is not None else k
    most = proposer.max_depth if proposer is not None else None
    if most is not None and depth > most:  # e.g. Medusa: one head per draft position
        raise DraftsmithError(
            f"{'--tree' if spec else '--k'}: drafts {depth} deep, but drafter '{name}' drafts at "
            f"most {most} tokens per round"
        )
    if proposer is None:
        k = 0
    elif spec is not None:
        k = spec.depth
    return k, tree, spec


@dataclass
class _Run:
    """One drafter's counters over the holdout prompts, as `decode_holdout` decodes them."""

    drafter: Resolved
    k: int  # as `draft_shape` gives them
    tree: str | None
    spec: TreeSpec | None
    stats: Stats = field(init=False)
    mismatches: int = 0
    gaps: list[float] = field(default_factory=list)

    def __post_init__(self):
        self.stats = Stats(k=max(self.k, 1))

    def decode(self, target, prompt: list[int], ref: list[int], max_new_tokens: int, eos: set[int], sampler) -> None:
        """Decode one prompt speculatively, timed; compare it with the target-only output `ref`."""
        generated, seconds = self.timed_decode(target, prompt, max_new_tokens, eos, sampler, self.stats)
        self.stats.seconds += seconds
        self.stats.new_tokens += len(generated)
        if generated != ref:
            self.mismatches += 1
            if sampler is None:  # greedy: where and by how much the two outputs part
                self.gaps.append(round(divergence_gap(target, prompt, ref, generated), 4))

    def timed_decode(
        self, target, prompt: list[int], max_new_tokens: int, eos: set[int], sampler, stats: Stats | None
    ) -> tuple[list[int], float]:
        """(tokens, seconds) of one speculative decode; stats None: timed only (eval.timing_runs' later runs)."""
        proposer, k, spec = self.drafter.proposer, self.k, self.spec
        return timed(speculative_decode, target, proposer, prompt, k, max_new_tokens, eos, sampler, stats, spec)

    def decoded(self, own: dict, **common: Any) -> Decoded:
        """This drafter's measurements; `common`: the fields every drafter of the run shares."""
        return Decoded(
            name=self.drafter.label,
            k=self.k,
            tree=self.tree,
            stats=self.stats,
            mismatches=self.mismatches,
            gaps=self.gaps,
            own=own,
            **common,
        )


def decode_holdout(
    drafter: Resolved,
    tok,
    holdout: str,
    cfg: EvalConfig,
    *,
    baseline: list[tuple[list[int], float]] | None = None,
    kernels: bool = True,
    batch_sizes: list[int] | None = None,
    split: str = "train",
    adaptive_costs: AdaptiveCosts | None = None,
    beside: Resolved | None = None,
) -> Decoded:
    """The decode part of `evaluate` (its docstring has the arguments): every holdout prompt decoded
    target-only (unless `baseline` has it) and speculatively on the same seed, then the adaptive run
    and the batch-size curve where they apply -> the raw measurements.

    beside: a second drafter verified by the same model, decoded on each prompt right after the first
    (target-only, drafter, beside), so both speedups divide by one target-only run timed beside them
    both (the eval stage's `eval.lookup` row) -> `Decoded.beside`; it gets no adaptive run or curve."""
    rows = decode_rows(
        [d for d in (drafter, beside) if d is not None],
        tok,
        holdout,
        cfg,
        baseline=baseline,
        kernels=kernels,
        batch_sizes=batch_sizes,
        split=split,
        adaptive_costs=adaptive_costs,
    )
    if beside is not None:
        rows[0].beside = rows[1]
    return rows[0]


def rotated(rows: list, i: int) -> list:
    """`rows` started at row i (mod their count): timing run i's order when the rows rotate, so that no
    row is always the one decoded right after target-only (its caches warm) or always the last."""
    j = i % len(rows)
    return rows[j:] + rows[:j]


def decode_rows(
    drafters: list[Resolved],
    tok,
    holdout: str,
    cfg: EvalConfig,
    *,
    baseline: list[tuple[list[int], float]] | None = None,
    kernels: bool = True,
    batch_sizes: list[int] | None = None,
    split: str = "train",
    adaptive_costs: AdaptiveCosts | None = None,
    every_row: bool = False,
) -> list[Decoded]:
    """Drafters verified by one model, interleaved: in each of the cfg.timing_runs runs every holdout
    prompt is decoded target-only (the first run: unless `baseline` has it), then by each drafter, so
    every row divides by a target-only run timed beside it (a baseline timed once before several
    drafters drifts with the host, docs/benchmarks.md); acceptance is counted on the first run only.
    every_row False (`decode_holdout`: a drafter and its `beside` row): the rows keep their order in
    every run, and only the first gets the adaptive run and the batch-size curve. True (`draftsmith
    compare`): each row gets both, and run i decodes the rows in `rotated(rows, i)` order.
    -> one Decoded per drafter, in their order."""
    for d in drafters[1:]:
        if d.verifier is not drafters[0].verifier:
            raise DraftsmithError(f"eval: '{d.label}' is verified by another model than '{drafters[0].label}'")
    sectioned = len(drafters) if every_row else 1  # rows [0, sectioned) get the adaptive run and the curve
    runs = [_Run(d, *draft_shape(d, cfg, batch_sizes if i < sectioned else None)) for i, d in enumerate(drafters)]
    target = drafters[0].verifier
    prompts = [
        encode_prompt(tok, p, thinking_kwargs(cfg.thinking)) for p in load_prompts(holdout, cfg.num_prompts, split)
    ]
    eos, max_new_tokens = eos_ids(target, tok), cfg.max_new_tokens
    device = next(target.parameters()).device

    def sampler(seed):
        """None = greedy; otherwise one warping shared by target and drafter (lossless sampling)."""
        return Sampler(cfg.temperature, cfg.top_p, seed, device) if cfg.temperature > 0 else None

    modules = [m for r in runs for m in proposer_modules(r.drafter.proposer)]
    # Target and drafter decode on the fastest kernels of the machine (draftsmith/util/kernels.py), the
    # target-only baseline included, so the speedup compares like with like.
    with packed_linears(target, *modules, enabled=kernels):
        warm_up(target, runs, prompts[0][:8], max_new_tokens, eos, sampler)
        # Run 0 starts at row 0 whether the rows rotate or not: `rotated(runs, 0)` is `runs`.
        ref_s, ref_tokens, refs = first_run(target, runs, prompts, baseline, max_new_tokens, eos, sampler)
        # Before the adaptive run and the timing runs add to them.
        own = [r.drafter.proposer.stats() if r.drafter.proposer is not None else {} for r in runs]
        more = later_runs(target, runs, prompts, max_new_tokens, eos, sampler, cfg.timing_runs, every_row)
        adaptive = [
            adaptive_run(target, r, prompts, refs, ref_tokens / ref_s, max_new_tokens, eos, sampler, adaptive_costs)
            for r in runs[:sectioned]
        ]
    curves = [
        batch_curve(
            target, tok, fresh_copies(r.drafter.proposer), prompts, batch_sizes, r.k, max_new_tokens, eos, kernels
        )
        if batch_sizes
        else None
        for r in runs[:sectioned]
    ]
    common = dict(
        num_prompts=len(prompts),
        target_seconds=ref_s,
        target_tokens=ref_tokens,
        dtype=str(next(target.parameters()).dtype).removeprefix("torch."),
        device=device,
    )
    adaptive += [None] * (len(runs) - sectioned)  # the rows past `sectioned` get neither section
    curves += [None] * (len(runs) - sectioned)
    decoded = []
    for i, (r, mine, a, curve) in enumerate(zip(runs, own, adaptive, curves)):
        decoded.append(r.decoded(mine, adaptive=a, batch_curve=curve, **common))
        decoded[-1].more_runs = [(t_tokens, t_s, *rows[i]) for t_tokens, t_s, rows in more]
    return decoded


def warm_up(target, runs: list[_Run], prompt: list[int], max_new_tokens: int, eos: set[int], sampler) -> None:
    """Decode `prompt` once target-only and once by each row, so one-time allocation costs do not bias
    the first timing; a proposer's own counters (a cascade's levels) then forget the warm-up."""
    target_decode(target, prompt, max_new_tokens, eos, sampler(0))
    for r in runs:
        speculative_decode(target, r.drafter.proposer, prompt, r.k, max_new_tokens, eos, sampler(0), tree=r.spec)
    for r in runs:
        if r.drafter.proposer is not None:
            r.drafter.proposer.reset_stats()


def first_run(
    target, runs: list[_Run], prompts, baseline, max_new_tokens: int, eos: set[int], sampler
) -> tuple[float, int, list[list[int]]]:
    """The counted run: each prompt decoded target-only (or taken from `baseline`), then by each row in
    the order given, each row's output checked against the target-only one and its acceptance counted
    (`_Run.decode`) -> (target-only seconds, target-only tokens, target-only outputs)."""
    ref_s, ref_tokens, refs = 0.0, 0, []
    for n, prompt in enumerate(tqdm(prompts, desc=f"eval {runs[0].drafter.label}")):
        ref, s_ref = baseline[n] if baseline else timed(target_decode, target, prompt, max_new_tokens, eos, sampler(n))
        ref_s, ref_tokens = ref_s + s_ref, ref_tokens + len(ref)
        refs.append(ref)
        for r in runs:
            r.decode(target, prompt, ref, max_new_tokens, eos, sampler(n))
    return ref_s, ref_tokens, refs


def later_runs(
    target, runs: list[_Run], prompts, max_new_tokens: int, eos: set[int], sampler, count: int, rotate: bool
) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """Timing runs 1 .. count-1 (`timing_run`), run i in the order `rotated(runs, i)` when `rotate`, else
    in `runs` order -> per run (target tokens, target seconds, [(tokens, seconds)] in `runs` order)."""
    more = []
    for i in range(1, count):
        j = i if rotate else 0  # the row run i starts at
        t_tokens, t_s, rows = timing_run(target, rotated(runs, j), prompts, max_new_tokens, eos, sampler)
        more.append((t_tokens, t_s, rotated(rows, -j)))  # rows in run i's order, turned back by j
    return more


def adaptive_run(
    target, r: _Run, prompts, refs, target_tps: float, max_new_tokens: int, eos: set[int], sampler, costs
) -> dict | None:
    """`adaptive_section` of row r, where it applies: only a chain drafter that says how sure it is
    (`drafts_confidence`) gets the calibration and adaptive sections; None otherwise."""
    proposer = r.drafter.proposer
    if proposer is None or not proposer.drafts_confidence or r.spec is not None or r.k <= 0:
        return None
    return adaptive_section(
        target, proposer, prompts, refs, r.stats, target_tps, r.k, max_new_tokens, eos, sampler, costs
    )


def timing_run(
    target, runs: list[_Run], prompts, max_new_tokens: int, eos: set[int], sampler
) -> tuple[int, float, list[tuple[int, float]]]:
    """One more timing of every row (eval.timing_runs): each prompt decoded target-only, then by each
    drafter in turn, as the first run did, so a slow minute of the host falls on every row alike ->
    (target tokens, target seconds, [(tokens, seconds) per drafter])."""
    t_tokens, t_s, rows = 0, 0.0, [[0.0, 0.0] for _ in runs]  # per drafter: tokens, seconds
    for n, prompt in enumerate(prompts):
        ref, seconds = timed(target_decode, target, prompt, max_new_tokens, eos, sampler(n))
        t_tokens, t_s = t_tokens + len(ref), t_s + seconds
        for row, r in zip(rows, runs):
            generated, seconds = r.timed_decode(target, prompt, max_new_tokens, eos, sampler(n), None)
            row[0], row[1] = row[0] + len(generated), row[1] + seconds
    return t_tokens, t_s, [(int(tokens), seconds) for tokens, seconds in rows]


def eval_report(
    run: Decoded, holdout: str, cfg: EvalConfig, *, target_name: str = "", stale: dict | None = None
) -> dict:
    """The report part of `evaluate`: the raw measurements rounded and named as report.md and
    `draftsmith compare` read them, with the conditions they were measured under, the proposer's own
    counters, and the calibration, adaptive and batch-curve sections where they were measured."""
    stats, k, temperature, greedy = run.stats, run.k, cfg.temperature, cfg.temperature == 0
    # Every timing run's (target tok/s, tok/s); the report's are the median run's (the lower of the middle
    # two for an even count), so its three speed columns come from one run.
    speeds = [
        (a / b, c / d)
        for a, b, c, d in [(run.target_tokens, run.target_seconds, stats.new_tokens, stats.seconds), *run.more_runs]
    ]
    speedups = [spec / ref for ref, spec in speeds]
    target_tps, spec_tps = speeds[speedups.index(statistics.median_low(speedups))]
    report = {
        "drafter": run.name,
        "target": target_name,
        "holdout": holdout,
        "num_prompts": run.num_prompts,
        "new_tokens": stats.new_tokens,
        "temperature": temperature,
        "k": k,
        "tree": run.tree,
        "tau": round(stats.tau, 4),
        "acceptance_rate": round(stats.acceptance_rate, 4),
        "per_position": [round(p, 4) for p in stats.per_position] if k else [],
        # Greedy: checked token by token. Sampling: outputs differ by design; exactness is a
        # distribution-level property, tested by chi-square tests in tests/engine/test_sampling.py and test_tree.py.
        "lossless": run.mismatches == 0 if greedy else None,
        # Greedy, two checks: `rule_exact`, every round emitted what the verification rule gives for
        # the target's own logits of that pass (what makes speculation lossless), and `lossless`,
        # outputs identical to a separately run target-only decode, which bf16 near-ties can break
        # (other shapes, other kernels, other roundings) while the rule holds.
        "rule_exact": stats.rule_breaks == 0 if greedy else None,
        "target_tokens_per_s": round(target_tps, 2),
        "spec_tokens_per_s": round(spec_tps, 2),
        "speedup": round(spec_tps / target_tps, 3),
        "speedup_runs": [round(x, 3) for x in speedups],  # in the order measured; the median is `speedup`
        # Beyond the fixed keys: the conditions users need to read the numbers.
        "batch_size": 1,
        "top_p": cfg.top_p,
        "stale": stale,
        "draft_tokens_per_pass": round(stats.proposed / max(stats.passes, 1), 2),
        "lossless_mismatches": run.mismatches if greedy else None,
        "mismatch_logit_gaps": run.gaps,
        "dtype": run.dtype,
        "thinking": cfg.thinking or "template default",  # the prompts' chat template thinking mode
        # Where it was measured (device, CPU model or GPU name, native bf16, threads): a speedup
        # read later means nothing without it.
        **hardware(run.device),
    }
    report.update(run.own)  # e.g. a cascade's levels, a hybrid's drafts by source; {} target-only
    if run.adaptive is not None:  # a chain drafter that states its confidences
        report["calibration"] = confidence_calibration(stats)
        report["adaptive"] = run.adaptive
    if run.batch_curve is not None:
        report["batch_curve"] = run.batch_curve
    return report


def confidence_calibration(stats: Stats, n_bins: int = 10) -> dict:
    """ECE and the reliability bins of the drafter's confidences over the full-block run's verified
    drafts (`Stats.confidence_outcomes`: draft i counts when drafts < i were accepted, outcome = it was
    accepted), rounded for the report (draftsmith/util/calibration.py)."""
    pairs = stats.confidence_outcomes
    cal = calibration([c for c, _ in pairs], [y for _, y in pairs], n_bins)

    def r4(x):
        return None if x is None else round(x, 4)

    return {
        "ece": r4(cal["ece"]),
        "ece_bound": r4(cal["ece_bound"]),  # the largest ECE true confidences give 99 times in 100
        "calibrated": cal["calibrated"],
        "n": cal["n"],
        "bins": [{**b, "confidence": r4(b["confidence"]), "accuracy": r4(b["accuracy"])} for b in cal["bins"]],
        "outcome": "draft i accepted, given drafts < i accepted (full-block verification)",
    }


@torch.no_grad()
def verify_seconds(target, prompt: list[int], k: int, reps: int = 5) -> tuple[float, float]:
    """Median seconds of one target verification pass over the root alone and over the root + k chain
    drafts, after the prompt is cached: the two shapes `speculative_decode` runs (the same mask and
    positions; which draft tokens are scored does not change the cost)."""
    device = next(target.parameters()).device
    cache, prefix = DynamicCache(), len(prompt) - 1
    verification_forward(target, prompt[:-1], cache, device)
    chain = Draft.chain(prompt[-1:] * k)
    mask, positions = verification_inputs(chain, prefix, device)
    shapes = [(prompt[-1:], None, None), (prompt[-1:] + chain.tokens, mask, positions)]
    seconds: list[list[float]] = [[], []]
    for _ in range(reps):
        for times, (ids, m, p) in zip(seconds, shapes):
            times.append(timed(verification_forward, target, ids, cache, device, (), m, p)[1])
            crop_cache(cache, prefix)
    return statistics.median(seconds[0]), statistics.median(seconds[1])


def measure_costs(draft_seconds_per_round: float, one: float, full: float, k: int) -> AdaptiveCosts:
    """The linear cost model of adaptive verification (draftsmith/engine/verify.py AdaptiveCosts) from
    what this run measured, in units of a target pass over the root alone (`one` seconds): draft_cost =
    drafting seconds per round / one; beta = the extra cost per verified draft, (full - one) / (k * one)
    with `full` the pass over root + k drafts, clamped to [0, 1] (timing noise on a tiny target)."""
    beta = (full - one) / (k * one)
    return AdaptiveCosts(draft_cost=draft_seconds_per_round / one, beta=min(max(beta, 0.0), 1.0))


def adaptive_section(
    target, proposer, prompts, refs, full: Stats, target_tps: float, k, max_new, eos, sampler, costs=None
) -> dict:
    """The same prompts decoded again with adaptive verification (vLLM 0.32's budget on the drafter's
    confidences), beside the full-block run `full`: τ, drafts verified per round and speedup of both
    against the same target-only baseline; greedy outputs are checked against that baseline too."""
    measured = costs is None
    if measured:
        one, whole = verify_seconds(target, prompts[0], k)
        costs = measure_costs(full.draft_seconds / max(full.passes, 1), one, whole, k)
    stats, mismatches = Stats(k=k), 0
    for n, (prompt, ref) in enumerate(zip(prompts, refs)):
        generated, seconds = timed(
            speculative_decode, target, proposer, prompt, k, max_new, eos, sampler(n), stats, None, costs
        )
        stats.seconds += seconds
        stats.new_tokens += len(generated)
        mismatches += int(generated != ref)
    greedy = sampler(0) is None
    return {
        "rule": "b = argmax_b (1 + sum_{i<=b} S_i) / (draft_cost + 1 + beta*b), S_i = prod_{j<=i} c_j (vLLM 0.32)",
        "draft_cost": round(costs.draft_cost, 4),
        "beta": round(costs.beta, 4),
        "costs": "measured" if measured else "given",
        "full_block": _run_summary(full, target_tps),
        "adaptive": {
            **_run_summary(stats, target_tps),
            "lossless": mismatches == 0 if greedy else None,
            "rule_exact": stats.rule_breaks == 0 if greedy else None,
            "lossless_mismatches": mismatches if greedy else None,
        },
    }


def _run_summary(stats: Stats, target_tps: float) -> dict:
    tps = stats.new_tokens / stats.seconds
    return {
        "tau": round(stats.tau, 4),
        "acceptance_rate": round(stats.acceptance_rate, 4),
        "per_position": [round(p, 4) for p in stats.per_position],
        "verified_per_round": round(stats.proposed / max(stats.passes, 1), 2),  # drafts scored per target pass
        "spec_tokens_per_s": round(tps, 2),
        "speedup": round(tps / target_tps, 3),
    }


def fresh_copies(proposer):
    """A factory of per-row proposers for batched decoding: shallow copies share the drafter's
    weights; `reset()` gives each its own per-sequence state (KV cache, fed tokens)."""
    if proposer is None:
        return None

    def make():
        row = copy.copy(proposer)
        row.reset()
        return row

    return make


def target_baseline(
    target, tok, holdout: str, cfg: EvalConfig, kernels: bool = True, split: str = "train"
) -> list[tuple[list[int], float]]:
    """Target-only decoding of the holdout prompts: (output, seconds) per prompt, seeded as `evaluate`
    seeds them, so a shared baseline is the one `evaluate` would have measured."""
    prompts = [
        encode_prompt(tok, p, thinking_kwargs(cfg.thinking)) for p in load_prompts(holdout, cfg.num_prompts, split)
    ]
    eos, device = eos_ids(target, tok), next(target.parameters()).device
    with packed_linears(target, enabled=kernels):
        target_decode(target, prompts[0][:8], cfg.max_new_tokens, eos, None)  # warm-up, as in evaluate
        return [
            timed(
                target_decode,
                target,
                p,
                cfg.max_new_tokens,
                eos,
                Sampler(cfg.temperature, cfg.top_p, n, device) if cfg.temperature > 0 else None,
            )
            for n, p in enumerate(prompts)
        ]


def evaluate_drafter(
    family: Family, drafter, dcfg, target, tok, holdout: str, out: Path | None, cfg: EvalConfig, **options
) -> dict:
    """The eval stage for a trained drafter of any family. The family's `verifier` checks the drafts:
    the target itself, or for a family that trained the backbone (Medusa-2) the trained backbone with
    its adapters merged, and then the report adds that backbone's drift from the original target.
    options: evaluate's keyword options (target_name, stale, batch_sizes, split, ...)."""
    verifier = family.verifier(drafter, target)
    proposer = family.make_proposer(drafter, verifier, dcfg)
    # eval.lookup: the same drafter with prompt lookup grafted on, one more row, decoded on each prompt
    # right after the drafter and against the same target-only run, timed beside both (a baseline
    # timed once before several drafters drifts with the host, docs/benchmarks.md). The proposer is
    # shared: decoding resets it for every prompt.
    hybrid = Resolved(f"hybrid ({family.NAME} + lookup)", HybridProposer(NgramProposer(), proposer), verifier, None)
    resolved = Resolved(family.NAME, proposer, verifier, None)
    report = evaluate(resolved, tok, holdout, None, cfg, beside=hybrid if cfg.lookup else None, **options)
    if cfg.lookup:
        report["with_lookup"] = report.pop("beside")
    if verifier is not target:
        with family.original(drafter, target) as original:
            split = options.get("split", "train")
            report["drift"] = backbone_drift(original, verifier, tok, holdout, proposer, cfg, split)
    if out is not None:
        write_report(report, out)
    return report


@torch.no_grad()
def backbone_drift(original, trained, tok, holdout: str, proposer, cfg: EvalConfig, split: str = "train") -> dict:
    """How far training moved the verifier, on the holdout prompts (greedy):
    - unchanged_fraction: prompts whose greedy output is the same under the original and the trained target;
    - token_agreement: along the original's greedy output, how often the trained target's next-token
      argmax is the original's token (teacher-forced, so one early change does not count twice);
    - original_tau: τ of the same heads drafting for the *original* target (what they would give if
      the backbone were served unchanged)."""
    prompts = [
        encode_prompt(tok, p, thinking_kwargs(cfg.thinking)) for p in load_prompts(holdout, cfg.num_prompts, split)
    ]
    eos, device = eos_ids(original, tok), next(original.parameters()).device
    k, max_new_tokens = cfg.k, cfg.max_new_tokens
    spec, stats = (parse_tree(cfg.tree) if cfg.tree else None), Stats(k=k)
    unchanged, agree, total = 0, 0, 0
    for prompt in prompts:
        ref = target_decode(original, prompt, max_new_tokens, eos)
        unchanged += int(target_decode(trained, prompt, max_new_tokens, eos) == ref)
        logits = trained(torch.tensor([prompt + ref], device=device)).logits[0, len(prompt) - 1 : -1]
        agree += int((logits.argmax(-1).cpu() == torch.tensor(ref)).sum())
        total += len(ref)
        speculative_decode(
            original, proposer, prompt, spec.depth if spec else k, max_new_tokens, eos, None, stats, spec
        )
    return {
        "unchanged_fraction": round(unchanged / len(prompts), 4),
        "token_agreement": round(agree / max(total, 1), 4),
        "original_tau": round(stats.tau, 4),
    }
