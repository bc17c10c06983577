"""Building blocks for the families' export formats: tensors and config written together, the
target's layer config and RoPE carried into a head, vLLM's speculative config and snippet."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from draftsmith.util.precision import keep_rope_fp32


def vllm_method(method: str):
    """`vllm_serving` of a family vLLM serves as speculative `method` with a chain of k drafts and no
    extra server flags: -> (--speculative-config, flags)."""

    def vllm_serving(export_dir, export_config: dict, k: int) -> tuple[dict, list[str]]:
        return {"method": method, "model": str(export_dir), "num_speculative_tokens": k}, []

    return vllm_serving


def write_tensors(out: Path, config: dict, state: dict) -> None:
    """An export folder's files: `model.safetensors` (the dtype the weights were trained and evaluated
    in; engines cast on load) and `config.json`."""
    tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    save_file(tensors, Path(out) / "model.safetensors", metadata={"format": "pt"})
    (Path(out) / "config.json").write_text(json.dumps(config, indent=2))


def llama_dims(drafter) -> dict:
    """The one-layer Llama config of a feature-space head, with the target's RoPE: its theta and its
    scaling (Llama-3.1's `llama3`, YaRN, linear, ...), which the drafter trained with and the engine
    must rebuild. Written in both spellings: `rope_theta` + `rope_scaling` (SGLang, transformers 4)
    and `rope_parameters` (transformers 5, which vLLM 0.32 reads)."""
    c = drafter.config
    rope = dict(c.rope_parameters)
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    return {
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "hidden_act": "silu",
        "max_position_embeddings": c.max_position_embeddings,
        "rope_theta": rope.get("rope_theta"),
        "rope_scaling": None if scaling.get("rope_type", "default") == "default" else scaling,
        "rope_parameters": rope,
        "num_hidden_layers": 1,
        "vocab_size": c.vocab_size,
    }


def exported_layer_config(config: dict):
    """The head's layer config an engine rebuilds from an exported config.json alone (speculators
    nests it): what `from_exported_head` builds with, so `export --verify` catches a config that does
    not say what the weights were trained with."""
    from transformers import LlamaConfig

    dims = config.get("transformer_layer_config", config)
    # transformers 5 reads rope_theta + rope_scaling into rope_parameters, as the engines do
    keys = {k: v for k, v in dims.items() if k not in ("model_type", "rope_parameters", "architectures")}
    layer = LlamaConfig(**keys)
    layer._attn_implementation = "sdpa"
    return layer


def from_exported_head(drafter, config: dict, state: dict):
    """A freshly built feature-space head given what the exported config says for every part not
    fixed by weight shapes (load_state_dict checks those): rotary embeddings (RoPE type, theta,
    scaling) and norm epsilons; then the exported weights."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

    layer = exported_layer_config(config)
    for name, child in list(drafter.named_modules()):
        if isinstance(child, LlamaRotaryEmbedding):
            parent, _, attr = name.rpartition(".")
            rope = keep_rope_fp32(LlamaRotaryEmbedding(layer))
            setattr(drafter.get_submodule(parent) if parent else drafter, attr, rope)
        elif isinstance(child, LlamaRMSNorm):
            child.variance_epsilon = layer.rms_norm_eps
    drafter.config = layer
    drafter.load_state_dict(state, strict=True)
    return drafter


def renamed(state: dict, old: str, new: str) -> dict:
    """Tensor names with prefix `old` under prefix `new` (the engines' names <-> draftsmith's)."""
    return {(new + k[len(old) :]) if k.startswith(old) else k: v for k, v in state.items()}


def vllm_snippet(method: str, repo_id: str, target: str, k: int) -> str:
    return (
        f"```bash\nvllm serve {target} --speculative-config \\\n"
        f'  \'{{"method": "{method}", "model": "{repo_id}", "num_speculative_tokens": {k}}}\'\n```'
    )


def logit_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """max |x - y| where equal entries count 0: a reduced draft vocabulary puts -inf on the tokens it
    cannot draft (EAGLE-3), and -inf - -inf would be nan."""
    return torch.where(x == y, 0.0, (x - y).abs()).max().item()
