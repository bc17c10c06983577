"""`draftsmith serve-check`: the export served by vLLM itself, next to draftsmith's eval of the
same drafter on the same prompts.

vLLM serves the target alone, then the target with the drafter (the `--speculative-config` the
family names: `family.vllm_serving`). Both get the holdout prompts as the token ids
draftsmith's eval uses, greedy. What is compared:

- outputs: vLLM speculative vs vLLM target-only (lossless in the engine), and vLLM target-only vs
  draftsmith's target-only greedy (the two engines decode the same target alike). In fp32 both must
  be identical. In bf16 a verification pass and a one-token step round differently, so vLLM's two
  outputs may part where the target's top two logits are a near-tie (docs/troubleshooting.md, "bf16
  near-ties"): there each output where they part is checked instead, on the target's own logits
  for the shared prefix (`divergences`), and it must be within a few bf16 steps of the other;
- acceptance: vLLM's own counters (`/metrics`) against draftsmith's eval with the same chain K;
- speed: vLLM's tokens/s with and without the drafter at each concurrency (continuous batching),
  beside draftsmith's batch-size curve when several levels are asked for.

τ tolerance. Both count τ = tokens emitted per verification pass that carried a draft (vLLM:
1 + accepted / drafts). They can still differ at the ends of a request: the last round (a budget
of fewer than K+1 tokens: draftsmith shortens the draft, vLLM may draft K and discard), the EOS
round (drafts accepted past an EOS). Either is the request's last round, so with R rounds over N
prompts the counts may differ by about N/R relative; 3 % more absorbs draft argmax near-ties
between two fp32 implementations whose operations run in another order. A wrong export moves τ far more (reversed aux layers: the drafter's
acceptance collapses; tests/ship/test_serve_check.py).
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from draftsmith import DraftsmithError
from draftsmith.data.load import encode_prompt, load_prompts
from draftsmith.eval.config import EvalConfig
from draftsmith.eval.drafters import Resolved
from draftsmith.eval.report import _where, lossless_cell
from draftsmith.eval.run import evaluate, target_baseline
from draftsmith.models.folder import read_drafter_meta
from draftsmith.models.readers import import_export
from draftsmith.models.registry import DRAFTERS, drafter_family, load_drafter, target_to_load_on
from draftsmith.ship import deploy, replay_check
from draftsmith.ship.export import export
from draftsmith.target import vllm_server
from draftsmith.target.load import load_target, resolve_target

NEAR_TIE_TOLERANCE = 0.03
# A near-tie in a low-precision run: the two tokens' logits within this many bf16 steps at the top
# logit's magnitude (a step is 2^(e-7) for |logit| in [2^e, 2^(e+1)): 0.125 for logits of 16 to 32).
# The flips measured between verification passes and one-token steps on the embedded target were all
# within 2 steps (benchmarks/near_ties.py); vLLM's kernels and draftsmith's, which reads the gap, add
# their own rounding.
NEAR_TIE_STEPS = 4


def near_tie_limit(top_logit: float) -> float:
    """The largest logit gap that counts as a bf16 near-tie next to a top logit of this size."""
    return NEAR_TIE_STEPS * 2.0 ** (math.floor(math.log2(max(abs(top_logit), 1.0))) - 7)


@torch.no_grad()
def divergences(target, prompts: list[list[int]], a: list[list[int]], b: list[list[int]], eos: int) -> list[dict]:
    """Where two greedy outputs of each prompt part: the position, the two tokens (`eos` for an output
    that ended there), the target's logit gap between them after the shared prefix (one forward of
    `target`), and whether that gap is a near-tie. Prompts whose outputs are identical are skipped."""
    device, rows = next(target.parameters()).device, []
    for n, (prompt, x, y) in enumerate(zip(prompts, a, b)):
        if x == y:
            continue
        i = next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        tokens = [x[i] if i < len(x) else eos, y[i] if i < len(y) else eos]
        logits = target(torch.tensor([prompt + x[:i]], device=device)).logits[0, -1].float()
        gap = abs(logits[tokens[0]] - logits[tokens[1]]).item()
        limit = near_tie_limit(logits.max().item())
        rows.append({"prompt": n, "position": i, "tokens": tokens, "gap": round(gap, 4), "near_tie": gap <= limit})
    return rows


def tau_tolerance(num_prompts: int, rounds: float) -> float:
    """Relative |τ_vLLM − τ_draftsmith| allowed (module docstring): one round per prompt + 3 %."""
    return NEAR_TIE_TOLERANCE + num_prompts / max(rounds, 1)


def vllm_families() -> str:
    return ", ".join(n for n, m in DRAFTERS.items() if m.SERVE_FORMAT)


def _read_config(path: Path) -> dict:
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DraftsmithError(f"{path}/config.json: cannot read a drafter or export config ({e})") from None


def served_target_name(path: Path) -> str:
    """The target an export or a drafter folder names, read before any model loads: a folder that is
    neither is a one-line error."""
    config = _read_config(path)
    if "draftsmith_format" in config:  # a trained drafter folder (final/)
        return read_drafter_meta(path)["target"]
    target = (config.get("draftsmith") or {}).get("target") if isinstance(config, dict) else None
    if not target:
        raise DraftsmithError(
            f"{path}/config.json: not a draftsmith drafter or export (expected a 'draftsmith' "
            "section naming the target, as `draftsmith export` writes)"
        )
    return target


def prepare(path: Path, out: Path, target, tok, drafter: Path | None = None):
    """-> (export folder, its config, the draftsmith drafter folder to compare with or None). A
    `final/` is exported first, in the format its family serves with in vLLM, into OUT/export."""
    config = _read_config(path)
    if "draftsmith_format" in config:  # a trained drafter folder
        family = drafter_family(config["drafter"], f"{path}/config.json: drafter")
        if not family.SERVE_FORMAT:
            raise DraftsmithError(f"{path}: vLLM serves no {family.NAME} export (it serves {vllm_families()})")
        exported = export(path, target_to_load_on(target, path), family.SERVE_FORMAT, out / "export", tok)
        return exported, _read_config(exported), path
    if "draftsmith" not in config:
        raise DraftsmithError(f"{path}/config.json: not a draftsmith drafter or export (no 'draftsmith' section)")
    return path, config, drafter


def draftsmith_side(
    export_dir: Path,
    config: dict,
    source: Path | None,
    target,
    tok,
    data: str,
    k: int,
    num_prompts: int,
    max_new_tokens: int,
    batch_sizes: list[int] | None,
) -> tuple[dict, list, Resolved]:
    """draftsmith's eval of the drafter with chain K -> (report, target-only greedy outputs, the drafter
    as it decoded: its proposer and verifier, for the replay). The drafter is the trained one
    (`source`) when known, so a wrong export shows as a difference; otherwise the export read back by
    draftsmith."""
    info = config["draftsmith"]
    if source is not None:
        family, dcfg, drafter = load_drafter(source, target_to_load_on(target, source))
        verifier = family.verifier(drafter, target)
    else:
        verifier = (
            load_target(str(export_dir / info["backbone"]), _dtype(target))[0] if info.get("backbone") else target
        )
        family, dcfg, drafter = import_export(export_dir, verifier)
    proposer = family.make_proposer(drafter, verifier, dcfg)
    cfg = EvalConfig(k=k, num_prompts=num_prompts, max_new_tokens=max_new_tokens)  # greedy, chains
    baseline = target_baseline(verifier, tok, data, cfg)
    resolved = Resolved(family.NAME, proposer, verifier, None)
    report = evaluate(
        resolved,
        tok,
        data,
        None,
        cfg,
        target_name=info["target"],
        baseline=baseline,
        batch_sizes=batch_sizes,
    )
    return report, [out for out, _ in baseline], resolved


def _dtype(model) -> str:
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def vllm_side(
    served: str,
    prompts: list[list[int]],
    max_new_tokens: int,
    concurrency: list[int],
    speculative=None,
    url: str | None = None,
    **serve_kwargs,
) -> dict:
    """One vLLM server (started here unless `url`): greedy outputs at concurrency 1 with each request's
    verification rounds (None where the server reports none), the speculation counters of that run,
    and tokens/s at every concurrency level."""
    with vllm_server.serve(served, url=url, speculative=speculative, **serve_kwargs) as server:
        vllm_server.complete(server, prompts[0][:8], 4)  # warm-up: first-request costs stay out of the timing
        before = vllm_server.spec_counters(server)
        start = time.perf_counter()
        answers = [vllm_server.completion(server, p, max_new_tokens) for p in prompts]  # concurrency 1
        seconds = time.perf_counter() - start
        counters = vllm_server.counter_delta(vllm_server.spec_counters(server), before)
        outs = [ids for ids, _ in answers]
        speed = {1: sum(map(len, outs)) / seconds}
        for c in concurrency:
            if c != 1:
                got, s = vllm_server.complete_all(server, prompts, max_new_tokens, c)
                speed[c] = sum(map(len, got)) / s
    return {
        "outputs": outs,
        "rounds": [rounds for _, rounds in answers],
        "counters": counters,
        "tokens_per_s": speed,
        "version": server.version,
        "args": server.args,
    }


def vllm_acceptance(counters: dict) -> dict:
    """τ, acceptance rate and per-position acceptance P(j accepted | j−1 accepted) from vLLM's counters."""
    drafts, pos = counters["num_drafts"], counters["per_pos"]
    per_position = [a / prev if prev else 0.0 for a, prev in zip(pos, [drafts, *pos[:-1]])]
    return {
        "vllm_tau": round(1 + counters["num_accepted_tokens"] / max(drafts, 1), 4),
        "vllm_acceptance_rate": round(counters["num_accepted_tokens"] / max(counters["num_draft_tokens"], 1), 4),
        "vllm_per_position": [round(p, 4) for p in per_position],
        "vllm_drafts": int(drafts),
    }


@dataclass
class Served:
    """What `decode_both` ran (the decode part of `serve_check`), before `serve_report` compares it:
    the export as vLLM was asked to serve it, draftsmith's eval of the drafter, and vLLM's two runs."""

    export_dir: Path
    family: str  # the drafter family's NAME
    speculative: dict  # the `--speculative-config` vLLM got
    family_args: list[str]  # the vLLM flags the family's export needs
    served: str  # the target (or trained backbone) vLLM served
    prompts: list[list[int]]
    k: int  # the chain K both engines drafted (vLLM's own count: Medusa drafts one token per head)
    ours: dict  # draftsmith's eval report (`draftsmith_side`)
    ours_ref: list[list[int]]  # draftsmith's target-only greedy outputs
    plain: dict  # vLLM serving the target alone (`vllm_side`)
    spec: dict | None = None  # vLLM serving the target with the drafter; None: it refused the export
    refusal: str | None = None  # vLLM's error when it refused the export
    exact: bool = True  # the target decoded in fp32, where outputs must be identical
    divergences: list[dict] | None = None  # low precision: where vLLM's two outputs part (`divergences`)
    serve_kwargs: dict | None = None  # how the speculative server was started (`vllm_server.serve`'s keywords)
    plain_kwargs: dict | None = None  # how the target-only server was started
    replay: dict | None = None  # vLLM's rounds replayed by draftsmith on vLLM's text (ship/replay_check.py)


def serve_check(
    path: str | Path,
    data: str,
    out: str | Path,
    num_prompts: int = 12,
    max_new_tokens: int = 96,
    k: int = 3,
    concurrency: list[int] | None = None,
    target_name: str | None = None,
    dtype: str = "float32",
    drafter: str | Path | None = None,
    server: str | None = None,
    target_server: str | None = None,
    vllm_python: str | None = None,
    port: int = 0,
    extra: tuple[str, ...] = (),
    deploy_k: list[int] | None = None,
    deploy_runs: int = deploy.MIN_RUNS,
) -> dict:
    """Run the check (module docstring); write OUT/serve_check.json, .md and .png -> the result.
    `deploy_k`: also serve these K at every concurrency, `deploy_runs` times interleaved with the target
    alone, and write OUT/deploy/vllm.json (ship/deploy.py `curve`)."""
    path, out = Path(path), Path(out)
    concurrency = sorted(set(concurrency or [1]) | {1})
    deploy.check_levels(num_prompts, concurrency, deploy_runs if deploy_k else deploy.MIN_RUNS)
    if server is None or target_server is None:
        vllm_python = vllm_server.find_python(vllm_python)  # fail before any model loads
    load_prompts(data, num_prompts)  # a bad holdout fails before any model loads, as a bad folder does
    target, tok = load_target(target_name or served_target_name(path), dtype)
    out.mkdir(parents=True, exist_ok=True)
    export_dir, config, source = prepare(path, out, target, tok, Path(drafter) if drafter else None)
    run = decode_both(
        export_dir,
        config,
        source,
        target,
        tok,
        data,
        out,
        num_prompts=num_prompts,
        max_new_tokens=max_new_tokens,
        k=k,
        concurrency=concurrency,
        dtype=dtype,
        server=server,
        target_server=target_server,
        vllm_python=vllm_python,
        port=port,
        extra=extra,
    )
    result = serve_report(run, data, max_new_tokens, dtype, concurrency)
    if deploy_k and run.spec is not None:
        result["deploy"] = deploy.curve(run, config, deploy_k, max_new_tokens, concurrency, out, deploy_runs)
    write(result, out)
    return result


def decode_both(
    export_dir: Path,
    config: dict,
    source: Path | None,
    target,
    tok,
    data: str,
    out: Path,
    *,
    num_prompts: int,
    max_new_tokens: int,
    k: int,
    concurrency: list[int],
    dtype: str,
    server: str | None,
    target_server: str | None,
    vllm_python: str | None,
    port: int,
    extra: tuple[str, ...],
) -> Served:
    """The decode part of `serve_check` (its arguments; `source`: the trained drafter folder or None,
    from `prepare`): draftsmith's eval of the drafter, then vLLM serving the target alone and with
    the drafter, on the same prompts. vLLM refusing the export is recorded, not raised: that is the
    finding. In low precision, where vLLM's two outputs part is measured on the model it verified with."""
    family = drafter_family(config["draftsmith"]["drafter"])
    if not family.SERVE_FORMAT or family.vllm_serving is None:
        raise DraftsmithError(f"{export_dir}: vLLM serves no {family.NAME} export (it serves {vllm_families()})")
    speculative, family_args = family.vllm_serving(export_dir.resolve(), config, k)
    k = speculative["num_speculative_tokens"]  # e.g. Medusa: vLLM drafts one token per head
    info = config["draftsmith"]
    served = str((export_dir / info["backbone"]).resolve() if info.get("backbone") else resolve_target(info["target"]))
    prompts = [encode_prompt(tok, p) for p in load_prompts(data, num_prompts)]
    ours, ours_ref, resolved = draftsmith_side(
        export_dir,
        config,
        source,
        target,
        tok,
        data,
        k,
        num_prompts,
        max_new_tokens,
        concurrency if len(concurrency) > 1 else None,
    )
    kw = dict(
        python=vllm_python,
        port=port,
        dtype=dtype,
        max_model_len=_max_len(prompts, max_new_tokens),
        extra=tuple(extra),
        log_dir=out,
    )
    plain = vllm_side(served, prompts, max_new_tokens, concurrency, url=target_server, **kw)
    plain_kwargs = dict(kw)
    # What the family's export needs, each request's rounds for the replay, then the user's flags.
    kw["extra"] = (*family_args, *vllm_server.PER_REQUEST_SPEC_METRICS, *extra)
    run = Served(export_dir, family.NAME, speculative, family_args, served, prompts, k, ours, ours_ref, plain)
    run.serve_kwargs, run.plain_kwargs = kw, plain_kwargs
    try:
        run.spec = vllm_side(served, prompts, max_new_tokens, concurrency, speculative, url=server, **kw)
    except DraftsmithError as e:  # vLLM refused the export: that is the finding
        run.refusal = str(e)
        return run
    run.replay = replay_check.compare(
        resolved.verifier, resolved.proposer, prompts, run.spec["outputs"], run.spec["rounds"], k, _dtype(target)
    )
    run.exact = next(target.parameters()).dtype == torch.float32  # what `dtype` (`auto` too) resolved to
    if not run.exact:  # where vLLM's speculative outputs part from its target-only ones, and at what gap
        # on the model vLLM verified with (Medusa-2: the exported backbone, not the original target)
        served_model = load_target(served, dtype)[0] if info.get("backbone") else target
        run.divergences = divergences(served_model, prompts, run.spec["outputs"], plain["outputs"], tok.eos_token_id)
    return run


def serve_report(run: Served, data: str, max_new_tokens: int, dtype: str, concurrency: list[int]) -> dict:
    """The report part of `serve_check`: what the check ran and draftsmith measured, then (when vLLM
    loaded the export) vLLM's outputs compared with its target-only ones and draftsmith's, its
    acceptance and speed, and the verdict (`failures`) -> the result serve_check.json holds."""
    ours, plain, spec, n = run.ours, run.plain, run.spec, len(run.prompts)
    result = {
        "export": str(run.export_dir),
        "family": run.family,
        "speculative_config": run.speculative,
        "vllm_args": list(run.family_args),
        "served_target": run.served,
        "data": data,
        "num_prompts": n,
        "max_new_tokens": max_new_tokens,
        "k": run.k,
        "dtype": dtype,
        "vllm_version": plain["version"],
        "draftsmith_tau": ours["tau"],
        "draftsmith_per_position": ours["per_position"],
        "draftsmith_acceptance_rate": ours["acceptance_rate"],
        "draftsmith_lossless": ours["lossless"],
        "draftsmith_rule_exact": ours["rule_exact"],
        "draftsmith_lossless_cell": lossless_cell(ours),
        "where": _where(ours),
    }
    if spec is None:  # vLLM refused the export: that is the finding
        result.update(loaded=False, why=run.refusal, passed=False)
        return result
    same_engine = [a == b for a, b in zip(spec["outputs"], plain["outputs"])]
    same_ref = [a == b for a, b in zip(plain["outputs"], run.ours_ref)]
    result.update(
        loaded=True,
        identical_to_target_only=all(same_engine),
        identical_to_draftsmith=all(same_ref),
        prompts_identical_to_target_only=sum(same_engine),
        prompts_identical_to_draftsmith=sum(same_ref),
        **vllm_acceptance(spec["counters"]),
    )
    result["tau_rel_diff"] = round(abs(result["vllm_tau"] - ours["tau"]) / ours["tau"], 4)
    result["tau_tolerance"] = round(tau_tolerance(n, result["vllm_drafts"]), 4)
    result["concurrency"] = [
        {
            "concurrency": c,
            "target_tokens_per_s": round(plain["tokens_per_s"][c], 2),
            "spec_tokens_per_s": round(spec["tokens_per_s"][c], 2),
            "speedup": round(spec["tokens_per_s"][c] / plain["tokens_per_s"][c], 3),
        }
        for c in concurrency
    ]
    result["draftsmith_speedup"] = ours["speedup"]
    result["draftsmith_batch_curve"] = ours.get("batch_curve")
    if run.divergences is not None:  # low precision only: fp32 checks identity itself
        result["divergences"] = run.divergences
    result["replay"] = run.replay
    why = failures(result, ours, run.exact)
    result.update(passed=not why, why="; ".join(why) or None)
    return result


def failures(result: dict, ours: dict, exact: bool) -> list[str]:
    """Why the check fails, one clause per reason (none: it passed). fp32 asks identical outputs; in
    low precision vLLM's outputs may part only at near-ties. Acceptance: where vLLM reported its rounds,
    both engines on vLLM's own text, round by round (ship/replay_check.py); otherwise τ on each
    engine's own text within `tau_tolerance`."""
    n, why = result["num_prompts"], []
    if ours["rule_exact"] is False:
        why.append("draftsmith's greedy rounds broke the verification rule (rule_exact false)")
    far = [d for d in result.get("divergences", []) if not d["near_tie"]]
    if exact and not result["identical_to_target_only"]:
        why.append(
            f"vLLM's speculative outputs differ from its target-only outputs on "
            f"{n - result['prompts_identical_to_target_only']} of {n} prompts"
        )
    elif far:
        why.append(
            f"vLLM's speculative outputs part from its target-only outputs on {len(far)} prompts where the "
            f"target's two tokens are no near-tie (logit gaps {_gaps(far)})"
        )
    if exact and not result["identical_to_draftsmith"]:
        why.append(
            f"vLLM's target-only outputs differ from draftsmith's on "
            f"{n - result['prompts_identical_to_draftsmith']} of {n} prompts (fp32)"
        )
    replayed = result.get("replay") or {}
    if replayed.get("available"):
        why += replay_check.failures(replayed)
    elif not result["tau_rel_diff"] <= result["tau_tolerance"]:
        why.append(
            f"τ {result['vllm_tau']:.3f} in vLLM vs {ours['tau']:.3f} in draftsmith: {result['tau_rel_diff']:.1%} "
            f"apart, more than the {result['tau_tolerance']:.1%} tolerance"
        )
    return why


def summary(r: dict) -> str:
    """One line for `export --verify`, publish and model cards."""
    if not r["loaded"]:
        return f"vLLM {r.get('vllm_version', '')} did not load the export: {r['why']}"
    c1 = r["concurrency"][0]
    return (
        f"served by {r['vllm_version']}: τ {r['vllm_tau']:.2f} in vLLM vs {r['draftsmith_tau']:.2f} in draftsmith "
        f"(per-position {' '.join(f'{p:.2f}' for p in r['vllm_per_position'])}), outputs identical to vLLM's "
        f"target-only on {r['prompts_identical_to_target_only']}/{r['num_prompts']} prompts, vLLM speedup "
        f"{c1['speedup']:.2f}x at concurrency 1 ({r['dtype']}){_replay_clause(r.get('replay'))} — "
        f"{'passed' if r['passed'] else 'FAILED: ' + r['why']}"
    )


def _replay_clause(p: dict | None) -> str:
    if not p or not p["available"]:
        return ""
    return (
        f"; on vLLM's text τ {p['vllm_tau']:.2f} vs {p['draftsmith_tau']:.2f} replayed, "
        f"{p['rounds_differing']} of {p['rounds']} rounds differing ({p['rounds_clear']} beyond a near-tie)"
    )


def _max_len(prompts: list[list[int]], max_new_tokens: int) -> int:
    """The server's context: the longest prompt + answer + a draft's room, rounded up to 256."""
    need = max(map(len, prompts)) + max_new_tokens + 16
    return -(-need // 256) * 256


def markdown(r: dict) -> str:
    head = [
        f"# serve-check: {r['family']} in vLLM {r.get('vllm_version', '?')}",
        "",
        f"Export `{r['export']}` served with `--speculative-config '{json.dumps(r['speculative_config'])}'` on "
        f"`{r['served_target']}`; {r['num_prompts']} prompts of `{r['data']}`, {r['max_new_tokens']} new tokens, "
        f"greedy, {r['dtype']}. draftsmith measured on {r['where']}.",
        "",
    ]
    if not r["loaded"]:
        return "\n".join(head + [f"**vLLM did not load the export**: {r['why']}", ""])
    pp = lambda xs: " ".join(f"{x:.2f}" for x in xs)  # noqa: E731
    yes = lambda ok, n: f"{'yes' if ok else 'NO'} ({n}/{r['num_prompts']})"  # noqa: E731
    return "\n".join(
        head
        + [
            "| engine | τ | acceptance | per-position | lossless |",
            "|---|---|---|---|---|",
            f"| vLLM | {r['vllm_tau']:.2f} | {r['vllm_acceptance_rate']:.2f} | {pp(r['vllm_per_position'])} | "
            f"{_vllm_lossless_cell(r, yes)} |",
            f"| draftsmith | {r['draftsmith_tau']:.2f} | {r['draftsmith_acceptance_rate']:.2f} | "
            f"{pp(r['draftsmith_per_position'])} | {r.get('draftsmith_lossless_cell', '?')} |",
            "",
            f"vLLM target-only = draftsmith's target-only: {yes(r['identical_to_draftsmith'], r['prompts_identical_to_draftsmith'])}"
            f"{'' if 'divergences' not in r else ' (required in fp32 only)'}. "
            "vLLM's rounds are not visible from outside, so its column is output identity; draftsmith's is the "
            "verification rule checked round by round (`rule_exact`), with identity beside it (report.md of `draftsmith eval` "
            "explains both).",
            "",
            *_divergence_lines(r),
            *_replay_lines(r.get("replay")),
            f"τ on each engine's own text differs by {r['tau_rel_diff']:.1%} (tolerance {r['tau_tolerance']:.1%}"
            f"{', informative only: the verdict compares the same rounds above' if (r.get('replay') or {}).get('available') else ''}): "
            f"**{'passed' if r['passed'] else 'FAILED: ' + r['why']}**.",
            "",
            "| concurrency | vLLM target tok/s | vLLM spec tok/s | vLLM speedup |",
            "|---|---|---|---|",
            *[
                f"| {c['concurrency']} | {c['target_tokens_per_s']:.1f} | {c['spec_tokens_per_s']:.1f} | {c['speedup']:.2f}x |"
                for c in r["concurrency"]
            ],
            "",
            f"draftsmith's own engine, batch 1: {r['draftsmith_speedup']:.2f}x."
            + (
                ""
                if not r.get("draftsmith_batch_curve")
                else " Its batch-size curve: "
                + ", ".join(f"B={c['batch_size']} {c['speedup']:.2f}x" for c in r["draftsmith_batch_curve"])
                + "."
            ),
            "",
            *_deploy_lines(r.get("deploy")),
        ]
    )


def _deploy_lines(d: dict | None) -> list[str]:
    """The deploy config's section: tokens/s per K and concurrency (median and min-max of the runs), the
    K chosen, and vLLM serving it."""
    if not d:
        return []
    ks, levels = list(d["spec_tokens_per_s"]), list(d["target_tokens_per_s"])
    runs = d["tokens_per_s_runs"]
    cell = lambda k, c: f"{statistics.median(runs[k][c]):.1f} ({min(runs[k][c]):.1f}-{max(runs[k][c]):.1f})"  # noqa: E731
    return [
        f'Deploy config `{d["path"]}` (pass it as `vllm serve ... --speculative-config "$(cat {d["path"]})"`): '
        f"`{deploy.SCHEDULE_KEY}` {d['speculative_config'][deploy.SCHEDULE_KEY]}. Each level timed in "
        f"{d['runs']} runs, the target alone and each K interleaved; rule: {d['rule']} (0: the target alone).",
        "",
        "| concurrency | target tok/s | "
        + " | ".join(f"K={k} tok/s" for k in ks)
        + " | K chosen | served with it: tok/s | K drafted |",
        "|---|---|" + "---|" * len(ks) + "---|---|---|",
        *[
            f"| {c} | {cell(0, c)} | "
            + " | ".join(cell(k, c) for k in ks)
            + f" | {d['chosen_k'][c]} | {d['served'][c]['tokens_per_s']:.1f} | {d['served'][c]['draft_tokens_per_draft']:.2f} |"
            for c in levels
        ],
        "",
        f"vLLM's own config code reads it as K {d['vllm_reads']['k_per_batch_size']} for batch sizes 1.."
        f"{len(d['vllm_reads']['k_per_batch_size'])} (method {d['vllm_reads']['method']}, "
        f"num_speculative_tokens {d['vllm_reads']['num_speculative_tokens']}).",
        "",
    ]


def _replay_lines(p: dict | None) -> list[str]:
    """The same-text comparison (ship/replay_check.py): the round verdict's counts, the prompts that
    hold differing rounds, and the pooled figures of both engines with draftsmith's sampling error."""
    if not p:
        return []
    if not p["available"]:
        return [f"Same-text comparison not made: {p['why']}.", ""]
    pp = lambda xs: " ".join(f"{x:.3f}" for x in xs)  # noqa: E731
    where = "; ".join(
        f"prompt {d['prompt']}: {d['clear']} beyond a near-tie, {d['near_tie']} at one" for d in p["differing_prompts"]
    )
    return [
        f"On vLLM's own text, round by round: {p['rounds']} of vLLM's rounds (drafts inside the text, "
        f"{p['prompts']} prompts), each replayed by draftsmith with the trained drafter from the same prefix. "
        f"**{p['rounds_differing']} rounds accept another count** — {p['rounds_clear']} where the drafter's logits "
        f"are no near-tie (each fails the check), {p['rounds_near_tie']} at a near-tie (bound: {p['tie_bound']}; "
        f"{p['tie_drafts']} drafts where rounding could flip one, binomial p = {p['flip_p_value']:.3g} against "
        "half of them flipping)." + (f" Prompts with differing rounds: {where}." if where else ""),
        "",
        "| | per-position acceptance | τ |",
        "|---|---|---|",
        f"| vLLM | {pp(p['vllm_per_position'])} | {p['vllm_tau']:.3f} |",
        f"| draftsmith (replay) | {pp(p['draftsmith_per_position'])} | {p['draftsmith_tau']:.3f} |",
        f"| difference | {pp(p['per_position_diff'])} | {p['tau_diff']:+.3f} |",
        f"| sampling error of draftsmith's figure (95 %, bootstrap over prompts) | "
        f"±{' ±'.join(f'{e:.3f}' for e in p['per_position_sampling_error'])} | ±{p['tau_sampling_error']:.3f} |",
        "",
    ]


def _vllm_lossless_cell(r: dict, yes) -> str:
    """fp32: identity with vLLM's target-only outputs. bf16: whether every parting is a near-tie,
    with the identity count beside it, as draftsmith's own column reads."""
    if "divergences" not in r:
        return f"identical to vLLM target-only: {yes(r['identical_to_target_only'], r['prompts_identical_to_target_only'])}"
    ties = all(d["near_tie"] for d in r["divergences"])
    n, same = r["num_prompts"], r["prompts_identical_to_target_only"]
    return (
        f"{'yes' if ties else 'NO'} (identical to vLLM target-only {same}/{n}, {r['dtype']}; "
        f"{'the other ' + str(n - same) + ' part at near-ties' if ties else 'parts beyond a near-tie'})"
    )


def _gaps(rows: list[dict]) -> str:
    return ", ".join(f"{x['gap']:.3g}" for x in rows)


def _divergence_lines(r: dict) -> list[str]:
    if "divergences" not in r:  # fp32: identity itself is checked
        return []
    d = r["divergences"]
    if not d:
        return [f"In {r['dtype']}, vLLM's speculative and target-only outputs are identical on every prompt.", ""]
    ties = sum(x["near_tie"] for x in d)
    return [
        f"In {r['dtype']}, vLLM's speculative outputs part from its target-only ones on {len(d)} prompts, "
        f"{ties} of them at a near-tie of the target's logits (within {NEAR_TIE_STEPS} bf16 steps); logit gaps "
        f"where they part: {_gaps(d)}.",
        "",
    ]


def _plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    xs = [c["concurrency"] for c in r["concurrency"]]
    ax.plot(xs, [c["speedup"] for c in r["concurrency"]], "o-", label="vLLM (concurrent requests)")
    if r.get("draftsmith_batch_curve"):
        curve = r["draftsmith_batch_curve"]
        ax.plot([c["batch_size"] for c in curve], [c["speedup"] for c in curve], "s--", label="draftsmith (batch size)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("concurrency / batch size")
    ax.set_ylabel("speedup vs target-only")
    ax.set_title(f"{r['family']}: vLLM τ {r['vllm_tau']:.2f}, draftsmith τ {r['draftsmith_tau']:.2f}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100, format="png")
    plt.close(fig)


def write(r: dict, out: Path) -> None:
    """serve_check.json / .md / .png, each written to a temp name and renamed."""
    files = {"serve_check.json": json.dumps(r, indent=2), "serve_check.md": markdown(r)}
    for name, text in files.items():
        tmp = out / (name + ".tmp")
        tmp.write_text(text)
        tmp.replace(out / name)
    if r["loaded"]:
        _plot(r, out / "serve_check.png.tmp")
        (out / "serve_check.png.tmp").replace(out / "serve_check.png")
    shutil.rmtree(out / "export.tmp", ignore_errors=True)
