"""Multi-process runs never park a rank behind one that works alone: regeneration and the feature
cache are split over the ranks (identical to one process), and the final eval on rank 0 keeps no
other rank in a collective (a 3-second process-group timeout does not fail a longer eval)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from safetensors.torch import load_file

from tests.conftest import MULTIPROCESS, write_pattern_chats
from tests.ranks import run_ranks

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1"}
TWO = 2  # ranks, forked (tests/ranks.py) in torchrun's environment
ONE = [sys.executable, "-m", "draftsmith.cli", "train"]


def _args(tmp_path, target, data, run, **extra):
    recipe = tmp_path / "empty.yaml"
    recipe.write_text("{}\n")
    base = {
        "target": target,
        "output_dir": tmp_path,
        "run": run,
        "data.train": data,
        "data.holdout": data,
        "data.max_length": 64,
        "optim.batch_size": 2,
        "optim.max_steps": 2,
        "optim.warmup_steps": 1,
        "eval.enabled": False,
        **extra,
    }
    return [str(recipe), *(f"{k}={v}" for k, v in base.items())]


def _launch(cmd, args):
    """ONE: a plain `python -m draftsmith.cli train ARGS`; TWO: two ranks of it."""
    t0 = time.perf_counter()
    if cmd == TWO:
        done = run_ranks(TWO, "draftsmith.cli", ["train", *args], env=ENV)
    else:
        done = subprocess.run(cmd + args, env=ENV, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, time.perf_counter() - t0


def _features(folder: Path) -> dict:
    return {k: v for f in sorted(folder.glob("shard-*.safetensors")) for k, v in load_file(f).items()}


@MULTIPROCESS
def test_two_ranks_regenerate_and_cache_features_exactly_as_one_process(tiny_target_dir, tmp_path):
    data = write_pattern_chats(tmp_path / "chats.jsonl", range(12))
    common = {
        "data.regenerate": "true",
        "data.regenerate_max_new_tokens": 12,
        "data.regenerate_batch_size": 2,
        "data.offline_features": "auto",
    }
    _, t1 = _launch(ONE, _args(tmp_path, tiny_target_dir, data, "one", cache_dir=tmp_path / "c1", **common))
    out, t2 = _launch(TWO, _args(tmp_path, tiny_target_dir, data, "two", cache_dir=tmp_path / "c2", **common))
    assert "2 process(es)" in out
    one, two = (sorted((tmp_path / c / "regenerated").glob("*.jsonl")) for c in ("c1", "c2"))
    assert len(one) == len(two) == 1 and one[0].read_bytes() == two[0].read_bytes()  # identical records
    assert not list((tmp_path / "c2" / "regenerated").glob("*.partial*"))  # every rank's partial file merged
    f1, f2 = (next(p for p in (tmp_path / c / "regenerated").iterdir() if p.is_dir()) for c in ("c1", "c2"))
    a, b = _features(f1), _features(f2)
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)  # both ranks' shares, bit for bit
    shards = json.loads((f2 / "index.json").read_text())["shards"]
    assert {s["file"].split("-")[1] for s in shards} == {"r0", "r1"}  # written by both ranks
    print(f"regeneration + features + 2 steps: 1 process {t1:.1f} s, 2 processes {t2:.1f} s")


@MULTIPROCESS
def test_a_final_eval_longer_than_the_process_group_timeout_does_not_fail_the_other_rank(tiny_target_dir, tmp_path):
    data = write_pattern_chats(tmp_path / "chats.jsonl", range(12))
    out, seconds = _launch(
        TWO,
        _args(
            tmp_path,
            tiny_target_dir,
            data,
            "r",
            **{
                "dist_timeout_minutes": 0.05,
                "eval.enabled": "true",
                # all 12 holdout prompts, 200 tokens: 4 x 120 took 1.9 s on a native-bf16 EPYC, under the timeout
                "eval.num_prompts": 12,
                "eval.max_new_tokens": 200,
            },
        ),
    )
    timings = json.loads((tmp_path / "r" / "timings.json").read_text())
    assert timings["eval"] > 3.0, timings  # rank 0 worked alone for longer than the 3-second timeout
    assert (tmp_path / "r" / "eval" / "report.json").is_file()
