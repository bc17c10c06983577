"""The explicit registry of drafter families. Adding a family = one module + one line here;
tests/test_registry.py checks that every entry has the shared interface and that every recipe's
`drafter.type` is registered."""

from __future__ import annotations

import difflib
from types import ModuleType

from draftsmith import DraftsmithError
from draftsmith.models import distill, eagle, eagle3, medusa

DRAFTERS: dict[str, ModuleType] = {
    "eagle": eagle,
    "eagle3": eagle3,
    "medusa": medusa,
    "distill": distill,
}

# What every family module provides (checked by the registry test).
INTERFACE = ("NAME", "DrafterConfig", "feature_names", "max_draft_depth", "build", "rebuild", "param_groups",
             "compute_loss", "make_proposer", "verifier")


def drafter_module(name: str, where: str = "drafter.type") -> ModuleType:
    if name not in DRAFTERS:
        close = difflib.get_close_matches(str(name), list(DRAFTERS), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise DraftsmithError(f"{where}: unknown drafter '{name}' (registered: {', '.join(DRAFTERS)}){hint}")
    return DRAFTERS[name]
