"""The data room's settings: a recipe's `data:` section (`Config.data` in train/config.py, which reads
the whole recipe), and `recipe_data`, what the `data` commands read of a recipe themselves (that
section and the target's keys) without importing train, which sits above data. Light on purpose."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from draftsmith import DraftsmithError
from draftsmith.data.load import TURNS, joined_sources, thinking_switch
from draftsmith.util.parse import _merge, from_dict, parse_overrides, read_yaml


@dataclass
class DataConfig:
    train: str = "builtin:code"
    """Training data: a jsonl/json/parquet path, a `datasets` name, or `builtin:code` / `builtin:prose`;
    several joined by `+` (`builtin:prose+chat.jsonl`) train on their records in that order."""
    holdout: str = "builtin:code-holdout"
    """Domain holdout used by the eval stage (prompts only are used)."""
    split: str = "train"
    """Split of a `datasets` hub dataset or parquet/json folder to train on (e.g. ultrachat_200k's `train_sft`)."""
    holdout_split: str = ""
    """Split of the holdout (e.g. `test_sft`); empty = `split`."""
    malformed: str = "skip"
    """A record that is not a valid conversation: `skip` it (counted, the first reasons printed with
    file:line) or `error` (stop at the first)."""
    regenerate: bool = False
    """Replace responses with the target's own answers before training (self-distillation)."""
    thinking: str = ""
    """The chat template's thinking mode while the target answers and training renders chats: `on`,
    `off` (Qwen3-style `enable_thinking`), or empty for the template's default. A record's own
    `enable_thinking` (or `chat_template_kwargs`) wins. The eval stage uses the same unless
    `eval.thinking` says otherwise."""
    turns: str = "all"
    """Which assistant turns of a conversation the target answers when regenerating: `all` (turn by
    turn, each prompt holding its own earlier answers; every answer trained) or `last`."""
    regenerate_max_new_tokens: int = 128
    regenerate_batch_size: int = 32
    regenerate_engine: str = "hf"
    """`hf`: the target answers in the training process, caching features in the same pass; `vllm`:
    through a vLLM server (exact token ids; features then take one target pass over the answers)."""
    regenerate_server: str = ""
    """`vllm` engine: URL of a running server of the target (empty: start one from .venv-vllm)."""
    regenerate_temperature: float = 0.0
    """`vllm` engine: sampling temperature (0 = greedy); top_p below."""
    regenerate_top_p: float = 1.0
    regenerate_concurrency: int = 32
    """`vllm` engine: requests in flight (vLLM batches them continuously)."""
    regenerate_vllm_args: list[str] = field(default_factory=list)
    """`vllm` engine: extra `vllm serve` flags, passed unchanged, e.g. [--tensor-parallel-size, "8"]."""
    max_length: int = 256
    """Tokens per example after the chat template; longer examples are truncated."""
    max_examples: int = 0
    """Keep at most this many training examples (0 = all)."""
    group_by_length: bool = True
    """Batch examples of similar length together to waste less compute on padding."""
    packing: bool = False
    """Pack whole examples end to end into rows of `max_length` tokens, each attending only to itself
    (data/packing.py): a micro-batch is then `optim.batch_size` rows, a fixed token budget with little
    padding, as speculators and SpecForge batch. Off: one example a row, padded to the longest."""
    offline_features: str = ""
    """Folder written by `draftsmith data features`; `auto` = build it once in the cache dir and reuse
    it (one target pass over the data, then every epoch is drafter-only); empty = online features."""
    features_engine: str = "hf"
    """Who computes the offline feature cache: `hf` (the target in the training process) or `vllm`
    (vLLM's extract_hidden_states method over the same tokens, docs/vllm-features.md; one engine on
    the main rank, with `features_vllm_args`), for targets no trainer GPU holds."""
    features_vllm_args: list[str] = field(default_factory=list)
    """`features_engine: vllm`: extra vLLM engine flags, passed unchanged, e.g. [--tensor-parallel-size, "8"]."""
    num_proc: int = 1

    def __post_init__(self):
        if self.malformed not in ("skip", "error"):
            raise DraftsmithError(f"data.malformed: expected skip or error, got {self.malformed!r}")
        joined_sources(self.train, "data.train")  # `a+` or `a++b`: an empty source, named now
        joined_sources(self.holdout, "data.holdout")
        self.thinking = thinking_switch(self.thinking, "data.thinking")
        if self.turns not in TURNS:
            raise DraftsmithError(f"data.turns: expected all or last, got {self.turns!r}")
        if self.features_engine not in ("hf", "vllm"):
            raise DraftsmithError(f"data.features_engine: expected hf or vllm, got {self.features_engine!r}")
        if self.features_engine == "hf" and self.features_vllm_args:
            raise DraftsmithError("data.features_vllm_args: these go to vLLM; set data.features_engine: vllm")
        if self.regenerate_engine not in ("hf", "vllm"):
            raise DraftsmithError(f"data.regenerate_engine: expected hf or vllm, got {self.regenerate_engine!r}")
        if self.regenerate_engine == "hf" and (
            self.regenerate_server or self.regenerate_temperature or self.regenerate_vllm_args
        ):
            raise DraftsmithError(
                "data.regenerate_server / regenerate_temperature / regenerate_vllm_args: "
                "these go to vLLM; set data.regenerate_engine: vllm"
            )

    def vllm_options(self, target: str, dtype: str, cache_dir: str = "") -> dict | None:
        """`regenerate_vllm`'s keyword arguments for `regenerate_engine: vllm` (None for hf)."""
        if self.regenerate_engine != "vllm":
            return None
        from draftsmith.target.load import resolve_target  # torch and transformers: only when it is used

        return {
            "target": str(resolve_target(target, cache_dir)),
            "server": self.regenerate_server or None,
            "temperature": self.regenerate_temperature,
            "top_p": self.regenerate_top_p,
            "concurrency": self.regenerate_concurrency,
            "dtype": dtype,
            "extra": tuple(str(a) for a in self.regenerate_vllm_args),
        }


@dataclass
class RecipeData:
    """The part of a recipe the `data` commands read: its `data:` section and the target's keys (the
    fields of the same names in train/config.py Config, with the same defaults: tests/train/test_config.py)."""

    data: DataConfig = field(default_factory=DataConfig)
    target: str = "smollm2-135m"
    target_dtype: str = "auto"
    cache_dir: str = ""


def recipe_data(recipe: str | None, overrides: list[str] | None = None) -> RecipeData:
    """Defaults < recipe YAML < `key=value` overrides, merged as train/config.py load_config merges
    them, for the `data:` section (every key checked) and the target's keys. The other sections are
    train's: `draftsmith train` and `plan` check them; a data command leaves them alone."""
    raw = read_yaml(recipe) if recipe else {}
    raw = _merge(raw, parse_overrides(overrides or []))
    mine = {f.name for f in fields(RecipeData)}
    return from_dict(RecipeData, {k: v for k, v in raw.items() if k in mine}, str(recipe) if recipe else "config")
