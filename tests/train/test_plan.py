"""The memory planner: exact weight / gradient / optimizer bytes against real tensors, preset
sharding, and its CLI."""

import pytest
import torch

from draftsmith import DraftsmithError
from draftsmith.cli import main
from draftsmith.train.config import drafter_config, load_config
from draftsmith.train.plan import per_rank, plan, sizes, target_config


@pytest.mark.parametrize(
    "family",
    [
        ["drafter.type=eagle3", "drafter.aux_layers=[0,1,1]", "drafter.draft_vocab_size=40"],
        [
            "drafter.type=medusa",
            "drafter.num_heads=2",
            "drafter.backbone=lora",
            "drafter.backbone_lr=1e-3",
            "drafter.lora_rank=4",
            "eval.k=2",
        ],
        ["drafter.type=distill", "drafter.num_layers=1"],
    ],
    ids=["eagle3", "medusa2", "distill"],
)
@pytest.mark.fp32_exact
def test_weights_gradients_and_optimizer_bytes_equal_real_tensors_after_a_step(tiny_target_dir, tiny_target, family):
    from draftsmith.models.registry import drafter_family

    cfg = load_config(None, [f"target={tiny_target_dir}", "target_dtype=float32", *family])
    planned = per_rank(sizes(cfg, target_config(cfg.target)), "multi-gpu", 1, 4)
    target, _ = tiny_target
    family = drafter_family(cfg.drafter["type"])
    drafter = family.build(drafter_config(cfg), target)
    target_ids = {id(p) for p in target.parameters()}
    trainable = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable)
    for p in trainable:
        p.grad = torch.zeros_like(p)
    opt.step()
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    assert planned["target weights"] == nbytes(target.parameters())
    assert planned["drafter weights"] == nbytes(p for p in drafter.parameters() if id(p) not in target_ids)
    assert planned["gradients"] == nbytes(p.grad for p in trainable)
    assert planned["optimizer"] == nbytes(v for st in opt.state.values() for k, v in st.items() if k != "step")


def test_presets_shard_what_they_say_and_the_table_says_what_fits(tiny_target_dir):
    cfg = load_config(None, [f"target={tiny_target_dir}", "drafter.type=medusa", "drafter.num_heads=2", "eval.k=2"])
    s = sizes(cfg, target_config(cfg.target))
    ddp, z2, z3, off, fsdp = (per_rank(s, p, 8, 2) for p in ("multi-gpu", "zero2", "zero3", "zero3-offload", "fsdp"))
    assert z2["drafter weights"] == ddp["drafter weights"] and z2["optimizer"] == ddp["optimizer"] / 8
    assert z3["drafter weights"] == ddp["drafter weights"] / 8 and off["optimizer"] == 0
    # ZeRO-3 shards the frozen target too (an optimizer-less engine); its offload variant moves it to CPU RAM.
    assert z2["target weights"] == ddp["target weights"] and z3["target weights"] == ddp["target weights"] / 8
    assert off["target weights"] == 0 and fsdp["target weights"] == ddp["target weights"] / 8
    table = plan(cfg, gpus=8, gpu_memory_gib=1e-6)
    assert "| zero3 |" in table and table.rstrip().endswith("| no |")
    with pytest.raises(DraftsmithError, match="unknown .valid: single-gpu"):
        plan(cfg, gpus=8, preset="zero4")


def test_plan_cli_prints_known_targets_offline(capsys):
    assert main(["plan", "recipes/llama-3.1-8b/eagle3.yaml", "--gpus", "8", "--preset", "zero2"]) == 0
    out = capsys.readouterr().out
    assert "target 8.03B params" in out and "| zero2 |" in out and "bytes/token" in out


@pytest.mark.parametrize("case", ["tiny-eagle3", "tiny-medusa2", "tiny-distill"])
@pytest.mark.fp32_exact
def test_planned_memory_is_within_20_percent_of_the_allocations_measured_in_a_training_step(case):
    # benchmarks/memory.py: the step's peak comes from torch's profiler (every CPU allocation and
    # free); weights and optimizer state from the real tensors, which the planner must hit exactly.
    from benchmarks import memory

    r = memory.measure(memory.case_config(case))
    planned, measured = r["planned"], r["measured"]
    for part in ("target weights", "drafter weights", "optimizer"):
        assert planned[part] == measured[part], part
    for part in ("step peak", "total"):
        assert 0.8 <= measured[part] / planned[part] <= 1.2, (part, measured[part], planned[part])


def test_a_distill_student_is_planned_from_its_config_as_its_build_makes_it(
    tiny_target_dir, other_target_dir, tiny_target
):
    # Its build loads the student's weights and tokenizer; the plan builds the same model from its config.
    from draftsmith.models.registry import drafter_family

    cfg = load_config(
        None,
        [
            f"target={tiny_target_dir}",
            "target_dtype=float32",
            "drafter.type=distill",
            f"drafter.init={other_target_dir}",
            "drafter.lora_rank=4",
        ],
    )
    s = sizes(cfg, target_config(cfg.target))
    target, _ = tiny_target
    student = drafter_family("distill").build(drafter_config(cfg), target)
    assert s.drafter_params == sum(p.numel() for p in student.parameters())
    assert s.trainable_params == sum(p.numel() for p in student.parameters() if p.requires_grad) < s.drafter_params


def test_an_unreadable_config_names_the_models_known_offline(monkeypatch, tmp_path):
    import transformers

    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co'\nmore")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", offline)
    cfg = load_config(None, ["target=meta-llama/Qwen3-8B", "drafter.type=medusa", "drafter.num_heads=2", "eval.k=2"])
    with pytest.raises(
        DraftsmithError,
        match=r"target 'meta-llama/Qwen3-8B' \(We couldn't connect.*\); known offline: "
        r"meta-llama/Llama-3.1-8B-Instruct, .*Qwen/Qwen3-8B",
    ) as e:
        plan(cfg, gpus=8)
    assert "\n" not in str(e.value)
