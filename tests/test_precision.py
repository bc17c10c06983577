"""Precision `auto` is chosen from the hardware (CPU bf16 capability and CUDA mocked both ways);
every documented spelling works in recipes and on the command line; bad values are one-line errors."""

import warnings

import pytest
import torch
import yaml

from draftsmith import DraftsmithError
from draftsmith.train import precision
from draftsmith.train.config import load_config, resolve_precision


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


@pytest.mark.parametrize("cpu, expected", [
    ({}, "float32"),                        # AVX2-only CPU: bf16 would take torch's slow path
    ({"avx512_bf16": True}, "bfloat16"),
    ({"amx": True}, "bfloat16"),
    ({"cuda": True, "cuda_bf16": True}, "bfloat16"),
    ({"cuda": True, "cuda_bf16": False}, "float32"),  # e.g. a V100
])
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


SPELLINGS = {"auto": None, "no": "float32", "fp32": "float32", "float32": "float32", "bf16": "bfloat16",
             "bfloat16": "bfloat16"}


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
    with pytest.raises(DraftsmithError, match=r"r.yaml: optim.mixed_precision: unknown precision 'true' \(YAML reads yes/on as true\)"):
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
