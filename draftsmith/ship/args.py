"""The flags of the shipping commands (`draftsmith export`, `publish`, `serve-check`, `bakeoff`): one dataclass a
command, one field a flag, the docstring its help (draftsmith/util/flags.py builds the parser).
Light on purpose: `draftsmith --help` imports this module, and ship/commands.py only when one runs."""

from __future__ import annotations

from dataclasses import dataclass, field

from draftsmith.util.precision import DTYPE_HELP, dtype_arg

FORMATS = ["vllm", "sglang", "speculators", "hf"]


@dataclass(kw_only=True)
class ExportArgs:
    drafter: str = field(metadata={"positional": True})
    """a drafter folder (…/final)"""
    format: str = field(metadata={"choices": FORMATS})
    out: str
    target: str | None = None
    """target to check the drafter against (default: the one it was trained for)"""
    verify: bool = False
    """read the export back as its consumer maps it and check that it drafts exactly like the drafter on
    a few holdout prompts; where vLLM is installed, also serve it there (serve-check on 4 prompts, report
    in OUT-serve-check/)"""
    data: str = "builtin:code-holdout"
    """holdout prompts for --verify"""
    dtype: str = field(
        default="auto", metadata={"type": dtype_arg, "help": "the target's (and --verify's) precision: " + DTYPE_HELP}
    )


@dataclass(kw_only=True)
class PublishArgs:
    drafter: str = field(metadata={"positional": True})
    """a drafter folder (…/final) whose run has an eval report"""
    repo_id: str
    """ORG/NAME on the Hugging Face Hub"""
    format: str | None = field(default=None, metadata={"choices": FORMATS})
    """default: the format vLLM serves the family from (its SERVE_FORMAT)"""
    private: bool = False
    revision: str | None = None
    """upload to this branch (created if missing)"""
    dry_run: bool = False
    """write the folder that would be uploaded; upload nothing"""
    force: bool = False
    """publish without the run's eval report (a report whose greedy rounds broke the verification rule is
    always refused; serving parity is always checked)"""
    out: str | None = None
    """the folder to write (default: next to the drafter, publish-FORMAT)"""
    license: str = "other"
    """model card license (the target's terms usually apply)"""
    target: str | None = None
    """target to check the drafter against (default: the one it was trained for)"""


@dataclass(kw_only=True)
class ServeCheckArgs:
    dir: str = field(metadata={"positional": True})
    """an exported folder (draftsmith export), or a drafter's final/ (exported first)"""
    data: str
    """holdout prompts (the same ids go to vLLM and to draftsmith's eval)"""
    out: str
    """folder for serve_check.json / .md / .png"""
    num_prompts: int = 12
    max_new_tokens: int = 96
    k: int = 3
    """draft tokens per step, in vLLM and draftsmith alike (Medusa: its heads)"""
    concurrency: str = "1"
    """vLLM tokens/s at these numbers of concurrent requests, e.g. 1,2,4,8,16 (beside draftsmith's
    batch-size curve at the same sizes)"""
    deploy_k: str = ""
    """also serve the export at each of these K (e.g. 1,2,3,4) at every --concurrency, --deploy-runs
    times interleaved with the target alone, and write OUT/deploy/vllm.json: the speculative config with
    the K per batch size that beats the runs' spread (vLLM's num_speculative_tokens_per_batch_size), read
    back by vLLM's own config code and served once"""
    deploy_runs: int = 3
    """timing runs per K and concurrency for --deploy-k (at least 3)"""
    dtype: str = field(default="float32", metadata={"type": dtype_arg})
    """both engines' precision (default float32: greedy outputs must then agree token for token)"""
    drafter: str | None = None
    """with an exported DIR: the trained final/ it came from, so draftsmith's side evaluates the trained
    drafter, not the export read back"""
    target: str | None = None
    """draftsmith's target (default: the one the export names)"""
    server: str | None = None
    """an already running vLLM server serving this export (no server is started)"""
    target_server: str | None = None
    """an already running vLLM server of the target alone"""
    vllm_python: str | None = None
    """the Python of an environment with vLLM (default: $DRAFTSMITH_VLLM_PYTHON, then .venv-vllm)"""
    port: int = 0
    """port for the servers started here (default: a free one)"""
    vllm_arg: list[str] = field(default_factory=list)
    """an extra `vllm serve` flag, passed unchanged (repeat; e.g. --vllm-arg=--tensor-parallel-size
    --vllm-arg=8)"""


@dataclass(kw_only=True)
class BakeoffArgs:
    drafter: list[str]
    """a trained drafter folder (…/final), taken as it is, or a recipe .yaml, trained first for --steps
    optimizer steps into OUT/train/ (repeat: one per drafter)"""
    data: list[str]
    """a domain's holdout prompts (repeat), e.g. builtin:code-holdout, builtin:prose-holdout, bench:humaneval,
    a jsonl"""
    out: str
    """folder for bakeoff.json / .md / .png, deploy/vllm.json, train/ (the recipes' runs) and cells/ (each
    drafter × domain's report)"""
    steps: int | None = None
    """the equal training budget: optimizer steps for every recipe (required when a --drafter is a recipe)"""
    train_data: str | None = None
    """train every recipe on this dataset (its data.train) instead of the recipe's own"""
    train_arg: list[str] = field(default_factory=list)
    """a KEY=VALUE override for every recipe's training (repeat), e.g. --train-arg optim.batch_size=8"""
    concurrency: str = "1,2,4,8,16"
    """numbers of concurrent requests in vLLM (draftsmith's engine: batch sizes) to measure tokens/s at"""
    k: int = 3
    """draft tokens per step, in vLLM and draftsmith alike (Medusa: its heads)"""
    num_prompts: int = 16
    """prompts per domain (at least the largest --concurrency)"""
    max_new_tokens: int = 64
    dtype: str = field(default="float32", metadata={"type": dtype_arg})
    """both engines' precision (default float32: greedy outputs must then agree token for token)"""
    deploy_k: str = ""
    """the K values deploy/vllm.json chooses among at each concurrency, e.g. 1,2,3,4 (default: --k alone,
    so speculation is on or off per batch size)"""
    vllm_python: str | None = None
    """the Python of an environment with vLLM (default: $DRAFTSMITH_VLLM_PYTHON, then .venv-vllm)"""
    vllm_arg: list[str] = field(default_factory=list)
    """an extra `vllm serve` flag, passed unchanged to every server (repeat)"""
