"""`draftsmith publish`: export a trained drafter, check that the export drafts like the drafter did,
write a model card with the evidence, and upload the folder through huggingface_hub.

The folder is built in full first (`--dry-run` stops there and uploads nothing). The Hub token comes
from huggingface_hub's own lookup (HF_TOKEN or `hf auth login`); it is never printed or written.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import torch
from huggingface_hub import ModelCard, ModelCardData

from draftsmith import DraftsmithError
from draftsmith.data.load import encode_prompt, load_prompts
from draftsmith.engine.proposers import Proposer, proposer_modules
from draftsmith.engine.speculative import Stats, speculative_decode
from draftsmith.eval.report import _where, format_table
from draftsmith.models.formats import logit_diff
from draftsmith.models.readers import import_export
from draftsmith.models.registry import drafter_family, load_drafter, target_to_load_on
from draftsmith.ship.export import export
from draftsmith.ship.serve_check import serve_check, summary
from draftsmith.target import vllm_server
from draftsmith.target.load import eos_ids, load_target, served_name

# speculators' forward vs draftsmith's drafter, both in fp32 on the same inputs: only the order of
# operations differs (speculators' flex/eager attention, draftsmith's sdpa): measured 7e-8 on the
# tests' tiny export, 6e-6 on the quickstart smollm2-135m one. A mapping error moves logits far more
# (reversed aux layer ids: 0.37, argmax agreement 13%, in tests/ship/test_publish.py).


class Recorder(Proposer):
    """Wraps a proposer and keeps every draft it proposes and every logits row its drafter computed,
    to compare two drafters round by round. Every trained drafter's proposer turns its drafter's output
    into logits through its `logits` function (the Proposer protocol), so the tap goes there."""

    def __init__(self, proposer):
        self.proposer, self.drafts, self.logits = proposer, [], []
        self.feature_names, self.max_depth = proposer.feature_names, proposer.max_depth
        keep = lambda out: self.logits.extend(out.detach().float().reshape(-1, out.shape[-1]))  # noqa: E731
        inner = proposer.logits
        proposer.logits = lambda out: _passed(keep, inner(out))

    def reset(self):
        self.proposer.reset()

    def propose(self, tokens, feats, k, sampler=None):
        draft = self.proposer.propose(tokens, feats, k, sampler)
        self.drafts.append(list(draft.tokens))
        return draft


def weight_parity(pairs: list[tuple[torch.nn.Module, torch.nn.Module]]) -> dict:
    """The export read back must hold the trained weights bit for bit: each pair is a module the
    drafter drafts with and its counterpart rebuilt from the export (`proposer_modules` of both
    proposers; the target's own modules, shared by both, are skipped). Both sides read the same stored
    values into the same dtype, so the difference is 0 exactly (every family, LoRA variants and
    Medusa-2 included, in fp32 and bf16: tests/ship/test_publish.py); any change the exported file can
    hold shows, where the logits of a few prompts hide a single weight moved by 1e-3.
    -> {"weight_tensors": tensors compared, "max_abs_weight_diff": inf for a missing tensor or another
    shape, "weight_diff_at": the first tensor at that maximum, None when all agree}."""
    worst, at, n = 0.0, None, 0
    for a, b in pairs:
        if a is b:
            continue
        sa, sb = a.state_dict(), b.state_dict()
        for name in sorted(set(sa) | set(sb)):
            d, n = _tensor_diff(sa.get(name), sb.get(name)), n + 1
            if d > worst:
                worst, at = d, f"{type(a).__name__}.{name}"
    return {"weight_tensors": n, "max_abs_weight_diff": worst, "weight_diff_at": at}


def _tensor_diff(x: torch.Tensor | None, y: torch.Tensor | None) -> float:
    """max |x - y| (`logit_diff`: equal entries count 0, so -inf masks agree); inf for a tensor on one
    side only, another shape, or a nan."""
    if x is None or y is None or x.shape != y.shape:
        return float("inf")
    d = logit_diff(x.float(), y.float()) if x.numel() else 0.0
    return float("inf") if d != d else d


def drafting_params(drafter, verifier, target) -> int:
    """Parameters of the drafting part: a drafter that trained its own backbone (the verifier is not
    the target) counts without the backbone it verifies with."""
    backbone = set() if verifier is target else {id(p) for p in verifier.parameters()}
    return sum(p.numel() for p in drafter.parameters() if id(p) not in backbone)


def _passed(keep, logits):
    keep(logits)
    return logits


def _read_back(drafter_dir: Path, exported: Path, target):
    """The drafter and its export read back, each as a proposer on the model that verifies drafts, and
    their weights compared -> (family, drafter config, drafter, proposers (drafter's, export's), verifier,
    drafting params, `weight_parity`)."""
    family, cfg, own = load_drafter(drafter_dir, target)
    trained = verifier = family.verifier(own, target)
    params = drafting_params(own, trained, target)
    if trained is not target:  # Medusa-2: the export's heads draft for the exported backbone
        verifier, _ = load_target(
            str(exported / "backbone"), str(next(target.parameters()).dtype).removeprefix("torch.")
        )
    _, _, back = import_export(exported, verifier)
    proposers = [family.make_proposer(drafter, verifier, cfg) for drafter in (own, back)]
    # Both proposers draft for `verifier`, so Medusa-2's exported backbone is compared with the trained
    # one beside them (elsewhere both are the target, and skipped).
    pairs = [*zip(proposer_modules(proposers[0]), proposer_modules(proposers[1])), (trained, verifier)]
    return family, cfg, own, proposers, verifier, params, weight_parity(pairs)


@torch.no_grad()
def verify_export(
    drafter_dir: Path, exported: Path, target, tok, holdout: str, k: int = 4, prompts: int = 3, max_new_tokens: int = 32
) -> dict:
    """Serving parity: re-read the exported folder (transformers for `hf`; the consumer's weight
    mapping for the EAGLE and Medusa formats; speculators' own loader too, for the speculators
    format, when it is installed) and decode a few holdout prompts greedily with it and with
    draftsmith's own drafter, on the same target. Every draft token must agree; the logits of every
    drafter pass are compared too (max |Δ| and argmax agreement)."""
    target = target_to_load_on(target, drafter_dir)
    family, cfg, own, proposers, verifier, params, weights = _read_back(drafter_dir, exported, target)
    eos, runs = eos_ids(target, tok), []
    for proposer in proposers:
        rec, stats = Recorder(proposer), Stats(k=k)
        for p in load_prompts(holdout, prompts):
            speculative_decode(verifier, rec, encode_prompt(tok, p), k, max_new_tokens, eos, None, stats)
        runs.append((rec.drafts, stats.tau, rec.logits))
    (a, tau_a, la), (b, tau_b, lb) = runs
    pairs = [(x, y) for da, db in zip(a, b) for x, y in zip(da, db)]
    agree = sum(x == y for x, y in pairs) / max(len(pairs), 1)
    rows = list(zip(la, lb))  # in call order; aligned while the drafts agree
    out = {
        "draft_token_agreement": round(agree, 4),
        "rounds": len(a),
        "tau_drafter": round(tau_a, 4),
        "tau_export": round(tau_b, 4),
        "logit_rows": len(rows),
        "max_abs_logit_diff": max((logit_diff(x, y) for x, y in rows), default=0.0),
        "logit_argmax_agreement": round(sum(int(x.argmax() == y.argmax()) for x, y in rows) / max(len(rows), 1), 4),
        "params": params,
        **weights,
    }
    # Both sides run the same code on the same weights in the same dtype, so the logits agree up to
    # rounding unless the export says something else than what was trained (e.g. another RoPE): a
    # rebuilt head whose argmaxes happen to survive still fails here. The weights themselves must be
    # the same bits (`weight_parity`): one weight moved by 1e-3 moves these logits by 3e-6 to 2e-4
    # in fp32, under the tolerance (docs/verdicts.md).
    out["logit_tolerance"] = 1e-3 if next(target.parameters()).dtype == torch.float32 else 5e-2
    out["passed"] = (
        out["max_abs_weight_diff"] == 0.0
        and agree == 1.0
        and len(a) == len(b)
        and len(la) == len(lb)
        and out["logit_argmax_agreement"] == 1.0
        and out["max_abs_logit_diff"] <= out["logit_tolerance"]
    )
    # The format's own consumer, where the family knows one to run (speculators for its format).
    # fp32 copy of our drafter: the comparison measures the two implementations, not the target's dtype
    ours = family.make_proposer(copy.deepcopy(own).float(), verifier, cfg)
    check = family.consumer_check(
        exported, verifier, ours, [encode_prompt(tok, p) for p in load_prompts(holdout, prompts)]
    )
    if check is not None:
        out[check["consumer"]] = check
        out["passed"] = out["passed"] and check.get("passed", True)
    return out


def model_card(
    meta: dict,
    report: dict,
    fmt: str,
    repo_id: str,
    params: int,
    parity: dict,
    license: str,
    served: dict | None = None,
) -> str:
    family, target = meta["drafter"], served_name(meta["target"])
    served_target = (
        "the `backbone/` folder of this repo (the trained backbone)"
        if drafter_family(family).trains_target(meta["drafter_config"])
        else f"`{target}`"
    )
    # The Hub's metadata block, written by huggingface_hub (it validates and orders the keys).
    data = ModelCardData(
        base_model=target,
        library_name="transformers" if fmt == "hf" else "vllm",
        license=license,
        tags=["speculative-decoding", family, "draftsmith"],
    )
    return str(
        ModelCard(
            "\n".join(
                [
                    f"---\n{data.to_yaml()}\n---",
                    "",
                    f"# {family} drafter for {target}",
                    "",
                    f"A {family} draft model ({params / 1e6:.1f}M parameters) trained with draftsmith for speculative "
                    f"decoding with {served_target} as the verifier, in the `{fmt}` format.",
                    "",
                    f"- Target: `{meta['target']}` (fingerprint `{meta['target_fingerprint']}`)",
                    f"- Training data: `{meta.get('train_data')}`, {meta.get('steps')} optimizer steps; recipe: `resolved_config.yaml`",
                    f"- Drafter config: `{json.dumps(meta['drafter_config'])}`",
                    "",
                    "## Evaluation",
                    "",
                    f"Holdout `{report['holdout']}`, {report['num_prompts']} prompts, temperature {report['temperature']}, "
                    f"batch size {report.get('batch_size', 1)}, measured on {_where(report)}.",
                    "",
                    format_table([report]),
                    "",
                    "τ = tokens per target verification pass; speedup = measured tokens/s against target-only decoding on the "
                    f"same hardware, {_timing_words(report)}.",
                    "",
                    *_lossless_words(report),
                    "![acceptance](acceptance.png)",
                    "",
                    "## Serving parity",
                    "",
                    f"The exported files were read back the way the serving engine maps them and decoded {parity['rounds']} draft "
                    f"rounds next to the trained drafter: draft-token agreement {parity['draft_token_agreement']:.1%}, "
                    f"max |Δ logits| {parity['max_abs_logit_diff']:.2e} over {parity['logit_rows']} drafter logits rows (argmax "
                    f"agreement {parity['logit_argmax_agreement']:.1%}), τ {parity['tau_export']:.2f} vs {parity['tau_drafter']:.2f} "
                    f"({'passed' if parity['passed'] else 'FAILED'}).{speculators_line(parity)}",
                    "",
                    *(["## In vLLM", "", _served_words(served), ""] if served else []),
                    "## Serving",
                    "",
                    drafter_family(family).serving_snippet(
                        fmt,
                        repo_id,
                        target if "backbone/" not in served_target else f"$(hf download {repo_id})/backbone",
                        report.get("k") or 4,
                    ),
                    "",
                ]
            )
        )
    )


def _timing_words(report: dict) -> str:
    """How many interleaved timing runs the speedup stands for (eval.timing_runs)."""
    runs = len(report.get("speedup_runs") or [report["speedup"]])
    if runs == 1:
        return "one timing run (`draftsmith eval --timing-runs 3` gives the median of three with its min-max)"
    return f"the median of {runs} interleaved timing runs, their min-max in brackets"


def _lossless_words(report: dict) -> list[str]:
    """Both checks of a greedy eval, stated apart (eval/run.py)."""
    if report.get("temperature", 0) > 0 or report.get("lossless") is None:
        return []
    same = report["num_prompts"] - (report.get("lossless_mismatches") or 0)
    rule = {True: "yes", False: "NO", None: "not checked (an older report)"}[report.get("rule_exact")]
    return [
        f"Lossless: rule-exact (every round emitted what the verification rule gives for the target's own "
        f"logits of that pass) {rule}; identical to a separately run target-only decode on {same} of "
        f"{report['num_prompts']} prompts in {report.get('dtype', '?')} (bf16 kernels of other shapes break "
        f"near-ties; the `lossless` column).",
        "",
    ]


def _served_words(served: dict) -> str:

    return (
        f"The export was {summary(served)}, on {served['num_prompts']} holdout prompts × "
        f"{served['max_new_tokens']} new tokens, greedy, chain of {served['k']} drafts "
        f"(`draftsmith serve-check`; vLLM's counters from its own `/metrics`)."
    )


def speculators_line(parity: dict) -> str:
    """What follows the parity figures (`export --verify`'s line, the model card): the weights read
    back (`weight_parity`), then speculators' own loader and forward where that format ran them."""
    return _weights_words(parity) + _speculators_words(parity.get("speculators"))


def _speculators_words(check: dict | None) -> str:
    if not check:
        return ""
    if not check["checked"]:
        return f" speculators' own loader was not run ({check['why']})."
    if "error" in check:
        return f" speculators {check['version']} `SpeculatorModel.from_pretrained` refused it: {check['error']}."
    return (
        f" speculators {check['version']} `SpeculatorModel.from_pretrained` loaded it as {check['class']}: "
        f"{check['tensors']} tensors, unused {check['unused_tensors'] or 'none'}, max |Δ| {check['max_abs_diff']:.1e}"
        f"{_forward_words(check.get('forward'))}."
    )


def _weights_words(parity: dict) -> str:
    if "weight_tensors" not in parity:  # a parity dict written before the weights were compared
        return ""
    if parity["max_abs_weight_diff"] == 0.0:
        return f" Weights read back: {parity['weight_tensors']} tensors, identical."
    return (
        f" Weights read back: {parity['weight_tensors']} tensors, max |Δ| {parity['max_abs_weight_diff']:.1e} "
        f"at {parity['weight_diff_at']} — they differ from the trained drafter's."
    )


def _forward_words(fwd: dict | None) -> str:
    if fwd is None:  # a family whose consumer check loads the tensors only (its forward runs in vLLM's serve-check)
        return "; its forward was not run here"
    if "error" in fwd:
        return f"; running its forward failed: {fwd['error']}"
    return (
        f"; and ran it (first draft step, every prompt position): max |Δ logits| {fwd['max_abs_logit_diff']:.2e} "
        f"over {fwd['rows']} rows, argmax agreement {fwd['logit_argmax_agreement']:.1%}"
        f"{'' if fwd['passed'] else ' — FAILED: ' + fwd['why']}"
    )


def checked_inputs(drafter_dir: Path, repo_id: str, fmt: str | None, force: bool, dry_run: bool):
    """Everything `publish` can refuse before a model loads -> (format, the run's eval report or None,
    the Hub token or None, the drafter's config.json)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
        if "/" not in repo_id:
            raise HFValidationError("expected ORG/NAME")
    except HFValidationError as e:
        raise DraftsmithError(f"--repo-id {repo_id}: not a valid Hub repo id ({str(e).splitlines()[0]})") from None
    meta = json.loads((drafter_dir / "config.json").read_text())
    fmt = fmt or drafter_family(meta["drafter"]).SERVE_FORMAT  # the format vLLM serves the family from
    formats = drafter_family(meta["drafter"]).EXPORTS
    if fmt not in formats:
        raise DraftsmithError(f"--format {fmt}: a {meta['drafter']} drafter exports to {', '.join(formats)}")
    # The training run's own eval stage (train/loop.py), never a standalone `draftsmith eval`, which
    # writes beside it under RUN/evals/: a quick check on a few prompts must not become the card's figures.
    report_file = drafter_dir.parent / "eval" / "report.json"
    if not report_file.is_file() and not force:
        raise DraftsmithError(
            f"{report_file}: no eval report of the training run; write one with `draftsmith eval "
            f"--drafter {drafter_dir} --data HOLDOUT --out {report_file.parent}` (or --force)"
        )
    report = json.loads(report_file.read_text()) if report_file.is_file() else None
    # The gate is the verification rule, checked round by round (`rule_exact`): identity with a
    # separately run target-only decode also fails on bf16 near-ties, where the rule still holds.
    # Reports written before the rule was checked carry only `lossless`.
    # --force covers a missing report, never a broken rule: a drafter that broke it is not published.
    exact = None if report is None else report.get("rule_exact", report["lossless"])
    if exact is False:
        raise DraftsmithError(
            f"{report_file}: the eval broke the verification rule (rule_exact false): the drafter's "
            f"speculation is not lossless; refusing to publish"
        )
    token = None
    if not dry_run:
        from huggingface_hub import get_token

        token = get_token()
        if not token:
            raise DraftsmithError("publish: not logged in to the Hugging Face Hub; run `hf auth login` or set HF_TOKEN")
    return fmt, report, token, meta


def publish(
    drafter_dir: str | Path,
    repo_id: str,
    target,
    tok,
    fmt: str | None = None,
    out: str | Path | None = None,
    private: bool = False,
    revision: str | None = None,
    dry_run: bool = False,
    force: bool = False,
    license: str = "other",
) -> Path:
    drafter_dir = Path(drafter_dir)
    fmt, report, token, meta = checked_inputs(drafter_dir, repo_id, fmt, force, dry_run)
    folder = Path(out or drafter_dir.parent / f"publish-{fmt}")
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    export(drafter_dir, target_to_load_on(target, drafter_dir), fmt, tmp, tok)  # writes tmp.tmp, renames it to tmp
    parity = verify_export(drafter_dir, tmp, target, tok, (report or {}).get("holdout", "builtin:code-holdout"))
    # Serving parity is never waived (--force covers the eval report only): a failed check means the
    # published files would draft differently from what was evaluated.
    if not parity["passed"]:
        shutil.rmtree(tmp, ignore_errors=True)
        raise DraftsmithError(f"publish: the export does not draft like the drafter ({parity})")
    served = None
    if vllm_server.available():  # the engine users deploy: the card states its figures, not only ours
        served = serve_check(
            tmp,
            (report or {}).get("holdout", "builtin:code-holdout"),
            folder.with_name(folder.name + "-serve-check"),
            num_prompts=4,
            max_new_tokens=48,
            target_name=str(target.name_or_path),
            drafter=drafter_dir,
        )
        if not served["passed"]:
            shutil.rmtree(tmp, ignore_errors=True)
            raise DraftsmithError(f"publish: vLLM does not serve the export like the drafter ({served['why']})")
    for extra in ("resolved_config.yaml",):
        if (drafter_dir.parent / extra).is_file():
            shutil.copy(drafter_dir.parent / extra, tmp / extra)
    if report is not None:
        for f in ("report.json", "acceptance.png"):
            if (drafter_dir.parent / "eval" / f).is_file():  # the run's own eval, as `checked_inputs` reads it
                shutil.copy(drafter_dir.parent / "eval" / f, tmp / f)
        (tmp / "README.md").write_text(
            model_card(meta, report, fmt, repo_id, parity["params"], parity, license, served)
        )
    shutil.rmtree(folder, ignore_errors=True)
    tmp.replace(folder)
    if dry_run:
        return folder
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    if revision:
        api.create_branch(repo_id, branch=revision, exist_ok=True)
    api.upload_folder(
        folder_path=str(folder),
        repo_id=repo_id,
        revision=revision,
        commit_message=f"draftsmith: {meta['drafter']} drafter for {meta['target']} ({fmt})",
    )
    return folder
