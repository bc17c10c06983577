"""Runs in the vLLM environment (.venv-vllm), never imported by draftsmith or its tests:

    .venv-vllm/bin/python tests/data/vllm_features_run.py OUT_DIR

calls vLLM 0.32's own `ExampleHiddenStatesConnector` code without an engine, on a hand-filled
hidden-states KV cache ([blocks, aux states, block size, H], the layout it indexes:
example_hidden_states_connector.py `extract_from_kv_cache`), in the process state vLLM's CPU worker
runs it in (v1/worker/cpu/shm.py's torch placeholders, imported as the CPU worker imports them):
- the stock `_submit_async_write` and `get_finished` (what they raise, and where in vLLM);
- draftsmith's CPU subclass (draftsmith/target/vllm_features.py `_cpu_connector`) through the same
  stock code: the file it writes, read back with vLLM's `load_hidden_states`.
Prints one JSON line.
"""

import importlib.util
import json
import sys
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    load_hidden_states,
)
from vllm.platforms import current_platform

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 4


def draftsmith_module():
    """draftsmith/target/vllm_features.py by path (draftsmith itself is not installed here)."""
    spec = importlib.util.spec_from_file_location("vllm_features", ROOT / "draftsmith" / "target" / "vllm_features.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # (dataclasses look it up)
    spec.loader.exec_module(module)
    return module


def worker_side(cls, kv: torch.Tensor):
    """A connector with the worker-side state its __init__ and register_kv_caches set (TP rank 0)."""
    c = object.__new__(cls)
    c._is_tp_rank_zero, c._kv_cache, c._block_size, c._copy_stream = True, kv, BLOCK, None
    c._req_futures, c._lock_fds, c._req_copy_events, c._accumulated_finished_req_ids = {}, {}, {}, set()
    c.use_lock, c._executor, c._connector_metadata = True, ThreadPoolExecutor(1), None
    return c


def refusal(call) -> tuple[str, str]:
    """(`Type: message`, vLLM file:line that raised) of a call expected to fail, or ("", "")."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 - what vLLM raises is the finding
        frames = [f for f in traceback.extract_tb(e.__traceback__) if "/vllm/" in f.filename]
        where = f"{frames[-1].filename.split('/vllm/')[-1]}:{frames[-1].lineno}" if frames else ""
        return f"{type(e).__name__}: {e}", where
    return "", ""


def main(out: Path) -> None:
    cpu = current_platform.is_cpu()
    if cpu:
        import vllm.v1.worker.cpu.shm  # noqa: F401 - the CPU worker's torch placeholders (events, streams)
    torch.manual_seed(0)
    kv = torch.randn(6, 3, BLOCK, 8)  # 6 blocks, 3 aux hidden states of H = 8
    tokens, blocks = torch.arange(7), [2, 5]  # 7 tokens: block 2's 4 slots, then 3 of block 5's
    want = torch.cat([kv[2].transpose(0, 1), kv[5, :, :3].transpose(0, 1)])  # [7, 3, 8]

    stock = worker_side(ExampleHiddenStatesConnector, kv)
    write, write_at = refusal(
        lambda: stock._submit_async_write(PendingSave("r", str(out / "s.safetensors"), tokens, blocks))
    )
    stock._req_copy_events, stock._accumulated_finished_req_ids = {"r": torch.cuda.Event()}, {"r"}
    poll, poll_at = refusal(lambda: stock.get_finished(set()))

    sub = worker_side(draftsmith_module()._cpu_connector(), kv)
    path = out / "r.safetensors"
    sub._submit_async_write(PendingSave("r", str(path), tokens, blocks))
    done, _ = sub.get_finished({"r"})
    sub._executor.shutdown(wait=True)
    saved = load_hidden_states(str(path))
    equal = torch.equal(saved["hidden_states"], want) and torch.equal(saved["token_ids"], tokens)
    report = {
        "cpu": cpu,
        "stock_write": write,
        "stock_write_at": write_at,
        "stock_poll": poll,
        "stock_poll_at": poll_at,
        "subclass_done": sorted(done or []),
        "subclass_file": {"keys": sorted(saved), "equal": equal},
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
