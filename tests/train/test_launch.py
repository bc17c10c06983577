"""launch.sh: presets, --dry-run, SLURM environment; every preset file is well formed."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
RECIPE = "recipes/cpu/eagle3-smollm2.yaml"
PRESETS = ["single-gpu", "multi-gpu", "multi-node", "zero2", "zero3", "zero3-offload", "fsdp", "cpu-2proc"]


def _launch(*args, env=None):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "MASTER_ADDR"}
    return subprocess.run(
        ["bash", "launch.sh", RECIPE, *args], cwd=ROOT, capture_output=True, text=True, env={**clean, **(env or {})}
    )


def test_dry_run_prints_the_exact_accelerate_command_for_a_preset():
    out = _launch(
        "--preset",
        "zero2",
        "--gpus",
        "8",
        "--nodes",
        "2",
        "--node-rank",
        "1",
        "--main-addr",
        "10.0.0.1",
        "--dry-run",
        "optim.lr=1e-4",
    )
    assert out.returncode == 0, out.stderr
    cmd = out.stdout.split()
    assert cmd[:2] == ["accelerate", "launch"] and cmd[cmd.index("--config_file") + 1].endswith(
        "recipes/accelerate/zero2.yaml"
    )
    assert cmd[cmd.index("--num_processes") + 1] == "16" and cmd[cmd.index("--machine_rank") + 1] == "1"
    assert cmd[cmd.index("--main_process_ip") + 1] == "10.0.0.1"
    assert cmd[-3:] == ["train", RECIPE, "optim.lr=1e-4"]


def test_slurm_variables_fill_nodes_rank_host_and_gpus():
    env = {
        "SLURM_JOB_ID": "42",
        "SLURM_NNODES": "4",
        "SLURM_NODEID": "3",
        "MASTER_ADDR": "gpu-node-01",
        "SLURM_GPUS_ON_NODE": "8",
    }
    cmd = _launch("--preset", "multi-node", "--dry-run", env=env).stdout.split()
    assert cmd[cmd.index("--num_machines") + 1] == "4" and cmd[cmd.index("--machine_rank") + 1] == "3"
    assert cmd[cmd.index("--main_process_ip") + 1] == "gpu-node-01" and cmd[cmd.index("--num_processes") + 1] == "32"


def test_an_unknown_preset_lists_the_valid_ones():
    out = _launch("--preset", "zero4", "--dry-run")
    assert out.returncode == 2 and "unknown preset 'zero4' (valid: " in out.stderr
    assert all(p in out.stderr for p in PRESETS)


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_is_well_formed(preset):
    config = yaml.safe_load((ROOT / "recipes" / "accelerate" / f"{preset}.yaml").read_text())
    assert config["distributed_type"] in ("NO", "MULTI_GPU", "MULTI_CPU", "DEEPSPEED", "FSDP")
    if config["distributed_type"] == "DEEPSPEED":
        ds = json.loads((ROOT / config["deepspeed_config"]["deepspeed_config_file"]).read_text())
        assert ds["zero_optimization"]["stage"] == int(preset[4]) and ds["zero_allow_untested_optimizer"]
        assert ("offload_optimizer" in ds["zero_optimization"]) == preset.endswith("offload")
