"""The benchmark scripts run end to end on tiny models (their figures come from real runs only)."""

import dataclasses

import pytest
import torch

from benchmarks import verify_cost
from tests.conftest import MULTIPROCESS


def test_verify_cost_prints_a_row_per_dtype_and_kernels(tiny_target_dir, capsys):
    verify_cost.main(["--target", str(tiny_target_dir), "--dtypes", "float32", "--tokens", "1", "4", "--context", "16"])
    out = capsys.readouterr().out
    for kernels in ("default", "packed"):
        ms_row = next(line for line in out.splitlines() if line.startswith(f"| float32, {kernels} ms"))
        values = [float(v) for v in ms_row.strip("|").split("|")[1:]]
        assert len(values) == 2 and all(v > 0 for v in values)
        assert f"| float32, {kernels} / n=1 | 1.00 |" in out


def test_precision_bench_prints_ratios_and_what_auto_picks(tiny_target_dir, capsys):
    from benchmarks import precision

    precision.main(["--target", str(tiny_target_dir), "--matmul", "64"])
    out = capsys.readouterr().out
    assert "auto picks float32" in out or "auto picks bfloat16" in out
    rows = [l for l in out.splitlines() if l.startswith("| ") and "measurement" not in l]
    assert len(rows) == 4 and all(float(l.strip("|").split("|")[3]) > 0 for l in rows)


def test_near_ties_scores_every_token_once_and_finds_no_flip_in_fp32(tiny_target_dir, capsys):
    """Teacher-forced verification passes score each reference token after the first exactly once; in
    fp32 (prepacked oneDNN linears, batch-invariant rows) a pass of K+1 rows picks what the one-token
    decode picked. Scoring against the wrong row (an off-by-one) would flip most tokens."""
    from benchmarks import near_ties

    r = near_ties.measure(str(tiny_target_dir), "float32", "builtin:code-holdout", prompts=2, max_new=12, k=3)
    assert r["scored"] == 2 * 11 and r["flips"] == 0 and r["per_1000"] == 0.0
    from draftsmith.engine.speculative import target_decode
    from draftsmith.target.load import load_target

    target, _ = load_target(str(tiny_target_dir), "float32")
    ref = target_decode(target, [5, 6, 7], 12, set())
    assert near_ties.flips(target, [5, 6, 7], ref, 3)[1] == 0
    other = torch.randint(5, 100, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    assert near_ties.flips(target, [5, 6, 7], other, 3)[1] > 3  # not the target's own decode: rows disagree


@pytest.mark.fp32_exact
def test_staleness_update_makes_a_loadable_different_target(tiny_target, chat_jsonl, tmp_path):
    from benchmarks.staleness import update_target
    from draftsmith.target.load import fingerprint, load_target

    target, tok = tiny_target
    out = update_target(target, tok, str(chat_jsonl), tmp_path / "updated", steps=3, batch_size=2, lr=1e-2, rank=4)
    updated, _ = load_target(str(out), "fp32")
    assert fingerprint(updated) != fingerprint(target)  # a new target: the drafter is now stale
    assert not (tmp_path / "updated.tmp").exists()
    x = torch.tensor([[1, 2, 3, 4]])
    assert not torch.allclose(updated(x).logits, target(x).logits)


@MULTIPROCESS
def test_scaling_bench_runs_two_processes_through_launch_sh(tiny_target_dir, chat_jsonl, tmp_path, capsys):
    """The bench end to end, its 2-process row only (a real `launch.sh --cpu-procs 2`: DDP over gloo);
    the 1-process row is the same code with one process fewer."""
    import json

    from benchmarks import scaling

    recipe = tmp_path / "empty.yaml"
    recipe.write_text("{}\n")
    scaling.main(
        [
            "--recipe",
            str(recipe),
            "--steps",
            "4",
            "--batch-size",
            "4",
            "--setups",
            "ddp",
            "--procs",
            "2",
            "--out",
            str(tmp_path / "s"),
            f"target={tiny_target_dir}",
            f"data.train={chat_jsonl}",
            f"data.holdout={chat_jsonl}",
            "data.max_length=64",
        ]
    )
    rows = json.loads((tmp_path / "s" / "scaling.json").read_text())["rows"]
    assert [(r["setup"], r["processes"]) for r in rows] == [("ddp", 2)]
    assert all(r["tokens_per_s"] > 0 and r["peak_rss_gb_rank0"] > 0 for r in rows)
    assert rows[0]["tokens_per_s_per_process"] == rows[0]["tokens_per_s"] / 2
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ddp |")]
    assert len(table) == 1 and table[0].split("|")[5].strip() == "-"  # no 1-process row to compare with


@pytest.mark.parametrize("family", ["dflash", "dspark", "dflash2"])
def test_block_step_cost_times_a_real_step_and_counts_every_trained_slot(family, tmp_path):
    """One micro-batch of a tiny 4-layer target: the step trains as many slot rows as the blocks it
    samples have drafting slots, and each timing is a positive wall time."""
    from benchmarks import block_step_cost
    from benchmarks.tiny_target import TINY_DRAFTERS
    from draftsmith.models.registry import drafter_family
    from draftsmith.target.load import load_target
    from tests.conftest import save_target

    target, _ = load_target(str(save_target(tmp_path, layers=4)), "float32")
    fam = drafter_family(family)
    cfg = fam.DrafterConfig(**{k.removeprefix("drafter."): v for k, v in TINY_DRAFTERS[family].items()}, num_anchors=5)
    if hasattr(cfg, "draft_vocab_size"):  # as the CPU recipes: the benchmark times the whole vocabulary
        cfg = dataclasses.replace(cfg, draft_vocab_size=40)
    ids = torch.randint(5, 100, (2, 20), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    r = block_step_cost.measure(family, cfg, target, batch, draft_vocab=32, reps=1)
    # 5 anchors per sequence, K drafts each: B-1 mask slots, B for DSpark anchor-as-first (its anchor drafts too)
    assert r["slot_rows"] == 2 * 5 * (cfg.block_size - (0 if getattr(cfg, "sample_from_anchor", False) else 1))
    assert min(r["step_s"], r["full_vocab_s"], r["draft_vocab_s"]) > 0


def test_train_throughput_times_every_family_in_parts_that_add_up_to_the_step(tmp_path, chat_jsonl):
    """Every registered family, one timed step on a 3-layer tiny target (the families' tiny sizes): the
    parts (features, drafter, logits, loss, backward, optimizer) are each >= 0 and add up to the step,
    and the padding share is the batches' padded positions (chat answers of several lengths: > 0)."""
    import json

    from benchmarks import train_throughput
    from draftsmith.models.registry import DRAFTERS
    from tests.conftest import save_target

    target = save_target(tmp_path / "target", layers=3)
    out = tmp_path / "throughput.json"
    argv = ["--target", str(target), "--data", str(chat_jsonl), "--dtypes", "float32", "--steps", "1"]
    train_throughput.main([*argv, "--examples", "48", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["family"] for r in rows] == list(DRAFTERS)
    for r in rows:
        shares = r["share"]
        assert set(shares) == set(train_throughput.PARTS) and min(shares.values()) >= 0, r
        assert 0.97 < sum(shares.values()) <= 1.0 + 1e-6, r  # the step is exactly these parts' clocks
        assert shares["logits"] > 0 and r["tokens_per_s"] > r["trained_tokens_per_s"] > 0, r
        assert 0 < r["padding"] < 0.5, r
    # Packed rows (data.packing): two answers a 96-token row, little of it padding; the same parts.
    two = ",".join(list(DRAFTERS)[:2])
    rows_of_two = ["--set", "data.max_length=96", "optim.batch_size=4"]  # 48 short answers: 24 rows, 6 batches
    train_throughput.main([*argv, "--examples", "48", "--packing", "--families", two, *rows_of_two, "--out", str(out)])
    packed = json.loads(out.read_text())["rows"]
    for p in packed:
        assert p["packing"] and 0.97 < sum(p["share"].values()) <= 1.0 + 1e-6, p
        assert p["padding"] < 0.1, p
    # From an offline cache (as the quickstart trains after its first pass): the same parts.
    train_throughput.main([*argv, "--examples", "48", "--features", "cache", "--families", "eagle3", "--out", str(out)])
    (row,) = json.loads(out.read_text())["rows"]
    assert row["features"] == "cache" and 0.97 < sum(row["share"].values()) <= 1.0 + 1e-6, row
