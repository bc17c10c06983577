"""`init_from`: every family starts from a draftsmith drafter folder or from any format `draftsmith
export` writes, with identical weights (draft vocabulary included); bad inits are one-line errors;
a fine-tuning run reports both holdouts before and after."""

import json

import pytest
import torch

from draftsmith import DraftsmithError
from draftsmith.models import eagle, eagle3, medusa
from draftsmith.models.folder import load_state, save_drafter
from draftsmith.models.readers import init_weights
from draftsmith.models.registry import DRAFTERS
from draftsmith.ship.export import export
from draftsmith.target.load import fingerprint

# Every registered family at its tiny size (its record's `tiny`, for a 3-layer target), and a variant
# that size leaves out: Medusa's reduced draft vocabulary over the target's own lm_head.
CASES = {name: (name, family.tiny) for name, family in DRAFTERS.items()} | {
    "medusa-draft-vocab": ("medusa", {"num_heads": 2, "draft_vocab_size": 30, "original_lm_head": True}),
}


@pytest.fixture(scope="module")
def target3_dir(tmp_path_factory):
    """Three layers: what the families' tiny sizes take (EAGLE-3's three distinct aux layers)."""
    from tests.conftest import save_target

    return save_target(tmp_path_factory.mktemp("target3"), layers=3)


def _trained(family, cfg, target, seed):
    """A drafter whose every weight differs from a fresh build (a fresh build must not pass as loaded)."""
    torch.manual_seed(seed)
    ds = {"input_ids": [list(range(5 + seed, 90))], "loss_mask": [[1] * (85 - seed)]}
    drafter = family.build(cfg, target, ds)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return drafter


@pytest.mark.parametrize("case", CASES)
@pytest.mark.fp32_exact
def test_init_from_a_final_folder_and_every_export_format_loads_identical_weights(target3_dir, tmp_path, case):
    from draftsmith.target.load import load_target

    name, sizes = CASES[case]
    family, (target, tok) = DRAFTERS[name], load_target(str(target3_dir))
    cfg, formats = family.DrafterConfig(**sizes), list(family.EXPORTS)
    source = _trained(family, cfg, target, seed=0)
    meta = {
        "drafter": family.NAME,
        "drafter_config": {"type": family.NAME, **cfg.__dict__},
        "target": "tiny",
        "target_fingerprint": fingerprint(target),
    }
    final = save_drafter(source, tmp_path / "final", meta)
    folders = [final] + [export(final, target, fmt, tmp_path / fmt, tok) for fmt in formats]
    for folder in folders:
        fresh = family.build(cfg, target, {"input_ids": [list(range(60, 100))], "loss_mask": [[1] * 40]})
        init_weights(fresh, family.NAME, folder, target)
        want, got = source.state_dict(), fresh.state_dict()
        assert sorted(want) == sorted(got)
        for key in want:  # buffers too: an EAGLE-3 / Medusa draft vocabulary is the init's, not the new data's
            assert torch.equal(want[key], got[key]), (folder.name, key)


@pytest.mark.fp32_exact
def test_official_style_exports_without_draftsmiths_section_are_recognised(tiny_target, tmp_path):
    target, tok = tiny_target
    cfg = eagle3.DrafterConfig(aux_layers=[0, 1, 1], draft_vocab_size=40)
    source = _trained(eagle3, cfg, target, seed=1)
    meta = {
        "drafter": "eagle3",
        "drafter_config": {"type": "eagle3", **cfg.__dict__},
        "target": "tiny",
        "target_fingerprint": fingerprint(target),
    }
    out = export(save_drafter(source, tmp_path / "final", meta), target, "sglang", tmp_path / "published")
    config = json.loads((out / "config.json").read_text())
    del config["draftsmith"]  # as a head published by someone else would be
    (out / "config.json").write_text(json.dumps(config))
    fresh = eagle3.build(cfg, target)
    init_weights(fresh, "eagle3", out, target)
    assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in source.state_dict().items())


def test_bad_inits_are_one_line_errors(tiny_target, other_target_dir, tmp_path):
    from draftsmith.target.load import load_target

    target, tok = tiny_target
    cfg = medusa.DrafterConfig(num_heads=2)
    meta = {
        "drafter": "medusa",
        "drafter_config": {"type": "medusa", **cfg.__dict__},
        "target": "tiny",
        "target_fingerprint": fingerprint(target),
    }
    final = save_drafter(medusa.build(cfg, target), tmp_path / "final", meta)
    with pytest.raises(DraftsmithError, match="holds a medusa drafter, but this recipe trains eagle"):
        init_weights(eagle.build(eagle.DrafterConfig(), target), "eagle", final, target)
    with pytest.raises(DraftsmithError, match=r"tensor 'blocks.2.layers.0.linear.weight' has no place|no weights for"):
        init_weights(medusa.build(medusa.DrafterConfig(num_heads=3), target), "medusa", final, target)
    small = medusa.DrafterConfig(num_heads=2, draft_vocab_size=20)
    with pytest.raises(DraftsmithError, match=r"tensor 'lm_heads.0.weight' is \(\d+, 32\) there but \(20, 32\)"):
        init_weights(
            medusa.build(small, target, {"input_ids": [[5, 6]], "loss_mask": [[1, 1]]}), "medusa", final, target
        )
    other, _ = load_target(str(other_target_dir))
    with pytest.raises(DraftsmithError, match="trained for target 'tiny'.*init_from_stale=true"):
        init_weights(medusa.build(cfg, other), "medusa", final, other)
    refresh = medusa.build(cfg, other)  # the refresh after a target update says so, and then loads
    init_weights(refresh, "medusa", final, other, allow_stale=True)
    assert all(torch.equal(v, refresh.state_dict()[k]) for k, v in load_state(final).items())
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    with pytest.raises(DraftsmithError, match="unknown export format"):
        init_weights(medusa.build(cfg, target), "medusa", tmp_path / "odd", target)
    with pytest.raises(DraftsmithError, match="not a drafter folder"):
        init_weights(medusa.build(cfg, target), "medusa", tmp_path / "missing", target)


def test_a_fine_tuning_run_reports_both_holdouts_before_and_after(tiny_target_dir, chat_jsonl, tmp_path):
    from draftsmith.eval.config import EvalConfig
    from draftsmith.eval.run import evaluate_drafter
    from draftsmith.models.registry import load_drafter
    from draftsmith.target.load import load_target
    from draftsmith.train.config import load_config
    from draftsmith.train.loop import train
    from tests.train.test_train import _overrides

    first = train(
        load_config(
            None,
            _overrides(
                tiny_target_dir, chat_jsonl, tmp_path / "a", **{"drafter.type": "medusa", "drafter.num_heads": 2}
            ),
        )
    )
    other = tmp_path / "other.jsonl"  # a second "domain": the same prompts, other answers
    other.write_text(
        "".join(json.dumps({"prompt": f"count {i}", "completion": "0123456789" * 3}) + "\n" for i in range(24))
    )
    eval_keys = {"eval.enabled": True, "eval.num_prompts": 2, "eval.max_new_tokens": 10, "eval.k": 2}
    run = train(
        load_config(
            None,
            _overrides(
                tiny_target_dir,
                other,
                tmp_path / "b",
                **{
                    "drafter.type": "medusa",
                    "drafter.num_heads": 2,
                    "init_from": str(first / "final"),
                    "eval.general_holdout": str(chat_jsonl),
                    **eval_keys,
                },
            ),
        )
    )
    table = json.loads((run / "eval" / "before_after.json").read_text())
    assert set(table) == {str(other), str(chat_jsonl)} and all(set(r) == {"before", "after"} for r in table.values())
    assert "| holdout | τ before | τ after" in (run / "eval" / "before_after.md").read_text()
    # "before" is the init itself: the same τ as evaluating the first run's drafter on that holdout.
    target, tok = load_target(str(tiny_target_dir))
    family, dcfg, init = load_drafter(first / "final", target)
    cfg = EvalConfig(k=2, num_prompts=2, max_new_tokens=10)
    again = evaluate_drafter(family, init, dcfg, target, tok, str(chat_jsonl), None, cfg)
    assert table[str(chat_jsonl)]["before"]["tau"] == again["tau"]
