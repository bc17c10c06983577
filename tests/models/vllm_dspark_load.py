"""Runs in the vLLM environment (.venv-vllm), never imported by draftsmith or its tests:

    .venv-vllm/bin/python tests/models/vllm_dspark_load.py EXPORT_DIR TARGET_DIR

feeds a draftsmith DSpark export through vLLM 0.32's own code: its speculators config parser
(`SpeculatorsConfig.from_pretrained`, i.e. `update_dspark`), the module it builds
(`Qwen3DSparkForCausalLM`, with `Qwen3DSparkModel` inside) and that module's `load_weights`. vLLM's
CPU build refuses to *serve* dspark (`VllmConfig._validate_v1_model_runner`: "Model Runner V1 does
not support: dspark speculative decoding"), so the speculative config is given to the module as a
plain namespace (what `Qwen3DSparkForCausalLM.__init__` reads of it) instead of through that check;
the target's ModelConfig, the distributed groups (1 process, gloo) and the attention layers are
vLLM's own. Prints one JSON line: the parsed config, every checkpoint tensor and the vLLM parameter
(and row offset) its values landed in, and the vLLM parameters no checkpoint tensor filled.
"""

import json
import socket
import sys
from types import SimpleNamespace

import torch
from safetensors.torch import load_file
from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM
from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

# vLLM stacks q/k/v into qkv_proj and gate/up into gate_up_proj (qwen3_dflash.py stacked params).
STACKED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj"}
STACKED["up_proj"] = "gate_up_proj"
KEYS = ("architectures", "markov_rank", "enable_confidence_head", "confidence_head_with_markov", "mask_token_id")
KEYS += ("eagle_aux_hidden_state_layer_ids", "draft_vocab_size", "vocab_size", "sample_from_anchor")


def build(export_dir: str, target_dir: str):
    hf = SpeculatorsConfig.from_pretrained(export_dir)
    vllm_config = VllmConfig(model_config=ModelConfig(model=target_dir, dtype="float32"))
    draft = SimpleNamespace(hf_config=hf, quantization=None, model=export_dir, revision=None, dtype=torch.float32)
    k = hf.speculators_config["proposal_methods"][0]["speculative_tokens"] if hasattr(hf, "speculators_config") else 1
    spec = SimpleNamespace(
        draft_model_config=draft, num_speculative_tokens=k, method="dspark", enable_adaptive_verification=False
    )
    object.__setattr__(vllm_config, "speculative_config", spec)  # past the V1 runner's refusal (see above)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, backend="gloo")
        initialize_model_parallel(1, 1)
        return hf, vllm_config, Qwen3DSparkForCausalLM(vllm_config=vllm_config)


def landed(name: str, tensor: torch.Tensor, params: dict) -> tuple[str, int] | None:
    """The vLLM parameter and row offset holding exactly `tensor` (vocabulary rows are padded and
    q/k/v, gate/up stacked, so the checkpoint tensor is a block of rows), or None."""
    parts = name.split(".")
    dest = "model." + ".".join(STACKED.get(p, p) for p in parts)
    param = params.get(dest)
    if param is None or param.shape[1:] != tensor.shape[1:]:
        return None
    for offset in range(param.shape[0] - tensor.shape[0] + 1):
        if torch.equal(param[offset : offset + tensor.shape[0]].float(), tensor.float()):
            return dest, offset
    return None


def main(export_dir: str, target_dir: str) -> None:
    hf, vllm_config, model = build(export_dir, target_dir)
    state = load_file(f"{export_dir}/model.safetensors")
    with set_current_vllm_config(vllm_config):
        model.load_weights(iter(state.items()))  # an unknown name raises here
    params = dict(model.named_parameters())
    where = {name: landed(name, t, params) for name, t in state.items()}
    filled = {w[0] for w in where.values() if w}
    print(
        json.dumps(
            {
                "config": {k: getattr(hf, k, None) for k in KEYS},
                "loaded": sorted(n for n, w in where.items() if w),
                "not_landed": sorted(n for n, w in where.items() if not w),
                "landed": where,
                "not_from_checkpoint": sorted(set(params) - filled),
                "confidence_head": model.model.confidence_head is not None,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
