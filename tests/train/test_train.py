"""The shared loop: end to end on a tiny target, resume, NaN stop, corrupt checkpoints,
offline features, and 1 vs 2 processes."""

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from benchmarks.tiny_target import TINY_RUNS
from draftsmith import DraftsmithError
from draftsmith.eval.report import REPORT_KEYS
from draftsmith.models.registry import DRAFTERS
from draftsmith.train import checkpoint
from draftsmith.train.config import load_config
from draftsmith.train.loop import train
from tests.conftest import MULTIPROCESS
from tests.ranks import run_ranks

ROOT = Path(__file__).resolve().parents[2]


def _overrides(target_dir, data, out, **extra):
    base = {
        "target": str(target_dir),
        "output_dir": str(out),
        "run": "r",
        "data.train": str(data),
        "data.holdout": str(data),
        "data.max_length": 64,
        "optim.batch_size": 4,
        "optim.max_steps": 6,
        "optim.warmup_steps": 2,
        "optim.lr": 1e-2,
        "log_every": 1,
        "eval.enabled": False,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def _weights(run_dir):
    return load_file(Path(run_dir) / "final" / "model.safetensors")


def test_train_end_to_end_writes_drafter_and_eval_report(tiny_target_dir, other_target_dir, chat_jsonl, tmp_path):
    cfg = load_config(
        None,
        _overrides(
            tiny_target_dir,
            chat_jsonl,
            tmp_path,
            **{"eval.enabled": True, "eval.num_prompts": 3, "eval.max_new_tokens": 12, "eval.k": 3},
        ),
    )
    run = train(cfg)
    for f in [
        "resolved_config.yaml",
        "final/config.json",
        "final/model.safetensors",
        "step-000006/trainer_state.json",
        "eval/report.json",
        "eval/report.md",
        "eval/acceptance.png",
        "train_log.jsonl",
    ]:
        assert (run / f).is_file(), f
    report = json.loads((run / "eval" / "report.json").read_text())
    assert set(REPORT_KEYS) <= set(report) and report["lossless"] and report["k"] == 3
    assert len(report["per_position"]) == 3 and 1.0 <= report["tau"] <= 4.0
    log = [json.loads(l) for l in (run / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["loss"] < log[0]["loss"]  # it learns something even in 6 steps
    # A drafter trained for another target is refused by eval.
    from draftsmith.models.registry import load_drafter
    from draftsmith.target.load import load_target

    other, _ = load_target(str(other_target_dir))
    with pytest.raises(DraftsmithError, match="trained for target"):
        load_drafter(run / "final", other)
    mine, _ = load_target(str(tiny_target_dir))
    family, _, drafter = load_drafter(run / "final", mine)  # loads standalone, without the run's config
    assert family.NAME == "eagle"


# Medusa-2 trains the target through LoRA, heads only for 2 steps, then jointly: its checkpoints
# carry the adapters, two optimizer groups and a late-starting schedule.
MEDUSA2 = {
    "drafter.type": "medusa",
    "drafter.num_heads": 2,
    "drafter.backbone": "lora",
    "drafter.backbone_lr": 1e-2,
    "drafter.lora_rank": 4,
    "drafter.heads_only_steps": 2,
}
# Every registered family at its tiny size and its LoRA variant (benchmarks/tiny_target.py, from the
# registry), and Medusa-2 in two stages.
# Packed batches (data/packing.py) through the loop: resumed mid-epoch, the packed epoch replays
# exactly; a block family's anchors are drawn per document.
PACKED = {"eagle3-packed": {**TINY_RUNS["eagle3"], "data.packing": "true"}}
PACKED["dflash-packed"] = {**TINY_RUNS["dflash"], "data.packing": "true"}
# Muon + AdamW (train/optimizer.py): both optimizers' states resume; Medusa-2's staged groups split.
MUON = {"dflash-muon": {**TINY_RUNS["dflash"], "optim.optimizer": "muon"}}
MUON["medusa2-staged-muon"] = {**MEDUSA2, "optim.optimizer": "muon"}
RUNS = {**TINY_RUNS, "medusa2-staged": MEDUSA2, **PACKED, **MUON}


@pytest.fixture(scope="module")
def target3_dir(tmp_path_factory):
    """Three layers: what the families' tiny sizes take (EAGLE-3's three distinct aux layers)."""
    from tests.conftest import save_target

    return save_target(tmp_path_factory.mktemp("target3"), layers=3)


@pytest.mark.parametrize("run", RUNS)
def test_resume_after_interruption_matches_uninterrupted(target3_dir, chat_jsonl, tmp_path, monkeypatch, run):
    family, tiny_target_dir = RUNS[run], target3_dir
    full = train(load_config(None, _overrides(tiny_target_dir, chat_jsonl, tmp_path / "a", save_every=3, **family)))

    real_save = checkpoint.save

    def save_then_die(accelerator, run_dir, step, state, keep_last):
        real_save(accelerator, run_dir, step, state, keep_last)
        raise KeyboardInterrupt  # the process dies right after the step-3 checkpoint

    monkeypatch.setattr(checkpoint, "save", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        train(load_config(None, _overrides(tiny_target_dir, chat_jsonl, tmp_path / "b", save_every=3, **family)))
    monkeypatch.setattr(checkpoint, "save", real_save)
    assert [p.name for p in checkpoint.list_steps(tmp_path / "b" / "r")] == ["step-000003"]
    resumed = train(
        load_config(
            None, _overrides(tiny_target_dir, chat_jsonl, tmp_path / "b", save_every=3, resume="true", **family)
        )
    )
    a, b = _weights(full), _weights(resumed)
    assert sorted(a) == sorted(b) and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_corrupt_checkpoint_and_nan_loss_are_clear_errors(tiny_target_dir, chat_jsonl, tmp_path, monkeypatch):
    run = train(load_config(None, _overrides(tiny_target_dir, chat_jsonl, tmp_path, **{"optim.max_steps": 2})))
    weights = run / "step-000002" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated
    with pytest.raises(DraftsmithError, match="corrupt checkpoint"):
        train(load_config(None, _overrides(tiny_target_dir, chat_jsonl, tmp_path, resume="true")))

    from draftsmith.models import eagle

    real = eagle.compute_loss
    calls = {"n": 0}

    def nan_at_third(*args, **kwargs):
        loss, n, m = real(*args, **kwargs)
        calls["n"] += 1
        return (loss * float("nan") if calls["n"] == 3 else loss), n, m

    monkeypatch.setattr(eagle.FAMILY, "compute_loss", nan_at_third)
    with pytest.raises(DraftsmithError, match=r"step 2: loss is nan \(nan/inf\).*last good checkpoint: .*step-000002"):
        train(load_config(None, _overrides(tiny_target_dir, chat_jsonl, tmp_path / "nan", save_every=1)))
    run = tmp_path / "nan" / "r"
    assert not (run / "final").exists() and not list(run.glob("*.tmp"))


@pytest.mark.fp32_exact
def test_offline_features_match_online_and_cost_4H_bytes_per_fp32_token(tiny_target_dir, chat_jsonl, tmp_path):
    from draftsmith.cli import main

    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        yaml.safe_dump({"target": str(tiny_target_dir), "data": {"train": str(chat_jsonl), "max_length": 64}})
    )
    assert main(["data", "features", str(recipe), "--out", str(tmp_path / "feats")]) == 0
    index = json.loads((tmp_path / "feats" / "index.json").read_text())
    shard_bytes = sum(os.path.getsize(tmp_path / "feats" / s["file"]) for s in index["shards"])
    assert index["dtype"] == "F32"  # features keep the dtype the target ran in (fp32 here)
    payload = index["num_tokens"] * 4 * index["hidden_size"]  # fp32, one captured layer
    assert payload <= shard_bytes < payload * 1.1 + 20_000  # only safetensors headers on top
    online = train(
        load_config(None, _overrides(tiny_target_dir, chat_jsonl, tmp_path / "on", **{"drafter.feature_noise": 0}))
    )
    offline = train(
        load_config(
            None,
            _overrides(
                tiny_target_dir,
                chat_jsonl,
                tmp_path / "off",
                **{"drafter.feature_noise": 0, "data.offline_features": str(tmp_path / "feats")},
            ),
        )
    )
    auto = train(
        load_config(
            None,
            _overrides(
                tiny_target_dir,
                chat_jsonl,
                tmp_path / "auto",
                **{"drafter.feature_noise": 0, "data.offline_features": "auto", "cache_dir": str(tmp_path / "cache")},
            ),
        )
    )
    assert len(list((tmp_path / "cache" / "features").glob("*/index.json"))) == 1
    first = [json.loads((r / "train_log.jsonl").read_text().splitlines()[0])["loss"] for r in (online, offline, auto)]
    assert first[0] == pytest.approx(first[1], rel=1e-5)  # fp32 cache vs fp32 online features
    assert first[1] == first[2]


@MULTIPROCESS
def test_the_two_process_tests_share_one_xdist_worker(request):
    """Under `--dist loadgroup` xdist suffixes a grouped test's id with `@multiprocess`; without it
    the 2-process tests silently run two at a time, 4 processes on 2 cores whose waits spin (pytest
    9.2 with pytest-xdist 3.8 does that: pytest-dev/pytest-xdist#1386)."""
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("not under pytest-xdist --dist loadgroup")
    assert request.node.nodeid.endswith("@multiprocess"), (
        f"{request.node.nodeid}: pytest-xdist is not grouping the 2-process tests; install pytest<9.2"
    )


# The draws each rank makes from its own generator (EAGLE's feature noise, P-EAGLE's sampled mask
# slots): off, in whichever family's config has them, so 1 and 2 processes train on the same.
NO_DRAWS = {"feature_noise": 0, "keep_ratio": 1, "keep_min": 1}


def _without_draws(run: dict) -> dict:
    fields = {f.name for f in dataclasses.fields(DRAFTERS[run["drafter.type"]].DrafterConfig)}
    return {**run, **{f"drafter.{k}": v for k, v in NO_DRAWS.items() if k in fields}}


@MULTIPROCESS
@pytest.mark.parametrize("run", RUNS)
@pytest.mark.fp32_exact
def test_two_processes_match_one_process_with_the_same_global_batch(target3_dir, chat_jsonl, tmp_path, run):
    family, tiny_target_dir = _without_draws(RUNS[run]), target3_dir
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1"}
    common = _overrides(tiny_target_dir, chat_jsonl, tmp_path, **{**family, "optim.max_steps": 4})
    recipe = tmp_path / "empty.yaml"
    recipe.write_text("{}\n")
    two = [str(recipe), *common, "run=two", "optim.batch_size=2"]
    one = train(load_config(None, [*common, "run=one", "optim.batch_size=4"]))  # in this process: no second start-up
    # Two ranks forked from preloaded modules (tests/ranks.py), in torchrun's environment.
    launched = run_ranks(2, "draftsmith.cli", ["train", *two], env=env)
    assert launched.returncode == 0, launched.stdout[-3000:] + launched.stderr[-3000:]
    assert "2 process(es)" in launched.stdout  # really two DDP ranks, not one
    a, b = _weights(one), _weights(tmp_path / "two")
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)


def test_tensorboard_tracker_writes_events(tiny_target_dir, chat_jsonl, tmp_path):
    pytest.importorskip("tensorboard")
    run = train(
        load_config(
            None, _overrides(tiny_target_dir, chat_jsonl, tmp_path, tracker="tensorboard", **{"optim.max_steps": 2})
        )
    )
    assert list(run.rglob("events.out.tfevents.*"))
