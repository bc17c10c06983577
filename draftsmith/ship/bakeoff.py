"""`draftsmith bakeoff`: drafter families head to head on one target and one training budget, each
served the way users serve it, on several domains and concurrencies.

Each `--drafter` is a trained drafter folder (taken as it is) or a recipe, which `draftsmith train`
trains first into OUT/train/<recipe>/ with `optim.max_steps=--steps`: the same number of optimizer
steps for every recipe is the equal budget, and the minutes each one's training loop took are
measured and reported beside it. Then every drafter on every `--data` domain:

- in vLLM, where its family serves there: `serve-check` (ship/serve_check.py) in
  OUT/cells/<drafter>/<domain>/ — vLLM's τ and per-position acceptance from its own counters, its
  tokens/s with and without the drafter at each `--concurrency` (concurrent requests), and the
  check's verdict (vLLM's outputs lossless, its τ the one draftsmith's eval counts);
- in draftsmith's engine, where vLLM does not serve the family or refused the export: draftsmith's
  eval with its batch-size curve at the same levels, against batched target-only decoding at the same
  batch size (eval/compare.py). These rows say `draftsmith` in the engine column: their speedups are
  draftsmith's engine's, not vLLM's.

Written to OUT: bakeoff.json (every measurement, the hardware, dtype and vLLM version), bakeoff.md
(one table: τ and speedup per domain and concurrency, and the geometric mean of the speedups across
domains at each concurrency; in bold the best of each column among one engine's passed rows),
bakeoff.png (that geomean against concurrency, one line per drafter) and deploy/vllm.json:
`serve-check --deploy-k` of the drafter with the best geomean speedup at concurrency 1 among those
vLLM served and whose check passed, on the first domain — the K fastest at each concurrency as vLLM's
per-batch-size schedule, read back by vLLM's own config code and served once with it (ship/deploy.py).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from draftsmith import DraftsmithError
from draftsmith.data.load import load_prompts
from draftsmith.eval.compare import compare
from draftsmith.eval.config import EvalConfig
from draftsmith.models.folder import read_drafter_meta
from draftsmith.models.registry import DEFAULT_DRAFTER, drafter_family
from draftsmith.ship import serve_check as sc
from draftsmith.target import load as target_load
from draftsmith.target import vllm_server
from draftsmith.util.parse import parse_overrides, read_yaml
from draftsmith.util.precision import describe, hardware

# The keys bakeoff sets on every recipe's training: the budget, where the run goes, no eval stage (the
# bakeoff measures every drafter itself).
OWN_KEYS = ("optim.max_steps", "output_dir", "run", "eval.enabled")


@dataclass
class Drafter:
    """One row of the bakeoff: a trained drafter folder and where it came from."""

    name: str  # the row's label: the recipe's file name, or the run folder's name
    path: Path  # the drafter folder (final/)
    recipe: str | None  # the recipe it was trained from here; None: given trained
    family: str  # its family's NAME
    meta: dict | None = None  # its config.json (read_drafter_meta): target, steps, train_data, train_seconds


def domain_label(data: str) -> str:
    """How the table names a domain: `builtin:code-holdout` -> code-holdout, `x/chat.jsonl` -> chat."""
    if Path(data).suffix in (".jsonl", ".json", ".parquet"):
        return Path(data).stem
    return data.split(":", 1)[-1]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-") or "x"


def read_drafters(specs: list[str]) -> list[Drafter]:
    """Each --drafter as a trained folder or a recipe, read before any model loads or training starts."""
    found = []
    for spec in specs:
        path = Path(spec)
        if path.is_dir() and (path / "config.json").is_file():
            try:
                meta = read_drafter_meta(path)
            except DraftsmithError as e:  # e.g. an export: the bakeoff measures trained folders
                raise DraftsmithError(f"--drafter {e}") from None
            family = drafter_family(meta["drafter"], f"--drafter {spec}: drafter").NAME
            found.append(Drafter(path.parent.name if path.name == "final" else path.name, path, None, family, meta))
        elif path.is_file() and path.suffix in (".yaml", ".yml"):
            kind = (read_yaml(path).get("drafter") or {}).get("type", DEFAULT_DRAFTER)
            family = drafter_family(kind, f"--drafter {spec}: drafter.type").NAME
            found.append(Drafter(path.stem, path, str(path), family))
        else:
            raise DraftsmithError(
                f"--drafter {spec}: neither a trained drafter folder (config.json + model.safetensors) nor a recipe .yaml"
            )
    names = [d.name for d in found]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise DraftsmithError(f"--drafter: two drafters named {twice[0]} (rows are named by recipe or run folder)")
    return found


def check_inputs(
    drafters: list[Drafter],
    data: list[str],
    levels: list[int],
    *,
    steps: int | None,
    k: int,
    num_prompts: int,
    max_new_tokens: int,
    train_args: list[str],
) -> None:
    """Every flag checked before any model loads or any training starts, each a one-line error naming it."""
    if any(d.recipe for d in drafters) and (steps is None or steps < 1):
        raise DraftsmithError("--steps: give the training budget (optimizer steps >= 1) that every recipe trains for")
    if k < 1 or num_prompts < 1 or max_new_tokens < 1:
        raise DraftsmithError("bakeoff: expected --k, --num-prompts and --max-new-tokens >= 1")
    for item in train_args:
        key = item.split("=", 1)[0].strip()
        if key in OWN_KEYS:
            raise DraftsmithError(f"--train-arg {item}: {key} is set by bakeoff (--steps sets the budget)")
    parse_overrides(train_args)  # key=value shape; the keys themselves `draftsmith train` checks
    labels = [domain_label(d) for d in data]
    for d in data:
        try:
            n = len(load_prompts(d, num_prompts))
        except DraftsmithError as e:
            raise DraftsmithError(f"--data {e}") from None
        if n < max(levels):
            raise DraftsmithError(
                f"--data {d}: {n} prompts measured, fewer than the {max(levels)} concurrent requests of "
                "--concurrency (raise --num-prompts or lower --concurrency)"
            )
        if labels.count(domain_label(d)) > 1:
            raise DraftsmithError(f"--data: two domains named {domain_label(d)}")
    one_target(drafters)


def one_target(drafters: list[Drafter]) -> None:
    """The drafters known so far (given folders; after training, all) were trained for one target."""
    known = sorted({d.meta["target"] for d in drafters if d.meta})
    if len(known) > 1:
        raise DraftsmithError(
            f"--drafter: drafters of different targets ({', '.join(known)}); a bakeoff compares one target's"
        )


def train_process(argv: list[str], log: Path) -> int:
    """`draftsmith ARGV` in its own process, its output to `log` -> the exit code. Its own process: ship
    and train are peer rooms that import neither each other (tests/architecture/test_layering.py), and a
    fresh process frees each run's memory."""
    with open(log, "w") as f:
        return subprocess.run([sys.executable, "-m", "draftsmith.cli", *argv], stdout=f, stderr=f).returncode


def train_recipe(recipe: str, name: str, steps: int, folder: Path, overrides: list[str]) -> Path:
    """`draftsmith train RECIPE` at `steps` optimizer steps into folder/name, its output in
    folder/name.log -> the final/ folder. A failure is one line: train's own error, and the log."""
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / f"{name}.log"
    own = [f"optim.max_steps={steps}", f"output_dir={folder}", f"run={name}", "eval.enabled=false"]
    print(f"bakeoff: training {name} ({steps} steps; log {log})", flush=True)
    if train_process(["train", recipe, *overrides, *own], log):  # bakeoff's keys last: they win
        lines = [l.strip() for l in log.read_text(errors="replace").splitlines() if l.strip()]
        why = next((l for l in reversed(lines) if l.startswith("draftsmith: error:")), lines[-1] if lines else "")
        raise DraftsmithError(
            f"--drafter {recipe}: training failed ({why.removeprefix('draftsmith: error: ')}; log {log})"
        )
    return folder / name / "final"


def vllm_cell(r: dict, report: Path) -> dict:
    """A serve-check result -> the bakeoff's cell: vLLM's τ, per-position acceptance and speed curve."""
    return {
        "engine": "vllm",
        "tau": r["vllm_tau"],
        "per_position": r["vllm_per_position"],
        "k": r["k"],
        "curve": [
            {key: c[key] for key in ("concurrency", "target_tokens_per_s", "spec_tokens_per_s", "speedup")}
            for c in r["concurrency"]
        ],
        "passed": r["passed"],
        "why": r["why"],
        "draftsmith_tau": r["draftsmith_tau"],
        "draftsmith_per_position": r["draftsmith_per_position"],
        "vllm_version": r["vllm_version"],
        "report": str(report),
    }


def draftsmith_cell(r: dict) -> dict:
    """A draftsmith eval report with its batch-size curve -> the bakeoff's cell (batch size = concurrency)."""
    return {
        "engine": "draftsmith",
        "tau": r["tau"],
        "per_position": r["per_position"],
        "k": r["k"],
        "curve": [
            {
                "concurrency": c["batch_size"],
                "target_tokens_per_s": c["target_tokens_per_s"],
                "spec_tokens_per_s": c["spec_tokens_per_s"],
                "speedup": c["speedup"],
            }
            for c in r["batch_curve"]
        ],
        # The verification rule held in every greedy round: what makes this engine's speculation lossless.
        "passed": r["rule_exact"] is True,
        "why": None if r["rule_exact"] is True else "draftsmith's greedy rounds broke the verification rule",
    }


def in_vllm(d: Drafter, data: list[str], out: Path, serve: dict) -> list[dict] | str:
    """serve-check of drafter `d` on every domain -> its cells, or vLLM's refusal of the export (found on
    the first domain: a refusal is about the export, not the prompts, so the others are not tried)."""
    cells = []
    for domain in data:
        where = out / "cells" / d.name / _slug(domain_label(domain))
        print(f"bakeoff: {d.name} on {domain} in vLLM", flush=True)
        r = sc.serve_check(d.path, domain, where, **serve)
        if not r["loaded"]:
            return r["why"] or "vLLM did not load the export"
        cells.append({"drafter": d.name, "domain": domain, **vllm_cell(r, where / "serve_check.json")})
    return cells


def in_draftsmith(drafters: list[Drafter], data: list[str], levels: list[int], cfg: EvalConfig) -> list[dict]:
    """draftsmith's eval of the drafters vLLM does not serve, every domain, with the batch-size curve
    at the concurrency levels (one target load, the target-only baseline once per domain)."""
    if not drafters:
        return []
    meta = drafters[0].meta or read_drafter_meta(drafters[0].path)
    target, tok = target_load.load_target(meta["target"], cfg.dtype)
    print(f"bakeoff: {', '.join(d.name for d in drafters)} in draftsmith's engine", flush=True)
    reports = compare(
        [str(d.path) for d in drafters], data, target, tok, None, cfg, target_name=meta["target"], batch_sizes=levels
    )
    by_path = {str(d.path): d for d in drafters}
    return [{"drafter": by_path[r["drafter_path"]].name, "domain": r["holdout"], **draftsmith_cell(r)} for r in reports]


def geomean(xs: list[float]) -> float:
    """The geometric mean: the mean speedup across domains that one slow domain cannot hide behind."""
    return round(math.exp(sum(math.log(x) for x in xs) / len(xs)), 3)


def speedup_at(cell: dict, c: int) -> float:
    return next(p["speedup"] for p in cell["curve"] if p["concurrency"] == c)


def make_rows(drafters: list[Drafter], cells: list[dict], levels: list[int], refused: dict[str, str]) -> list[dict]:
    """One row per drafter: its engine, training budget, and the geomean of its speedups across
    domains at each concurrency."""
    rows = []
    for d in drafters:
        mine = [c for c in cells if c["drafter"] == d.name]
        meta = d.meta or {}
        rows.append(
            {
                "drafter": d.name,
                "family": d.family,
                "path": str(d.path),
                "recipe": d.recipe,
                "engine": mine[0]["engine"],
                "vllm_refused": refused.get(d.name),
                "steps": meta.get("steps"),
                "train_seconds": meta.get("train_seconds"),  # the training loop's, as train measured it
                "train_data": meta.get("train_data"),
                "passed": all(c["passed"] for c in mine),
                "geomean_speedup": [
                    {"concurrency": c, "speedup": geomean([speedup_at(x, c) for x in mine])} for c in levels
                ],
            }
        )
    return rows


def deploy_best(rows: list[dict], drafters: list[Drafter], domain: str, out: Path, serve: dict, ks: list[int]) -> dict:
    """serve-check --deploy-k of the row with the best geomean speedup at the lowest concurrency among
    those vLLM served and whose check passed, on `domain`, in OUT/deploy-check; its deploy config is
    copied to OUT/deploy/ -> what bakeoff.json says of it."""
    served = [r for r in rows if r["engine"] == "vllm" and r["passed"]]
    if not served:
        return {"path": None, "why": "no drafter was served by vLLM with its serve-check passed"}
    best = max(served, key=lambda r: r["geomean_speedup"][0]["speedup"])
    path = next(d.path for d in drafters if d.name == best["drafter"])
    print(f"bakeoff: deploy config from {best['drafter']} on {domain} (K among {ks})", flush=True)
    r = sc.serve_check(path, domain, out / "deploy-check", **serve, deploy_k=ks)
    if "deploy" not in r:
        return {"path": None, "drafter": best["drafter"], "why": f"vLLM did not load the export again: {r['why']}"}
    tmp = out / "deploy.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(Path(r["deploy"]["path"]).parent, tmp)
    shutil.rmtree(out / "deploy", ignore_errors=True)
    tmp.replace(out / "deploy")
    keep = (
        "speculative_config",
        "chosen_k",
        "runs",
        "target_tokens_per_s",
        "spec_tokens_per_s",
        "vllm_reads",
        "served",
    )
    return {
        "path": str(out / "deploy" / "vllm.json"),
        "drafter": best["drafter"],
        "family": best["family"],
        "domain": domain,
        "check": str(out / "deploy-check" / "serve_check.json"),
        "check_passed": r["passed"],
        "served_target": r["served_target"],
        **{key: r["deploy"][key] for key in keep},
    }


def bakeoff(
    drafter_specs: list[str],
    data: list[str],
    out: str | Path,
    *,
    steps: int | None = None,
    concurrency: list[int] | None = None,
    k: int = 3,
    num_prompts: int = 16,
    max_new_tokens: int = 64,
    dtype: str = "float32",
    deploy_k: list[int] | None = None,
    train_data: str | None = None,
    train_args: list[str] | None = None,
    vllm_python: str | None = None,
    extra: tuple[str, ...] = (),
) -> dict:
    """Run the bakeoff (module docstring); write OUT/bakeoff.json, .md, .png and OUT/deploy/ -> the result."""
    out, train_args = Path(out), list(train_args or []) + ([f"data.train={train_data}"] if train_data else [])
    levels = sorted(set(concurrency or [1]) | {1})  # serve-check always measures one request
    drafters = read_drafters(drafter_specs)
    check_inputs(
        drafters,
        data,
        levels,
        steps=steps,
        k=k,
        num_prompts=num_prompts,
        max_new_tokens=max_new_tokens,
        train_args=train_args,
    )
    if any(drafter_family(d.family).SERVE_FORMAT for d in drafters):
        vllm_python = vllm_server.find_python(vllm_python)  # no vLLM: fail before any training
    for d in drafters:
        if d.recipe:
            assert steps is not None  # check_inputs asked for it
            d.path = train_recipe(d.recipe, d.name, steps, out / "train", train_args)
        d.meta = read_drafter_meta(d.path)
    one_target(drafters)
    serve = dict(
        num_prompts=num_prompts,
        max_new_tokens=max_new_tokens,
        k=k,
        concurrency=levels,
        dtype=dtype,
        vllm_python=vllm_python,
        extra=tuple(extra),
    )
    cells, refused, rest = [], {}, []
    for d in drafters:
        served = drafter_family(d.family).SERVE_FORMAT
        got = in_vllm(d, data, out, serve) if served else "vLLM serves no export of this family"
        if isinstance(got, str):
            refused[d.name] = got
            rest.append(d)
        else:
            cells += got
    cfg = EvalConfig(k=k, num_prompts=num_prompts, max_new_tokens=max_new_tokens, dtype=dtype)  # greedy chains
    cells += in_draftsmith(rest, data, levels, cfg)
    rows = make_rows(drafters, cells, levels, refused)
    result = {
        "target": drafters[0].meta["target"] if drafters[0].meta else None,
        "data": data,
        "concurrency": levels,
        "k": k,
        "num_prompts": num_prompts,
        "max_new_tokens": max_new_tokens,
        "dtype": dtype,
        "steps": steps,
        "hardware": hardware(),
        "vllm_version": next((c["vllm_version"] for c in cells if c["engine"] == "vllm"), None),
        "rows": rows,
        "cells": cells,
    }
    result["deploy"] = deploy_best(rows, drafters, data[0], out, serve, deploy_k or [k])
    write(result, out)
    return result


ENGINE = {"vllm": "vLLM", "draftsmith": "draftsmith"}


def _cell(r: dict, drafter: str, domain: str) -> dict:
    return next(c for c in r["cells"] if c["drafter"] == drafter and c["domain"] == domain)


def measured_columns(r: dict) -> list[tuple[str, str, list[float]]]:
    """The table's measured columns, in order: (header, format, one value per row)."""
    cols = []
    for domain in r["data"]:
        cells = [_cell(r, row["drafter"], domain) for row in r["rows"]]
        label = domain_label(domain)
        cols.append((f"{label} τ", "{:.2f}", [c["tau"] for c in cells]))
        cols += [(f"{label} c={c}", "{:.2f}x", [speedup_at(x, c) for x in cells]) for c in r["concurrency"]]
    for i, c in enumerate(r["concurrency"]):
        cols.append((f"geomean c={c}", "{:.2f}x", [row["geomean_speedup"][i]["speedup"] for row in r["rows"]]))
    return cols


def _engine(row: dict) -> str:
    return ENGINE[row["engine"]] + ("" if row["passed"] else " (check FAILED)")


def _trained(row: dict) -> str:
    if row["steps"] is None:  # a folder saved before train recorded its steps
        return "given"
    seconds = row["train_seconds"]
    took = "" if seconds is None else f", {seconds:.0f} s" if seconds < 60 else f", {seconds / 60:.1f} min"
    return f"{row['steps']} steps{took}" + ("" if row["recipe"] else " (given)")


def best_cells(rows: list[dict], cols: list[tuple[str, str, list[float]]]) -> set[tuple[int, int]]:
    """(row, column) of every bold cell: in each column, the largest value (ties too) among the rows of
    one engine whose check passed. A failed row is never crowned (its figures are not the ones a check
    stood behind), nor compared across engines (vLLM's speedups and draftsmith's engine's are measured
    against different target-only runs), and an engine with one passed row has no rival to beat."""
    best: set[tuple[int, int]] = set()
    for engine in dict.fromkeys(row["engine"] for row in rows):
        mine = [i for i, row in enumerate(rows) if row["engine"] == engine and row["passed"]]
        if len(mine) < 2:
            continue
        for j, (_, _, xs) in enumerate(cols):
            top = max(xs[i] for i in mine)
            best |= {(i, j) for i in mine if xs[i] == top}
    return best


def table(r: dict) -> str:
    """One row per drafter: τ and speedup per domain and concurrency, then the geomean across domains;
    in bold, the best of each measured column among the passed rows of one engine (`best_cells`)."""
    cols = measured_columns(r)
    best = best_cells(r["rows"], cols)
    lines = [
        "| drafter | family | engine | trained | " + " | ".join(head for head, _, _ in cols) + " |",
        "|---|---|---|---|" + "---|" * len(cols),
    ]
    for i, row in enumerate(r["rows"]):
        shown = [
            f"**{fmt.format(xs[i])}**" if (i, j) in best else fmt.format(xs[i]) for j, (_, fmt, xs) in enumerate(cols)
        ]
        lines.append(f"| {row['drafter']} | {row['family']} | {_engine(row)} | {_trained(row)} | {' | '.join(shown)} |")
    return "\n".join(lines)


def details(r: dict) -> str:
    """Per drafter and domain: the draft length, per-position acceptance and the tokens/s behind each speedup."""
    levels = "/".join(str(c) for c in r["concurrency"])
    lines = [
        f"| drafter | domain | engine | K | per-position acceptance | target tok/s (c={levels}) | "
        f"with the drafter tok/s (c={levels}) |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in r["cells"]:
        pp = " ".join(f"{p:.2f}" for p in c["per_position"]) or "-"
        plain = " / ".join(f"{p['target_tokens_per_s']:.1f}" for p in c["curve"])
        spec = " / ".join(f"{p['spec_tokens_per_s']:.1f}" for p in c["curve"])
        lines.append(
            f"| {c['drafter']} | {domain_label(c['domain'])} | {ENGINE[c['engine']]} | {c['k']} | {pp} | {plain} | {spec} |"
        )
    return "\n".join(lines)


def notes(r: dict) -> list[str]:
    """Why a row is in draftsmith's engine, why a check failed, and whether the budgets were equal."""
    lines = [
        f"- {row['drafter']}: {row['vllm_refused']}; measured in draftsmith's engine."
        for row in r["rows"]
        if row["vllm_refused"]
    ]
    for c in r["cells"]:
        if not c["passed"]:
            lines.append(
                f"- {c['drafter']} on {c['domain']}: check failed: {c['why']} ({c.get('report', 'see bakeoff.json')})."
            )
    steps = {row["steps"] for row in r["rows"]}
    data = {row["train_data"] for row in r["rows"]}
    budget = f"{steps.pop()} optimizer steps each" if len(steps) == 1 else "UNEQUAL budgets (see trained)"
    lines.append(
        f"- Training budget: {budget}; trained on {data.pop() if len(data) == 1 else 'DIFFERENT data: ' + ', '.join(map(str, sorted(data, key=str)))}."
    )
    return lines


def deploy_lines(d: dict) -> list[str]:
    """The deploy config's paragraph: whose it is, how to serve it, the K chosen and vLLM's reading of it."""
    if not d.get("path"):
        return [f"No deploy config: {d['why']}.", ""]
    reads, drafted = d["vllm_reads"], d["served"]
    again = "" if d["check_passed"] else " Its serve-check FAILED this time: read it before deploying."
    return [
        f"Deploy config `{d['path']}`, from {d['drafter']} ({d['family']}: the best geomean speedup at concurrency "
        f"1 among the drafters vLLM served with their check passed), measured again on {d['domain']} "
        f"(its serve-check: `{d['check']}`).{again}",
        "",
        f'Serve with `vllm serve {d["served_target"]} --speculative-config "$(cat {d["path"]})"`.',
        "",
        f"K chosen per concurrency: {d['chosen_k']} (from {d['runs']} interleaved runs: a K only where its slowest run "
        "beats the target alone's and the smaller K's fastest; 0: the target alone). vLLM's own config code "
        f"reads it as K {reads['k_per_batch_size']} for batch sizes 1..{len(reads['k_per_batch_size'])}. Served "
        "with it, vLLM drafted "
        + ", ".join(
            f"{v['draft_tokens_per_draft']:.2f} tokens per draft at concurrency {c}" for c, v in drafted.items()
        )
        + " (averaged over its drafting steps).",
        "",
    ]


def markdown(r: dict) -> str:
    return "\n".join(
        [
            f"# draftsmith bakeoff: {len(r['rows'])} drafter{'s' * (len(r['rows']) != 1)} of `{r['target']}`",
            "",
            f"{r['num_prompts']} prompts per domain, {r['max_new_tokens']} new tokens, greedy, chain K={r['k']}, "
            f"{r['dtype']}; measured on {describe(r['hardware'])}; vLLM {r['vllm_version'] or 'not used'}.",
            "",
            "Speedup at c: tokens/s with the drafter over tokens/s of the target alone, in the same engine at the "
            "same concurrency c (vLLM: concurrent requests; draftsmith's engine: batch size). τ: tokens per verification "
            "pass, the bonus token included (vLLM's counters in vLLM rows). Geomean: the geometric mean of the "
            "speedups across domains. Bold: the best of each column among the rows of one engine whose check passed "
            "(an engine with one such row has none).",
            "",
            table(r),
            "",
            *notes(r),
            "",
            details(r),
            "",
            *deploy_lines(r["deploy"]),
        ]
    )


def plot(r: dict, path: Path) -> None:
    """The geomean speedup against concurrency, one line per drafter (dashed: draftsmith's engine)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for row in r["rows"]:
        g = row["geomean_speedup"]
        style = "o-" if row["engine"] == "vllm" else "s--"
        label = f"{row['drafter']} ({ENGINE[row['engine']]})"
        ax.plot([p["concurrency"] for p in g], [p["speedup"] for p in g], style, label=label)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(r["concurrency"], [str(c) for c in r["concurrency"]])
    ax.set_xlabel("concurrent requests (vLLM) / batch size (draftsmith)")
    ax.set_ylabel(f"geomean speedup, {len(r['data'])} domains")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100, format="png")
    plt.close(fig)


def write(r: dict, out: Path) -> None:
    """bakeoff.json / .md / .png, each written to a temp name and renamed."""
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (("bakeoff.json", json.dumps(r, indent=2)), ("bakeoff.md", markdown(r))):
        tmp = out / (name + ".tmp")
        tmp.write_text(text)
        tmp.replace(out / name)
    plot(r, out / "bakeoff.png.tmp")
    (out / "bakeoff.png.tmp").replace(out / "bakeoff.png")
