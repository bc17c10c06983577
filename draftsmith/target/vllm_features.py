"""Target features captured by vLLM (`data.features_engine: vllm`): the feature cache of
data/features.py (same example ids, same names, the dtype the target runs in) from one vLLM pass
over the training set, e.g. a 70B target served with tensor parallelism, instead of an in-process
forward pass.

What vLLM 0.32 does (its source, paths under vllm/):
- speculative method `extract_hidden_states` (v1/spec_decode/extract_hidden_states.py) drafts
  nothing: after each target forward the aux hidden states go into the KV cache of one cache-only
  attention layer (model_executor/models/extract_hidden_states.py); which layers:
  `draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids` (v1/worker/gpu_model_runner.py
  `_get_eagle3_aux_layers_from_config`); one speculative token, nothing else to configure
  (config/speculative.py, `method == "extract_hidden_states"`).
- vLLM's layer id L is the residual stream entering decoder layer L, before any norm: id 0 the
  embeddings, id L the output of layer L-1 (`_maybe_add_hidden_state(..., idx + 1, ...)` after
  layer idx, model_executor/models/llama.py:429-441, interfaces.py:1601), stacked in layer order
  whatever order the ids are given in.
- `ExampleHiddenStatesConnector` (distributed/kv_transfer/kv_connector/v1/
  example_hidden_states_connector.py) writes, one engine step after a request finishes, one
  safetensors file per request: `hidden_states` [T, len(ids), H] in the model's dtype and
  `token_ids` [T] int64, the prompt's ids (prompt positions only, :539-545), under an exclusive
  flock on PATH.lock that readers wait on (`load_hidden_states`, :48-66); PATH comes back in the
  request's `kv_transfer_params["hidden_states_path"]` (:559). Only TP rank 0 writes (:367).

draftsmith's names (target/features.py): `hidden.i` is transformers' hidden_states[i + 1], i.e.
vLLM id i + 1, except that transformers ties hidden_states[-1] to the post-norm last_hidden_state
(utils/output_capturing.py, `tie_last_hidden_states`): `hidden.{N-1}` and `last_hidden` are both
vLLM id N through the target's final norm, which `to_features` applies.

The capture runs in vLLM's environment: this file is also the script (`python vllm_features.py
JOB.json`, see `_capture_main`), so its top-level imports are the ones both environments have, and
draftsmith's own are imported inside the functions that run in draftsmith's.
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

PREFIX = "DRAFTSMITH_VLLM "  # the script's event lines on stdout, among vLLM's own log lines
# Requests in the engine or in files not yet read back: bounds the connector's files on disk (a 70B
# target's 4 states of 8192 bf16 numbers per token: 134 MB for a 2048-token example), still fills batches.
MAX_IN_FLIGHT = 64


@dataclass(frozen=True)
class LayerPlan:
    ids: tuple[int, ...]
    """vLLM's `eagle_aux_hidden_state_layer_ids`, ascending: the order it stacks them in."""
    columns: dict
    """draftsmith feature name -> (its column of `hidden_states`, whether it goes through the final norm)."""


def layer_plan(names, config) -> LayerPlan:
    """Which vLLM layer ids give the feature contract `names` of a target with this config."""
    from draftsmith import DraftsmithError

    n = config.get_text_config().num_hidden_layers
    tied = getattr(config, "tie_last_hidden_states", None) is not False  # transformers' default: tied
    want = {}
    for name in names:
        if name == "last_hidden":
            want[name] = (n, True)
        elif name.startswith("hidden.") and name[7:].isdigit() and int(name[7:]) < n:
            i = int(name[7:])
            want[name] = (i + 1, tied and i == n - 1)  # output of layer i = the residual stream entering i + 1
        else:
            raise DraftsmithError(
                f"feature {name!r}: vLLM captures the residual stream between decoder layers "
                f"(hidden.0 .. hidden.{n - 1}, last_hidden), not this; use data.features_engine: hf"
            )
    ids = sorted({v for v, _ in want.values()})
    return LayerPlan(tuple(ids), {k: (ids.index(v), normed) for k, (v, normed) in want.items()})


def engine_flags(target: str, plan: LayerPlan, storage: Path, dtype: str, max_model_len: int, extra=()) -> list[str]:
    """The capture engine's flags: draftsmith's engine flags (`vllm_server.engine_args`), the
    extract_hidden_states method tapping `plan`'s layers and the connector writing to `storage`.
    `extra` comes last and overrides, e.g. --tensor-parallel-size 8 --gpu-memory-utilization 0.85."""
    from draftsmith.target.vllm_server import engine_args

    spec = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,  # the method's only setting (ExtractHiddenStatesProposer asserts 1)
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(plan.ids)}},
    }
    transfer = {
        "kv_connector": "ExampleHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(storage)},
    }
    return engine_args(str(target), dtype, max_model_len, spec, ("--kv-transfer-config", json.dumps(transfer), *extra))


def capture(
    flags: list[str],
    requests: Path,
    workdir: Path,
    python: str | None = None,
    stats: dict | None = None,
    max_in_flight: int = MAX_IN_FLIGHT,
):
    """Run the capture engine in vLLM's environment over `requests` (jsonl of {"id", "ids"}); yield
    (id, path of the connector's file) as each is written, to be read back (and so deleted) with
    `read_capture`: at most `max_in_flight` requests are in the engine or in files not read back.
    `stats` gets the engine's start-up and capture seconds. The engine process is stopped however
    this ends."""
    from draftsmith import DraftsmithError
    from draftsmith.target import vllm_server

    python = vllm_server.find_python(python)
    job = Path(workdir) / "job.json"
    job.write_text(json.dumps({"flags": flags, "requests": str(requests), "max_in_flight": max_in_flight}))
    log = Path(workdir) / "vllm.log"
    env = {**os.environ, "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "INFO")}
    cmd = [python, str(Path(__file__).resolve()), str(job)]
    with open(log, "w") as f:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env
        )
        try:
            for line in proc.stdout or ():  # one reader for both streams: neither pipe can fill and block vLLM
                f.write(line)
                if not line.startswith(PREFIX):
                    continue
                event = json.loads(line[len(PREFIX) :])
                if event["event"] == "captured":
                    yield event["id"], Path(event["path"])
                elif stats is not None:
                    stats.update({k: v for k, v in event.items() if k != "event"})
            if proc.wait() != 0:
                f.flush()
                why = vllm_server.startup_error(log.read_text(errors="replace"))
                raise DraftsmithError(f"vLLM feature capture failed (exit code {proc.returncode}): {why} (log: {log})")
        finally:
            vllm_server.stop(proc)


def read_capture(path: Path) -> dict[str, torch.Tensor]:
    """The connector's file once written (its `load_hidden_states` protocol: a shared flock on
    PATH.lock waits for the writer's exclusive one), then the file and its lock removed."""
    path = Path(path)
    lock = path.with_name(path.name + ".lock")
    if lock.exists():
        with open(lock) as lf:
            fcntl.flock(lf, fcntl.LOCK_SH)
            raw = load_file(str(path))
        lock.unlink()
    else:  # the connector's use_synchronization_lock=false: written before it was reported
        raw = load_file(str(path))
    path.unlink()
    return raw


def to_features(hidden_states: torch.Tensor, plan: LayerPlan, norm) -> dict[str, torch.Tensor]:
    """[T, len(plan.ids), H] from the connector -> {name: [T, H]} as `target_features` computes them;
    `norm`: the target's final norm (its module, e.g. `target.get_decoder().norm`), applied once per
    name that needs it, so `hidden.{N-1}` and `last_hidden` are two tensors (safetensors stores no
    two names over one storage)."""
    out = {}
    for name, (col, normed) in plan.columns.items():
        x = hidden_states[:, col]
        if normed:
            weight = next(norm.parameters(), None)
            x = norm(x.to(weight.device if weight is not None else x.device)).to("cpu")
        out[name] = x.contiguous()
    return out


@torch.no_grad()
def convert_captures(captured, dataset, plan: LayerPlan, norm, writer, shard_tokens: int = 2_000_000) -> int:
    """(position in `dataset`, connector file) pairs -> shards of `writer` (a data/features.py
    ShardWriter) under each example's `idx`, checking that vLLM saw exactly the example's tokens.
    Returns the number of examples written."""
    from tqdm import tqdm

    from draftsmith import DraftsmithError

    current, n_tok, done = {}, 0, set()
    for pos, path in tqdm(captured, total=len(dataset), desc="features (vLLM)"):
        raw, row = read_capture(path), dataset[pos]
        if raw["token_ids"].tolist() != list(row["input_ids"]):
            raise DraftsmithError(f"{path}: vLLM captured other tokens than example {row['idx']}'s")
        current[row["idx"]] = to_features(raw["hidden_states"], plan, norm)
        n_tok += len(row["input_ids"])
        done.add(pos)
        if n_tok >= shard_tokens:
            writer.write_shard(current)
            current, n_tok = {}, 0
    if current:
        writer.write_shard(current)
    if len(done) != len(dataset):
        raise DraftsmithError(f"vLLM feature capture: {len(dataset) - len(done)} of {len(dataset)} examples missing")
    return len(done)


def capture_features(
    path: str,
    target,
    dataset,
    names,
    writer,
    extra=(),
    python: str | None = None,
    shard_tokens: int = 2_000_000,
    stats: dict | None = None,
    max_in_flight: int = MAX_IN_FLIGHT,
) -> None:
    """data/features.py `write_cache` through vLLM: the target at `path` (a folder or hub id vLLM
    loads) over every example of a tokenized `dataset` (rows with `idx` and `input_ids`), the features
    `names` into `writer`, a data/features.py ShardWriter (this room sits below data: the caller makes
    it and calls its `finish`). `target`: the same target in-process, for its config, dtype and final
    norm (what the last layer's output goes through). `extra`: vLLM flags, passed unchanged, e.g.
    --tensor-parallel-size 8. One process: a launch runs it on its main rank alone."""
    plan = layer_plan(names, target.config)
    parent = Path(writer.out).parent
    parent.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="vllm-features-", dir=parent))  # beside the cache, on its disk
    requests, longest = workdir / "requests.jsonl", 1
    with open(requests, "w") as f:
        for pos in range(len(dataset)):
            ids = list(dataset[pos]["input_ids"])
            longest = max(longest, len(ids))
            f.write(json.dumps({"id": pos, "ids": ids}) + "\n")
    dtype = str(next(target.parameters()).dtype).removeprefix("torch.")  # the cache's dtype, as in-process
    # One position more than the longest example: each request samples the one token vLLM requires.
    flags = engine_flags(path, plan, workdir / "hidden", dtype, longest + 1, extra)
    writer.meta["captured_by"] = {"engine": "vllm extract_hidden_states", "vllm_layer_ids": list(plan.ids)}
    stats = {} if stats is None else stats
    start = time.perf_counter()
    # closing(): an error while converting stops the engine at once, not when the traceback is freed.
    with closing(capture(flags, requests, workdir, python, stats, max_in_flight)) as captured:
        convert_captures(captured, dataset, plan, target.get_decoder().norm, writer, shard_tokens)
    stats["wall_s"] = time.perf_counter() - start
    shutil.rmtree(workdir)  # kept when something failed: its vllm.log says why


# ---- Below: runs in vLLM's environment (`capture` starts it), never in draftsmith's. --------------


def _emit(event: str, **fields) -> None:
    print(PREFIX + json.dumps({"event": event, **fields}), flush=True)


@functools.cache
def _cpu_connector():
    """vLLM 0.32's connector as its CPU backend can run it. The stock one refuses there, in the
    step after a request finishes: `torch.empty_like(..., pin_memory=True)`
    (example_hidden_states_connector.py:402: "pin_memory=True requires a CUDA or other accelerator
    backend"), and, past that, `event.query()` (:587) on the CUDA-event placeholder vLLM's CPU
    backend installs (v1/worker/cpu/shm.py `_EventPlaceholder`, without `query`). On CPU the KV cache
    is host memory and the copy out of it synchronous, so this subclass runs the stock code with an
    unpinned host tensor and marks the copy done; the file, its keys and its lock are the stock ones."""
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        ExampleHiddenStatesConnector,
    )

    class CopyDone:
        def query(self) -> bool:
            return True

        def synchronize(self) -> None:
            pass

    class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
        def _submit_async_write(self, pending) -> None:
            empty_like = torch.empty_like
            torch.empty_like = lambda *args, pin_memory=False, **kwargs: empty_like(*args, **kwargs)
            try:
                super()._submit_async_write(pending)
            finally:
                torch.empty_like = empty_like
            if pending.req_id in self._req_copy_events:
                self._req_copy_events[pending.req_id] = CopyDone()

    return CpuHiddenStatesConnector


def __getattr__(name: str):
    # PEP 562: vLLM's connector factory looks the CPU connector up in this module by name.
    if name == "CpuHiddenStatesConnector":
        return _cpu_connector()
    raise AttributeError(name)


def _requests(path: str):
    with open(path) as f:
        for line in f:
            yield json.loads(line)


def _capture_main(job_path: str) -> None:
    """The engine over every request of the job, in this process (stepped here: the connector
    writes a finished request's file one step later), with at most `max_in_flight` requests in the
    engine or in files draftsmith has not read back yet."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    start = time.perf_counter()
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.engine.llm_engine import LLMEngine

    job = json.loads(Path(job_path).read_text())
    args = EngineArgs.from_cli_args(EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(job["flags"]))
    connector = "ExampleHiddenStatesConnector"
    if current_platform.is_cpu():
        connector = "CpuHiddenStatesConnector"
        args.kv_transfer_config.kv_connector = connector
        args.kv_transfer_config.kv_connector_module_path = "__main__"  # this module: the engine runs in-process
    engine = LLMEngine.from_engine_args(args)
    _emit("started", start_s=time.perf_counter() - start, connector=connector)
    start, tokens = time.perf_counter(), 0
    params = SamplingParams(max_tokens=1, temperature=0.0)  # the prompt's forward pass is what is captured
    todo, more = _requests(job["requests"]), True
    pending: dict[str, str | None] = {}  # request id -> its file once finished (None before)
    handed: set[str] = set()  # files not yet read back
    while True:
        handed = {p for p in handed if os.path.exists(p)}  # draftsmith deletes each file once converted
        while more and len(pending) + len(handed) < job["max_in_flight"]:
            req = next(todo, None)
            if req is None:
                more = False
                break
            engine.add_request(str(req["id"]), {"prompt_token_ids": req["ids"]}, params)
            pending[str(req["id"])], tokens = None, tokens + len(req["ids"])
        if not pending and not more:
            break
        for out in engine.step() if pending else ():
            if out.finished:
                pending[out.request_id] = out.kv_transfer_params["hidden_states_path"]
        for rid, path in list(pending.items()):
            if path is not None and os.path.exists(path):  # submitted: the reader's flock waits for the write
                _emit("captured", id=int(rid), path=path)
                handed.add(path)
                del pending[rid]
        if not engine.has_unfinished_requests():
            time.sleep(0.002)  # only writes to submit or finish, or files to be read back
    _emit("done", capture_s=time.perf_counter() - start, tokens=tokens)


if __name__ == "__main__":
    sys.path.pop(0)  # this file's folder: its modules (features.py, load.py) must not shadow vLLM's imports
    _capture_main(sys.argv[1])
