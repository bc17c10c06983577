"""DeepSpeed ZeRO-2/3 (and ZeRO-3 with CPU offload) through the shared loop, for real, on 2 CPU
processes (gloo): the same weights as one process with the same global batch, the frozen target
sharded under ZeRO-3, a consolidated `final/`, and ZeRO-3 checkpoints that resume (same world size)
or refuse another one in one line.

Marked `deepspeed` (select with `-m deepspeed`, skip with `-m "not deepspeed"`); skipped when
deepspeed is not installed. The zero3-offload preset as shipped uses DeepSpeed's CPU Adam, which
JIT-compiles on first use (150-250 CPU-seconds on a 2-core EPYC): its two tests are marked `cpu_adam`
and left out of scripts/test.sh's default run (`bash scripts/test.sh -m cpu_adam` runs them); the
default run offloads with torch's AdamW instead."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from draftsmith import DraftsmithError
from draftsmith.train.checkpoint import _check_layout
from draftsmith.train.config import load_config
from draftsmith.train.loop import fill_deepspeed_config, train
from tests.conftest import MULTIPROCESS
from tests.ranks import run_ranks
from tests.train.test_train import _overrides, _weights

# Every DeepSpeed run is compared with the 1-process reference weight for weight: fp32 on every CPU.
pytestmark = [MULTIPROCESS, pytest.mark.fp32_exact]
ROOT = Path(__file__).resolve().parents[2]
no_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="deepspeed is not installed (DS_BUILD_OPS=0 pip install -e '.[deepspeed]')",
)
# 4 optimizer steps of 8 examples: 1 process x 4 x 2 accumulated, or 2 processes x 2 x 2. Warmup, a
# cosine schedule and clipping are on (0.01 clips every step here: without it the weights move by
# 4e-3), so the engine's accumulation and clipping and the loop's schedule are all compared.
STEPS = {
    "optim.max_steps": 4,
    "optim.grad_accum": 2,
    "optim.clip_grad": 0.01,
    "drafter.feature_noise": 0,
    "optim.mixed_precision": "no",
    "target_dtype": "float32",
}


def _env():
    env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"}  # it would switch DeepSpeed off
    path = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # `accelerate` for launch.sh
    return {**env, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PATH": path}


def _torchrun(procs: int, args: list[str], check: bool = True):
    """`torchrun --nproc_per_node procs -m draftsmith.cli train ARGS`, its ranks forked (tests/ranks.py)."""
    out = run_ranks(procs, "draftsmith.cli", ["train", *args], env=_env())
    if check and out.returncode != 0:
        raise AssertionError(f"exit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}")
    return out


def _same(a: dict, b: dict, atol: float = 1e-5) -> bool:
    return sorted(a) == sorted(b) and all(a[k].shape == b[k].shape and torch.allclose(a[k], b[k], atol=atol) for k in a)


@pytest.fixture(scope="module")
def runs(tiny_target_dir, tmp_path_factory):
    """The data, an empty recipe, and the 1-process reference run every DeepSpeed run must match."""
    tmp = tmp_path_factory.mktemp("ds")
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"say {i}"},
                {"role": "assistant", "content": "".join(chr(97 + (i * 7 + j) % 26) for j in range(20 + i % 13))},
            ]
        }
        for i in range(48)
    ]
    data = tmp / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = tmp / "empty.yaml"
    recipe.write_text("{}\n")
    common = _overrides(tiny_target_dir, data, tmp, **STEPS)
    one = train(load_config(None, [*common, "run=one", "optim.batch_size=4"]))
    return SimpleNamespace(tmp=tmp, recipe=str(recipe), common=common, one=one, target=tiny_target_dir)


@pytest.fixture(scope="module")
def zero3(runs):
    """A ZeRO-3 run on 2 processes launched with torchrun and the recipe's `deepspeed:` key, saving a
    checkpoint at step 2 of 4, then running the eval stage (rank 0 evaluates final/)."""
    args = [
        runs.recipe,
        *runs.common,
        "run=zero3",
        "optim.batch_size=2",
        "save_every=2",
        "keep_last=5",
        "eval.enabled=true",
        "eval.num_prompts=2",
        "eval.max_new_tokens=8",
        "eval.k=2",
        f"deepspeed={ROOT / 'recipes/deepspeed/zero3.json'}",
    ]
    return runs.tmp / "zero3", _torchrun(2, args).stdout


@pytest.mark.deepspeed
@no_deepspeed
def test_zero3_matches_one_process_shards_the_target_and_writes_a_whole_final(runs, zero3):
    run, stdout = zero3
    assert "2 process(es)" in stdout and "DeepSpeed ZeRO-3" in stdout
    assert "deepspeed_shm_comm" not in stdout  # training does not build DeepSpeed-inference's comm op
    ref, mine = _weights(runs.one), _weights(run)
    assert _same(ref, mine)  # final/ holds full fp32 weights (same shapes), not 1/2-size shards
    # Each rank holds about half of the frozen target: its partition, plus norms small enough to
    # stay whole (stage3_param_persistence_threshold = 10 x hidden).
    held = re.search(r"per-rank bytes \[(\d+), (\d+)\], full (\d+)", stdout)
    a, b, full = map(int, held.groups())
    assert all(0.45 * full < x < 0.55 * full for x in (a, b)), (a, b, full)
    from draftsmith.models.registry import load_drafter
    from draftsmith.target.load import load_target

    target, _ = load_target(str(runs.target))
    family, _, drafter = load_drafter(run / "final", target)
    assert family.NAME == "eagle" and _same({k: v for k, v in drafter.state_dict().items() if k in mine}, mine, 0)
    state = json.loads((run / "step-000004" / "trainer_state.json").read_text())
    assert state["zero_stage"] == 3 and state["processes"] == 2
    assert json.loads((run / "eval" / "report.json").read_text())["lossless"]  # the eval stage ran on final/


@pytest.mark.deepspeed
@no_deepspeed
def test_zero2_preset_through_launch_sh_matches_one_process(runs):
    # The GPU route (accelerate launch --config_file recipes/accelerate/zero2.yaml), on CPUs.
    cmd = [
        "bash",
        "launch.sh",
        runs.recipe,
        "--preset",
        "zero2",
        "--cpu-procs",
        "2",
        "--main-port",
        "0",
        *runs.common,
        "run=zero2",
        "optim.batch_size=2",
    ]
    out = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-6000:]
    assert "2 process(es)" in out.stdout and "DeepSpeed ZeRO-2" in out.stdout
    assert _same(_weights(runs.one), _weights(runs.tmp / "zero2"))


@pytest.mark.deepspeed
@no_deepspeed
def test_zero3_checkpoint_resumes_and_refuses_another_world_size(runs, zero3):
    run, _ = zero3
    step2 = run / "step-000002"
    resumed = [
        runs.recipe,
        *runs.common,
        "optim.batch_size=2",
        f"resume={step2}",
        f"deepspeed={ROOT / 'recipes/deepspeed/zero3.json'}",
    ]
    out = _torchrun(2, [*resumed, "run=resumed"])
    assert f"resumed from {step2} at step 2" in out.stdout
    assert _same(_weights(run), _weights(runs.tmp / "resumed"), atol=1e-6)
    out = _torchrun(1, [*resumed, "run=one-rank"], check=False)
    assert out.returncode != 0
    assert (
        f"{step2}: written by 2 processes under DeepSpeed ZeRO-3, whose optimizer state is partitioned 2 ways "
        "and DeepSpeed cannot repartition it; resume with 2 processes"
    ) in out.stderr


@pytest.mark.deepspeed
@pytest.mark.cpu_adam("builds")
@pytest.mark.xdist_group("cpu-adam")  # one process: not part of the 2-process chain, it runs beside it
@no_deepspeed
def test_deepspeed_cpu_adam_steps_like_torch_adamw(monkeypatch):
    """What accelerate swaps in for the loop's AdamW under zero3-offload: DeepSpeedCPUAdam with
    adamw_mode=True takes torch's AdamW steps (decoupled weight decay, bias correction, a per-group
    lr); with adamw_mode=False (L2 decay folded into the gradient) it does not."""
    for key, value in _env().items():  # the build the 2-process runs load, to the byte: the same ninja
        monkeypatch.setenv(key, value)  # (an older one on PATH records other command hashes and rebuilds)
    # Its two files compile side by side: the build is the unit phase's longest single item (about 250 s
    # on one core of a 2-core EPYC), and the 2-process tests beside it fork their ranks (tests/ranks.py)
    # instead of starting interpreters, so they no longer need a core to themselves.
    monkeypatch.setenv("MAX_JOBS", "2")
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    torch.manual_seed(0)
    start = [torch.randn(64, 16), torch.randn(16)]
    grads = [[torch.randn_like(p) for p in start] for _ in range(5)]

    def run(make):
        params = [p.clone().requires_grad_() for p in start]
        opt = make(
            [{"params": [params[0]], "weight_decay": 0.1}, {"params": [params[1]], "weight_decay": 0.0, "lr": 3e-3}]
        )
        for step in grads:
            for p, g in zip(params, step):
                p.grad = g.clone()
            opt.step()
        return params

    torch_adamw = run(lambda groups: torch.optim.AdamW(groups, lr=1e-2, eps=1e-8))
    cpu_adamw = run(lambda groups: DeepSpeedCPUAdam(groups, lr=1e-2, eps=1e-8, adamw_mode=True))
    cpu_l2 = run(lambda groups: DeepSpeedCPUAdam(groups, lr=1e-2, eps=1e-8, adamw_mode=False))
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(torch_adamw, cpu_adamw))
    assert not torch.allclose(torch_adamw[0], cpu_l2[0], atol=1e-4)


def test_deepspeed_config_is_filled_from_the_recipe_and_a_mismatch_is_one_line():
    cfg = load_config(None, ["optim.batch_size=3", "optim.grad_accum=2", "optim.clip_grad=0.5"])
    ds = {
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_param_persistence_threshold": 7},
    }
    acc = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(deepspeed_config=ds)), num_processes=4)
    fill_deepspeed_config(acc, cfg, hidden=16)
    assert ds == {
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.5,
        "train_micro_batch_size_per_gpu": 3,
        "train_batch_size": 24,  # 3 per process x 4 processes x 2 accumulated
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 256, "stage3_param_persistence_threshold": 7},
    }
    ds.update(gradient_clipping=1.0)
    with pytest.raises(
        DraftsmithError, match=r"gradient_clipping is 1.0 but optim.clip_grad is 0.5; set it to \"auto\""
    ):
        fill_deepspeed_config(acc, cfg, hidden=16)


def test_a_checkpoint_resumes_only_under_the_layout_that_wrote_it(tmp_path):
    _check_layout({"zero_stage": 3, "processes": 2}, tmp_path, 3, 2)  # same layout: fine
    _check_layout({}, tmp_path, 0, 4)  # DDP checkpoints (and old ones) need no particular world size
    with pytest.raises(DraftsmithError, match="written under DeepSpeed ZeRO-3, but this run trains without DeepSpeed"):
        _check_layout({"zero_stage": 3, "processes": 2}, tmp_path, 0, 2)
    with pytest.raises(DraftsmithError, match="written by 2 processes under DeepSpeed ZeRO-2.*resume with 2 processes"):
        _check_layout({"zero_stage": 2, "processes": 2}, tmp_path, 2, 4)


@pytest.mark.deepspeed
@no_deepspeed
def test_zero3_offload_matches_one_process(runs):
    """ZeRO-3 with the drafter's parameters and optimizer state offloaded to CPU RAM, stepping the
    loop's own AdamW there (`zero_force_ds_cpu_optimizer: false`, so accelerate does not swap in the
    JIT-built CPU Adam): partitioned, offloaded and gathered back, the weights are one process's."""
    config = json.loads((ROOT / "recipes/deepspeed/zero3-offload.json").read_text())
    config["zero_force_ds_cpu_optimizer"] = False
    path = runs.tmp / "zero3-offload-torch-adamw.json"
    path.write_text(json.dumps(config))
    common = [*runs.common, "optim.weight_decay=0.1"]
    one = train(load_config(None, [*common, "run=one-wd-torch", "optim.batch_size=4"]))
    out = _torchrun(2, [runs.recipe, *common, "run=zero3off-torch", "optim.batch_size=2", f"deepspeed={path}"])
    assert (
        "2 process(es)" in out.stdout and "DeepSpeed ZeRO-3, optimizer offloaded to cpu (torch's AdamW)" in out.stdout
    )
    assert _same(_weights(one), _weights(runs.tmp / "zero3off-torch"))


@pytest.mark.deepspeed
@pytest.mark.cpu_adam("uses")
@no_deepspeed
def test_zero3_offload_preset_through_launch_sh_matches_one_process(runs):
    """`pin_memory: true` is a no-op on DeepSpeed's CPU accelerator, so the preset runs as shipped.
    accelerate swaps the loop's AdamW for DeepSpeedCPUAdam (adamw_mode=True, the same param-group
    dicts, so the schedule still applies); weight decay is on so that an L2-style Adam would show."""
    common = [*runs.common, "optim.weight_decay=0.1"]
    one = train(load_config(None, [*common, "run=one-wd", "optim.batch_size=4"]))
    cmd = [
        "bash",
        "launch.sh",
        runs.recipe,
        "--preset",
        "zero3-offload",
        "--cpu-procs",
        "2",
        "--main-port",
        "0",
        *common,
        "run=zero3off",
        "optim.batch_size=2",
    ]
    out = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-6000:]
    assert "2 process(es)" in out.stdout and "ZeRO-3, optimizer offloaded to cpu (DeepSpeed's CPU Adam)" in out.stdout
    held = re.search(r"target sharded by ZeRO-3: .*per-rank bytes \[(\d+), (\d+)\], full (\d+)", out.stdout)
    a, b, full = map(int, held.groups())
    assert all(0.45 * full < x < 0.55 * full for x in (a, b)), (a, b, full)
    assert _same(_weights(one), _weights(runs.tmp / "zero3off"))  # max difference 1.2e-7
