"""Precision `auto` is chosen from the hardware (CPU bf16 capability and CUDA mocked both ways);
every documented spelling works in recipes and on the command line; bad values are one-line errors."""

import warnings

import pytest
import torch
import yaml

from draftsmith import DraftsmithError
from draftsmith.train.config import load_config, resolve_precision
from draftsmith.util import precision


@pytest.fixture
def hw(monkeypatch):
    """hw(cuda=..., cuda_bf16=..., avx512_bf16=..., amx=...) fixes what the resolver sees."""

    def set_hw(cuda=False, cuda_bf16=False, avx512_bf16=False, amx=False):
        monkeypatch.delenv("DRAFTSMITH_CPU_BF16", raising=False)  # the mocked capability decides
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: cuda_bf16)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
        precision._warn_slow_bf16.cache_clear()

    return set_hw


@pytest.mark.parametrize(
    "cpu, expected",
    [
        ({}, "float32"),  # AVX2-only CPU: bf16 would take torch's slow path
        ({"avx512_bf16": True}, "bfloat16"),
        ({"amx": True}, "bfloat16"),
        ({"cuda": True, "cuda_bf16": True}, "bfloat16"),
        ({"cuda": True, "cuda_bf16": False}, "float32"),  # e.g. a V100
    ],
)
def test_auto_follows_the_hardware(hw, cpu, expected):
    hw(**cpu)
    assert precision.resolve("auto", "x") == expected
    assert precision.mixed_precision("auto") == {"float32": "no", "bfloat16": "bf16"}[expected]


def test_explicit_bf16_on_a_cpu_without_native_bf16_warns_once_and_still_runs(hw):
    hw()
    with pytest.warns(UserWarning, match="no native bf16.*slow"):
        assert precision.resolve("bf16", "optim.mixed_precision") == "bfloat16"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        precision.resolve("bf16", "optim.mixed_precision")  # no second warning for the same setting
        hw(avx512_bf16=True)
        assert precision.resolve("bfloat16", "target_dtype") == "bfloat16"  # native: no warning


def test_fp16_needs_cuda_and_unknown_names_are_listed(hw):
    hw()
    with pytest.raises(DraftsmithError, match="fp16 needs a CUDA GPU"):
        precision.resolve("fp16", "eval.dtype")
    with pytest.raises(DraftsmithError, match=r"unknown precision 'fp8'; expected one of auto, no/fp32"):
        precision.resolve("fp8", "eval.dtype")
    hw(cuda=True, cuda_bf16=True)
    assert precision.resolve("fp16", "eval.dtype") == "float16"


SPELLINGS = {
    "auto": None,
    "no": "float32",
    "fp32": "float32",
    "float32": "float32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
}


@pytest.mark.parametrize("value", list(SPELLINGS))
@pytest.mark.parametrize("key", ["optim.mixed_precision", "target_dtype", "eval.dtype"])
def test_every_spelling_works_in_a_recipe_and_as_an_override(hw, tmp_path, key, value):
    hw()
    *parents, leaf = key.split(".")
    raw = yaml.safe_load(f"{leaf}: {value}")  # YAML reads a bare `no` as False: it must still mean fp32
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({parents[0]: raw} if parents else raw))
    expected = SPELLINGS[value] or "float32"  # auto on this mocked AVX2-only CPU
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # explicit bf16 warns here, tested above
        for cfg in (load_config(recipe), load_config(None, [f"{key}={value}"])):
            resolved = resolve_precision(cfg)
            node = getattr(resolved, parents[0]) if parents else resolved
            assert getattr(node, leaf) == expected


def test_bad_precision_in_a_recipe_is_a_one_line_error(hw, tmp_path):
    hw()
    with pytest.raises(
        DraftsmithError, match=r"r.yaml: optim.mixed_precision: unknown precision 'true' \(YAML reads yes/on as true\)"
    ):
        recipe = tmp_path / "r.yaml"
        recipe.write_text("optim:\n  mixed_precision: yes\n")
        load_config(recipe)
    with pytest.raises(DraftsmithError, match="target_dtype: fp16 needs a CUDA GPU"):
        load_config(None, ["target_dtype=fp16"])


def test_cli_dtype_flag_accepts_aliases_and_rejects_unknown_names(capsys):
    from draftsmith.cli import build_parser

    args = build_parser().parse_args(["eval", "--drafter", "none", "--data", "x", "--dtype", "bf16"])
    assert args.dtype == "bfloat16"
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["eval", "--drafter", "none", "--data", "x", "--dtype", "int8"])
    assert e.value.code == 2 and "unknown precision 'int8'" in capsys.readouterr().err


def test_hardware_record_names_the_cpu(hw):
    hw()
    info = precision.hardware("cpu")
    assert info["device"] == "cpu" and info["native_bf16"] is False and info["threads"] >= 1
    assert info["device_name"] and "no native bf16" in precision.describe(info)


@pytest.mark.parametrize(
    "family, cfg",
    [
        ("distill", {"num_layers": 1}),  # a full-weight student
        ("medusa", {"num_heads": 2, "backbone": "full", "backbone_lr": 2e-5}),  # Medusa-2 training a copy of the target
    ],
)
def test_a_bf16_autocast_step_at_lr_2e5_changes_full_weights_as_an_fp32_step_does(
    tiny_target_dir, chat_jsonl, family, cfg
):
    """GPU recipes train on a bf16 target under bf16 autocast. Trainable full weights are fp32 masters,
    so AdamW's first step (about lr x sign(grad) per weight) lands as in fp32; on bf16 weights most
    of it would round away (checked below on the same update)."""
    from draftsmith.data.batching import build_dataset, collate
    from draftsmith.models.registry import drafter_family
    from draftsmith.target.features import target_features
    from draftsmith.target.load import load_target

    fam = drafter_family(family)
    dcfg = fam.DrafterConfig(**cfg)

    def one_step(dtype: str):
        target, tok = load_target(str(tiny_target_dir), dtype)
        ds = build_dataset(str(chat_jsonl), tok, 48)
        torch.manual_seed(0)
        drafter = fam.build(dcfg, target, ds)
        params = {n: p for n, p in drafter.named_parameters() if p.requires_grad and "heads." not in n}
        before = {n: p.detach().clone() for n, p in params.items()}
        batch = collate([ds[i] for i in range(4)], tok.pad_token_id)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            feats = target_features(target, batch, fam.feature_names(dcfg, target.config))
            loss, n, _ = fam.compute_loss(drafter, target, batch, feats, dcfg)
        (loss / n).backward()
        torch.optim.AdamW(params.values(), lr=2e-5, weight_decay=0.0).step()
        assert all(p.dtype == torch.float32 for p in params.values())  # fp32 masters on a bf16 target too
        return {k: (params[k].detach() - before[k]).flatten() for k in params}, before

    fp32, _ = one_step("float32")
    bf16, weights = one_step("bfloat16")
    d32, d16 = torch.cat(list(fp32.values())), torch.cat(list(bf16.values()))
    moved = d32 != 0
    assert moved.float().mean() > 0.95 and (d16 != 0).float().mean() > 0.95
    assert ((d16[moved] * d32[moved]) > 0).float().mean() > 0.9  # the same direction almost everywhere
    assert torch.allclose(d16.abs().mean(), d32.abs().mean(), rtol=0.05)
    # What bf16 weights would keep of the same update: most of it rounds away.
    w = torch.cat([v.flatten() for v in weights.values()])
    kept = (w.bfloat16() + d16.bfloat16()).float() != w.bfloat16().float()
    assert kept.float().mean() < 0.5
    print(
        f"{family}: weights changed fp32 {moved.float().mean():.4f}, bf16 autocast {(d16 != 0).float().mean():.4f}; "
        f"mean |Δ| {d32.abs().mean():.3e} vs {d16.abs().mean():.3e}; same sign {((d16[moved] * d32[moved]) > 0).float().mean():.4f}; "
        f"kept by bf16 weights {kept.float().mean():.4f}"
    )


def test_rope_frequencies_stay_fp32_through_every_cast():
    """keep_rope_fp32: a cast to bf16 (or fp16 and back) leaves a rotary embedding's inverse
    frequencies fp32 and exact, so its angles at position 1,000 are the fp32 ones; a plain module
    loses them (the control)."""
    import copy

    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from draftsmith.util.precision import keep_rope_fp32

    config = LlamaConfig(
        hidden_size=128, num_attention_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 1e5}
    )
    exact = LlamaRotaryEmbedding(config).inv_freq.clone()
    x, pos = torch.zeros(1, 1, 64), torch.tensor([[1000]])
    cos32, _ = LlamaRotaryEmbedding(config)(x, pos)
    plain = LlamaRotaryEmbedding(config).to(torch.bfloat16)
    assert plain.inv_freq.dtype == torch.bfloat16
    assert (plain(x, pos)[0] - cos32).abs().max() > 0.1  # what the rounding does to the angles
    kept = keep_rope_fp32(LlamaRotaryEmbedding(config))
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.bfloat16(), lambda m: copy.deepcopy(m).half().float()):
        m = cast(kept)
        assert m.inv_freq.dtype == torch.float32 and torch.equal(m.inv_freq, exact)
        assert torch.equal(m(x, pos)[0], cos32)
    with pytest.raises(ValueError, match="call before casting"):
        keep_rope_fp32(plain)
