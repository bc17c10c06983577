"""The registry is explicit; this keeps it in sync with the modules and the recipes."""

import importlib
import pkgutil

import torch
import yaml

import draftsmith.models as models_pkg
from draftsmith.models.registry import DRAFTERS, INTERFACE
from tests.train.test_config import RECIPES


def test_every_registered_family_has_the_shared_interface():
    for name, module in DRAFTERS.items():
        missing = [attr for attr in INTERFACE if not hasattr(module, attr)]
        assert not missing, f"{name} lacks {missing}"
        assert module.NAME == name
        assert callable(module.feature_names), "a family must declare the target features it trains on"


def test_every_family_module_is_registered():
    families = []
    for info in pkgutil.iter_modules(models_pkg.__path__):
        module = importlib.import_module(f"draftsmith.models.{info.name}")
        if hasattr(module, "NAME") and hasattr(module, "compute_loss"):
            families.append(module.NAME)
    assert sorted(families) == sorted(DRAFTERS)


def test_every_recipe_names_a_registered_drafter():
    for recipe in RECIPES:
        data = yaml.safe_load(recipe.read_text())
        assert data["drafter"]["type"] in DRAFTERS, recipe


def test_fingerprint_ignores_load_dtype_and_sees_an_update_of_any_one_matrix(tiny_target_dir):
    from draftsmith.target.load import fingerprint, load_target

    fp32, _ = load_target(str(tiny_target_dir), "fp32")
    bf16, _ = load_target(str(tiny_target_dir), "bf16")
    assert fingerprint(fp32) == fingerprint(bf16)
    before = fingerprint(fp32)
    with torch.no_grad():  # what a merged LoRA update does to one projection, and nothing else
        fp32.model.layers[-1].self_attn.v_proj.weight.add_(0.05)
    assert fingerprint(fp32) != before
