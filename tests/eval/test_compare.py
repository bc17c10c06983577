"""`draftsmith compare`: drafters x holdouts in one table; every timing run decodes each prompt
target-only, then with each drafter, the drafters' order rotated between runs."""

import json
import statistics
from dataclasses import replace

import pytest

from draftsmith import DraftsmithError
from draftsmith.cli import main
from draftsmith.eval.drafters import resolve
from tests.conftest import lossless_ok


def test_compare_writes_one_row_per_drafter_and_holdout_with_a_shared_baseline(
    tiny_target_dir, chat_jsonl, tmp_path, capsys
):
    from draftsmith.train.config import load_config
    from draftsmith.train.loop import train
    from tests.train.test_train import _overrides

    run = train(
        load_config(
            None,
            _overrides(tiny_target_dir, chat_jsonl, tmp_path, **{"drafter.type": "medusa", "drafter.num_heads": 2}),
        )
    )
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"prompt": f"count {i}", "completion": "0123"}) + "\n" for i in range(4)))
    out = tmp_path / "cmp"
    assert (
        main(
            [
                "compare",
                "--drafter",
                f"{run / 'final'}@static:[[0],[1],[0,0]]",
                "--drafter",
                "ngram",
                "--drafter",
                "none",
                "--data",
                str(chat_jsonl),
                "--data",
                str(other),
                "--k",
                "2",
                "--num-prompts",
                "3",
                "--max-new-tokens",
                "8",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    reports = json.loads((out / "compare.json").read_text())
    assert len(reports) == 6 and {f.name for f in out.iterdir()} == {"compare.json", "compare.md", "compare.png"}
    assert all(lossless_ok(r) for r in reports)
    for holdout in (str(chat_jsonl), str(other)):
        rows = [r for r in reports if r["holdout"] == holdout]
        assert len({r["target_tokens_per_s"] for r in rows}) == 1  # the baseline is measured once and shared
    medusa = next(r for r in reports if r["drafter"].startswith("medusa"))
    assert medusa["tree"] == "static:[[0],[1],[0,0]]" and medusa["k"] == 2
    assert "| ngram |" in (out / "compare.md").read_text() and "| drafter | holdout |" in capsys.readouterr().out


def test_allow_stale_is_required_for_another_target_and_the_report_marks_it(
    tiny_target_dir, other_target_dir, chat_jsonl, tmp_path, capsys
):
    from draftsmith.train.config import load_config
    from draftsmith.train.loop import train
    from tests.train.test_train import _overrides

    run = train(load_config(None, _overrides(tiny_target_dir, chat_jsonl, tmp_path, **{"optim.max_steps": 2})))
    args = [
        "eval",
        "--drafter",
        str(run / "final"),
        "--target",
        str(other_target_dir),
        "--data",
        str(chat_jsonl),
        "--num-prompts",
        "2",
        "--max-new-tokens",
        "8",
        "--k",
        "2",
        "--out",
        str(tmp_path / "stale"),
    ]
    assert main(args) == 1 and "trained for target" in capsys.readouterr().err
    assert main(args + ["--allow-stale"]) == 0
    report = json.loads((tmp_path / "stale" / "report.json").read_text())
    assert report["stale"]["trained_for"] != report["stale"]["evaluated_on"] and lossless_ok(report)
    assert "Stale drafter" in (tmp_path / "stale" / "report.md").read_text()


def test_compare_gives_the_numbers_separate_evals_give(tiny_target_dir, chat_jsonl, tmp_path):
    from draftsmith.eval.compare import compare
    from draftsmith.eval.config import EvalConfig
    from draftsmith.eval.drafters import Resolved, make_baseline
    from draftsmith.eval.run import evaluate
    from draftsmith.target.load import load_target

    target, tok = load_target(str(tiny_target_dir))
    cfg = EvalConfig(k=3, num_prompts=3, max_new_tokens=10)
    together = compare(["ngram"], [str(chat_jsonl)], target, tok, None, cfg)[0]
    alone = evaluate(Resolved("ngram", make_baseline("ngram"), target, None), tok, str(chat_jsonl), None, cfg)
    for key in ("tau", "acceptance_rate", "per_position", "new_tokens", "lossless"):
        assert together[key] == alone[key], key


def test_training_free_and_combined_drafters_by_name_are_lossless(tiny_target_dir, chat_jsonl, tmp_path, capsys):
    """`lookahead`, `hybrid:PATH` and `cascade:LOW,MID` resolve in compare and in eval (same numbers
    as separate eval runs is the first test's contract; here: every name loads and stays lossless)."""
    from draftsmith.train.config import load_config
    from draftsmith.train.loop import train
    from tests.train.test_train import _overrides

    student = (
        train(
            load_config(
                None,
                _overrides(
                    tiny_target_dir,
                    chat_jsonl,
                    tmp_path,
                    **{"drafter.type": "distill", "drafter.num_layers": 1, "optim.max_steps": 2, "run": "student"},
                ),
            )
        )
        / "final"
    )
    out = tmp_path / "cmp"
    flags = ["--data", str(chat_jsonl), "--k", "2", "--num-prompts", "2", "--max-new-tokens", "8"]
    assert (
        main(
            [
                "compare",
                "--drafter",
                "lookahead:W=4,G=2",
                "--drafter",
                f"hybrid:{student}",
                "--drafter",
                f"cascade:ngram,{student}",
                *flags,
                "--out",
                str(out),
            ]
        )
        == 0
    )
    reports = json.loads((out / "compare.json").read_text())
    assert [r["drafter"].split(" ")[0] for r in reports] == ["lookahead:W=4,N=3,G=2", "hybrid", "cascade"]
    assert all(lossless_ok(r) for r in reports)
    assert sum(reports[1]["draft_sources"].values()) > 0 and reports[2]["levels"]["rounds"] > 0
    assert main(["eval", "--cascade", f"ngram,{student}", *flags, "--out", str(tmp_path / "ev")]) == 0
    report = json.loads((tmp_path / "ev" / "report.json").read_text())
    assert lossless_ok(report) and "Cascade levels" in (tmp_path / "ev" / "report.md").read_text()
    assert main(["eval", "--cascade", f"{student},ngram", *flags, "--out", str(tmp_path / "bad")]) == 1
    assert "level 2 'ngram' cannot verify drafts" in capsys.readouterr().err


def test_block_drafters_run_in_compare_the_batch_curve_and_the_hybrid_like_any_drafter(
    tiny_target_dir, chat_jsonl, tmp_path
):
    """P-EAGLE and DFlash, trained by the loop: compare (with a batch-size curve) and hybrid:PATH,
    every greedy row lossless, chains of their own length."""
    from draftsmith.train.config import load_config
    from draftsmith.train.loop import train
    from tests.train.test_train import _overrides

    runs = {
        family: train(
            load_config(
                None,
                _overrides(
                    tiny_target_dir,
                    chat_jsonl,
                    tmp_path,
                    **{"drafter.type": family, "optim.max_steps": 2, "run": family, **extra},
                ),
            )
        )
        / "final"
        for family, extra in (
            ("peagle", {"drafter.aux_layers": [0, 1, 1], "drafter.depths": 3, "drafter.draft_vocab_size": 60}),
            ("dflash", {"drafter.aux_layers": [0], "drafter.block_size": 4}),
        )
    }
    out = tmp_path / "cmp"
    assert (
        main(
            [
                "compare",
                "--drafter",
                str(runs["peagle"]),
                "--drafter",
                str(runs["dflash"]),
                "--drafter",
                f"hybrid:{runs['dflash']}",
                "--drafter",
                "ngram@k=2",  # its own chain length
                "--data",
                str(chat_jsonl),
                "--k",
                "3",
                "--num-prompts",
                "2",
                "--max-new-tokens",
                "8",
                "--batch-sizes",
                "1,2",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    reports = json.loads((out / "compare.json").read_text())
    assert [r["drafter"].split(" ")[0] for r in reports] == ["peagle", "dflash", "hybrid", "ngram"]
    assert all(lossless_ok(r) and r["k"] == (2 if r["drafter"] == "ngram" else 3) and not r["tree"] for r in reports)
    assert max(len(r["per_position"]) for r in reports if r["drafter"] == "ngram") <= 2
    with pytest.raises(DraftsmithError, match=r"--drafter ngram@k=0: expected @k=N with N >= 1") as e:
        resolve("ngram@k=0", None)
    assert "\n" not in str(e.value)
    assert all([c["batch_size"] for c in r["batch_curve"]] == [1, 2] for r in reports)


def test_every_timing_run_decodes_each_prompt_target_only_then_each_drafter_in_a_rotated_order(
    tiny_target, chat_jsonl, monkeypatch
):
    """The call order, recorded: per prompt, target-only first and then every drafter, in every run,
    the first included; run i starts at drafter i (mod 3). On a fake clock (target-only 1 s a prompt,
    each drafter its own seconds) every run of a row reads that row's speedup, so no run's timings land
    on another row."""
    from draftsmith.data.load import encode_prompt, load_prompts, thinking_kwargs
    from draftsmith.eval import run as eval_run
    from draftsmith.eval.compare import compare, compare_table
    from draftsmith.eval.config import EvalConfig

    target, tok = tiny_target
    calls: list[tuple[str, tuple[int, ...], bool]] = []  # (who, prompt, whether it counts acceptance)
    real_target, real_speculative = eval_run.target_decode, eval_run.speculative_decode
    seconds = {"target": 1.0, "NgramProposer k=3": 0.25, "NgramProposer k=2": 0.5, "NoneType k=0": 2.0}

    def target_only(target, prompt, *args, **kwargs):
        calls.append(("target", tuple(prompt), False))
        return real_target(target, prompt, *args, **kwargs)

    def speculative(target, proposer, prompt, k, *args, **kwargs):  # a row is known by its proposer and k
        stats = args[3] if len(args) > 3 else kwargs.get("stats")  # after max_new, eos, sampler
        calls.append((f"{type(proposer).__name__} k={k}", tuple(prompt), stats is not None))
        return real_speculative(target, proposer, prompt, k, *args, **kwargs)

    def clock(fn, *args, **kwargs):  # the decode, then the seconds of whoever `fn` just recorded
        return fn(*args, **kwargs), seconds[calls[-1][0]]

    monkeypatch.setattr(eval_run, "target_decode", target_only)
    monkeypatch.setattr(eval_run, "speculative_decode", speculative)
    monkeypatch.setattr(eval_run, "timed", clock)
    specs, cfg = ["ngram", "ngram@k=2", "none"], EvalConfig(k=3, num_prompts=2, max_new_tokens=6, timing_runs=3)
    three = compare(specs, [str(chat_jsonl)], target, tok, None, cfg)
    rows = ["NgramProposer k=3", "NgramProposer k=2", "NoneType k=0"]
    prompts = [tuple(encode_prompt(tok, p, thinking_kwargs(cfg.thinking))) for p in load_prompts(str(chat_jsonl), 2)]
    warm = [(name, prompts[0][:8], False) for name in ["target", *rows]]  # each path once before any timing
    # Run i: each prompt target-only, then the drafters from drafter i on; only run 0 counts acceptance.
    runs = [
        [(name, p, i == 0 and name != "target") for p in prompts for name in ["target", *rows[i:], *rows[:i]]]
        for i in range(3)
    ]
    assert calls == warm + runs[0] + runs[1] + runs[2]

    one = compare(specs, [str(chat_jsonl)], target, tok, None, replace(cfg, timing_runs=1))
    for r3, r1, row in zip(three, one, rows):
        for key in ("tau", "per_position", "new_tokens", "acceptance_rate", "lossless"):
            assert r3[key] == r1[key], key
        # Every run of this row divides its own seconds by target-only's (each run decodes the same tokens).
        spec_tps = r3["new_tokens"] / (2 * seconds[row])  # 2 prompts
        assert r3["speedup_runs"] == [round(spec_tps / r3["target_tokens_per_s"], 3)] * 3, row
        assert r3["speedup"] == statistics.median(r3["speedup_runs"]) and r1["speedup_runs"] == [r1["speedup"]]
    assert "(0.50-0.50x, 3 runs) |" in compare_table(three).splitlines()[4]  # `none`: 1 s against 2 s
