"""The guarantee the tables show: the target-only baseline is the reference's own computation (so
`--drafter none` is identical to it in bf16 too), the lossless column is `rule_exact` with the
identity count and dtype beside it, and a greedy run that broke the rule is an error everywhere."""

import json

import pytest
import torch

from draftsmith import DraftsmithError
from draftsmith.cli import main
from draftsmith.eval.report import lossless_cell

pytestmark = pytest.mark.filterwarnings("ignore:.*no native bf16")  # explicit bf16 on an AVX2 CPU warns: expected


@pytest.fixture(autouse=True)
def no_vllm(monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_VLLM_PYTHON", "none")


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_target_only_baseline_is_identical_to_its_reference(dtype, tiny_target_dir, chat_jsonl, tmp_path, capsys):
    out = tmp_path / "none"
    assert (
        main(
            [
                "eval",
                "--drafter",
                "none",
                "--target",
                str(tiny_target_dir),
                "--data",
                str(chat_jsonl),
                "--num-prompts",
                "4",
                "--max-new-tokens",
                "24",
                "--dtype",
                dtype,
                "--out",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads((out / "report.json").read_text())
    short = {"bf16": "bfloat16", "fp32": "float32"}[dtype]
    assert report["dtype"] == short and report["lossless"] is True and report["rule_exact"] is True
    assert report["lossless_mismatches"] == 0 and report["new_tokens"] == 4 * 24
    assert f"| yes (identical 4/4, {dtype}) |" in capsys.readouterr().out


def test_target_decode_is_the_engine_without_a_drafter(tiny_target, monkeypatch):
    """One computation: the reference decode is the speculative engine with no drafts, pass for pass."""
    from draftsmith.engine import speculative

    target, _ = tiny_target
    calls = []
    real = speculative.verification_forward

    def spy(target, ids, cache, device, names=(), mask=None, positions=None):
        calls.append((len(ids), None if mask is None else tuple(mask.shape)))
        return real(target, ids, cache, device, names, mask, positions)

    monkeypatch.setattr(speculative, "verification_forward", spy)
    out = speculative.target_decode(target, [5, 6, 7], 6, set())
    ref_calls, calls[:] = list(calls), []
    assert speculative.speculative_decode(target, None, [5, 6, 7], 0, 6, set()) == out
    assert calls == ref_calls and ref_calls == [(3, None)] + [(1, None)] * 5  # the prefill, then one-token steps


@pytest.mark.parametrize(
    "report, cell",
    [
        (
            {"lossless": False, "rule_exact": True, "num_prompts": 20, "lossless_mismatches": 2, "dtype": "bfloat16"},
            "yes (identical 18/20, bf16)",
        ),
        (
            {"lossless": True, "rule_exact": True, "num_prompts": 20, "lossless_mismatches": 0, "dtype": "float32"},
            "yes (identical 20/20, fp32)",
        ),
        (
            {"lossless": False, "rule_exact": False, "num_prompts": 4, "lossless_mismatches": 1, "dtype": "float32"},
            "NO (identical 3/4, fp32)",
        ),
        (
            {"lossless": None, "rule_exact": None, "num_prompts": 4, "lossless_mismatches": None, "dtype": "bfloat16"},
            "sampled*",
        ),
        (
            {"lossless": True, "num_prompts": 4, "lossless_mismatches": 0, "dtype": "float32"},
            "yes (identical 4/4)",
        ),  # older report
    ],
)
def test_the_lossless_column_is_the_rule_with_the_identity_count(report, cell):
    assert lossless_cell(report) == cell


@pytest.fixture
def rule_broken(monkeypatch):
    """Every greedy round reports a broken verification rule (what a wrong verify rule would give)."""
    from draftsmith.engine import speculative

    monkeypatch.setattr(speculative, "rule_exact", lambda *a: False)


def test_a_broken_rule_fails_eval_with_one_line_after_writing_the_report(
    tiny_target_dir, chat_jsonl, tmp_path, capsys, rule_broken
):
    out = tmp_path / "ngram"
    assert (
        main(
            [
                "eval",
                "--drafter",
                "ngram",
                "--target",
                str(tiny_target_dir),
                "--data",
                str(chat_jsonl),
                "--num-prompts",
                "2",
                "--max-new-tokens",
                "8",
                "--out",
                str(out),
            ]
        )
        == 1
    )
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # not progress bars
    assert len(err) == 1 and err[0].startswith("draftsmith: error: ") and "broke the rule (rule_exact false)" in err[0]
    assert json.loads((out / "report.json").read_text())["rule_exact"] is False  # the evidence stays


def test_a_broken_rule_fails_training_after_the_run_is_saved(tiny_target_dir, chat_jsonl, tmp_path, rule_broken):
    from draftsmith.train.config import load_config
    from draftsmith.train.loop import train
    from tests.train.test_train import _overrides

    cfg = load_config(
        None,
        _overrides(
            tiny_target_dir,
            chat_jsonl,
            tmp_path,
            **{"eval.enabled": True, "eval.num_prompts": 2, "eval.max_new_tokens": 8, "optim.max_steps": 1},
        ),
    )
    with pytest.raises(DraftsmithError, match=r"eval: greedy verification broke the rule"):
        train(cfg)
    assert (tmp_path / "r" / "final" / "model.safetensors").is_file() and (
        tmp_path / "r" / "eval" / "report.md"
    ).is_file()


@pytest.fixture
def untrained_eagle(tiny_target_dir, tmp_path):
    """An untrained EAGLE head for the tiny target, saved as training saves one: its drafts are nearly
    always rejected, so every round is one the rule must reject."""
    from draftsmith.models import eagle
    from draftsmith.models.folder import save_drafter
    from draftsmith.target.load import fingerprint, load_target

    target, _ = load_target(str(tiny_target_dir), "float32")
    torch.manual_seed(0)
    cfg = eagle.DrafterConfig()
    meta = {"drafter": "eagle", "drafter_config": {"type": "eagle", **cfg.__dict__}, "target": "tiny"}
    return save_drafter(
        eagle.build(cfg, target), tmp_path / "final", {**meta, "target_fingerprint": fingerprint(target)}
    )


def one_wrong_in(every: int, monkeypatch) -> list[int]:
    """Plant a verifier that follows the rule except once in `every` drafted rounds, where it keeps the
    first draft although the target's argmax differs (and emits the target's next token after it):
    one wrong token in `every` rounds. -> the rounds it fired at (filled as the eval runs)."""
    from draftsmith.engine import speculative

    real, rounds, fired = speculative.verify_tree_greedy, [0], []

    def verify(draft, logits):
        path, new = real(draft, logits)
        rounds[0] += bool(draft.tokens)  # drafted rounds only: target-only decoding verifies empty drafts
        due = rounds[0] >= every * (len(fired) + 1)
        if due and draft.tokens and not path:
            fired.append(rounds[0])
            return [0], [draft.tokens[0], int(logits[1].argmax())]  # row 1: the target after node 0
        return path, new

    monkeypatch.setattr(speculative, "verify_tree_greedy", verify)
    return fired


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_planted_verifier_accepting_one_wrong_token_in_200_rounds_breaks_rule_exact(
    untrained_eagle, tiny_target_dir, chat_jsonl, tmp_path, capsys, monkeypatch, dtype
):
    """4 prompts x 64 tokens: 63 drafted rounds of warm-up, then 252 counted; the planted verifier fires
    at drafted round 200, inside the counted run, once."""
    args = ["eval", "--drafter", str(untrained_eagle), "--target", str(tiny_target_dir), "--data", str(chat_jsonl)]
    args += ["--num-prompts", "4", "--max-new-tokens", "64", "--k", "3", "--dtype", dtype]
    assert main(args + ["--out", str(tmp_path / "unbroken")]) == 0
    report = json.loads((tmp_path / "unbroken" / "report.json").read_text())
    assert report["rule_exact"] is True and lossless_cell(report).startswith("yes")
    fired = one_wrong_in(200, monkeypatch)
    assert main(args + ["--out", str(tmp_path / "planted")]) == 1
    assert fired == [200]  # one wrong token, in the counted run of 252 drafted rounds
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1 and "broke the rule (rule_exact false)" in err[0]
    report = json.loads((tmp_path / "planted" / "report.json").read_text())
    assert report["rule_exact"] is False and lossless_cell(report).startswith("NO")
