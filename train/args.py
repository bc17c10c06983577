"""The flags of the commands that read a whole recipe (`draftsmith train`, `plan`): one dataclass a
command, one field a flag, the docstring its help (draftsmith/util/flags.py builds the parser). Light
on purpose: `draftsmith --help` imports this module, and train/commands.py only when one runs. The
`data` commands' flags, `data features` and `data inspect` included, are data/args.py's."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(kw_only=True)
class RecipeArgs:  # `draftsmith train` takes just these
    recipe: str = field(metadata={"positional": True})
    """recipe YAML, e.g. recipes/cpu/eagle-smollm2.yaml"""
    overrides: list[str] = field(default_factory=list, metadata={"positional": True})
    """key=value overrides, e.g. optim.lr=1e-4 resume=true"""


@dataclass(kw_only=True)
class PlanArgs(RecipeArgs):
    gpus: int = 1
    """GPUs per node"""
    nodes: int = 1
    preset: str | None = None
    """one preset only (default: all)"""
    gpu_memory: float = 80.0
    """GiB per GPU, for the `fits` column"""
