"""Batched greedy decoding (draftsmith/engine/batched.py): every row equals unbatched target-only greedy, with
ragged acceptance, short drafts, EOS and budgets per row; Stats pool exactly as prompt-by-prompt
decoding does; drafters see the same target features as at batch size 1."""

import json

import pytest
import torch

from draftsmith import DraftsmithError
from draftsmith.engine.batched import batch_curve, parse_batch_sizes, speculative_decode_batch, target_decode_batch
from draftsmith.engine.drafts import Draft
from draftsmith.engine.proposers import NgramProposer, Proposer
from draftsmith.engine.speculative import Stats, speculative_decode, target_decode
from draftsmith.models import eagle, eagle3
from tests.conftest import make_target
from tests.engine.test_speculative import OracleProposer  # proposes the target's own greedy continuation


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core machine the thread pool's
    spinning made these tests ~5x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def lively():
    """The tiny random target with larger weights: the default init (std 0.02) mostly repeats the
    last token forever; std 0.2 gives varied continuations with some repetition (n-gram hits)."""
    target = make_target(vocab=105)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in target.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return target


def _prompts(lengths=(3, 12, 7, 20, 1, 9)):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(5, 100, (n,), generator=g).tolist() for n in lengths]


class Flaky(OracleProposer):
    """Right up to a position that depends on the context length, then wrong; sometimes drafts fewer
    tokens or none: ragged acceptance and ragged blocks across rows and rounds."""

    def propose(self, tokens, feats, k, sampler=None):
        n = tokens.shape[1]
        good = super().propose(tokens, feats, k).tokens[: k - (n % 3 == 0)] if n % 5 else []
        wrong_at = (n // 2) % (k + 1)  # k: all right
        return Draft.chain([(t + 1) % 105 if j == wrong_at else t for j, t in enumerate(good)])


def _eos_for(refs):
    """A token that some reference emits after its first token and another never emits: used as EOS,
    it stops one row early (in a verification round) while another runs to its budget."""
    for t in (t for r in refs for t in r[1:]):
        if any(t not in r for r in refs):
            return t
    raise AssertionError("no suitable EOS token in the references")


def _stats_fields(s: Stats):
    return s.passes, s.emitted, s.proposed, s.accepted, s.reached, s.accepted_at


def test_target_decode_batch_equals_unbatched_with_eos_and_budgets(lively):
    prompts = _prompts()
    eos = {_eos_for([target_decode(lively, p, 24, set()) for p in prompts])}
    refs = [target_decode(lively, p, 24, eos) for p in prompts]
    assert any(len(r) < 24 and r[-1] in eos for r in refs) and any(len(r) == 24 for r in refs)
    assert target_decode_batch(lively, prompts, 24, eos) == refs
    assert target_decode_batch(lively, prompts[:1], 24, eos) == refs[:1]
    assert target_decode_batch(lively, prompts, 1, eos) == [r[:1] for r in refs]


@pytest.mark.parametrize("k", [1, 4])
def test_ragged_speculative_batch_is_lossless_and_pools_stats_like_batch_size_1(lively, k):
    prompts = _prompts()
    prompts[2] = [5, 6, 7, 8] * 4  # repetitive: prompt lookup hits
    eos = {_eos_for([target_decode(lively, p, 30, set()) for p in prompts])}
    refs = [target_decode(lively, p, 30, eos) for p in prompts]
    for factory in (lambda: Flaky(lively), NgramProposer, None):
        stats, single = Stats(k=k), Stats(k=k)
        assert speculative_decode_batch(lively, factory, prompts, k, 30, eos, stats) == refs
        for p in prompts:
            speculative_decode(lively, factory() if factory else None, p, k, 30, eos, None, single)
        # Each row's drafts depend on its own tokens only, so the pooled counters are the same.
        assert _stats_fields(stats) == _stats_fields(single)
        if factory is not None:
            assert 0 < stats.acceptance_rate < 1, factory
    batch1 = Stats(k=k)
    assert speculative_decode_batch(lively, lambda: Flaky(lively), prompts[3:4], k, 30, eos, batch1) == refs[3:4]
    speculative_decode(lively, Flaky(lively), prompts[3], k, 30, eos, None, single := Stats(k=k))
    assert _stats_fields(batch1) == _stats_fields(single)


def test_perfect_drafter_in_a_batch_gets_full_acceptance(lively):
    k, rounds = 3, 4
    prompts = _prompts((4, 11, 6))
    stats = Stats(k=k)
    out = speculative_decode_batch(
        lively, lambda: OracleProposer(lively), prompts, k, 1 + rounds * (k + 1), set(), stats
    )
    assert out == [target_decode(lively, p, 1 + rounds * (k + 1), set()) for p in prompts]
    assert stats.tau == k + 1 and stats.acceptance_rate == 1.0
    assert stats.passes == rounds * len(prompts)  # one pass per row per round


class Recorder(Proposer):
    """Wraps a proposer and records what the engine hands it: tokens and target features."""

    def __init__(self, inner, calls):
        self.inner, self.calls, self.feature_names = inner, calls, inner.feature_names

    def reset(self):
        self.inner.reset()

    def propose(self, tokens, feats, k, sampler=None):
        self.calls.append((tokens[0].tolist(), {n: f.clone() for n, f in feats.items()}))
        return self.inner.propose(tokens, feats, k, sampler)


@pytest.mark.parametrize("family", ["eagle", "eagle3"])
def test_feature_drafters_see_the_features_of_batch_size_1(lively, family):
    torch.manual_seed(0)
    if family == "eagle":
        module, cfg, data = eagle, eagle.DrafterConfig(), None
    else:  # several feature tensors (aux layers), not just last_hidden
        module, cfg = eagle3, eagle3.DrafterConfig(aux_layers=[0, 1, 1], draft_vocab_size=40)
        data = {"input_ids": [list(range(5, 60))], "loss_mask": [[1] * 55]}
    drafter = module.build(cfg, lively, data).eval()
    prompts = _prompts((5, 13, 8))
    made = []  # one Recorder per row, in prompt order

    def factory():
        made.append(Recorder(module.make_proposer(drafter, lively, cfg), []))
        return made[-1]

    out = speculative_decode_batch(lively, factory, prompts, 4, 20, set())
    for p, got, row in zip(prompts, made, out):
        want = Recorder(module.make_proposer(drafter, lively, cfg), [])
        assert row == speculative_decode(lively, want, p, 4, 20, set()) == target_decode(lively, p, 20, set())
        assert [t for t, _ in got.calls] == [t for t, _ in want.calls]
        for (tokens, f), (_, g) in zip(got.calls, want.calls):
            assert set(f) == set(g) == set(module.feature_names(cfg, lively.config))
            for n in f:  # target features of every token but the newest, of this row only
                assert f[n].shape == (1, len(tokens) - 1, lively.config.hidden_size)
                torch.testing.assert_close(f[n], g[n], atol=1e-4, rtol=1e-4)


def test_batch_curve_reports_each_batch_size(lively):
    prompts = _prompts((6, 10, 3, 8, 12))
    curve = batch_curve(lively, None, lambda: OracleProposer(lively), prompts, [1, 2, 4], 3, 9, set())
    assert [c["batch_size"] for c in curve] == [1, 2, 4]
    for c in curve:
        assert c["lossless"] and c["lossless_mismatches"] == 0 and c["target_mismatches"] == 0
        # max_new 9 = the prefill token + 2 rounds of k + 1 tokens, all drafts right.
        assert c["tau"] == 4.0 and c["target_tokens_per_s"] > 0 and c["spec_tokens_per_s"] > 0
        assert c["speedup"] == pytest.approx(c["spec_tokens_per_s"] / c["target_tokens_per_s"], rel=1e-2)
    for bad in ([0], [], [2, 1.5], [True], [-1]):
        with pytest.raises(DraftsmithError, match="--batch-sizes"):
            batch_curve(lively, None, None, prompts, bad, 3, 9, set())


def test_parse_batch_sizes():
    assert parse_batch_sizes("1,2,4") == [1, 2, 4]
    assert parse_batch_sizes(" 8 ") == [8]
    for bad in ("0", "-1", "a", "1.5", "", "1,,2", "2,0"):
        with pytest.raises(DraftsmithError, match="--batch-sizes"):
            parse_batch_sizes(bad)


def test_eval_batch_sizes_adds_the_curve_to_report_and_plot(tiny_target_dir, chat_jsonl, tmp_path, capsys):
    from draftsmith.cli import main

    out = tmp_path / "ev"
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
                "--k",
                "2",
                "--num-prompts",
                "3",
                "--max-new-tokens",
                "6",
                "--batch-sizes",
                "1,2",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads((out / "report.json").read_text())
    assert [c["batch_size"] for c in report["batch_curve"]] == [1, 2]
    assert all(c["lossless"] and c["num_prompts"] == 3 for c in report["batch_curve"])
    assert "Batch-size curve" in (out / "report.md").read_text() and (out / "batch_curve.png").is_file()
    # Batched decoding is greedy with chains: a tree or sampling is refused before anything runs.
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
                "--temperature",
                "0.7",
                "--batch-sizes",
                "1,2",
                "--out",
                str(tmp_path / "x"),
            ]
        )
        == 1
    )
    assert "--batch-sizes: batched decoding is greedy" in capsys.readouterr().err
