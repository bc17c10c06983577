"""The benchmark scripts run end to end on tiny models (their figures come from real runs only)."""

import torch

from draftsmith.eval.bench import verify_cost


def test_verify_cost_prints_a_row_per_dtype_and_kernels(tiny_target_dir, capsys):
    verify_cost.main(["--target", str(tiny_target_dir), "--dtypes", "float32", "--tokens", "1", "4", "--context", "16"])
    out = capsys.readouterr().out
    for kernels in ("default", "packed"):
        ms_row = next(line for line in out.splitlines() if line.startswith(f"| float32, {kernels} ms"))
        values = [float(v) for v in ms_row.strip("|").split("|")[1:]]
        assert len(values) == 2 and all(v > 0 for v in values)
        assert f"| float32, {kernels} / n=1 | 1.00 |" in out


def test_precision_bench_prints_ratios_and_what_auto_picks(tiny_target_dir, capsys):
    from draftsmith.eval.bench import precision

    precision.main(["--target", str(tiny_target_dir), "--matmul", "64"])
    out = capsys.readouterr().out
    assert "auto picks float32" in out or "auto picks bfloat16" in out
    rows = [l for l in out.splitlines() if l.startswith("| ") and "measurement" not in l]
    assert len(rows) == 4 and all(float(l.strip("|").split("|")[3]) > 0 for l in rows)


def test_staleness_update_makes_a_loadable_different_target(tiny_target, chat_jsonl, tmp_path):
    from draftsmith.eval.bench.staleness import update_target
    from draftsmith.models.target import fingerprint, load_target

    target, tok = tiny_target
    out = update_target(target, tok, str(chat_jsonl), tmp_path / "updated", steps=3, batch_size=2, lr=1e-2, rank=4)
    updated, _ = load_target(str(out), "fp32")
    assert fingerprint(updated) != fingerprint(target)  # a new target: the drafter is now stale
    assert not (tmp_path / "updated.tmp").exists()
    x = torch.tensor([[1, 2, 3, 4]])
    assert not torch.allclose(updated(x).logits, target(x).logits)
