"""The deploy config: the `--speculative-config` to pass to `vllm serve`, with the K that was fastest
at each measured concurrency.

One fixed K does not suit every load: a draft that pays at one request slows a busy server down, because
every sequence of a large batch pays the verification of K more tokens whatever its acceptance (on the
2-core EPYC the quickstart's head at K=3 went from 1.63x at one request to 0.68x at 16). vLLM 0.32 takes
the answer as config: `SpeculativeConfig.num_speculative_tokens_per_batch_size`, a list of inclusive
`(batch_lo, batch_hi, K)` ranges starting at 1, K >= 0 (0: no draft at that batch size) and at most
`num_speculative_tokens` (vLLM caps a larger one silently; here it is an error, so the file says what is
served). vLLM fills a gap between ranges, and every batch size past the last, with the K before it
(`vllm/v1/spec_decode/dynamic/utils.py build_dynamic_sd_schedule_lookup`).

`choose_k` picks, at each measured concurrency, the K that noise cannot have picked: every level is
timed in at least `MIN_RUNS` runs, target-only and each K interleaved (`interleaved_runs`: one server
each, all up together, the order rotated every run), and K > 0 is chosen only where its slowest run
beats target-only's fastest; between two K the larger only where its slowest run beats the smaller's
fastest (it wins by more than the runs' spread), else the smaller. A K planted to lose is so never
chosen, and one planted to win is chosen once its margin exceeds the spread (tests/ship/test_deploy.py).
`schedule` turns those picks into vLLM's ranges: the K measured at concurrency c covers batch sizes from c
up to the next measured level; `deploy_config` is the speculative config; `check` refuses a file vLLM
would serve differently from what it says; `in_vllm` builds vLLM's own `VllmConfig` from it in the vLLM
environment (its `SpeculativeConfig` validation included) and reads back the K per batch size.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

from draftsmith import DraftsmithError
from draftsmith.models.registry import drafter_family
from draftsmith.target import vllm_server

if TYPE_CHECKING:
    from draftsmith.ship.serve_check import Served

SCHEDULE_KEY = "num_speculative_tokens_per_batch_size"


MIN_RUNS = 3  # timing runs per K and level: fewer leave no spread for a margin to beat


def choose_k(target_runs: dict[int, list[float]], spec_runs: dict[int, dict[int, list[float]]]) -> dict[int, int]:
    """{concurrency: target-only tokens/s of each run} and {K: {concurrency: tokens/s of each run}} ->
    {concurrency: the K to serve there, 0 = the target alone}. Walking K upwards, a K replaces the choice
    so far (the target alone at first) only where its slowest run beats that choice's fastest; a K
    whose margin is within the runs' spread leaves the smaller choice standing."""
    best = {}
    for c, plain in sorted(target_runs.items()):
        chosen, runs = 0, plain
        for k in sorted(spec_runs):
            mine = spec_runs[k].get(c)
            if mine and min(mine) > max(runs):
                chosen, runs = k, mine
        best[c] = chosen
    return best


def check_levels(num_prompts: int, concurrency: list[int], runs: int = MIN_RUNS) -> None:
    """A curve that can be measured: each level needs as many prompts as requests in flight, and every
    level at least MIN_RUNS runs (a one-line error naming the flag otherwise)."""
    if max(concurrency) > num_prompts:
        raise DraftsmithError(
            f"--concurrency {max(concurrency)}: more concurrent requests than the {num_prompts} prompts measured "
            "(raise --num-prompts or lower --concurrency)"
        )
    if runs < MIN_RUNS:
        raise DraftsmithError(f"--deploy-runs {runs}: at least {MIN_RUNS} runs per level, to have a spread to beat")


def schedule(best: dict[int, int]) -> list[list[int]]:
    """{concurrency: K} -> vLLM's inclusive ranges [[lo, hi, K], ...]: the K measured at concurrency c
    serves batch sizes c .. (next measured level - 1); the first range starts at 1 (as vLLM requires)
    and the last ends at its own level (vLLM carries it to larger batches). Neighbours with the same K
    are one range."""
    levels = sorted(best)
    if not levels:
        raise DraftsmithError("deploy: no measured concurrency to choose K for")
    ranges: list[list[int]] = []
    for i, c in enumerate(levels):
        lo = 1 if i == 0 else c
        hi = levels[i + 1] - 1 if i + 1 < len(levels) else c
        if ranges and ranges[-1][2] == best[c]:
            ranges[-1][1] = hi
        else:
            ranges.append([lo, hi, best[c]])
    return ranges


def deploy_config(speculative: dict, best: dict[int, int]) -> dict:
    """The family's speculative config (method, model, num_speculative_tokens...) with the schedule of
    `best`: num_speculative_tokens is the largest K chosen (vLLM sizes its buffers for it), or the
    measured one if no K paid anywhere (every range then says 0: speculation off at every batch size)."""
    ranges = schedule(best)
    top = max(k for _, _, k in ranges) or speculative["num_speculative_tokens"]
    return {**speculative, "num_speculative_tokens": top, SCHEDULE_KEY: ranges}


def check(config: dict, where: str = "deploy config") -> dict:
    """A deploy config served as it reads: every range [lo, hi, K] with 1 <= lo <= hi, the first from
    batch size 1, sorted without overlaps, 0 <= K <= num_speculative_tokens. A one-line error naming
    `where` and the entry otherwise; the config back when it is good."""
    top, ranges = config.get("num_speculative_tokens"), config.get(SCHEDULE_KEY)
    if not isinstance(top, int) or top < 1:
        raise DraftsmithError(f"{where}: num_speculative_tokens must be a positive integer, got {top!r}")
    if not isinstance(ranges, list) or not ranges:
        raise DraftsmithError(f"{where}: {SCHEDULE_KEY} must be a non-empty list of [batch_lo, batch_hi, K]")
    previous = 0
    for entry in ranges:
        if not (isinstance(entry, list | tuple) and len(entry) == 3 and all(isinstance(x, int) for x in entry)):
            raise DraftsmithError(f"{where}: {SCHEDULE_KEY} entry {entry!r} is not [batch_lo, batch_hi, K] integers")
        lo, hi, k = entry
        if not 0 <= k <= top:
            raise DraftsmithError(
                f"{where}: {SCHEDULE_KEY} entry {list(entry)}: K {k} is outside 0..num_speculative_tokens ({top})"
            )
        if previous == 0 and lo != 1:
            raise DraftsmithError(
                f"{where}: {SCHEDULE_KEY} entry {list(entry)}: the first range must start at batch size 1"
            )
        if lo <= previous or hi < lo:
            raise DraftsmithError(
                f"{where}: {SCHEDULE_KEY} entry {list(entry)}: ranges must be sorted, not overlap, and end at or after their start"
            )
        previous = hi
    return config


def read(path: str | Path) -> dict:
    """A deploy/vllm.json, checked (`check`)."""
    try:
        config = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DraftsmithError(f"{path}: cannot read a deploy config ({e})") from None
    if not isinstance(config, dict):
        raise DraftsmithError(f"{path}: a deploy config is a JSON object (vLLM's speculative config)")
    return check(config, str(path))


def write(config: dict, folder: Path, measured: dict) -> Path:
    """folder/vllm.json (the speculative config) and folder/measured.json (the tokens/s it was chosen
    from), each through a temp name."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, value in (("vllm.json", check(config, str(folder / "vllm.json"))), ("measured.json", measured)):
        tmp = folder / (name + ".tmp")
        tmp.write_text(json.dumps(value, indent=2) + "\n")
        tmp.replace(folder / name)
    return folder / "vllm.json"


# Run in the vLLM environment: vLLM's own engine config from the deploy config (SpeculativeConfig's
# validation and the schedule's), then the K its scheduler uses at each batch size.
_IN_VLLM = """
import json, sys
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup
spec, model, max_len, max_seqs = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
try:
    config = EngineArgs(model=model, dtype="float32", max_model_len=max_len, max_num_seqs=max_seqs,
                        enforce_eager=True, speculative_config=spec).create_engine_config()
    sc = config.speculative_config
    lookup = build_dynamic_sd_schedule_lookup(sc.num_speculative_tokens_per_batch_size, max_seqs,
                                              sc.num_speculative_tokens)
except Exception as e:
    print(json.dumps({"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}))
    sys.exit(0)
print(json.dumps({"method": sc.method, "num_speculative_tokens": sc.num_speculative_tokens,
                  "schedule": [list(r) for r in sc.num_speculative_tokens_per_batch_size],
                  "k_per_batch_size": lookup[1:]}))
"""


def in_vllm(config: dict, model: str, python: str, max_model_len: int = 1024, max_num_seqs: int = 16) -> dict:
    """vLLM's reading of a deploy config for `model` (the served target): {method,
    num_speculative_tokens, schedule, k_per_batch_size (index 0 = batch size 1)}. vLLM refusing it is a
    one-line error with vLLM's reason."""
    proc = subprocess.run(
        [python, "-c", _IN_VLLM, json.dumps(config), model, str(max_model_len), str(max_num_seqs)],
        capture_output=True,
        text=True,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise DraftsmithError(f"deploy config: vLLM's config check did not run ({tail})")
    got = json.loads(lines[-1])
    if "error" in got:
        raise DraftsmithError(f"deploy config: vLLM refuses it ({got['error']})")
    return got


def curve(
    run: Served, config: dict, ks: list[int], max_new_tokens: int, concurrency: list[int], out: Path, runs: int
) -> dict:
    """`serve-check --deploy-k`: the target alone and the export at each K of `ks` (and the check's own
    K), timed `runs` times at every concurrency (`interleaved_runs`); the K `choose_k` picks at each
    becomes OUT/deploy/vllm.json with the runs it was chosen from beside it (measured.json), which vLLM's
    own config code then reads back, and one more server runs with it to show the K vLLM drafted at each
    concurrency (draft tokens per draft, from its counters)."""
    serving = drafter_family(config["draftsmith"]["drafter"]).vllm_serving
    assert serving is not None and run.spec is not None  # decode_both served this family's export
    speculative: dict[int, dict] = {}
    for k in sorted({*ks, run.k}):
        spec = serving(run.export_dir.resolve(), config, k)[0]
        speculative.setdefault(spec["num_speculative_tokens"], spec)  # Medusa drafts its heads whatever K asks
    timed = interleaved_runs(run, speculative, max_new_tokens, concurrency, runs)
    best = choose_k(timed[0], {k: v for k, v in timed.items() if k})
    chosen = deploy_config(run.speculative, best)
    kw = run.serve_kwargs or {}
    python = vllm_server.find_python(kw.get("python"))
    vllm_reads = in_vllm(chosen, run.served, python, kw.get("max_model_len", 1024), max(concurrency))
    med = lambda by_c: {c: round(statistics.median(v), 2) for c, v in by_c.items()}  # noqa: E731
    measured = {
        "rule": "K > 0 where its slowest run beats target-only's fastest; a larger K only where its slowest run "
        "beats the smaller choice's fastest",
        "runs": runs,
        "target_tokens_per_s": med(timed[0]),
        "spec_tokens_per_s": {k: med(timed[k]) for k in sorted(speculative)},
        "tokens_per_s_runs": {k: {c: [round(x, 2) for x in v] for c, v in by_c.items()} for k, by_c in timed.items()},
        "spread": {k: {c: round(max(v) - min(v), 2) for c, v in by_c.items()} for k, by_c in timed.items()},
        "chosen_k": best,
        "vllm_reads": vllm_reads,
        "served": drafted_k(run, chosen, max_new_tokens, concurrency),
    }
    path = write(chosen, out / "deploy", measured)
    return {"path": str(path), "speculative_config": chosen, **measured}


def interleaved_runs(
    run: Served, speculative: dict[int, dict], max_new_tokens: int, concurrency: list[int], runs: int
) -> dict[int, dict[int, list[float]]]:
    """One vLLM server of the target alone (key 0) and one per K, all up together; `runs` times over,
    each server in turn (the order rotated one place per run, so no K always goes first or follows the
    same one) times the prompts at every concurrency -> {K: {concurrency: [tokens/s of each run]}}."""
    plain_kw = run.plain_kwargs or {}
    spec_kw = {**plain_kw, "extra": (*run.family_args, *plain_kw.get("extra", ()))}
    with contextlib.ExitStack() as stack:
        servers = {0: stack.enter_context(vllm_server.serve(run.served, **plain_kw))}
        for k, spec in speculative.items():
            servers[k] = stack.enter_context(vllm_server.serve(run.served, speculative=spec, **spec_kw))
        for server in servers.values():
            vllm_server.complete(server, run.prompts[0][:8], 4)  # warm-up: first-request costs stay out
        order = list(servers)
        got: dict[int, dict[int, list[float]]] = {k: {c: [] for c in concurrency} for k in servers}
        for i in range(runs):
            for k in order[i % len(order) :] + order[: i % len(order)]:
                for c in concurrency:
                    outs, seconds = vllm_server.complete_all(servers[k], run.prompts, max_new_tokens, c)
                    got[k][c].append(sum(map(len, outs)) / seconds)
    return got


def drafted_k(run: Served, speculative: dict, max_new_tokens: int, concurrency: list[int]) -> dict:
    """vLLM serving the prompts with `speculative` at each concurrency -> {concurrency: {tokens_per_s,
    draft_tokens_per_draft (the K it drafted, averaged over its drafting steps; 0: it did not draft)}}."""
    got: dict[int, dict] = {}
    with vllm_server.serve(run.served, speculative=speculative, **(run.serve_kwargs or {})) as server:
        vllm_server.complete(server, run.prompts[0][:8], 4)  # warm-up
        for c in concurrency:
            before = vllm_server.spec_counters(server)
            outs, seconds = vllm_server.complete_all(server, run.prompts, max_new_tokens, c)
            delta = vllm_server.counter_delta(vllm_server.spec_counters(server), before)
            got[c] = {
                "tokens_per_s": round(sum(map(len, outs)) / seconds, 2),
                "draft_tokens_per_draft": round(delta["num_draft_tokens"] / max(delta["num_drafts"], 1), 3),
            }
    return got
