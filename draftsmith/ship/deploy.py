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

`fastest_k` picks, at each measured concurrency, the K with the most tokens/s (0 where the target alone
was faster); `schedule` turns those picks into vLLM's ranges: the K measured at concurrency c covers batch
sizes from c up to the next measured level; `deploy_config` is the speculative config; `check` refuses
a file vLLM would serve differently from what it says; `in_vllm` builds vLLM's own `VllmConfig` from it
in the vLLM environment (its `SpeculativeConfig` validation included) and reads back the K per batch size.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from draftsmith import DraftsmithError

SCHEDULE_KEY = "num_speculative_tokens_per_batch_size"


def fastest_k(target_tps: dict[int, float], spec_tps: dict[int, dict[int, float]]) -> dict[int, int]:
    """{concurrency: target-only tokens/s} and {K: {concurrency: tokens/s}} -> {concurrency: the K with
    the most tokens/s there, or 0 where the target alone was fastest}. Ties go to the smaller K (less
    verification work for the same speed)."""
    best = {}
    for c, plain in sorted(target_tps.items()):
        k, tps = max(((k, run[c]) for k, run in sorted(spec_tps.items()) if c in run), key=lambda kv: kv[1])
        best[c] = k if tps > plain else 0
    return best


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
