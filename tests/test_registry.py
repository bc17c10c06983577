"""The registry is explicit; this keeps it in sync with the modules and the recipes."""

import importlib
import pkgutil

import yaml

import draftsmith.models as models_pkg
from draftsmith.models.registry import DRAFTERS, INTERFACE
from tests.test_config import RECIPES


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
