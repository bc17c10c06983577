"""The flags of the eval room's commands (`draftsmith eval`, `compare`, `layerskip`): one dataclass a
command, one field a flag, the docstring its help (draftsmith/util/flags.py builds the parser).
Light on purpose: `draftsmith --help` imports this module, and eval/commands.py only when one runs."""

from __future__ import annotations

from dataclasses import dataclass, field

from draftsmith.eval.config import EvalConfig
from draftsmith.util.precision import DTYPE_HELP, dtype_arg

# The eval stage's settings (a recipe's `eval:` section) are the defaults of the flags that set them.
EVAL = {"mirrors": EvalConfig}


@dataclass(kw_only=True)
class EvalArgs:
    drafter: str | None = None
    """a drafter folder (…/final) or layer-skip folder, none, ngram, lookahead, hybrid:PATH"""
    cascade: str | None = None
    """LOW,MID: LOW (ngram or a student folder) drafts for MID (a student or layer-skip folder), whose
    greedy continuation the target verifies"""
    target: str | None = None
    """target id/path/alias (default: the one the drafter was trained for)"""
    data: str
    """holdout: jsonl/json/parquet path, builtin:code-holdout, or a benchmark: bench:humaneval, bench:mt-bench, bench:gsm8k, bench:speed-bench"""
    k: int = field(metadata=EVAL)
    tree: str | None = field(metadata=EVAL)
    """draft tree instead of a chain: 'dynamic[:depth=5,top_k=8,tokens=48]' (EAGLE-2) or
    'static:[[0],[1],[0,0]]' (child-rank paths, or a .json file)"""
    temperature: float = field(metadata=EVAL)
    top_p: float = field(metadata=EVAL)
    max_new_tokens: int = field(metadata=EVAL)
    num_prompts: int = field(metadata=EVAL)
    dtype: str = field(metadata={**EVAL, "type": dtype_arg})
    thinking: str = field(metadata={**EVAL, "choices": ["", "on", "off"]})
    timing_runs: int = field(metadata=EVAL)
    out: str | None = None
    """report folder (default for a trained drafter: RUN/evals/<holdout>-k<K>-<N>p, beside the training
    run's own RUN/eval/, which stays as training wrote it; for others: eval-<drafter>)"""
    force: bool = False
    """let --out replace the report the folder already holds"""
    batch_sizes: str | None = None
    """also measure batched decoding at these batch sizes, e.g. 1,2,4,8,16 (greedy, chain drafts): the
    batch-size curve in the report"""
    allow_stale: bool = False
    """evaluate against a target the drafter was not trained for (e.g. after a target update); the report
    marks it stale"""
    lookup: bool = False
    """a trained drafter: also decode it with prompt lookup grafted onto its drafts, on each prompt right
    after it and divided by the same target-only run (the eval stage's `eval.lookup` row)"""


@dataclass(kw_only=True)
class CompareArgs:
    drafter: list[str]
    """a drafter folder (PATH@TREE for a tree), a layer-skip folder, none, ngram, lookahead, hybrid:PATH
    or cascade:LOW,MID; any of them @k=N for chains of N (its own --k)"""
    data: list[str]
    """a holdout (repeat for several domains)"""
    target: str | None = None
    """default: the first trained drafter's target"""
    k: int = field(metadata=EVAL)
    tree: str | None = field(metadata=EVAL)
    """a draft tree for every drafter that builds trees (PATH@TREE overrides)"""
    temperature: float = field(metadata=EVAL)
    top_p: float = field(metadata=EVAL)
    max_new_tokens: int = field(metadata=EVAL)
    num_prompts: int = field(metadata=EVAL)
    dtype: str = field(metadata={**EVAL, "type": dtype_arg})
    thinking: str = field(metadata={**EVAL, "choices": ["", "on", "off"]})
    timing_runs: int = field(metadata=EVAL)
    batch_sizes: str | None = None
    """also measure each drafter's batch-size curve, e.g. 1,2,4,8,16"""
    out: str


@dataclass(kw_only=True)
class LayerskipArgs:
    target: str = "smollm2-135m"
    data: str
    """holdout prompts of the domain"""
    k: int = 4
    num_prompts: int = 4
    max_new_tokens: int = 32
    budget: int = 300
    """candidate skip sets scored at most (one teacher-forced pass each)"""
    dtype: str = field(default="auto", metadata={"type": dtype_arg, "help": DTYPE_HELP})
    out: str
    """a folder for layerskip.json (use it in compare as --drafter DIR)"""
