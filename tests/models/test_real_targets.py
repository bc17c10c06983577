"""Every family on tiny targets of the architectures users train on (tests/conftest.py REAL_ARCHS:
Llama-3.1 with llama3 RoPE scaling, Qwen3 with q/k norm, Qwen2.5 with q/k/v biases, Qwen3-MoE's
routed experts, Gemma-3's scaled embeddings and sliding-window layers): training, a lossless eval,
exports that carry the target's RoPE and rebuild from their config alone."""

import json
from dataclasses import fields

import pytest

from benchmarks.tiny_target import TINY_DRAFTERS
from draftsmith import DraftsmithError
from draftsmith.models import eagle3
from draftsmith.models.eagle import target_rope
from draftsmith.models.registry import DRAFTERS, drafter_family, load_drafter
from draftsmith.ship.export import export
from draftsmith.ship.publish import verify_export
from draftsmith.target.load import load_target
from draftsmith.train.config import load_config
from draftsmith.train.loop import train
from tests.conftest import REAL_ARCHS, lossless_ok, save_arch_target, write_pattern_chats

# Every registered family at its tiny size (benchmarks/tiny_target.py, from the registry), with the
# shortest unrolls its config has (EAGLE-3's training-time test: 2 steps) to keep to the CI budget.
SHORT = {"ttt_steps": 2}
FAMILIES = {
    name: {
        "drafter.type": name,
        **extra,
        **{f"drafter.{k}": v for k, v in SHORT.items() if k in {f.name for f in fields(DRAFTERS[name].DrafterConfig)}},
    }
    for name, extra in TINY_DRAFTERS.items()
}
CASES = [(arch, family) for arch in REAL_ARCHS for family in FAMILIES]


@pytest.fixture(scope="module")
def arch_targets(tmp_path_factory):
    return {arch: save_arch_target(tmp_path_factory.mktemp(arch), arch) for arch in REAL_ARCHS}


def _train(target_dir, data, out, family: dict, **extra):
    base = {
        "target": str(target_dir),
        "output_dir": str(out),
        "run": "r",
        "data.train": data,
        "data.holdout": data,
        "data.max_length": 160,
        "optim.batch_size": 4,
        "optim.max_steps": 3,
        "optim.warmup_steps": 1,
        "optim.lr": 1e-3,
        "log_every": 1,
        "eval.num_prompts": 2,
        "eval.max_new_tokens": 10,
        "eval.k": 2,
        **family,
        **extra,
    }
    return train(
        load_config(None, [f"{k}={json.dumps(v) if isinstance(v, list) or v is None else v}" for k, v in base.items()])
    )


def _ropes(out, target_config) -> tuple[list[dict], dict]:
    """The RoPE an engine builds from an exported config.json: from the legacy keys (rope_theta +
    rope_scaling, what SGLang and transformers 4 read) and from rope_parameters (transformers 5);
    and the target's RoPE it must equal: a head's one full-attention layer takes that of the
    target's global layers (Gemma-3 has one per layer type), a student all of them."""
    from transformers import AutoConfig, LlamaConfig

    config = json.loads((out / "config.json").read_text())
    dims = config.get("transformer_layer_config", config)
    if "rope_scaling" not in dims:  # a plain transformers folder (a student): transformers' own format
        return [dict(AutoConfig.from_pretrained(out).rope_parameters)], dict(target_config.rope_parameters)
    legacy = {k: v for k, v in dims.items() if k not in ("model_type", "architectures", "rope_parameters")}
    return [dict(LlamaConfig(**legacy).rope_parameters), dims["rope_parameters"]], target_rope(target_config)


@pytest.mark.parametrize("arch, family", CASES, ids=[f"{a}-{f}" for a, f in CASES])
def test_every_family_trains_evaluates_losslessly_and_exports_with_the_targets_rope(
    arch_targets, tmp_path, arch, family
):
    data = write_pattern_chats(tmp_path / "chats.jsonl", range(24))
    run = _train(arch_targets[arch], data, tmp_path, FAMILIES[family])
    report = json.loads((run / "eval" / "report.json").read_text())
    assert lossless_ok(report) and report["new_tokens"] > 0
    target, tok = load_target(str(arch_targets[arch]), "float32")
    fam = drafter_family(family)
    out = export(run / "final", target, fam.SERVE_FORMAT, tmp_path / "export", tok=tok)
    drafter = load_drafter(run / "final", target)[2]
    if any(name.endswith("inv_freq") for name, _ in drafter.named_buffers()):  # a head with attention (RoPE)
        ropes, want = _ropes(out, target.config)
        assert ropes and all(r == want for r in ropes), (ropes, want)
    parity = verify_export(run / "final", out, target, tok, data, k=2, prompts=2, max_new_tokens=12)
    assert parity["passed"], parity


@pytest.mark.parametrize("fmt", ["speculators", "sglang"])
def test_a_llama31_head_exported_without_its_rope_scaling_fails_verify(arch_targets, tmp_path, fmt):
    """What exports wrote before: the layer config without `llama3` scaling. Rebuilt from that config
    alone, the head's logits differ from the trained head's, and `export --verify` says so."""
    data = write_pattern_chats(tmp_path / "chats.jsonl", range(24))
    run = _train(arch_targets["llama3.1"], data, tmp_path, FAMILIES["eagle3"], **{"eval.enabled": False})
    target, tok = load_target(str(arch_targets["llama3.1"]), "float32")
    out = export(run / "final", target, fmt, tmp_path / "export", tok=tok)
    good = verify_export(run / "final", out, target, tok, data, k=3, prompts=3, max_new_tokens=24)
    assert good["passed"] and good["max_abs_logit_diff"] < 1e-4, good
    config = json.loads((out / "config.json").read_text())
    dims = config.get("transformer_layer_config", config)
    dims["rope_scaling"], dims["rope_parameters"] = None, {"rope_type": "default", "rope_theta": dims["rope_theta"]}
    (out / "config.json").write_text(json.dumps(config))
    bad = verify_export(run / "final", out, target, tok, data, k=3, prompts=3, max_new_tokens=24)
    assert not bad["passed"] and bad["max_abs_logit_diff"] > 1e-2, bad


def test_a_tree_verification_pass_on_gemma3_keeps_its_sliding_windows(arch_targets):
    """The engine's 4-D tree mask would let Gemma-3's local layers see past their window (16 here)
    once the context outgrows it: the pass must give the logits of one plain forward, row by row."""
    import torch
    from transformers import DynamicCache

    from draftsmith.engine.drafts import Draft
    from draftsmith.engine.speculative import verification_forward
    from draftsmith.engine.verify import verification_inputs

    target, _ = load_target(str(arch_targets["gemma3"]), "float32")
    ids = [5 + (7 * i) % 90 for i in range(34)]
    with torch.no_grad():
        full = target(input_ids=torch.tensor([ids])).logits[0]
        cache = DynamicCache()
        verification_forward(target, ids[:30], cache, "cpu")
        # root ids[30]; a chain ids[31..33] with a sibling (token 7) beside its first node
        draft = Draft(tokens=[ids[31], 7, ids[32], ids[33]], parents=[-1, -1, 0, 2], qs=[None] * 4)
        mask, positions = verification_inputs(draft, 30, "cpu")
        _, logits = verification_forward(target, [ids[30], *draft.tokens], cache, "cpu", (), mask, positions)
    assert (logits[0, [0, 1, 3, 4]] - full[30:34]).abs().max() < 1e-4


def test_drafters_read_gemma3s_embedding_table_unscaled_as_engines_serve_it(arch_targets):
    """Gemma-3's embedding module scales rows by sqrt(hidden); vLLM shares the unscaled table with
    heads (and speculators trains them on it), so drafters train on the rows as they are."""
    import torch

    from draftsmith.target.features import draft_embeddings

    target, _ = load_target(str(arch_targets["gemma3"]), "float32")
    module, ids = target.get_input_embeddings(), torch.arange(12)[None]
    assert torch.equal(draft_embeddings(target)(ids), module.weight[ids])
    assert torch.allclose(module(ids), module.weight[ids] * target.config.hidden_size**0.5)


def test_a_drafter_layer_on_an_moe_target_has_a_dense_mlp_of_its_active_width():
    from types import SimpleNamespace

    from draftsmith.models.eagle import dense_intermediate_size, layer_config
    from draftsmith.models.known import known_config

    moe = known_config("Qwen/Qwen3-30B-A3B")
    assert layer_config(moe).intermediate_size == moe.intermediate_size == 6144
    # An MoE config without a dense width: the experts a token passes through, 8 x 768.
    assert dense_intermediate_size(SimpleNamespace(num_experts_per_tok=8, moe_intermediate_size=768)) == 6144


def test_eagle3_default_aux_layers_are_the_engines_and_exports_name_them_in_both_conventions(tmp_path):
    from transformers import LlamaConfig

    # 12 layers: vLLM/SpecForge tap the inputs of layers (2, 6, 9) = the outputs of (1, 5, 8).
    assert eagle3.aux_layers(eagle3.DrafterConfig(), LlamaConfig(num_hidden_layers=12)) == [1, 5, 8]
    assert eagle3.aux_layers(eagle3.DrafterConfig(), LlamaConfig(num_hidden_layers=32)) == [1, 15, 28]
    with pytest.raises(DraftsmithError, match="set drafter.aux_layers"):
        eagle3.aux_layers(eagle3.DrafterConfig(), LlamaConfig(num_hidden_layers=4))  # [1, 1, 0]: not in order
    speculators = {"eagle_aux_hidden_state_layer_ids": [2, 6, 9]}
    sglang = {
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 5, 8]},
        "eagle_aux_hidden_state_layer_ids": [2, 6, 9],
    }
    tc = LlamaConfig(num_hidden_layers=12)
    assert eagle3.exported_aux_layers(speculators, tc) == eagle3.exported_aux_layers(sglang, tc) == [1, 5, 8]
    assert eagle3.exported_aux_layers({"architectures": ["LlamaForCausalLMEagle3"]}, tc) == [
        1,
        5,
        8,
    ]  # engines' default


def test_init_from_an_eagle3_head_uses_its_aux_layers_and_refuses_others(arch_targets, tmp_path):
    data = write_pattern_chats(tmp_path / "chats.jsonl", range(24))
    run = _train(
        arch_targets["qwen3"],
        data,
        tmp_path,
        {**FAMILIES["eagle3"], "drafter.aux_layers": [0, 2, 3]},
        **{"eval.enabled": False},
    )
    target, tok = load_target(str(arch_targets["qwen3"]), "float32")
    published = export(run / "final", target, "speculators", tmp_path / "published", tok=tok)
    # A fine-tune that names no aux layers reads the head's own.
    tuned = _train(
        arch_targets["qwen3"],
        data,
        tmp_path,
        {**FAMILIES["eagle3"], "drafter.aux_layers": None},
        **{"run": "tuned", "init_from": str(published), "eval.enabled": False},
    )
    assert json.loads((tuned / "final" / "config.json").read_text())["drafter_config"]["aux_layers"] == [0, 2, 3]
    with pytest.raises(
        DraftsmithError, match=r"names \[0, 1, 2\] but the init_from head was trained on layers \[0, 2, 3\]"
    ):
        _train(
            arch_targets["qwen3"],
            data,
            tmp_path,
            FAMILIES["eagle3"],
            **{"run": "wrong", "init_from": str(published), "eval.enabled": False},
        )


def test_bf16_training_and_eval_on_a_llama31_target_is_rule_exact(arch_targets, tmp_path):
    """The precision GPU recipes use: a bf16 target, bf16 autocast, a bf16 eval. Outputs may differ
    from a separately run bf16 target-only decode on near-ties; the verification rule may not."""
    data = write_pattern_chats(tmp_path / "chats.jsonl", range(24))
    run = _train(
        arch_targets["llama3.1"],
        data,
        tmp_path,
        FAMILIES["eagle3"],
        **{
            "target_dtype": "bfloat16",
            "optim.mixed_precision": "bf16",
            "eval.dtype": "bfloat16",
            "eval.num_prompts": 4,
            "eval.max_new_tokens": 16,
        },
    )
    report = json.loads((run / "eval" / "report.json").read_text())
    assert report["dtype"] == "bfloat16" and report["rule_exact"] is True
    assert "**the rule** (`rule_exact`: yes)" in (run / "eval" / "report.md").read_text()


def test_a_process_group_timeout_must_be_positive():
    with pytest.raises(DraftsmithError, match="dist_timeout_minutes must be a number of minutes > 0"):
        load_config(None, ["dist_timeout_minutes=0"])
