"""Exports carry the exact config keys and tensor names engines load, and decode like the original."""

import json

import pytest
import torch
from safetensors.torch import load_file

from draftsmith import DraftsmithError
from draftsmith.cli import main
from draftsmith.engine.speculative import Stats, speculative_greedy
from draftsmith.models import distill, eagle, eagle3, medusa
from draftsmith.models.folder import save_drafter
from draftsmith.models.readers import import_export
from draftsmith.models.registry import load_drafter
from draftsmith.ship.export import export
from draftsmith.target.load import fingerprint
from tests.conftest import lossless_ok

H = 32  # tiny target hidden size


def _save(tmp_path, family, cfg, target):
    torch.manual_seed(0)
    ds = {"input_ids": [list(range(5, 60))], "loss_mask": [[1] * 55]}
    drafter = family.build(cfg, target, ds)
    meta = {
        "drafter": family.NAME,
        "drafter_config": {"type": family.NAME, **cfg.__dict__},
        "target": "tiny",
        "target_fingerprint": fingerprint(target),
    }
    return save_drafter(drafter, tmp_path / f"{family.NAME}-final", meta)


def _same_decoding(path, exported, target):
    prompt = list(range(10, 22))
    runs = []
    for loader in (lambda: load_drafter(path, target), lambda: import_export(exported, target)):
        family, cfg, d = loader()
        stats = Stats(k=4)
        out = speculative_greedy(target, family.make_proposer(d, target, cfg), prompt, 4, 24, set(), stats)
        runs.append((out, stats.accepted, stats.passes))
    assert runs[0] == runs[1]


def test_eagle1_vllm_sglang_format(tiny_target, tmp_path):
    target, _ = tiny_target
    path = _save(tmp_path, eagle, eagle.DrafterConfig(), target)
    out = export(path, target, "vllm", tmp_path / "vllm")
    cfg, state = json.loads((out / "config.json").read_text()), load_file(out / "model.safetensors")
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["num_hidden_layers"] == 1
    assert state["fc.weight"].shape == (H, 2 * H) and not state["fc.bias"].any()  # zero bias for SGLang
    assert "layers.0.self_attn.q_proj.weight" in state and "layers.0.post_attention_layernorm.weight" in state
    assert not any("input_layernorm" in k or "embed_tokens" in k or "lm_head" in k for k in state)
    _same_decoding(path, out, target)


def test_eagle3_sglang_format(tiny_target, tmp_path):
    target, _ = tiny_target
    cfg = eagle3.DrafterConfig(aux_layers=[0, 1, 1], draft_vocab_size=40, ttt_steps=2)
    path = _save(tmp_path, eagle3, cfg, target)
    assert (
        main(
            [
                "export",
                str(path),
                "--format",
                "sglang",
                "--out",
                str(tmp_path / "sg"),
                "--target",
                str(tiny_target[0].name_or_path),
            ]
        )
        == 0
    )
    out = tmp_path / "sg"
    c, state = json.loads((out / "config.json").read_text()), load_file(out / "model.safetensors")
    assert c["architectures"] == ["LlamaForCausalLMEagle3"] and c["model_type"] == "llama"
    assert c["draft_vocab_size"] == 40 and c["vocab_size"] == target.config.vocab_size and not c["tie_word_embeddings"]
    assert c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 1]
    assert c["eagle_aux_hidden_state_layer_ids"] == [1, 2, 2]  # top-level = nested + 1
    assert state["fc.weight"].shape == (H, 3 * H) and state["lm_head.weight"].shape == (40, H)
    assert state["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * H
    for k in [
        "midlayer.input_layernorm.weight",
        "midlayer.hidden_norm.weight",
        "midlayer.post_attention_layernorm.weight",
        "midlayer.mlp.gate_proj.weight",
        "norm.weight",
    ]:
        assert k in state
    assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool
    assert "embed_tokens.weight" not in state
    _same_decoding(path, out, target)


def test_eagle3_speculators_format(tiny_target, tmp_path):
    target, _ = tiny_target
    cfg = eagle3.DrafterConfig(aux_layers=[0, 1, 1], draft_vocab_size=40, ttt_steps=2)
    path = _save(tmp_path, eagle3, cfg, target)
    out = export(path, target, "speculators", tmp_path / "spec")
    c, state = json.loads((out / "config.json").read_text()), load_file(out / "model.safetensors")
    assert c["architectures"] == ["Eagle3Speculator"] and c["speculators_model_type"] == "eagle3"
    sc = c["speculators_config"]
    assert sc["algorithm"] == "eagle3" and sc["proposal_methods"][0]["speculative_tokens"] >= 1
    assert sc["verifier"]["name_or_path"] == "tiny" and isinstance(c["transformer_layer_config"], dict)
    assert c["norm_before_residual"] is False
    assert "layers.0.self_attn.q_proj.weight" in state and not any(k.startswith("midlayer.") for k in state)
    assert torch.equal(state["embed_tokens.weight"], target.get_input_embeddings().weight)  # never random
    _same_decoding(path, out, target)


def test_export_refuses_other_target_and_unknown_format(tiny_target, other_target_dir, tmp_path):
    from draftsmith.target.load import load_target

    target, _ = tiny_target
    path = _save(tmp_path, eagle, eagle.DrafterConfig(), target)
    other, _ = load_target(str(other_target_dir))
    with pytest.raises(DraftsmithError, match="trained for target"):
        export(path, other, "vllm", tmp_path / "x")
    with pytest.raises(DraftsmithError, match="exports to vllm, sglang"):
        export(path, target, "speculators", tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_drafters_bench_runs_every_row_on_tiny_drafters_of_every_family(tiny_target_dir, chat_jsonl, tmp_path, capsys):
    """The side-by-side benchmark end to end on tiny drafters: every row present, greedy rows
    lossless, costs computed from the real modules, Medusa on its static tree."""
    from benchmarks import drafters as bench
    from draftsmith.target.load import load_target

    target, _ = load_target(str(tiny_target_dir))
    paths = {}
    for family, cfg in (
        (eagle, eagle.DrafterConfig()),
        (eagle3, eagle3.DrafterConfig(aux_layers=[0, 1, 1], draft_vocab_size=48)),
        (medusa, medusa.DrafterConfig(num_heads=2)),
        (distill, distill.DrafterConfig(num_layers=1)),
    ):
        path = _save(tmp_path, family, cfg, target)
        meta = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**meta, "target": str(tiny_target_dir)}))
        paths[family.NAME] = str(path)
    out = tmp_path / "bench.json"
    bench.main(
        [
            "--drafter",
            f"eagle={paths['eagle']}",
            "--drafter",
            f"eagle3={paths['eagle3']}",
            "--drafter",
            f"medusa={paths['medusa']}",
            "--drafter",
            f"distill={paths['distill']}",
            "--data",
            str(chat_jsonl),
            "--num-prompts",
            "2",
            "--max-new-tokens",
            "8",
            "--tree",
            "dynamic:depth=3,top_k=2,tokens=5",
            "--tree",
            "medusa=static:[[0],[1],[0,0]]",
            "--out",
            str(out),
        ]
    )
    result = json.loads(out.read_text())
    rows = [(r["drafter"], r["tree"], r["temperature"]) for r in result["reports"]]
    assert len(rows) == 14 and ("eagle3", "dynamic:depth=3,top_k=2,tokens=5", 0.7) in rows
    assert [r for r in rows if r[0] == "distill"] == [("distill", None, 0.0), ("distill", None, 0.7)]  # chains only
    assert ("medusa", "static:[[0],[1],[0,0]]", 0.0) in rows
    assert all(lossless_ok(r) for r in result["reports"] if r["temperature"] == 0)
    c3, c1 = result["costs"]["eagle3"], result["costs"]["eagle"]
    assert c3["draft_vocab"] == 48 and 0 < c3["draft_flops_fraction"] < c1["draft_flops_fraction"]
    assert "draft FLOPs/token vs target" in capsys.readouterr().out
    top1 = result["costs"]["medusa"]["draft_top1"]
    assert len(top1) == 2 and all(0 <= a <= 1 for a in top1)


def test_exports_name_a_target_serving_engines_resolve(tmp_path):
    from draftsmith.target.load import served_name

    # draftsmith's alias means nothing to vLLM or speculators: the hub id behind it is written instead.
    assert served_name("smollm2-135m") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert served_name("meta-llama/Llama-3.1-8B-Instruct") == "meta-llama/Llama-3.1-8B-Instruct"
    (tmp_path / "local").mkdir()
    assert served_name(str(tmp_path / "local")) == str((tmp_path / "local").resolve())


def test_drafters_bench_takes_a_chain_length_per_drafter_for_block_drafters(tiny_target_dir, chat_jsonl, tmp_path):
    """P-EAGLE drafts at most its depths per pass: `--k peagle=3` next to EAGLE-3's plain --k 5."""
    from benchmarks import drafters as bench
    from draftsmith.models import peagle
    from draftsmith.target.load import load_target

    target, _ = load_target(str(tiny_target_dir))
    paths = {}
    for family, cfg in (
        (eagle3, eagle3.DrafterConfig(aux_layers=[0, 1, 1], draft_vocab_size=48)),
        (peagle, peagle.DrafterConfig(aux_layers=[0, 1, 1], draft_vocab_size=48, depths=3)),
    ):
        path = _save(tmp_path, family, cfg, target)
        meta = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**meta, "target": str(tiny_target_dir)}))
        paths[family.NAME] = str(path)
    out = tmp_path / "bench.json"
    bench.main(
        [
            "--drafter",
            f"eagle3={paths['eagle3']}",
            "--drafter",
            f"peagle={paths['peagle']}",
            "--data",
            str(chat_jsonl),
            "--num-prompts",
            "2",
            "--max-new-tokens",
            "8",
            "--temperature",
            "0",
            "--k",
            "5",
            "--k",
            "peagle=3",
            "--out",
            str(out),
        ]
    )
    rows = [(r["drafter"], r["k"], r["tree"]) for r in json.loads(out.read_text())["reports"]]
    assert ("peagle", 3, None) in rows and ("eagle3", 5, None) in rows
    assert not [r for r in rows if r[0] == "peagle" and r[2]]  # chains only
