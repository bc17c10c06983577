"""FSDP, for real on 2 CPU processes (gloo): the frozen target sharded with torch's FSDP2; the training
loop under accelerate's FSDP2 (its state set as on GPUs, tests/train/fsdp_train_worker.py) reaching the
weights of one process and resuming; and the fsdp preset refusing CPUs, where accelerate would not
enable FSDP and every rank would train alone."""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from draftsmith import DraftsmithError
from draftsmith.train.config import load_config, resolve_precision
from draftsmith.train.loop import make_accelerator
from tests.conftest import MULTIPROCESS, lossless_ok
from tests.ranks import run_ranks

pytestmark = MULTIPROCESS
ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _torchrun(script: str, *args: str) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node 2 tests/train/SCRIPT ARGS`, its ranks forked (tests/ranks.py)."""
    # A rank that gathers a unit the other does not call would hang: the timeout turns that into a failure.
    out = run_ranks(2, str(ROOT / "tests" / "train" / script), list(args), env=ENV, timeout=600)
    # Both streams in the message: the one failure seen in a full-suite run left no cause on record.
    assert out.returncode == 0, f"rc {out.returncode}\nstdout: {out.stdout[-3000:]}\nstderr: {out.stderr[-5000:]}"
    return out


def test_a_sharded_target_gives_the_same_features_losses_and_gradients_and_holds_half(tmp_path):
    _torchrun("fsdp_worker.py", tmp_path)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for family in ("eagle3", "eagle"):
        for r in ranks:
            case = r[family]
            assert case["max_diff"] <= 1e-6 and case["tensors"] >= 4, (family, case)
            assert 0.45 * case["full"] < case["held"] < 0.55 * case["full"], (family, case)
        assert ranks[0][family]["loss"] != ranks[1][family]["loss"]  # each rank saw its own batch


def test_the_fsdp_preset_on_cpus_is_a_one_line_error(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(
        DraftsmithError, match="the fsdp preset needs GPUs: accelerate enables FSDP only on accelerators"
    ):
        make_accelerator(resolve_precision(load_config(None, [])))


def test_training_under_fsdp_matches_one_process_and_resumes(tiny_target_dir, tmp_path):
    from draftsmith.train.loop import train
    from tests.train.test_deepspeed import STEPS, _same
    from tests.train.test_train import _overrides, _weights

    rows = [
        {
            "messages": [
                {"role": "user", "content": f"say {i}"},
                {"role": "assistant", "content": "".join(chr(97 + (i * 7 + j) % 26) for j in range(20 + i % 13))},
            ]
        }
        for i in range(48)
    ]
    data, recipe = tmp_path / "chat.jsonl", tmp_path / "empty.yaml"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe.write_text("{}\n")
    common = _overrides(tiny_target_dir, data, tmp_path, **STEPS)
    one = train(load_config(None, [*common, "run=one", "optim.batch_size=4"]))
    out = _torchrun(
        "fsdp_train_worker.py",
        recipe,
        *common,
        "run=fsdp",
        "optim.batch_size=2",
        "save_every=2",
        "keep_last=5",
        "eval.enabled=true",
        "eval.num_prompts=2",
        "eval.max_new_tokens=8",
        "eval.k=2",
    )
    held = re.search(r"target sharded by FSDP: .* \(per-rank bytes \[(\d+), (\d+)\], full (\d+)\)", out.stdout)
    a, b, full = map(int, held.groups())
    assert all(0.45 * full < x < 0.55 * full for x in (a, b)), (a, b, full)
    assert "2 process(es)" in out.stdout and _same(_weights(one), _weights(tmp_path / "fsdp"))  # final/: whole tensors
    assert lossless_ok(json.loads((tmp_path / "fsdp" / "eval" / "report.json").read_text()))
    step2 = tmp_path / "fsdp" / "step-000002"
    out = _torchrun("fsdp_train_worker.py", recipe, *common, "run=resumed", "optim.batch_size=2", f"resume={step2}")
    assert f"resumed from {step2} at step 2" in out.stdout
    assert _same(_weights(tmp_path / "fsdp"), _weights(tmp_path / "resumed"), atol=1e-6)
