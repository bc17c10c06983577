"""The eval stage's settings: a recipe's `eval:` section, and the defaults of the flags of
`draftsmith eval` and `compare` that set the same things (eval/args.py). Light on purpose:
`draftsmith --help` imports it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EvalConfig:
    enabled: bool = True
    k: int = 5
    """Draft tokens proposed per target verification pass."""
    num_prompts: int = 20
    max_new_tokens: int = 64
    temperature: float = 0.0
    """0 = greedy (token-exact lossless check); > 0 = lossless speculative sampling."""
    top_p: float = 1.0
    tree: str | None = None
    """Draft tree instead of a chain, e.g. `dynamic:depth=5,top_k=8,tokens=48` (see draftsmith/engine/drafts.py)."""
    dtype: str = "auto"
    """Target and drafter dtype in the eval stage: `auto`, `float32`/`no` or `bfloat16` (draftsmith/util/precision.py)."""
    thinking: str = ""
    """The chat template's thinking mode for the holdout prompts: `on`, `off` or empty (in a training run:
    data.thinking, else the template's default). The report says which was used."""
    lookup: bool = False
    """A training run's eval stage also decodes with prompt lookup grafted onto the drafter's drafts
    (the `hybrid:` drafter of `draftsmith eval`, draftsmith/engine/lookahead.py): a second row, decoded
    on each prompt right after the drafter's and divided by the same target-only run. vLLM serves the
    drafter alone; this row is draftsmith's engine."""
    timing_runs: int = 1
    """How many times each drafter's speed is measured: after the first run (which also counts
    acceptance) each prompt is decoded again target-only, then by each drafter, prompt by prompt, timed
    only (greedy and seeded sampling give the same tokens). The speedup is the median run's, its min-max
    beside it in the table (`speedup_runs` in report.json). 3 or more for a figure to publish: on a
    2-core CPU one run moves by several percent; each run costs one more decode of every row."""
    general_holdout: str = ""
    """With `init_from` (domain fine-tuning): a second holdout, e.g. the init's own domain. The eval then
    reports τ on both holdouts before (the init) and after fine-tuning, side by side."""
