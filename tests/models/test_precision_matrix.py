"""The precision matrix: every family trains, evaluates greedily with the verification rule held
round by round (`rule_exact`), exports in the format vLLM serves it from and passes `export --verify`
(which reads the export back and drafts with it), in each precision users run:

- fp32: target, drafter and eval in fp32 (AVX2-only CPUs; token-exact everywhere);
- bf16-target: a bf16 target with an fp32 drafter trained without autocast (docs/troubleshooting.md's
  fallback; on GPUs the same path when a recipe says `optim.mixed_precision: no`);
- bf16-autocast: a bf16 target, fp32 master weights under bf16 autocast (the GPU default);
- bf16-weights: the drafter's own weights in bf16, where a family has them: a LoRA student (distill)
  and Medusa-2's LoRA-adapted backbone keep their frozen base in the target's dtype (peft keeps the
  adapters fp32). The other families train fp32 masters only (test_precision.py shows why: AdamW's
  steps round away on bf16 weights).

Tiny models (hidden 32) keep this cheap on any CPU, AVX2-only ones included, where bf16 takes torch's
slow kernels. A negative check puts EAGLE-1's fp32-drafter dtype bug back and sees the cell fail."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks.tiny_target import TINY_DRAFTERS, TINY_LORA
from draftsmith.cli import main
from draftsmith.models.registry import DRAFTERS

# An explicit bf16 on an AVX2-only CPU warns once that its kernels are slow: expected here.
pytestmark = pytest.mark.filterwarnings("ignore:.*no native bf16")

FAMILIES = TINY_DRAFTERS
# What a bf16-weights cell trains: the family's LoRA variant, whose frozen base is bf16.
BF16_WEIGHTS = TINY_LORA
PRECISIONS = {  # target_dtype, optim.mixed_precision, eval.dtype (= the --dtype of export --verify)
    "fp32": ("float32", "float32", "float32"),
    "bf16-target": ("bfloat16", "float32", "bfloat16"),
    "bf16-autocast": ("bfloat16", "bfloat16", "bfloat16"),
    "bf16-weights": ("bfloat16", "bfloat16", "bfloat16"),
}
CELLS = [(f, p) for f in FAMILIES for p in PRECISIONS if p != "bf16-weights" or f in BF16_WEIGHTS]


@pytest.fixture(autouse=True)
def no_vllm(monkeypatch):
    """These tiny targets (head dim 8) are below what vLLM's CPU attention takes; tests/ship/test_serve_check.py
    serves real exports."""
    monkeypatch.setenv("DRAFTSMITH_VLLM_PYTHON", "none")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """Three layers: EAGLE-3's aux layers must be distinct for speculators' loader."""
    from tests.conftest import save_target

    return save_target(tmp_path_factory.mktemp("matrix-target"), layers=3)


def run_cell(family: str, cell: str, target_dir, data, out) -> dict:
    """Train -> eval stage -> the served format's export with --verify; returns what each step gave."""
    from draftsmith.train.config import load_config
    from draftsmith.train.loop import train
    from tests.train.test_train import _overrides

    target_dtype, mixed, eval_dtype = PRECISIONS[cell]
    extra = {**FAMILIES[family], **(BF16_WEIGHTS[family] if cell == "bf16-weights" else {})}
    run = train(
        load_config(
            None,
            _overrides(
                target_dir,
                data,
                out,
                run=f"{family}-{cell}",
                **{
                    "drafter.type": family,
                    "optim.max_steps": 3,
                    "target_dtype": target_dtype,
                    "optim.mixed_precision": mixed,
                    "eval.enabled": True,
                    "eval.dtype": eval_dtype,
                    "eval.num_prompts": 2,
                    "eval.max_new_tokens": 10,
                    "eval.k": 2,
                    **extra,
                },
            ),
        )
    )
    report = json.loads((run / "eval" / "report.json").read_text())
    one = out / "verify-prompt.jsonl"  # --verify decodes up to 3 holdout prompts: one is enough here
    one.write_text(Path(data).read_text().splitlines()[0] + "\n")
    fmt = DRAFTERS[family].SERVE_FORMAT  # the format vLLM serves it from; every format: tests/ship/test_init_from.py
    verified = {
        fmt: main(
            [
                "export",
                str(run / "final"),
                "--format",
                fmt,
                "--out",
                str(out / f"{family}-{cell}-{fmt}"),
                "--verify",
                "--data",
                str(one),
                "--dtype",
                eval_dtype,
            ]
        )
    }
    return {"report": report, "verified": verified}


@pytest.mark.parametrize("family, cell", CELLS, ids=[f"{f}-{p}" for f, p in CELLS])
def test_every_family_trains_evaluates_and_verifies_in_every_precision(family, cell, target_dir, chat_jsonl, tmp_path):
    got = run_cell(family, cell, target_dir, chat_jsonl, tmp_path)
    report = got["report"]
    assert report["dtype"] == PRECISIONS[cell][2]
    assert report["rule_exact"] is True, report
    assert report["lossless_mismatches"] is not None and report["new_tokens"] > 0
    assert got["verified"] and all(rc == 0 for rc in got["verified"].values()), got["verified"]
    if cell == "fp32":  # fp32 is token-exact: outputs identical to the target-only decode too
        assert report["lossless"] is True


def test_the_matrix_fails_with_eagle1s_dtype_bug_put_back(target_dir, chat_jsonl, tmp_path, monkeypatch):
    """The bug the matrix was written for: EAGLE-1 cast its inputs to the target's embedding dtype,
    not to its own fc's, so an fp32 drafter beside a bf16 target crashed in its first step."""
    from draftsmith.models import eagle

    def buggy_step(self, features, token_embeds, position_ids, attention_mask, cache=None):
        x = self.fc(torch.cat([token_embeds, features.to(token_embeds.dtype)], dim=-1))
        return self.layer(
            x,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=cache is not None,
            position_embeddings=self.rotary(x, position_ids),
        )

    monkeypatch.setattr(eagle.EagleDrafter, "step", buggy_step)
    with pytest.raises(RuntimeError, match="same dtype"):
        run_cell("eagle", "bf16-target", target_dir, chat_jsonl, tmp_path)
    run_cell("eagle", "fp32", target_dir, chat_jsonl, tmp_path / "fp32")  # the bug only shows across dtypes


@pytest.mark.parametrize("family", FAMILIES)
def test_rope_frequencies_stay_fp32_in_a_bf16_drafter_and_in_its_export_read_back(family, target_dir, tmp_path):
    """A drafter loaded on a bf16 target is cast to bf16, and so is one re-read from its export: its
    RoPE frequencies must stay the fp32 ones vLLM and speculators compute from the config (rounded to
    bf16 they shift every angle by up to position x 2^-9 of it; draftsmith/util/precision.py)."""
    from draftsmith.models.folder import save_drafter
    from draftsmith.models.readers import import_export
    from draftsmith.models.registry import load_drafter
    from draftsmith.ship.export import export
    from draftsmith.target.load import fingerprint, load_target

    fam = DRAFTERS[family]
    target, tok = load_target(str(target_dir), "bfloat16")
    cfg = fam.resolve(
        fam.DrafterConfig(**{k.removeprefix("drafter."): v for k, v in FAMILIES[family].items()}), target.config
    )
    data = {"input_ids": [list(range(5, 60))], "loss_mask": [[1] * 55]}
    meta = {
        "drafter": family,
        "drafter_config": {"type": family, **cfg.__dict__},
        "target": str(target_dir),
        "target_fingerprint": fingerprint(target),
    }
    path = save_drafter(fam.build(cfg, target, data), tmp_path / "final", meta)
    fmt = fam.SERVE_FORMAT or next(iter(fam.EXPORTS))
    loaded = load_drafter(path, target)[2]
    exported = import_export(export(path, target, fmt, tmp_path / fmt, tok), target)[2]
    theta = target.config.rope_parameters["rope_theta"]
    found = {}
    for what, model in (("target", target), ("drafter", loaded), ("export", exported)):
        assert next(model.parameters()).dtype == torch.bfloat16, what
        found[what] = 0
        for name, freq in model.named_buffers():
            if name.endswith("inv_freq"):
                dim = 2 * freq.numel()
                exact = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
                assert freq.dtype == torch.float32 and torch.equal(freq, exact), f"{family}: {what}'s {name}"
                found[what] += 1
    # The drafter's own (none in a head without attention) come back from its export, as many and as exact.
    assert found["target"] >= 1 and found["export"] == found["drafter"], found
