"""Tiny, hermetic fixtures: a character-level tokenizer with a chat template and randomly
initialised Llama targets saved as local folders (no hub, no download)."""

from __future__ import annotations

import os
import string

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

# The tokenizer, chat template, pattern data and trained target the tests share with scripts/gpu-check.sh.
from benchmarks.tiny_target import (  # noqa: F401
    CHAT_TEMPLATE,
    make_tokenizer,
    pattern_chat,
    plain_config,
    train_pattern_target,
    write_pattern_chats,
)

# Tests that launch 2 processes run one at a time on one pytest-xdist worker (`--dist loadgroup`):
# two such launches at once put 4 processes on 2 cores, where DeepSpeed's and gloo's waits spin.
MULTIPROCESS = pytest.mark.xdist_group("multiprocess")


def pytest_collection_modifyitems(items):
    """DeepSpeed JIT-compiles its CPU Adam op on first use (100-125 s on one core). The test that
    builds it is collected first, so the other worker compiles it while the 2-process chain runs,
    and the 2-process test that uses it (zero3-offload) last, so it finds the op built."""
    order = {"builds": 0, "uses": 2}
    items.sort(key=lambda item: order.get(getattr(item.get_closest_marker("cpu_adam"), "args", ("",))[0], 1))


def make_target(seed: int = 0, vocab: int = 128, layers: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="session")
def peaked_target():
    """The target of the lossless-sampling tests (tests/engine/test_sampling.py and the drafters that reuse its
    chi-square test): sharper next-token distributions than a fresh random init, so fewer categories."""
    target = make_target(seed=3)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(8.0)
    return target


def save_target(path, seed: int = 0, chat_template: str | None = CHAT_TEMPLATE, layers: int = 2):
    tok = make_tokenizer(chat_template)
    make_target(seed, vocab=len(tok), layers=layers).save_pretrained(path)
    tok.save_pretrained(path)
    return path


# Tests run in the precision `auto` picks for the machine: bf16 on a CPU with native bf16 (as on every
# GPU), fp32 on an AVX2-only one, so each kind of machine tests its own path. A test marked
# `fp32_exact` compares against a separately computed reference token for token (or to fp32
# rounding), which only fp32 guarantees: it runs in fp32 on every CPU. The switch is set before the
# test's fixtures are (a module fixture first built for such a test is built in fp32 too) and is
# inherited by the processes a test launches.
_CPU_BF16 = os.environ.get("DRAFTSMITH_CPU_BF16")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if item.get_closest_marker("fp32_exact"):
        os.environ["DRAFTSMITH_CPU_BF16"] = "0"
    elif _CPU_BF16 is None:
        os.environ.pop("DRAFTSMITH_CPU_BF16", None)
    else:
        os.environ["DRAFTSMITH_CPU_BF16"] = _CPU_BF16


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory):
    return save_target(tmp_path_factory.mktemp("tiny-target"))


@pytest.fixture(scope="session")
def other_target_dir(tmp_path_factory):
    return save_target(tmp_path_factory.mktemp("other-target"), seed=1)


@pytest.fixture
def tiny_target(tiny_target_dir):
    from draftsmith.target.load import load_target

    return load_target(str(tiny_target_dir))


@pytest.fixture
def chat_jsonl(tmp_path):
    import json

    rows = []
    for i in range(48):
        a = "".join(string.ascii_lowercase[(i * 7 + j) % 26] for j in range(20 + i % 13))
        rows.append({"messages": [{"role": "user", "content": f"say {i}"}, {"role": "assistant", "content": a}]})
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def save_pattern_target(
    path, steps: int = 160, layers: int = 4, arch: str | None = None, chat_template: str = CHAT_TEMPLATE
):
    """A tiny target *trained* to answer `pattern_chat` prompts (benchmarks/tiny_target.py), so its
    greedy answers are varied and learnable: a drafter of it has real acceptance, and a broken export
    visibly loses it. `arch`: one of REAL_ARCHS (that architecture's config at this size), else a
    plain tied Llama."""
    tok = make_tokenizer(arch_template(arch) if arch else chat_template)
    cfg = arch_config(arch, len(tok), layers) if arch else plain_config(len(tok), layers)
    return train_pattern_target(path, cfg, tok, steps)


# Tiny random targets with the architectures users train on (models/known.py shrinks their real
# configs), each with a test template that renders as that model's does (tests/templates.py):
# Llama-3.1's llama3 RoPE scaling, untied, and its injected system header; Qwen3's q/k norm, tied as
# its small models are, and its think block on the last assistant turn; Qwen2.5's q/k/v biases and
# its default system prompt; Qwen3-30B-A3B's sparse MLPs (4 experts, top-2), untied, with Qwen3's
# template; Gemma-3's scaled embeddings, (1 + w) norms, sliding-window layers with their own RoPE
# base, tied, and its <start_of_turn>model turns.
REAL_ARCHS = {
    "llama3.1": ("meta-llama/Llama-3.1-8B-Instruct", {}, "LLAMA31_LIKE"),
    "qwen3": ("Qwen/Qwen3-8B", {"tie_word_embeddings": True}, "QWEN3_LIKE"),
    "qwen2.5": ("Qwen/Qwen2.5-7B-Instruct", {}, "QWEN25_LIKE"),
    "qwen3-moe": ("Qwen/Qwen3-30B-A3B", {}, "QWEN3_LIKE"),
    "gemma3": ("google/gemma-3-1b-it", {}, "GEMMA3_LIKE"),
}


def arch_template(arch: str) -> str:
    from tests import templates

    return getattr(templates, REAL_ARCHS[arch][2])


def arch_config(arch: str, vocab: int, layers: int = 4):
    from draftsmith.models.known import tiny_config

    name, extra, _ = REAL_ARCHS[arch]
    return tiny_config(name, vocab, layers=layers, **extra)


def save_arch_target(path, arch: str, layers: int = 4, seed: int = 0):
    """A tiny random target of `arch` (REAL_ARCHS) with the test tokenizer and its template, saved as a folder."""
    from transformers import AutoModelForCausalLM

    tok = make_tokenizer(arch_template(arch))
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(arch_config(arch, len(tok), layers)).eval().save_pretrained(path)
    tok.save_pretrained(path)
    return path


def lossless_ok(report: dict) -> bool:
    """A greedy eval kept the guarantee: the verification rule held in every round, and outputs are
    identical to target-only decoding in fp32; in bf16 a mismatch may only be a near-tie of the
    target's logits (a few bf16 steps; docs/troubleshooting.md, "bf16 near-ties")."""
    if report["rule_exact"] is not True:
        return False
    if report["dtype"] == "float32":
        return report["lossless"] is True
    return all(gap <= 0.5 for gap in report["mismatch_logit_gaps"])
