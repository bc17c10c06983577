"""FSDP: the frozen target sharded with torch's FSDP2, for real on 2 CPU processes (gloo), and the
fsdp preset refusing CPUs, where accelerate would not enable FSDP and every rank would train alone."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from draftsmith import DraftsmithError
from draftsmith.train.config import load_config, resolve_precision
from draftsmith.train.loop import make_accelerator

ROOT = Path(__file__).resolve().parents[1]


def test_a_sharded_target_gives_the_same_features_losses_and_gradients_and_holds_half(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "tests" / "fsdp_worker.py"), str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # A rank that gathers a unit the other does not call would hang: the timeout turns that into a failure.
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for family in ("eagle3", "eagle"):
        for r in ranks:
            case = r[family]
            assert case["max_diff"] <= 1e-6 and case["tensors"] >= 4, (family, case)
            assert 0.45 * case["full"] < case["held"] < 0.55 * case["full"], (family, case)
        assert ranks[0][family]["loss"] != ranks[1][family]["loss"]  # each rank saw its own batch


def test_the_fsdp_preset_on_cpus_is_a_one_line_error(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(DraftsmithError, match="the fsdp preset needs GPUs: accelerate enables FSDP only on accelerators"):
        make_accelerator(resolve_precision(load_config(None, [])))
