"""`draftsmith compare`: drafters x holdouts in one table, one target-only baseline per holdout."""

import json

from draftsmith.cli import main


def test_compare_writes_one_row_per_drafter_and_holdout_with_a_shared_baseline(tiny_target_dir, chat_jsonl, tmp_path,
                                                                               capsys):
    from draftsmith.train.config import load_config
    from draftsmith.train.loop import train
    from tests.test_train import _overrides

    run = train(load_config(None, _overrides(tiny_target_dir, chat_jsonl, tmp_path, **{
        "drafter.type": "medusa", "drafter.num_heads": 2})))
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"prompt": f"count {i}", "completion": "0123"}) + "\n" for i in range(4)))
    out = tmp_path / "cmp"
    assert main(["compare", "--drafter", f"{run / 'final'}@static:[[0],[1],[0,0]]", "--drafter", "ngram",
                 "--drafter", "none", "--data", str(chat_jsonl), "--data", str(other), "--k", "2",
                 "--num-prompts", "3", "--max-new-tokens", "8", "--out", str(out)]) == 0
    reports = json.loads((out / "compare.json").read_text())
    assert len(reports) == 6 and {f.name for f in out.iterdir()} == {"compare.json", "compare.md", "compare.png"}
    assert all(r["lossless"] for r in reports)
    for holdout in (str(chat_jsonl), str(other)):
        rows = [r for r in reports if r["holdout"] == holdout]
        assert len({r["target_tokens_per_s"] for r in rows}) == 1  # the baseline is measured once and shared
    medusa = next(r for r in reports if r["drafter"].startswith("medusa"))
    assert medusa["tree"] == "static:[[0],[1],[0,0]]" and medusa["k"] == 2
    assert "| ngram |" in (out / "compare.md").read_text() and "| drafter | holdout |" in capsys.readouterr().out
