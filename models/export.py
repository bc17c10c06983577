"""Export drafters in the formats serving engines load (anchors.md, section 4), and read them back.

| family | format        | loaded by                                                   |
|--------|---------------|-------------------------------------------------------------|
| eagle  | `vllm`/`sglang` | vLLM `EagleLlamaForCausalLM`, SGLang `LlamaForCausalLMEagle` |
| eagle3 | `sglang`      | official EAGLE-3 / SGLang / vLLM `LlamaForCausalLMEagle3`    |
| eagle3 | `speculators` | vLLM speculators `Eagle3Speculator`                         |
| medusa | `vllm`        | vLLM `MedusaModel` (Medusa-2: + `backbone/`, the new target) |
| distill | `hf`         | a plain causal LM: vLLM/SGLang draft model, transformers `assistant_model` |

Every export is written to a temp folder and renamed; `import_export` maps it back to a draftsmith
drafter so tests can check that the exported head decodes exactly like the trained one.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from draftsmith import DraftsmithError
from draftsmith.models.target import served_name

FORMATS = {"eagle": ("vllm", "sglang"), "eagle3": ("sglang", "vllm", "speculators"), "medusa": ("vllm",),
           "distill": ("hf",)}


def _llama_dims(drafter) -> dict:
    """The one-layer Llama config of a feature-space head, with the target's RoPE: its theta and its
    scaling (Llama-3.1's `llama3`, YaRN, linear, ...), which the drafter trained with and the engine
    must rebuild. Written in both spellings: `rope_theta` + `rope_scaling` (SGLang, transformers 4)
    and `rope_parameters` (transformers 5, which vLLM 0.32 reads)."""
    c = drafter.config
    rope = dict(c.rope_parameters)
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    return {"model_type": "llama", "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "hidden_act": "silu",
            "max_position_embeddings": c.max_position_embeddings, "rope_theta": rope.get("rope_theta"),
            "rope_scaling": None if scaling.get("rope_type", "default") == "default" else scaling,
            "rope_parameters": rope, "num_hidden_layers": 1, "vocab_size": c.vocab_size}


def exported_layer_config(config: dict):
    """The drafter layer config an engine rebuilds from an exported config.json alone (None for
    exports without one: Medusa heads, plain causal LMs): what `import_export` builds the head with,
    so `export --verify` catches a config that does not say what the weights were trained with."""
    from transformers import LlamaConfig

    dims = config.get("transformer_layer_config", config)  # speculators nests the layer's config
    if dims.get("model_type") != "llama" or "hidden_size" not in dims:
        return None
    # transformers 5 reads rope_theta + rope_scaling into rope_parameters, as the engines do
    keys = {k: v for k, v in dims.items() if k not in ("model_type", "rope_parameters", "architectures")}
    layer = LlamaConfig(**keys)
    layer._attn_implementation = "sdpa"
    return layer


def _eagle1(drafter, meta: dict) -> tuple[dict, dict]:
    state = {k.replace("layer.", "layers.0.", 1): v for k, v in drafter.state_dict().items()}
    # SGLang's EAGLE fc has a bias; vLLM's does not (and skips fc.bias). A zero bias serves both.
    state["fc.bias"] = torch.zeros(drafter.config.hidden_size)
    config = {"architectures": ["LlamaForCausalLM"], **_llama_dims(drafter), "bias": False,
              "tie_word_embeddings": False}
    return config, state


def _eagle3_sglang(drafter, meta: dict) -> tuple[dict, dict]:
    state = {k: v for k, v in drafter.state_dict().items()}
    ids = list(meta["aux_layers"])
    config = {"architectures": ["LlamaForCausalLMEagle3"], **_llama_dims(drafter),
              "draft_vocab_size": drafter.lm_head.out_features, "tie_word_embeddings": False,
              "target_hidden_size": drafter.config.hidden_size,
              # SGLang reads the nested ids (layer outputs) and adds 1; vLLM reads top-level ids as
              # layer *inputs* with no +1. Top-level = nested + 1 makes both tap the same layers.
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
              "eagle_aux_hidden_state_layer_ids": [i + 1 for i in ids]}
    return config, state


def _eagle3_speculators(drafter, meta: dict, target) -> tuple[dict, dict]:
    state = {k.replace("midlayer.", "layers.0.", 1): v for k, v in drafter.state_dict().items()}
    # vLLM keeps a drafter's own embed_tokens when it differs from the target's, so ship the
    # target's own (never random) embeddings.
    state["embed_tokens.weight"] = target.get_input_embeddings().weight.detach()
    dims = _llama_dims(drafter)
    config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
              "draft_vocab_size": drafter.lm_head.out_features, "norm_before_residual": False,
              "target_hidden_size": drafter.config.hidden_size,
              "eagle_aux_hidden_state_layer_ids": [i + 1 for i in meta["aux_layers"]],
              "speculators_config": {
                  "algorithm": "eagle3", "default_proposal_method": "greedy",
                  "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": meta.get("k", 5),
                                        "accept_tolerance": 0.0, "verifier_accept_k": 1}],
                  # A name vLLM and speculators resolve, never draftsmith's own alias.
                  "verifier": {"name_or_path": served_name(meta["target"]), "architectures": list(target.config.architectures or [])}},
              "transformer_layer_config": dims}
    return config, state


def _medusa_vllm(heads, meta: dict) -> tuple[dict, dict]:
    """vLLM `MedusaModel`: blocks.{h}.layers.{l}.weight (+ .bias only with medusa_fc_bias: vLLM builds
    the ResBlock linears without bias otherwise) and lm_heads.{h}.weight, or one lm_head.weight
    (the target's) with original_lm_head."""
    state = {k.replace(".linear.", "."): v for k, v in heads.state_dict().items()}
    shared, vocab = heads.shared_lm_head is not None, meta["target_vocab_size"]
    reduced = hasattr(heads, "token_map")
    if reduced and not shared:
        # vLLM 0.32 MedusaModel builds each head's own lm_head over the full vocabulary and asserts
        # that the checkpoint's rows fill it (ParallelLMHead.weight_loader), so per-head draft-vocabulary
        # heads have no encoding it loads; only one shared lm_head is built at truncated_vocab_size.
        raise DraftsmithError(f"--format vllm: vLLM's MedusaModel serves a reduced head vocabulary only through one "
                              f"shared lm_head; these {len(heads.lm_heads)} heads each have their own "
                              f"{heads.lm_heads[0].out_features}-row lm_head. Train with drafter.original_lm_head=true "
                              f"(the target's rows of the draft vocabulary) or drafter.draft_vocab_size=0")
    if shared:  # vLLM gives every head this one lm_head (with token_map: its rows of the draft vocabulary)
        state["lm_head.weight"] = heads.shared_rows() if reduced else heads.shared_lm_head.weight.detach()
    hidden = heads.blocks[0].layers[0].linear.in_features
    # A reduced head vocabulary: vLLM scatters the heads' logits through `token_map` (-inf elsewhere).
    truncated = len(heads.token_map) if reduced else None
    config = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": hidden,
              "vocab_size": vocab, "num_heads": len(heads.blocks), "num_hidden_layers": len(heads.blocks[0].layers),
              "medusa_fc_bias": heads.blocks[0].layers[0].linear.bias is not None,
              "truncated_vocab_size": truncated, "original_lm_head": shared}
    return config, state


def export(drafter_dir: str | Path, target, fmt: str, out: str | Path, tok=None) -> Path:
    """Write `out/` in format `fmt`. A Medusa-2 drafter also writes `out/backbone/`: the trained
    backbone with its adapters merged, a plain transformers folder with the target's tokenizer (`tok`),
    which serves as the new target (vLLM `--model out/backbone`, `speculative_config.model: out`)."""
    from draftsmith.models.registry import load_drafter

    module, cfg, drafter = load_drafter(drafter_dir, target)  # checks the target fingerprint
    allowed = FORMATS.get(module.NAME, ())
    if fmt not in allowed:
        raise DraftsmithError(f"--format {fmt}: a {module.NAME} drafter exports to {', '.join(allowed) or 'nothing yet'}")
    meta = json.loads((Path(drafter_dir) / "config.json").read_text())
    info = {"drafter": module.NAME, "format": fmt, "target": meta["target"],
            "target_fingerprint": meta["target_fingerprint"], "drafter_config": meta["drafter_config"]}
    if module.NAME == "distill":
        return _write_hf(module.plain(drafter), tok, info, Path(out))
    if module.NAME == "eagle":
        config, state = _eagle1(drafter, meta)
    elif module.NAME == "medusa":
        config, state = _medusa_vllm(getattr(drafter, "heads", drafter), {**meta, "target_vocab_size": target.config.vocab_size})
    else:
        meta = {**meta, "aux_layers": list(module.aux_layers(cfg, target.config))}
        config, state = (_eagle3_speculators(drafter, meta, target) if fmt == "speculators"
                         else _eagle3_sglang(drafter, meta))
    config["draftsmith"] = info
    backbone = module.verifier(drafter, target)
    if backbone is not target:
        if tok is None:
            raise DraftsmithError(f"{drafter_dir}: exporting a trained backbone needs the target's tokenizer")
        config["draftsmith"]["backbone"] = "backbone"  # the new target, relative to this folder
    return _write(config, state, Path(out), None if backbone is target else (backbone, tok))


def _write(config: dict, state: dict, out: Path, backbone=None) -> Path:
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if backbone is not None:
        model, tok = backbone
        model.save_pretrained(tmp / "backbone")
        tok.save_pretrained(tmp / "backbone")
    # Weights keep the dtype they were trained and evaluated in; engines cast on load.
    tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.replace(out)
    return out


def _write_hf(student, tok, info: dict, out: Path) -> Path:
    """A plain transformers folder (weights, config, generation config, the target's tokenizer);
    `draftsmith` in config.json records where it came from (transformers keeps unknown keys)."""
    if tok is None:
        raise DraftsmithError("--format hf: the export needs the target's tokenizer")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    student.config.draftsmith = info
    student.save_pretrained(tmp)
    del student.config.draftsmith
    tok.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.replace(out)
    return out


# Exported architectures -> the family whose weights they hold (folders without draftsmith's section:
# heads published for a target by others, in the formats the engines load).
ARCHITECTURES = {"LlamaForCausalLMEagle3": "eagle3", "Eagle3Speculator": "eagle3", "MedusaModel": "medusa",
                 "EagleLlamaForCausalLM": "eagle", "LlamaForCausalLMEagle": "eagle"}


def export_family(path: str | Path) -> str:
    """Which drafter family an exported folder holds: its `draftsmith` section, else its architecture
    (a one-layer Llama with an `fc` is an EAGLE-1 head; any other causal LM a distilled student)."""
    path = Path(path)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DraftsmithError(f"{path}/config.json: cannot read an exported drafter's config ({e})") from None
    if "draftsmith" in config:
        return config["draftsmith"]["drafter"]
    arch = (config.get("architectures") or ["?"])[0]
    if arch in ARCHITECTURES:
        return ARCHITECTURES[arch]
    if arch.endswith("ForCausalLM"):
        names = load_file(path / "model.safetensors").keys() if (path / "model.safetensors").is_file() else ()
        return "eagle" if "fc.weight" in names else "distill"
    raise DraftsmithError(f"{path}/config.json: unknown export format (architectures {config.get('architectures')}); "
                          f"expected one of {', '.join(ARCHITECTURES)} or a causal LM")


def read_export(path: str | Path, family: str, target) -> dict[str, torch.Tensor]:
    """An exported folder's weights under draftsmith's own tensor names for `family`."""
    path = Path(path)
    if family == "distill":  # a plain causal LM folder: transformers reads it (sharded or not)
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(path, dtype=next(target.parameters()).dtype).state_dict()
    try:
        state = load_file(path / "model.safetensors")
    except Exception as e:  # a missing or truncated file
        raise DraftsmithError(f"{path}/model.safetensors: cannot read weights ({e})") from None
    if family == "medusa":
        state.pop("lm_head.weight", None)  # original_lm_head: the target's own, not a head weight
        # blocks.h.layers.l.weight -> the ResBlock's .linear
        return {(k.rsplit(".", 1)[0] + ".linear." + k.rsplit(".", 1)[1]) if k.startswith("blocks.") else k: v
                for k, v in state.items()}
    state.pop("embed_tokens.weight", None)  # EAGLE heads use the target's embeddings
    if family == "eagle":
        state.pop("fc.bias", None)  # the zero bias written for SGLang
    old, new = ("layers.0.", "layer.") if family == "eagle" else ("layers.0.", "midlayer.")
    return {(new + k[len(old):]) if k.startswith(old) else k: v for k, v in state.items()}


def import_export(path: str | Path, target):
    """An exported folder -> (module, drafter config, drafter) in draftsmith's own layout."""
    from draftsmith.models.registry import drafter_module
    from draftsmith.train.parse import from_dict

    config = json.loads((Path(path) / "config.json").read_text())
    info = config.get("draftsmith")
    if not info:
        raise DraftsmithError(f"{path}/config.json: not exported by draftsmith (no 'draftsmith' section)")
    module = drafter_module(info["drafter"])
    cfg = from_dict(module.DrafterConfig, {k: v for k, v in info["drafter_config"].items() if k != "type"}, str(path))
    param = next(target.parameters())
    if info["drafter"] == "distill":  # a plain causal LM folder
        from transformers import AutoModelForCausalLM

        return module, cfg, AutoModelForCausalLM.from_pretrained(path, dtype=param.dtype).to(param.device).eval()
    if info["drafter"] == "medusa":  # exported heads are plain Medusa heads; a Medusa-2 backbone is `backbone/`
        cfg.backbone = "frozen"
    drafter = module.build(cfg, target)
    layer = exported_layer_config(config)
    if layer is not None:
        _rebuild_from(drafter, layer)
    drafter.load_state_dict(read_export(path, info["drafter"], target), strict=True)
    return module, cfg, drafter.to(param.device, param.dtype).eval()


def _rebuild_from(drafter, layer) -> None:
    """Give a head built from the target's config what the exported config says instead, for every
    part not fixed by weight shapes (load_state_dict checks those): rotary embeddings (RoPE type,
    theta, scaling) and norm epsilons."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

    for name, child in list(drafter.named_modules()):
        if isinstance(child, LlamaRotaryEmbedding):
            parent = drafter.get_submodule(name.rpartition(".")[0]) if "." in name else drafter
            setattr(parent, name.rpartition(".")[2], LlamaRotaryEmbedding(layer).to(child.inv_freq.device))
        elif isinstance(child, LlamaRMSNorm):
            child.variance_epsilon = layer.rms_norm_eps
    drafter.config = layer


def read_config(path: str | Path) -> dict:
    """The config.json of a drafter folder (`init_from`): a draftsmith final/ or any export."""
    try:
        return json.loads((Path(path) / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DraftsmithError(f"init_from {path}: not a drafter folder (cannot read config.json: {e})") from None


def init_weights(drafter, family: str, path: str | Path, target, allow_stale: bool = False) -> None:
    """`init_from`: load a draftsmith drafter folder (final/) or any exported format into the freshly
    built `drafter` of `family`, before training (domain fine-tuning). Imported buffers come along,
    so an EAGLE-3 head keeps its draft vocabulary (d2t/t2d). Another family, another target or
    other shapes fail with the tensor and both shapes named; another target is allowed with
    `allow_stale` (a refresh after the target was updated)."""
    from draftsmith.models.common import check_fingerprint, load_state, read_drafter_meta
    from draftsmith.models.target import fingerprint

    path = Path(path)
    if not (path / "config.json").is_file():
        raise DraftsmithError(f"init_from {path}: not a drafter folder (no config.json)")
    native = "draftsmith_format" in json.loads((path / "config.json").read_text())  # a final/ folder
    if native:
        meta = read_drafter_meta(path)
        if not allow_stale:
            check_fingerprint(meta, fingerprint(target), f"init_from {path}")
    found = meta["drafter"] if native else export_family(path)
    if found != family:
        raise DraftsmithError(f"init_from {path}: holds a {found} drafter, but this recipe trains {family}")
    state = load_state(path) if native else read_export(path, family, target)
    # A Medusa-2 run may start from Medusa-1 heads (the two stages as two runs).
    dest = drafter.heads if hasattr(drafter, "heads") and not any(k.startswith("heads.") for k in state) else drafter
    own = dest.state_dict()
    for name, tensor in state.items():
        if name not in own:
            raise DraftsmithError(f"init_from {path}: tensor '{name}' has no place in a {family} drafter built from "
                                  f"this recipe (e.g. {next(iter(own))})")
        if own[name].shape != tensor.shape:
            raise DraftsmithError(f"init_from {path}: tensor '{name}' is {tuple(tensor.shape)} there but "
                                  f"{tuple(own[name].shape)} in this recipe's drafter; match the drafter keys of the init")
    loaded = {own[k].data_ptr() for k in state}
    missing = [k for k in own if own[k].data_ptr() not in loaded and "lora_" not in k]
    if missing:
        raise DraftsmithError(f"init_from {path}: no weights for {missing[:3]} of this recipe's {family} drafter")
    dest.load_state_dict(state, strict=False)
