"""`data.features_engine: vllm` (draftsmith/target/vllm_features.py): the feature cache written from
vLLM's `extract_hidden_states` method and its connector holds what the in-process target computes
(`target_features`), under the same example ids and names. The layer numbering and the conversion
are checked on connector-format files without vLLM; the capture itself, and vLLM's CPU refusals of
the stock connector, in vLLM's environment (marker `vllm`; skipped without .venv-vllm)."""

from __future__ import annotations

import json
import random
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from draftsmith import DraftsmithError
from draftsmith.data.features import FeatureCache, ShardWriter, write_cache
from draftsmith.target import vllm_server
from draftsmith.target.features import target_features
from draftsmith.target.load import fingerprint, load_target
from draftsmith.target.vllm_features import capture_features, convert_captures, layer_plan
from tests.conftest import save_pattern_target

ROOT = Path(__file__).resolve().parents[2]
# Every layer of a 4-layer target: hidden.3 is the last one, post-norm like last_hidden in transformers.
NAMES = ("hidden.0", "hidden.1", "hidden.2", "hidden.3", "last_hidden")


def needs_vllm(test):
    """A test that runs vLLM: marker `vllm`, skipped where none is installed."""
    return pytest.mark.vllm(
        pytest.mark.skipif(not vllm_server.available(), reason="no vLLM: bash scripts/setup.sh --vllm")(test)
    )


@pytest.fixture(scope="module")
def target4(tmp_path_factory):
    """A 4-layer Llama of head dim 32 (the smallest vLLM's CPU attention takes), briefly trained so its
    layers differ from their inputs."""
    path = save_pattern_target(tmp_path_factory.mktemp("target4") / "target", steps=40, layers=4)
    target, tok = load_target(str(path), "fp32")
    return path, target, tok


def rows(vocab: int, n: int = 12, seed: int = 0) -> list[dict]:
    """Tokenized examples as build_dataset gives them; `idx` unlike the position, as after filtering."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        ids = [rng.randrange(3, vocab) for _ in range(rng.randrange(4, 160))]
        out.append({"idx": 3 * i + 1, "input_ids": ids, "loss_mask": [1] * len(ids)})
    return out


def test_layer_plan_numbers_layers_as_vllm_does(target4):
    """vLLM's id L is the residual stream entering layer L (id 0: the embeddings), so `hidden.i` is
    id i + 1; the last layer's output is pre-norm there and post-norm in transformers (tied to
    last_hidden), so both take id N through the final norm. Ids ascend: vLLM stacks in layer order."""
    config = target4[1].config
    plan = layer_plan(("last_hidden", "hidden.2", "hidden.0", "hidden.3"), config)
    assert plan.ids == (1, 3, 4)
    assert plan.columns == {
        "hidden.0": (0, False),
        "hidden.2": (1, False),
        "hidden.3": (2, True),
        "last_hidden": (2, True),
    }
    config.tie_last_hidden_states = False  # a model whose hidden_states[-1] stays pre-norm
    try:
        assert layer_plan(("hidden.3",), config).columns == {"hidden.3": (0, False)}
    finally:
        del config.tie_last_hidden_states
    for bad in ("hidden.4", "logits_topk.8", "hidden.x"):
        with pytest.raises(DraftsmithError, match="features_engine: hf"):
            layer_plan((bad,), config)


def connector_file(path: Path, target, ids: list[int], plan) -> Path:
    """What ExampleHiddenStatesConnector writes for one request, from the in-process target: keys
    `hidden_states` [T, len(ids), H] (vLLM's aux states: the residual stream, pre-norm) and
    `token_ids` [T] int64 (vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py:
    415-418, saved with safetensors' save_file at :343), beside the PATH.lock it creates (:286-288)."""
    layers = target.get_decoder().layers
    seen = {}
    hook = layers[-1].register_forward_hook(lambda m, i, o: seen.update(last=o[0] if isinstance(o, tuple) else o))
    try:
        out = target.get_decoder()(input_ids=torch.tensor([ids]), output_hidden_states=True)
    finally:
        hook.remove()
    pre_norm = list(out.hidden_states[:-1]) + [seen["last"]]  # id L: the stream entering layer L
    stacked = torch.stack([pre_norm[i][0] for i in plan.ids], dim=1)
    save_file({"hidden_states": stacked.contiguous(), "token_ids": torch.tensor(ids)}, str(path))
    path.with_name(path.name + ".lock").touch()
    return path


def test_connector_files_convert_to_the_in_process_features(target4, tmp_path):
    _, target, tok = target4
    data, plan, fp = rows(target.config.vocab_size), layer_plan(NAMES, target.config), fingerprint(target)
    files = [
        connector_file(tmp_path / f"req-{p}.safetensors", target, r["input_ids"], plan) for p, r in enumerate(data)
    ]
    writer = ShardWriter(tmp_path / "cache", NAMES, fp, target.config.hidden_size)
    # Small shards: examples spread over several files, as a long capture writes them.
    convert_captures(list(enumerate(files)), data, plan, target.get_decoder().norm, writer, shard_tokens=300)
    cache = FeatureCache(writer.finish(len(data)), NAMES, fp)
    assert len(cache.index["shards"]) > 1 and not list(tmp_path.glob("req-*"))  # the connector's files consumed
    for r in data:
        want = target_features(target, {"input_ids": torch.tensor([r["input_ids"]])}, NAMES)
        for name in NAMES:
            torch.testing.assert_close(cache._get(name, r["idx"]), want[name][0], rtol=0, atol=1e-5)
    bad = connector_file(tmp_path / "bad.safetensors", target, data[0]["input_ids"][:-1], plan)
    writer = ShardWriter(tmp_path / "bad-cache", NAMES, fp, target.config.hidden_size)
    with pytest.raises(DraftsmithError, match="other tokens than example 1's"):
        convert_captures([(0, bad)], data, plan, target.get_decoder().norm, writer)


@needs_vllm
def test_vllm_capture_equals_in_process_features(target4, tmp_path):
    """One vLLM engine (CPU: vLLM 0.32's connector with draftsmith's CPU subclass, see
    `_cpu_connector`) over two dozen examples: every example's every feature equals `target_features`
    within fp32 rounding; the throughput of both paths is printed (run with -s to see it)."""
    path, target, tok = target4
    data, fp = rows(target.config.vocab_size, n=24), fingerprint(target)
    stats, writer = {}, ShardWriter(tmp_path / "vllm-cache", NAMES, fp, target.config.hidden_size)
    extra = ("--kv-cache-memory-bytes", str(256 * 1024**2))  # passed through: overrides the CPU default
    # 4 in flight: the engine waits for files to be read back (and deleted) before taking more requests.
    capture_features(str(path), target, data, NAMES, writer, extra=extra, stats=stats, max_in_flight=4)
    out = writer.finish(len(data))
    cache = FeatureCache(out, NAMES, fp)
    assert cache.index["captured_by"]["vllm_layer_ids"] == [1, 2, 3, 4]
    assert sorted(cache.where) == [r["idx"] for r in data] and cache.index["dtype"] == "F32"
    assert not list(tmp_path.glob("vllm-features-*"))  # the capture's work folder (requests, files) removed
    worst = {}
    for r in data:
        want = target_features(target, {"input_ids": torch.tensor([r["input_ids"]])}, NAMES)
        for name in NAMES:
            got = cache._get(name, r["idx"])
            assert got.shape == want[name][0].shape and got.dtype == torch.float32
            worst[name] = max(worst.get(name, 0.0), (got - want[name][0]).abs().max().item())
    assert max(worst.values()) < 1e-4, worst
    # The in-process pass for comparison (hidden.3 left out: data/features.py's write_cache cannot
    # save it beside last_hidden, the same tensor in transformers).
    start = time.perf_counter()
    write_cache(target, data, NAMES[:3] + NAMES[4:], tmp_path / "hf-cache", fp, tok.pad_token_id)
    hf_s = time.perf_counter() - start
    tokens = sum(len(r["input_ids"]) for r in data)
    assert stats["tokens"] == tokens and stats["connector"] in (
        "CpuHiddenStatesConnector",
        "ExampleHiddenStatesConnector",
    )
    print(
        f"\nvLLM capture ({stats['connector']}): {tokens} tokens, engine {tokens / stats['capture_s']:.0f} tok/s "
        f"(start-up {stats['start_s']:.1f} s, whole call {stats['wall_s']:.1f} s); in-process write_cache "
        f"{tokens / hf_s:.0f} tok/s; max |diff| {worst}"
    )


@needs_vllm
@pytest.mark.vllm_families  # (an import of vLLM, 16 s: the extended vLLM run)
def test_stock_connector_calls_refused_on_cpu(tmp_path):
    """vLLM 0.32's own connector code, without an engine (tests/data/vllm_features_run.py): on its CPU
    backend the stock write refuses pinned memory and its completion poll calls `query()` on an event
    placeholder that lacks it; draftsmith's CPU subclass writes the stock file through the stock code."""
    result = subprocess.run(
        [vllm_server.find_python(), str(ROOT / "tests" / "data" / "vllm_features_run.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    if not report["cpu"]:
        pytest.skip("vLLM runs on an accelerator here: the stock connector is used")
    # When these stop failing, vLLM runs the stock connector on CPU: drop `_cpu_connector`.
    assert report["stock_write"].startswith("RuntimeError: pin_memory=True"), report
    assert "example_hidden_states_connector.py:" in report["stock_write_at"]
    assert report["stock_poll"].startswith("AttributeError:") and "query" in report["stock_poll"], report
    assert report["subclass_file"] == {"keys": ["hidden_states", "token_ids"], "equal": True}, report


def test_the_features_engine_keys_are_checked_in_one_line():
    from draftsmith import DraftsmithError
    from draftsmith.train.config import load_config

    assert load_config(None, ["data.features_engine=vllm"]).data.features_engine == "vllm"
    with pytest.raises(DraftsmithError, match="data.features_engine: expected hf or vllm, got 'sglang'"):
        load_config(None, ["data.features_engine=sglang"])
    with pytest.raises(DraftsmithError, match="data.features_vllm_args: these go to vLLM; set data.features_engine"):
        load_config(None, ['data.features_vllm_args=["--tensor-parallel-size", "8"]'])
