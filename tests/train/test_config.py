from pathlib import Path

import pytest

from draftsmith import DraftsmithError
from draftsmith.train.config import drafter_config, load_config

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted(p for p in (ROOT / "recipes").rglob("*.yaml") if p.parts[-2] not in ("accelerate", "deepspeed"))


def test_precedence_defaults_recipe_overrides(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("run: a\noptim:\n  lr: 1.0e-3\n  batch_size: 2\ndrafter:\n  type: eagle\n  feature_noise: 0.2\n")
    cfg = load_config(recipe, ["optim.lr=5e-4", "drafter.feature_noise=0"])
    assert cfg.run == "a"  # from the recipe
    assert cfg.optim.batch_size == 2  # from the recipe
    assert cfg.optim.lr == 5e-4  # override beats recipe
    assert cfg.optim.grad_accum == 1  # default
    assert drafter_config(cfg).feature_noise == 0.0
    assert drafter_config(cfg).token_loss_weight == 0.1


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.lrr=1", "unknown key 'lrr'; did you mean 'lr'"),
        ("optimm.lr=1", "unknown key 'optimm'; did you mean 'optim'"),
        ("drafter.feature_nois=0", "unknown key 'feature_nois'; did you mean 'feature_noise'"),
        ("drafter.type=eagel", "unknown drafter 'eagel'"),
        ("optim.batch_size=four", "expected int"),
        ("optim.schedule=step", "optim.schedule must be"),
        ("eval.timing_runs=0", "eval.timing_runs must be an integer >= 1"),
        ("noequals", "expected key=value"),
    ],
)
def test_bad_keys_and_values_are_one_line_errors(override, message):
    with pytest.raises(DraftsmithError, match=message) as e:
        load_config(None, [override])
    assert "\n" not in str(e.value)


def test_bad_recipe_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(DraftsmithError, match="bad.yaml: expected a mapping"):
        load_config(bad)
    with pytest.raises(DraftsmithError, match="recipe file not found"):
        load_config(tmp_path / "missing.yaml")


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shipped_recipe_validates(recipe):
    cfg = load_config(recipe)
    drafter_config(cfg)
    assert cfg.run


def test_recipes_exist():
    names = {str(p.relative_to(ROOT / "recipes")) for p in RECIPES}
    assert {
        "cpu/eagle-smollm2.yaml",
        "llama-3.1-8b/eagle.yaml",
        "cpu/medusa1-smollm2.yaml",
        "cpu/medusa2-smollm2.yaml",
        "vicuna-7b/medusa1.yaml",
        "vicuna-7b/medusa2.yaml",
        "llama-3.1-8b/medusa1.yaml",
        "llama-3.1-8b/medusa2.yaml",
        "cpu/distill-smollm2.yaml",
        "cpu/domain-prose-smollm2.yaml",
        "llama-3.1-8b/distill-1b.yaml",
        "qwen2.5-7b/distill-0.5b.yaml",
        "llama-3.1-70b/distill-3b.yaml",
    } <= names


def test_the_data_commands_read_a_recipe_as_train_does():
    """`data inspect` reads the `data:` section and the target's keys itself (data/config.py: data sits
    below train); the same recipe and overrides give the same values, defaults included."""
    from draftsmith.data.config import RecipeData, recipe_data

    for recipe, overrides in [(None, []), *((r, ["data.max_length=64", "cache_dir=/tmp/c"]) for r in RECIPES)]:
        cfg = load_config(recipe, overrides)
        assert recipe_data(recipe, overrides) == RecipeData(cfg.data, cfg.target, cfg.target_dtype, cfg.cache_dir)
    with pytest.raises(DraftsmithError, match=r"^config.data: unknown key 'max_lenght'; did you mean 'max_length'"):
        recipe_data(None, ["data.max_lenght=64"])
