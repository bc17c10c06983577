"""vLLM in the loop: `draftsmith serve-check` and `data regenerate --engine vllm` against a real vLLM
server on loopback (marker `vllm`; skipped without .venv-vllm: `bash scripts/setup.sh --vllm`), and
the pieces around it that need no server (counters, errors, the Medusa encoding vLLM loads).

The target is a tiny Llama trained to answer alphabet-walk prompts (tests/conftest.py
`save_pattern_target`), so drafters of it have real acceptance that a broken export loses."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from draftsmith import DraftsmithError
from draftsmith.ship.serve_check import divergences, near_tie_limit, serve_check, tau_tolerance, vllm_acceptance
from draftsmith.target import vllm_server

EAGLE3 = {"drafter.type": "eagle3", "drafter.aux_layers": [0, 1, 2], "drafter.draft_vocab_size": 60}
FAMILIES = {
    "eagle3": EAGLE3,
    "eagle": {"drafter.type": "eagle"},
    # A reduced head vocabulary the way vLLM serves it: one shared lm_head (the target's rows) + token_map.
    "medusa": {
        "drafter.type": "medusa",
        "drafter.num_heads": 3,
        "drafter.draft_vocab_size": 60,
        "drafter.original_lm_head": True,
    },
    "medusa2": {
        "drafter.type": "medusa",
        "drafter.num_heads": 3,
        "drafter.backbone": "lora",
        "drafter.backbone_lr": 1e-3,
        "drafter.draft_vocab_size": 60,
        "drafter.original_lm_head": True,
    },
    "distill": {"drafter.type": "distill", "drafter.num_layers": 2},
    # EAGLE-3.1: speculators' defaults (norm_before_fc + norm_output), and fc_norm instead.
    "eagle3.1": {**EAGLE3, "drafter.norm_before_fc": True, "drafter.norm_output": True},
    "eagle3.1-fc_norm": {**EAGLE3, "drafter.fc_norm": True, "drafter.norm_output": True},
    # Block drafters: one drafter pass per round.
    "peagle": {
        "drafter.type": "peagle",
        "drafter.aux_layers": [0, 1, 2],
        "drafter.draft_vocab_size": 60,
        "drafter.depths": 4,
    },
    "dflash": {"drafter.type": "dflash", "drafter.aux_layers": [0, 1, 2], "drafter.block_size": 4},
    # Causal inside the block: vLLM reads it from the export's sliding_window_non_causal: false.
    "dflash-causal": {
        "drafter.type": "dflash",
        "drafter.aux_layers": [0, 1, 2],
        "drafter.block_size": 4,
        "drafter.causal": True,
    },
    # A reduced vocabulary: vLLM loads the drafter's own lm_head and d2t instead of sharing the target's.
    "dflash-vocab": {
        "drafter.type": "dflash",
        "drafter.aux_layers": [0, 1, 2],
        "drafter.block_size": 4,
        "drafter.draft_vocab_size": 60,
    },
}


# scripts/test.sh sets this for its vLLM phase: set-up installed vLLM there, so a skip would hide a break
# (one did: the server's environment was looked up from the wrong folder, and every vLLM test skipped).
if os.environ.get("DRAFTSMITH_REQUIRE_VLLM") == "1" and not vllm_server.available():
    raise RuntimeError(f"DRAFTSMITH_REQUIRE_VLLM=1 but no vLLM at {vllm_server.DEFAULT_VENV}")


def needs_vllm(test):
    """A test that talks to a real vLLM server: marker `vllm`, skipped where none is installed."""
    return pytest.mark.vllm(
        pytest.mark.skipif(not vllm_server.available(), reason="no vLLM: bash scripts/setup.sh --vllm")(test)
    )


def _processes_with(text: str) -> list[int]:
    """pids whose command line mentions `text` (a server left behind would)."""
    found = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and text in (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                found.append(int(d.name))
        except OSError:
            pass
    return found


@pytest.fixture(scope="module", autouse=True)
def one_engine_process():
    """vLLM's CPU platform gives each engine a worker process of its own (to bind OpenMP threads to
    cores): a third full import of vLLM, 12 s of the 33 s a server takes to start on a 2-core Xeon.
    With VLLM_ENABLE_V1_MULTIPROCESSING=0 the engine process runs the model itself (vLLM's `uni`
    executor), the same model code: 21 s. The Ctrl-C test keeps vLLM's default."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        yield


@pytest.fixture(scope="module")
def pattern(tmp_path_factory):
    from tests.conftest import save_pattern_target, write_pattern_chats

    root = tmp_path_factory.mktemp("pattern")
    save_pattern_target(root / "target")
    return {
        "root": root,
        "target": root / "target",
        "train": write_pattern_chats(root / "train.jsonl", range(130)),
        "holdout": write_pattern_chats(root / "holdout.jsonl", range(200, 212)),
    }


@pytest.fixture(scope="module")
def trained(pattern):
    """family -> its trained final/ folder (each trained once per module, on self-distilled data)."""
    from draftsmith.train.config import load_config
    from draftsmith.train.loop import train
    from tests.train.test_train import _overrides

    runs = {}

    def get(family: str) -> Path:
        if family not in runs:
            runs[family] = (
                train(
                    load_config(
                        None,
                        _overrides(
                            pattern["target"],
                            pattern["train"],
                            pattern["root"] / family,
                            **{
                                "data.regenerate": True,
                                "optim.max_steps": 80,
                                "optim.lr": 3e-3,
                                "optim.batch_size": 8,
                                "log_every": 40,
                                **FAMILIES[family],
                            },
                        ),
                    )
                )
                / "final"
            )
        return runs[family]

    return get


@pytest.fixture(scope="module")
def target_server(pattern):
    """One vLLM server of the target alone, shared by the checks (each still starts its own speculative one)."""
    if not vllm_server.available():
        pytest.skip("no vLLM")
    with vllm_server.serve(str(pattern["target"]), max_model_len=512) as server:
        yield server


def _check(pattern, target_server, path, out, **kw):
    kw = {"num_prompts": 12, "max_new_tokens": 40, **kw}
    return serve_check(
        path, pattern["holdout"], out, k=3, target_server=target_server.url if target_server else None, **kw
    )


# --- a real vLLM server ------------------------------------------------------------------------------


@needs_vllm
@pytest.mark.parametrize(
    "concurrency",
    [None, pytest.param([1, 2], marks=pytest.mark.vllm_families)],  # (the curve: ~20 s more; the extended run)
    ids=["concurrency-1", "concurrency-1-2"],
)
def test_eagle3_export_served_by_vllm_matches_draftsmith(pattern, trained, target_server, tmp_path, concurrency):
    final = trained("eagle3")
    r = _check(pattern, target_server, final, tmp_path / "sc", **({"concurrency": concurrency} if concurrency else {}))
    assert r["loaded"] and r["passed"], r.get("why")
    assert r["identical_to_target_only"] and r["identical_to_draftsmith"] and r["prompts_identical_to_draftsmith"] == 12
    # A drafter that learned the walk is accepted often, and vLLM counts what draftsmith counts.
    assert r["draftsmith_tau"] > 1.5 and r["tau_rel_diff"] <= r["tau_tolerance"] < 0.2
    assert len(r["vllm_per_position"]) == len(r["draftsmith_per_position"]) == 3
    # The verdict's own comparison: vLLM's rounds, replayed by draftsmith on vLLM's text. In fp32 the
    # texts are draftsmith's greedy ones, and the two engines' drafters agree round by round.
    p = r["replay"]
    assert p["available"] and p["prompts"] == 12 and p["untiled_prompts"] == 0 and p["rounds"] > 12 * 5
    # fp32: every one of vLLM's rounds accepts what draftsmith's replay of it accepts.
    assert p["rounds_differing"] == 0 and p["per_position_diff"] == [0.0] * 3 and p["tau_diff"] == 0.0
    assert p["vllm_tau"] > 1.5 and p["tau_sampling_error"] > 0
    if concurrency:
        assert [c["concurrency"] for c in r["concurrency"]] == [1, 2]
        assert [c["batch_size"] for c in r["draftsmith_batch_curve"]] == [1, 2]
    assert {"serve_check.json", "serve_check.md", "serve_check.png", "export"} <= {
        p.name for p in (tmp_path / "sc").iterdir()
    }
    assert json.loads((tmp_path / "sc" / "export" / "config.json").read_text())["speculators_model_type"] == "eagle3"
    assert not _processes_with(str(tmp_path / "sc" / "export"))  # the speculative server is gone


@needs_vllm
def test_vllms_own_config_code_reads_the_deploy_schedule_and_refuses_a_bad_one(pattern):
    from draftsmith.ship import deploy

    config = {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 3,
        "prompt_lookup_min": 1,
        deploy.SCHEDULE_KEY: deploy.schedule({1: 3, 2: 3, 4: 2, 8: 0}),
    }
    python = vllm_server.find_python()
    got = deploy.in_vllm(deploy.check(config), str(pattern["target"]), python, 512, 10)
    assert got["method"] == "ngram" and got["num_speculative_tokens"] == 3
    assert got["k_per_batch_size"] == [3, 3, 3, 2, 2, 2, 2, 0, 0, 0]  # batch sizes 1..10; 8 on carries 0
    # What draftsmith's check would refuse first, vLLM refuses too, in one line with its reason.
    with pytest.raises(
        DraftsmithError, match=r"vLLM refuses it \(ValueError: The first batch-size range must start at 1"
    ) as e:
        deploy.in_vllm({**config, deploy.SCHEDULE_KEY: [[2, 4, 3]]}, str(pattern["target"]), python, 512, 10)
    assert "\n" not in str(e.value)


@needs_vllm
@pytest.mark.vllm_families
def test_serve_check_writes_the_deploy_config_vllm_serves_with_the_k_it_chose(
    pattern, trained, target_server, tmp_path
):
    from draftsmith.ship import deploy

    r = _check(pattern, target_server, trained("eagle3"), tmp_path / "sc", concurrency=[1, 4], deploy_k=[1, 3])
    assert r["passed"], r.get("why")
    d = r["deploy"]
    config = deploy.read(tmp_path / "sc" / "deploy" / "vllm.json")
    assert config == d["speculative_config"] and config["method"] == r["speculative_config"]["method"]
    assert sorted(d["spec_tokens_per_s"]) == [1, 3] and sorted(d["chosen_k"]) == [1, 4] and d["runs"] == 3
    runs = d["tokens_per_s_runs"]
    assert all(len(runs[k][c]) == 3 for k in (0, 1, 3) for c in (1, 4))
    assert d["chosen_k"] == deploy.choose_k(runs[0], {k: runs[k] for k in (1, 3)})  # the rule, on its own runs
    for c, k in d["chosen_k"].items():  # a chosen K's slowest run beats the target's fastest
        assert k == 0 or min(runs[k][c]) > max(runs[0][c])
    assert d["vllm_reads"]["k_per_batch_size"][0] == d["chosen_k"][1]
    if d["chosen_k"][1]:
        assert d["served"][1]["draft_tokens_per_draft"] == pytest.approx(d["chosen_k"][1], abs=0.01)
    assert "Deploy config" in (tmp_path / "sc" / "serve_check.md").read_text()


def _swap_d2t(export_dir: Path, tok, pair: str = "eq") -> None:
    """Two rows of the draft->target map swapped (2 of 60 draft ids, 3 %): the head drafts letter
    `pair[1]` where it means `pair[0]` and back. Rounds that draft neither letter are untouched."""
    from safetensors.torch import load_file, save_file

    from benchmarks.planted_export import swap_d2t

    state = load_file(export_dir / "model.safetensors")
    targets = torch.arange(len(state["d2t"])) + state["d2t"]  # target id = draft id + d2t[draft id]
    rows = [int((targets == tok.convert_tokens_to_ids(c)).nonzero()[0]) for c in pair]
    state["d2t"] = swap_d2t(state["d2t"], rows)
    save_file(state, export_dir / "model.safetensors")


def _set_everywhere(config, key: str, change):
    """Every `key` of a nested config changed by `change` (a RoPE base is written in both spellings)."""
    if isinstance(config, dict):
        return {k: change(v) if k == key else _set_everywhere(v, key, change) for k, v in config.items()}
    return [_set_everywhere(v, key, change) for v in config] if isinstance(config, list) else config


def _break(export_dir: Path, how: str, tok=None) -> None:
    """Realistic export defects, each partial: `rows`: the head's lm_head rows rolled by one (every
    draft token is the wrong one); `ids`: the aux layer ids one lower, the classic off-by-one (vLLM
    then taps other layers); `d2t`: two of the 60 draft->target rows swapped; `rope`: the drafter's
    rope_theta doubled (positions mis-rotated, more the farther they are)."""
    from safetensors.torch import load_file, save_file

    config = json.loads((export_dir / "config.json").read_text())
    if how == "rows":
        state = load_file(export_dir / "model.safetensors")
        state["lm_head.weight"] = state["lm_head.weight"].roll(1, dims=0).contiguous()
        save_file(state, export_dir / "model.safetensors")
    elif how == "d2t":
        _swap_d2t(export_dir, tok)
    elif how == "rope":
        config = _set_everywhere(config, "rope_theta", lambda v: 2 * v)
    else:
        config["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in config["eagle_aux_hidden_state_layer_ids"]]
    (export_dir / "config.json").write_text(json.dumps(config))


@needs_vllm
# The three partial defects run in every suite; the rolled rows (every draft wrong) in the extended run.
@pytest.mark.parametrize("how", [pytest.param("rows", marks=pytest.mark.vllm_families), "d2t", "rope", "ids"])
def test_planted_export_defects_fail_round_by_round(pattern, trained, target_server, tmp_path, how):
    """vLLM loads a broken export and stays lossless, but drafts other tokens than the trained drafter
    in some rounds: compared with it (not with the export read back), those rounds accept another count
    on the same text, at margins no rounding explains."""
    from draftsmith.ship.export import export
    from draftsmith.target.load import load_target

    final = trained("eagle3")
    target, tok = load_target(str(pattern["target"]), "float32")
    broken = export(final, target, "speculators", tmp_path / "broken", tok)
    _break(broken, how, tok)
    r = _check(pattern, target_server, broken, tmp_path / "sc", drafter=final)
    assert r["loaded"] and r["identical_to_target_only"]  # lossless still: only acceptance suffers
    p = r["replay"]
    assert not r["passed"] and "rounds on vLLM's own text accepted another count" in r["why"], json.dumps(p)
    assert p["rounds_clear"] >= 1 and p["differing_prompts"]
    if how == "rows":
        assert p["draftsmith_per_position"][0] - p["vllm_per_position"][0] > 0.5


@needs_vllm
@pytest.mark.vllm_families
@pytest.mark.parametrize(
    "family",
    [
        "eagle",
        "medusa",
        "medusa2",
        "distill",
        "eagle3.1",
        "eagle3.1-fc_norm",
        "peagle",
        "dflash",
        "dflash-causal",
        "dflash-vocab",
    ],
)
def test_every_family_vllm_serves_passes(pattern, trained, target_server, tmp_path, family):
    # Medusa-2 serves its own trained backbone: the shared target-only server does not apply.
    r = _check(pattern, None if family == "medusa2" else target_server, trained(family), tmp_path / "sc")
    assert r["loaded"] and r["passed"], r.get("why")
    assert r["identical_to_target_only"] and r["draftsmith_tau"] > 1.1


def _perturb(export_dir: Path, scale: float = 0.7) -> None:
    """Noise of `scale` × its own std on the head's fc weight: on the pattern drafter, τ 10-20 % lower
    (2.38 -> 2.04 at 0.6 in draftsmith's engine, 12 prompts × 40 tokens; at 0.5 the drop, 5-7 %, sat
    on few prompts, which chance explains)."""
    from safetensors.torch import load_file, save_file

    state = load_file(export_dir / "model.safetensors")
    w = state["fc.weight"]
    noise = torch.randn(w.shape, generator=torch.Generator().manual_seed(0))
    state["fc.weight"] = (w.float() + scale * w.float().std() * noise).to(w.dtype).contiguous()
    save_file(state, export_dir / "model.safetensors")


@needs_vllm
@pytest.mark.vllm_families
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_same_text_verdict_passes_the_head_and_fails_it_perturbed(pattern, trained, target_server, tmp_path, dtype):
    """The verdict compares both engines on vLLM's own text (ship/replay_check.py), so it can pass in
    bf16, where vLLM's text may part from draftsmith's at near-ties; and a head whose τ is only ~10 %
    lower than its drafter's fails in either precision."""
    from draftsmith.ship.export import export
    from draftsmith.target.load import load_target
    from tests.conftest import write_pattern_chats

    final = trained("eagle3")
    server = target_server if dtype == "float32" else None  # the shared target server is fp32
    # 24 prompts: the pattern's answers are short (about 10 rounds each), and 12 of them leave a 10 %
    # difference at the edge of what chance explains in bf16.
    holdout = write_pattern_chats(tmp_path / "holdout.jsonl", range(200, 224))
    kw = {"dtype": dtype, "num_prompts": 24, "target_server": server.url if server else None}
    ok = serve_check(final, holdout, tmp_path / "ok", k=3, max_new_tokens=40, **kw)
    assert ok["passed"], ok["why"]
    assert ok["replay"]["available"] and ok["replay"]["untiled_prompts"] == 0
    target, tok = load_target(str(pattern["target"]), "float32")
    bad = export(final, target, "speculators", tmp_path / "bad", tok)
    _perturb(bad)
    r = serve_check(bad, holdout, tmp_path / "sc", k=3, max_new_tokens=40, drafter=final, **kw)
    p = r["replay"]
    assert 0.05 < (p["draftsmith_tau"] - p["vllm_tau"]) / p["draftsmith_tau"] < 0.3
    assert not r["passed"] and "on vLLM's own text" in r["why"], json.dumps(p)


@needs_vllm
@pytest.mark.vllm_families
def test_eagle3_official_sglang_format_is_served_too(pattern, trained, target_server, tmp_path):
    from draftsmith.ship.export import export
    from draftsmith.target.load import load_target

    final = trained("eagle3")
    target, tok = load_target(str(pattern["target"]), "float32")
    exported = export(final, target, "sglang", tmp_path / "sglang", tok)
    r = _check(pattern, target_server, exported, tmp_path / "sc", drafter=final)
    assert r["loaded"] and r["passed"], r.get("why")


def _stops_after_a_startup_failure_and_after_ctrl_c(model, tmp_path, python=None, engine_names_model=False):
    # A folder vLLM cannot serve: the cause comes back as one line, and nothing is left running.
    bad = tmp_path / "not-a-model"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"architectures": ["NoSuchForCausalLM"], "model_type": "nosuch"}))
    with pytest.raises(DraftsmithError, match="vLLM did not start") as e:
        with vllm_server.serve(str(bad), python=python):
            pass
    assert "\n" not in str(e.value) and not _processes_with(str(bad))
    # Ctrl-C inside the block: the server and its engine processes stop.
    copy = tmp_path / "target-copy"
    copy.symlink_to(model)
    with pytest.raises(KeyboardInterrupt):
        with vllm_server.serve(str(copy), python=python, max_model_len=512) as server:
            pid = server.pid
            assert len(_processes_with(str(copy))) >= 1 + engine_names_model  # the server (and the stand-in's engine)
            assert vllm_server.complete(server, [3, 10, 11, 12], 4)
            raise KeyboardInterrupt
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not _processes_with(str(copy))


def test_server_is_stopped_after_a_startup_failure_and_after_ctrl_c(tmp_path):
    """How draftsmith starts and stops a server, on a stand-in for vLLM's api_server that starts in
    a fraction of a second (tests/ship/fake_vllm): the real one is the `vllm_families` test below."""
    python = tmp_path / "python"
    fake = Path(__file__).parent / "fake_vllm"
    python.write_text(f'#!/bin/sh\nPYTHONPATH="{fake}" exec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    (tmp_path / "model").mkdir()
    _stops_after_a_startup_failure_and_after_ctrl_c(tmp_path / "model", tmp_path, str(python), engine_names_model=True)


@needs_vllm
@pytest.mark.vllm_families
def test_vllm_is_stopped_after_a_startup_failure_and_after_ctrl_c(pattern, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # vLLM's default: engine and worker processes
    _stops_after_a_startup_failure_and_after_ctrl_c(pattern["target"], tmp_path)


@needs_vllm
def test_regenerate_through_vllm_keeps_vllms_exact_ids_and_resumes(pattern, target_server, tmp_path, monkeypatch):
    from draftsmith.data import regenerate as regen
    from draftsmith.data.load import encode_prompt, load_prompts
    from draftsmith.target.load import load_target

    target, tok = load_target(str(pattern["target"]), "float32")
    out = tmp_path / "regen.jsonl"
    calls, real = [], vllm_server.complete

    def interrupted(*args, **kwargs):  # Ctrl-C on the fourth request
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(vllm_server, "complete", interrupted)
    with pytest.raises(KeyboardInterrupt):
        regen.regenerate_vllm(
            str(pattern["target"]), tok, pattern["holdout"], out, 40, concurrency=1, server=target_server.url
        )
    # The request in flight when Ctrl-C came may still land; every line is whole and nothing is final yet.
    answered = [json.loads(l)["id"] for l in (tmp_path / "regen.jsonl.partial").read_text().splitlines()]
    assert not out.exists() and 3 <= len(answered) < 12
    monkeypatch.setattr(vllm_server, "complete", lambda *a, **k: calls.append(1) or real(*a, **k))
    calls.clear()
    regen.regenerate_vllm(
        str(pattern["target"]), tok, pattern["holdout"], out, 40, concurrency=4, server=target_server.url
    )
    records = [json.loads(l) for l in out.read_text().splitlines()]
    assert len(calls) == 12 - len(answered) and [r["id"] for r in records] == list(range(12))  # none asked twice
    prompts = [encode_prompt(tok, p) for p in load_prompts(pattern["holdout"])]
    for r, p in zip(records, prompts):  # the ids vLLM returned, unchanged; the prompts draftsmith sent
        assert r["prompt_ids"] == p and r["completion_ids"] == real(target_server, p, 40)
    # The CLI form writes the same records.
    from draftsmith.cli import main

    assert (
        main(
            [
                "data",
                "regenerate",
                "--engine",
                "vllm",
                "--target",
                str(pattern["target"]),
                "--data",
                pattern["holdout"],
                "--out",
                str(tmp_path / "cli.jsonl"),
                "--max-new-tokens",
                "40",
                "--server",
                target_server.url,
            ]
        )
        == 0
    )
    assert (tmp_path / "cli.jsonl").read_text() == out.read_text()
    # In fp32 vLLM's greedy answers are the in-process engine's, token for token.
    inproc = regen.regenerate(target, tok, pattern["holdout"], tmp_path / "hf.jsonl", 4, 40)
    assert [json.loads(l)["completion_ids"] for l in inproc.read_text().splitlines()] == [
        r["completion_ids"] for r in records
    ]


@needs_vllm
def test_multi_turn_regeneration_through_vllm_answers_every_turn_as_in_process(pattern, target_server, tmp_path):
    """Turn by turn through vLLM, each prompt holding the target's own earlier answers: the same
    records, ids and all, as the in-process engine's in fp32."""
    from draftsmith.data import regenerate as regen
    from draftsmith.target.load import load_target

    target, tok = load_target(str(pattern["target"]), "float32")
    data = tmp_path / "chats.jsonl"
    turns = [("user", "abc"), ("assistant", "x"), ("user", "cfi"), ("assistant", "y"), ("user", "dhl")]
    rows = [{"messages": [{"role": r, "content": c} for r, c in turns[:n]]} for n in (5, 3, 1)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    served = regen.regenerate_vllm(
        str(pattern["target"]), tok, str(data), tmp_path / "vllm.jsonl", 30, server=target_server.url
    )
    inproc = regen.regenerate(target, tok, str(data), tmp_path / "hf.jsonl", 4, 30)
    lines = [json.loads(l) for l in served.read_text().splitlines()]
    assert regen.regeneration_counts(served)["answers"] == 3 + 2 + 1
    assert lines == [json.loads(l) for l in inproc.read_text().splitlines()]


# --- no server needed ---------------------------------------------------------------------------------


def test_counters_from_vllms_metrics_text(monkeypatch):
    text = "\n".join(
        [
            "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
            'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 652.0',
            'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 1956.0',
            'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 428.0',
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 103.0',
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 270.0',
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 55.0',
            'vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e9',
        ]
    )
    monkeypatch.setattr(vllm_server, "_get", lambda url, timeout=10.0: text)
    c = vllm_server.spec_counters(vllm_server.Server("http://x", "m"))
    assert c == {
        "num_drafts": 652.0,
        "num_draft_tokens": 1956.0,
        "num_accepted_tokens": 428.0,
        "per_pos": [270.0, 103.0, 55.0],
    }
    # The issue's own reading of these counters: τ 1.66, per-position 0.41 / 0.38 / 0.53.
    a = vllm_acceptance(c)
    assert a["vllm_tau"] == pytest.approx(1.656, abs=1e-3)
    assert [round(p, 2) for p in a["vllm_per_position"]] == [0.41, 0.38, 0.53]
    zero = {"num_drafts": 0.0, "num_draft_tokens": 0.0, "num_accepted_tokens": 0.0, "per_pos": []}
    assert vllm_server.counter_delta(c, zero) == c


def test_tau_tolerance_is_one_round_per_prompt_plus_near_ties():
    assert tau_tolerance(12, 652) == pytest.approx(0.03 + 12 / 652)
    assert tau_tolerance(12, 12) == pytest.approx(1.03)  # one round each: nothing can be compared


def test_low_precision_divergences_are_judged_by_the_targets_logit_gap_where_outputs_part(tiny_target):
    """In bf16 vLLM's speculative and target-only outputs may part at a near-tie: each parting is
    read on the target's own logits after the shared prefix, and only a gap within a few bf16 steps
    passes. Built here on the target's greedy continuation: at position 2, two outputs that take the
    two closest of its top tokens (a near-tie), one that takes the least likely token against the
    greedy one (no near-tie), and one that ends at EOS there."""
    import torch

    target, tok = tiny_target
    prompt, out = [5, 6, 7], []
    with torch.no_grad():
        for _ in range(4):
            out.append(int(target(torch.tensor([prompt + out])).logits[0, -1].argmax()))
        logits = target(torch.tensor([prompt + out[:2]])).logits[0, -1].float()
    top = logits.topk(10)
    i = int((top.values[:-1] - top.values[1:]).argmin())  # the two closest neighbours among the top 10
    a, b, last = int(top.indices[i]), int(top.indices[i + 1]), int(logits.argmin())
    rows = divergences(
        target,
        [prompt] * 4,
        [out, out[:2] + [a, 9], out[:2] + [last], out[:2]],
        [out, out[:2] + [b], out, out],
        tok.eos_token_id,
    )
    assert [r["prompt"] for r in rows] == [1, 2, 3] and all(r["position"] == 2 for r in rows)
    assert rows[0]["tokens"] == [a, b] and rows[2]["tokens"] == [tok.eos_token_id, out[2]]
    limit = near_tie_limit(logits.max().item())
    for r, (x, y) in zip(rows, ((a, b), (last, out[2]), (tok.eos_token_id, out[2]))):
        gap = abs(logits[x] - logits[y]).item()
        assert r["gap"] == pytest.approx(gap, abs=1e-4) and r["near_tie"] == (gap <= limit)
    assert rows[0]["near_tie"] and not rows[1]["near_tie"]  # both verdicts occur
    # 4 bf16 steps: 0.5 for logits of 16 to 32, 0.0625 for logits of 2 to 4, 0.03125 below 2.
    assert near_tie_limit(20.0) == 0.5 and near_tie_limit(-3.0) == 0.0625 and near_tie_limit(0.2) == 0.03125


def test_startup_error_is_the_line_that_names_the_cause():
    log = "\n".join(
        [
            "(APIServer pid=1) INFO 12-01 10:11:05 [core.py:133] Initializing a V1 LLM engine",
            "(EngineCore pid=2) Traceback (most recent call last):",
            '(EngineCore pid=2)   File "medusa.py", line 200, in load_weights',
            "(EngineCore pid=2) AssertionError: Attempted to load weight (torch.Size([8192, 576])) into parameter (torch.Size([49152, 576]))",
            "(APIServer pid=1) RuntimeError: Engine core initialization failed. See root cause above.",
        ]
    )
    assert vllm_server.startup_error(log).startswith("AssertionError: Attempted to load weight")  # the root cause
    assert vllm_server.startup_error(log.rsplit("\n", 1)[0] + "\nRuntimeError: no port").startswith(
        "RuntimeError: no port"
    )
    assert vllm_server.startup_error("nothing useful\nlast words") == "last words"


def test_bad_input_gives_one_line_errors(tmp_path, monkeypatch):
    import socket

    monkeypatch.setenv(vllm_server.PYTHON_ENV, str(tmp_path / "no-python"))
    with pytest.raises(DraftsmithError, match=r"vLLM not found .*setup.sh --vllm"):
        vllm_server.find_python()
    with socket.socket() as s:  # a port in use
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(DraftsmithError, match="already in use"):
            vllm_server.free_port(s.getsockname()[1])
        port = s.getsockname()[1]
    with pytest.raises(DraftsmithError, match="no vLLM server answers"):  # nothing listens there now
        with vllm_server.serve(url=f"http://127.0.0.1:{port}"):
            pass
    # A speed at 16 concurrent requests from 2 prompts is never measured: refused before anything runs.
    for flags, want in (
        (dict(num_prompts=2, concurrency=[1, 16], deploy_k=[1, 2]), r"^--concurrency 16: more concurrent requests"),
        (dict(concurrency=[1, 4], deploy_k=[1, 2], deploy_runs=1), r"^--deploy-runs 1: at least 3 runs"),
    ):
        with pytest.raises(DraftsmithError, match=want):
            serve_check(tmp_path / "nothing", "builtin:code-holdout", tmp_path / "out", **flags)
        assert not (tmp_path / "out").exists()


def test_serve_check_cli_without_vllm_says_how_to_install(tmp_path, monkeypatch, capsys):
    from draftsmith.cli import main

    monkeypatch.setenv(vllm_server.PYTHON_ENV, str(tmp_path / "no-python"))
    assert main(["serve-check", str(tmp_path), "--data", "builtin:code-holdout", "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "setup.sh --vllm" in err and not (tmp_path / "o").exists()


def test_a_family_vllm_cannot_serve_is_named(tiny_target_dir, chat_jsonl, tmp_path, monkeypatch):
    from draftsmith.models import eagle
    from draftsmith.ship import serve_check as sc
    from draftsmith.target.load import load_target
    from draftsmith.train.config import load_config
    from draftsmith.train.loop import train
    from tests.train.test_train import _overrides

    final = (
        train(load_config(None, _overrides(tiny_target_dir, chat_jsonl, tmp_path, **{"optim.max_steps": 1}))) / "final"
    )
    monkeypatch.setattr(eagle.FAMILY, "SERVE_FORMAT", None)
    target, tok = load_target(str(tiny_target_dir))
    with pytest.raises(
        DraftsmithError,
        match=r"vLLM serves no eagle export \(it serves eagle3, peagle, dflash, dspark, dflash2, medusa, distill\)",
    ):
        sc.prepare(final, tmp_path / "out", target, tok)


def test_medusa_reduced_vocabulary_is_exported_the_one_way_vllm_loads_it(tiny_target_dir, chat_jsonl, tmp_path):
    """vLLM 0.32 MedusaModel: with original_lm_head it builds one lm_head of truncated_vocab_size rows
    and scatters its logits through token_map; per-head reduced lm_heads hit its weight_loader's
    shape assertion, so they are refused with the way out named."""
    from safetensors.torch import load_file

    from draftsmith.ship.export import export
    from draftsmith.target.load import load_target
    from draftsmith.train.config import load_config
    from draftsmith.train.loop import train
    from tests.train.test_train import _overrides

    target, tok = load_target(str(tiny_target_dir))
    common = {"drafter.type": "medusa", "drafter.num_heads": 2, "drafter.draft_vocab_size": 40, "optim.max_steps": 2}
    shared = (
        train(
            load_config(
                None,
                _overrides(tiny_target_dir, chat_jsonl, tmp_path / "a", **common, **{"drafter.original_lm_head": True}),
            )
        )
        / "final"
    )
    out = export(shared, target, "vllm", tmp_path / "shared", tok)
    config, state = json.loads((out / "config.json").read_text()), load_file(out / "model.safetensors")
    assert config["original_lm_head"] and config["truncated_vocab_size"] == 40 and config["vocab_size"] == len(tok)
    token_map = state["token_map"]
    assert state["lm_head.weight"].shape == (40, 32) and token_map.dtype.is_floating_point is False
    assert (state["lm_head.weight"] == target.get_output_embeddings().weight[token_map]).all()
    assert not any(k.startswith("lm_heads.") for k in state)
    own = train(load_config(None, _overrides(tiny_target_dir, chat_jsonl, tmp_path / "b", **common))) / "final"
    with pytest.raises(DraftsmithError, match="original_lm_head=true"):
        export(own, target, "vllm", tmp_path / "own", tok)
    assert not (tmp_path / "own").exists()


@needs_vllm
@pytest.mark.vllm_families
def test_regeneration_bench_prints_both_engines_and_their_agreement(pattern, tmp_path, capsys):
    from benchmarks import regen_vllm

    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"target: {pattern['target']}\ndrafter:\n  type: eagle\n")
    regen_vllm.main(
        [
            "--recipe",
            str(recipe),
            "--data",
            pattern["holdout"],
            "--num-prompts",
            "6",
            "--max-new-tokens",
            "30",
            "--batch-size",
            "3",
            "--concurrency",
            "3",
            "--out",
            str(tmp_path / "b"),
        ]
    )
    result = json.loads((tmp_path / "b" / "regen.json").read_text())
    assert result["prompts"] == 6 and result["hf"]["answers_per_s"] > 0 and result["vllm"]["answers_per_s"] > 0
    assert result["agreement"] == {
        "identical_answers": 6,
        "answers": 6,
        "token_agreement": 1.0,
    }  # fp32: the same answers
    assert "greedy agreement (float32): 6/6" in capsys.readouterr().out


# --- real architectures in vLLM (marker vllm_families: two servers per check) ------------------------


@pytest.mark.vllm_families
@needs_vllm
@pytest.mark.parametrize(
    "arch, family",
    [(a, f) for a in ("llama3.1", "qwen3", "qwen2.5") for f in ("eagle3", "eagle", "distill")]
    + [("qwen3-moe", "eagle3")],  # speculators#1136: EAGLE-3 on an MoE verifier
)
def test_real_architecture_exports_served_by_vllm_match_draftsmith(tmp_path, arch, family):
    """A tiny target of each real architecture (llama3 RoPE scaling, q/k norm, q/k/v biases, Qwen3's
    MoE, their templates) trained to answer the walk; a drafter trained on its own regenerated
    answers; vLLM rebuilds the export from its config alone, and serves it with outputs identical
    and τ equal."""
    from draftsmith.train.config import load_config
    from draftsmith.train.loop import train
    from tests.conftest import save_pattern_target, write_pattern_chats
    from tests.train.test_train import _overrides

    target = save_pattern_target(tmp_path / "target", arch=arch)
    data, holdout = (
        write_pattern_chats(tmp_path / "train.jsonl", range(130)),
        write_pattern_chats(tmp_path / "h.jsonl", range(200, 212)),
    )
    final = (
        train(
            load_config(
                None,
                _overrides(
                    target,
                    data,
                    tmp_path / family,
                    **{
                        "data.regenerate": True,
                        "data.max_length": 160,
                        "optim.max_steps": 80,
                        "optim.lr": 3e-3,
                        "optim.batch_size": 8,
                        "log_every": 40,
                        **FAMILIES[family],
                    },
                ),
            )
        )
        / "final"
    )
    r = serve_check(final, holdout, tmp_path / "sc", num_prompts=12, max_new_tokens=40, k=3)
    assert r["loaded"] and r["passed"], r.get("why")
    assert r["identical_to_target_only"] and r["identical_to_draftsmith"]
    assert r["draftsmith_tau"] > 1.3 and r["tau_rel_diff"] <= r["tau_tolerance"]
    print(
        f"{arch} {family}: vLLM τ {r['vllm_tau']:.3f}, draftsmith τ {r['draftsmith_tau']:.3f}, "
        f"identical {r['prompts_identical_to_draftsmith']}/12"
    )
