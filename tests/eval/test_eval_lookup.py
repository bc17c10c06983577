"""`eval.lookup`: the eval stage's second row, the trained drafter with prompt lookup grafted onto its
drafts, decoded losslessly and shown under the drafter's own row in the table and report."""

import copy
import json

import pytest
import torch

from draftsmith import DraftsmithError
from draftsmith.engine.proposers import NgramProposer
from draftsmith.eval.config import EvalConfig
from draftsmith.eval.drafters import Resolved
from draftsmith.eval.report import format_table
from draftsmith.eval.run import evaluate, evaluate_drafter
from draftsmith.models import eagle3
from draftsmith.models.registry import drafter_family


@pytest.mark.fp32_exact
def test_lookup_row_is_lossless_and_follows_the_drafters_row(tiny_target, chat_jsonl, tmp_path):
    target, tok = tiny_target
    torch.manual_seed(0)
    dcfg = eagle3.DrafterConfig(aux_layers=[0, 1, 1])
    drafter = eagle3.build(dcfg, target).eval()
    cfg = EvalConfig(num_prompts=3, max_new_tokens=12, tree="dynamic:depth=2,top_k=2,tokens=3", lookup=True)
    family = drafter_family("eagle3")
    report = evaluate_drafter(family, drafter, dcfg, target, tok, str(chat_jsonl), tmp_path / "eval", cfg)
    row = report["with_lookup"]
    assert report["drafter"] == "eagle3" and row["drafter"] == "hybrid (eagle3 + lookup)"
    assert row["lossless"] is True and row["rule_exact"] is True and row["num_prompts"] == 3
    assert row["tree"] == cfg.tree and sum(row["draft_sources"].values()) > 0  # the hybrid's own counters
    # One target-only run, timed beside both rows, divides both speedups.
    assert row["target_tokens_per_s"] == report["target_tokens_per_s"] and row["new_tokens"] == report["new_tokens"]
    lines = format_table([report]).splitlines()
    assert len(lines) == 4 and lines[2].startswith("| eagle3 |") and lines[3].startswith("| hybrid (eagle3 + lookup) |")
    assert "| hybrid (eagle3 + lookup) |" in (tmp_path / "eval" / "report.md").read_text()
    assert json.loads((tmp_path / "eval" / "report.json").read_text())["with_lookup"]["tau"] == row["tau"]
    # Off by default: one row, no key.
    plain = evaluate_drafter(family, drafter, dcfg, target, tok, str(chat_jsonl), None, EvalConfig(num_prompts=1, k=2))
    assert "with_lookup" not in plain and len(format_table([plain]).splitlines()) == 3


def test_a_row_beside_must_share_the_verifier(tiny_target, chat_jsonl):
    target, tok = tiny_target
    other = copy.deepcopy(target)
    with pytest.raises(DraftsmithError, match="verified by another model"):
        evaluate(
            Resolved("ngram", NgramProposer(), target, None),
            tok,
            str(chat_jsonl),
            None,
            EvalConfig(num_prompts=1, k=2, max_new_tokens=4),
            beside=Resolved("ngram2", NgramProposer(), other, None),
        )
