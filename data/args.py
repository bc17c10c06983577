"""The flags of the data room's commands (`draftsmith data regenerate`, `data corpus`, `data features`,
`data inspect`): one dataclass a command, one field a flag, the docstring its help
(draftsmith/util/flags.py builds the parser). Light on purpose: `draftsmith --help` imports this
module, and data/commands.py only when one runs."""

from __future__ import annotations

from dataclasses import dataclass, field

from draftsmith.util.precision import DTYPE_HELP, dtype_arg


@dataclass(kw_only=True)
class RegenerateArgs:
    target: str = "smollm2-135m"
    data: str
    out: str
    """the records to write, e.g. datasets/code-regen.jsonl (its folder is made if missing)"""
    batch_size: int = 8
    max_new_tokens: int = 128
    temperature: float = 0.0
    max_examples: int = 0
    turns: str = field(default="all", metadata={"choices": ["all", "last"]})
    """which assistant turns the target answers: every one, turn by turn, or the last"""
    thinking: str = field(default="", metadata={"choices": ["", "on", "off"]})
    """the chat template's thinking mode (Qwen3-style enable_thinking); empty: the template's default"""
    dtype: str = field(default="auto", metadata={"type": dtype_arg, "help": DTYPE_HELP})
    engine: str = field(default="hf", metadata={"choices": ["hf", "vllm"]})
    """hf: the target answers in this process (with features); vllm: through a vLLM server, exact token ids
    read back"""
    top_p: float = 1.0
    """(--engine vllm)"""
    concurrency: int = 16
    """requests in flight (--engine vllm)"""
    server: str | None = None
    """an already running vLLM server of the target (--engine vllm)"""
    vllm_python: str | None = None
    """the Python of an environment with vLLM (--engine vllm)"""
    vllm_arg: list[str] = field(default_factory=list)
    """an extra `vllm serve` flag, passed unchanged, e.g. --vllm-arg=--tensor-parallel-size --vllm-arg=8
    (--engine vllm)"""


@dataclass(kw_only=True)
class CorpusArgs:
    name: str = field(metadata={"positional": True})
    out: str
    """the jsonl to write, e.g. datasets/code.jsonl (its folder is made if missing)"""


@dataclass(kw_only=True)
class RecipeDataArgs:
    """A recipe, of which a data command reads the `data:` section and the target (data/config.py)."""

    recipe: str = field(metadata={"positional": True})
    """recipe YAML, e.g. recipes/cpu/eagle-smollm2.yaml"""
    overrides: list[str] = field(default_factory=list, metadata={"positional": True})
    """key=value overrides, e.g. data.train=datasets/mine.jsonl data.max_length=512"""


@dataclass(kw_only=True)
class FeaturesArgs(RecipeDataArgs):
    out: str
    """the feature cache folder, e.g. features/smollm2-code"""
    batch_size: int = 8


@dataclass(kw_only=True)
class InspectArgs(RecipeDataArgs):
    index: int = 0
    """which record of data.train (0-based)"""
