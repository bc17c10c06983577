"""`draftsmith publish`: export a trained drafter, check that the export drafts like the drafter did,
write a model card with the evidence, and upload the folder through huggingface_hub.

The folder is built in full first (`--dry-run` stops there and uploads nothing). The Hub token comes
from huggingface_hub's own lookup (HF_TOKEN or `hf auth login`); it is never printed or written.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from draftsmith import DraftsmithError
from draftsmith.data.load import encode_prompt, load_prompts
from draftsmith.data.regenerate import eos_ids
from draftsmith.eval.report import _where, format_table
from draftsmith.eval.speculative import Stats, speculative_decode
from draftsmith.models.export import FORMATS, export, import_export
from draftsmith.models.registry import load_drafter, target_to_load_on
from draftsmith.models.target import served_name

DEFAULT_FORMAT = {"eagle": "vllm", "eagle3": "speculators", "medusa": "vllm", "distill": "hf"}


class Recorder:
    """Wraps a proposer and keeps every draft it proposes, to compare two drafters round by round."""

    def __init__(self, proposer):
        self.proposer, self.drafts = proposer, []
        self.feature_names = getattr(proposer, "feature_names", ())

    def reset(self):
        self.proposer.reset()

    def propose(self, tokens, feats, k, sampler=None):
        draft = self.proposer.propose(tokens, feats, k, sampler)
        self.drafts.append(list(draft.tokens))
        return draft


@torch.no_grad()
def verify_export(drafter_dir: Path, exported: Path, target, tok, holdout: str, k: int = 4, prompts: int = 3,
                  max_new_tokens: int = 32) -> dict:
    """Serving parity: re-read the exported folder (transformers for `hf`; the consumer's weight
    mapping for the EAGLE and Medusa formats) and decode a few holdout prompts greedily with it and
    with draftsmith's own drafter, on the same target. Every draft token must agree."""
    target = target_to_load_on(target, drafter_dir)
    module, cfg, own = load_drafter(drafter_dir, target)
    verifier = module.verifier(own, target)
    if verifier is not target:  # Medusa-2: the export's heads draft for the exported backbone
        from draftsmith.models.target import load_target

        verifier, _ = load_target(str(exported / "backbone"), str(next(target.parameters()).dtype).removeprefix("torch."))
    _, _, back = import_export(exported, verifier)
    eos, runs = eos_ids(target, tok), []
    for drafter in (own, back):
        rec, stats = Recorder(module.make_proposer(drafter, verifier, cfg)), Stats(k=k)
        for p in load_prompts(holdout, prompts):
            speculative_decode(verifier, rec, encode_prompt(tok, p), k, max_new_tokens, eos, None, stats)
        runs.append((rec.drafts, stats.tau))
    (a, tau_a), (b, tau_b) = runs
    pairs = [(x, y) for da, db in zip(a, b) for x, y in zip(da, db)]
    agree = sum(x == y for x, y in pairs) / max(len(pairs), 1)
    return {"draft_token_agreement": round(agree, 4), "rounds": len(a), "tau_drafter": round(tau_a, 4),
            "tau_export": round(tau_b, 4), "passed": agree == 1.0 and len(a) == len(b),
            "params": sum(p.numel() for p in getattr(own, "heads", own).parameters())}


def serving_snippet(family: str, fmt: str, repo_id: str, target: str, k: int) -> str:
    if fmt == "hf":
        return (f"```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
                f"tok = AutoTokenizer.from_pretrained(\"{target}\")\n"
                f"target = AutoModelForCausalLM.from_pretrained(\"{target}\")\n"
                f"student = AutoModelForCausalLM.from_pretrained(\"{repo_id}\")\n"
                f"out = target.generate(**tok(\"def fib(n):\", return_tensors=\"pt\"), assistant_model=student,\n"
                f"                      max_new_tokens=64, do_sample=False)\n```\n"
                f"vLLM: `vllm serve {target} --speculative-config '{{\"model\": \"{repo_id}\", \"num_speculative_tokens\": {k}}}'`")
    if fmt == "sglang":
        algo = "EAGLE3" if family == "eagle3" else "EAGLE"
        return (f"```bash\npython -m sglang.launch_server --model {target} --speculative-algorithm {algo} \\\n"
                f"  --speculative-draft-model-path {repo_id} --speculative-num-steps {k} \\\n"
                f"  --speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}\n```")
    if fmt == "speculators":
        return f"```bash\nvllm serve {repo_id}   # the speculators config names the verifier, {target}\n```"
    method = {"eagle": "eagle", "medusa": "medusa"}[family]
    return (f"```bash\nvllm serve {target} --speculative-config \\\n"
            f"  '{{\"method\": \"{method}\", \"model\": \"{repo_id}\", \"num_speculative_tokens\": {k}}}'\n```")


def model_card(meta: dict, report: dict, fmt: str, repo_id: str, params: int, parity: dict, license: str) -> str:
    family, target = meta["drafter"], served_name(meta["target"])
    served_target = "the `backbone/` folder of this repo (the trained backbone)" if meta["drafter_config"].get(
        "backbone", "frozen") != "frozen" else f"`{target}`"
    return "\n".join([
        "---", f"base_model: {target}", f"library_name: {'transformers' if fmt == 'hf' else 'vllm'}",
        f"license: {license}", "tags:", "- speculative-decoding", f"- {family}", "- draftsmith", "---", "",
        f"# {family} drafter for {target}", "",
        f"A {family} draft model ({params / 1e6:.1f}M parameters) trained with draftsmith for speculative "
        f"decoding with {served_target} as the verifier, in the `{fmt}` format.", "",
        f"- Target: `{meta['target']}` (fingerprint `{meta['target_fingerprint']}`)",
        f"- Training data: `{meta.get('train_data')}`, {meta.get('steps')} optimizer steps; recipe: `resolved_config.yaml`",
        f"- Drafter config: `{json.dumps(meta['drafter_config'])}`", "",
        "## Evaluation", "",
        f"Holdout `{report['holdout']}`, {report['num_prompts']} prompts, temperature {report['temperature']}, "
        f"batch size {report.get('batch_size', 1)}, measured on {_where(report)}.", "",
        format_table([report]), "",
        "τ = tokens per target verification pass; speedup = measured tokens/s against target-only decoding on the "
        "same hardware.", "", "![acceptance](acceptance.png)", "",
        "## Serving parity", "",
        f"The exported files were read back the way the serving engine maps them and decoded {parity['rounds']} draft "
        f"rounds next to the trained drafter: draft-token agreement {parity['draft_token_agreement']:.1%}, "
        f"τ {parity['tau_export']:.2f} vs {parity['tau_drafter']:.2f} ({'passed' if parity['passed'] else 'FAILED'}).", "",
        "## Serving", "", serving_snippet(family, fmt, repo_id, target if "backbone/" not in served_target else
                                          f"$(hf download {repo_id})/backbone", report.get("k") or 4), "",
    ])


def publish(drafter_dir: str | Path, repo_id: str, target, tok, fmt: str | None = None, out: str | Path | None = None,
            private: bool = False, revision: str | None = None, dry_run: bool = False, force: bool = False,
            license: str = "other") -> Path:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    drafter_dir = Path(drafter_dir)
    try:
        validate_repo_id(repo_id)
        if "/" not in repo_id:
            raise HFValidationError("expected ORG/NAME")
    except HFValidationError as e:
        raise DraftsmithError(f"--repo-id {repo_id}: not a valid Hub repo id ({str(e).splitlines()[0]})") from None
    meta = json.loads((drafter_dir / "config.json").read_text())
    fmt = fmt or DEFAULT_FORMAT[meta["drafter"]]
    if fmt not in FORMATS[meta["drafter"]]:
        raise DraftsmithError(f"--format {fmt}: a {meta['drafter']} drafter exports to {', '.join(FORMATS[meta['drafter']])}")
    report_file = drafter_dir.parent / "eval" / "report.json"
    if not report_file.is_file() and not force:
        raise DraftsmithError(f"{report_file}: no eval report; run `draftsmith eval --drafter {drafter_dir}` first (or --force)")
    report = json.loads(report_file.read_text()) if report_file.is_file() else None
    if report is not None and report["lossless"] is False and not force:
        raise DraftsmithError(f"{report_file}: the eval was not lossless; refusing to publish (--force overrides)")
    token = None
    if not dry_run:
        from huggingface_hub import get_token

        token = get_token()
        if not token:
            raise DraftsmithError("publish: not logged in to the Hugging Face Hub; run `hf auth login` or set HF_TOKEN")
    folder = Path(out or drafter_dir.parent / f"publish-{fmt}")
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    export(drafter_dir, target_to_load_on(target, drafter_dir), fmt, tmp, tok)  # writes tmp.tmp, renames it to tmp
    parity = verify_export(drafter_dir, tmp, target, tok, (report or {}).get("holdout", "builtin:code-holdout"))
    if not parity["passed"] and not force:
        shutil.rmtree(tmp, ignore_errors=True)
        raise DraftsmithError(f"publish: the export does not draft like the drafter ({parity}); --force overrides")
    for extra in ("resolved_config.yaml",):
        if (drafter_dir.parent / extra).is_file():
            shutil.copy(drafter_dir.parent / extra, tmp / extra)
    if report is not None:
        for f in ("report.json", "acceptance.png"):
            if (report_file.parent / f).is_file():
                shutil.copy(report_file.parent / f, tmp / f)
        (tmp / "README.md").write_text(model_card(meta, report, fmt, repo_id, parity["params"], parity, license))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.replace(folder)
    if dry_run:
        return folder
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    if revision:
        api.create_branch(repo_id, branch=revision, exist_ok=True)
    api.upload_folder(folder_path=str(folder), repo_id=repo_id, revision=revision,
                      commit_message=f"draftsmith: {meta['drafter']} drafter for {meta['target']} ({fmt})")
    return folder
