"""The GPU recipes: each loads, names a target (and a distill student) whose published config
models/known.py holds, and plans offline; and each known config is the model it names (its
parameter count is the published size). Recipes are found by glob, so a new one is covered."""

import re
from pathlib import Path

import pytest
import torch
import transformers

from draftsmith.cli import main
from draftsmith.models.known import KNOWN_CONFIGS, known_config
from draftsmith.train.config import load_config
from draftsmith.train.plan import PRESETS

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
# CPU recipes run the embedded target; accelerate/ holds launcher configs, not recipes.
GPU_RECIPES = sorted(p for p in RECIPES.rglob("*.yaml") if p.parent.name not in ("cpu", "accelerate"))
# Published sizes (model cards / safetensors totals), in billions of parameters.
PUBLISHED_B = {
    "meta-llama/Llama-3.1-8B-Instruct": 8.03,
    "meta-llama/Llama-3.1-70B-Instruct": 70.6,
    "meta-llama/Llama-3.2-1B-Instruct": 1.24,
    "meta-llama/Llama-3.2-3B-Instruct": 3.21,
    "lmsys/vicuna-7b-v1.3": 6.74,
    "Qwen/Qwen3-8B": 8.19,
    "Qwen/Qwen2.5-7B-Instruct": 7.62,
    "Qwen/Qwen2.5-0.5B-Instruct": 0.494,
    "Qwen/Qwen3-30B-A3B": 30.5,
    "google/gemma-3-1b-it": 1.0,
}


def recipe_id(path: Path) -> str:
    return str(path.relative_to(RECIPES))


def models_named(cfg) -> list[str]:
    """The target, and a distill student initialised from another model."""
    init = cfg.drafter.get("init", "truncate") if cfg.drafter["type"] == "distill" else "truncate"
    return [cfg.target] + ([init] if init != "truncate" else [])


@pytest.fixture
def no_hub(monkeypatch):
    """Planning must read nothing from the hub: every config, weight and tokenizer load fails."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"hub access while planning: {args[:1]}")

    for cls in (transformers.AutoConfig, transformers.AutoModelForCausalLM, transformers.AutoTokenizer):
        monkeypatch.setattr(cls, "from_pretrained", refuse)


def test_the_glob_finds_the_gpu_recipes():
    assert len(GPU_RECIPES) >= 10 and RECIPES / "qwen3-8b" / "eagle3.yaml" in GPU_RECIPES


@pytest.mark.parametrize("recipe", GPU_RECIPES, ids=recipe_id)
def test_recipe_loads_and_names_known_models(recipe):
    cfg = load_config(str(recipe), [])
    for name in models_named(cfg):
        assert name in KNOWN_CONFIGS, f"{recipe_id(recipe)}: {name} is not in models/known.py"


@pytest.mark.parametrize("recipe", GPU_RECIPES, ids=recipe_id)
def test_recipe_plans_offline_with_a_row_per_preset(recipe, no_hub, capsys):
    assert main(["plan", str(recipe), "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"target \d+\.\d\dB params, drafter \d+\.\dM own", out), out
    for preset in PRESETS:  # six GiB figures, then whether the total fits
        assert re.search(rf"^\| {preset} \|( \d+\.\d\d \|){{6}} (yes|no) \|$", out, re.M), (preset, out)
    assert "| yes |" in out, f"{recipe_id(recipe)} fits 80 GiB per rank under no preset:\n{out}"


@pytest.mark.parametrize("name", KNOWN_CONFIGS)
def test_known_config_is_the_published_model(name):
    config, arch = known_config(name), KNOWN_CONFIGS[name]["architectures"][0]
    # Gemma-3's text-only model has a config of its own (Gemma3Config is the multimodal model's).
    assert type(config).__name__ == {"Gemma3ForCausalLM": "Gemma3TextConfig"}.get(
        arch, arch.replace("ForCausalLM", "Config")
    )
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert type(model).__name__ == arch
    billions = sum(p.numel() for p in model.parameters()) / 1e9
    assert abs(billions / PUBLISHED_B[name] - 1) <= 0.03, (name, billions)


def test_unknown_models_are_none():
    assert known_config("meta-llama/Qwen3-8B") is None


def test_recipes_read_users_files_from_datasets():
    """Users' records live in datasets/ at the top of the repository (git-ignored), not in data/, the
    data room's code."""
    files = {
        (recipe_id(p), spec)
        for p in GPU_RECIPES
        for spec in (load_config(p).data.train, load_config(p).data.holdout)
        if spec.endswith((".jsonl", ".json", ".parquet"))
    }
    assert len(files) >= 18 and all(spec.startswith("datasets/") for _, spec in files), files
