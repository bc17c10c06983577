"""What the vLLM-side loader checks of the block families share (run in vLLM's environment, imported
by tests/models/vllm_dspark_load.py and vllm_dflash2_load.py from their own folder).

vLLM's CPU build refuses to *serve* DSpark and DFlash2 drafts (`VllmConfig._validate_v1_model_runner`),
so `build` hands the draft module its speculative config as a plain namespace (what the modules read
of it) instead of through that check; the target's ModelConfig, the distributed groups (1 process,
gloo) and the attention layers are vLLM's own."""

import socket
from types import SimpleNamespace

import torch
from safetensors.torch import load_file
from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

# vLLM stacks q/k/v into qkv_proj and gate/up into gate_up_proj (qwen3_dflash.py stacked params).
STACKED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj"}
STACKED["up_proj"] = "gate_up_proj"


def build(export_dir: str, target_dir: str, module_cls, method: str, k: int):
    """(the parsed speculators config, the VllmConfig, vLLM's draft module `module_cls` for the export)."""
    hf = SpeculatorsConfig.from_pretrained(export_dir)
    vllm_config = VllmConfig(model_config=ModelConfig(model=target_dir, dtype="float32"))
    draft = SimpleNamespace(hf_config=hf, quantization=None, model=export_dir, revision=None, dtype=torch.float32)
    spec = SimpleNamespace(draft_model_config=draft, num_speculative_tokens=k, method=method)
    spec.enable_adaptive_verification = False
    object.__setattr__(vllm_config, "speculative_config", spec)  # past the V1 runner's refusal (see above)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, backend="gloo")
        initialize_model_parallel(1, 1)
        return hf, vllm_config, module_cls(vllm_config=vllm_config)


def landed(name: str, tensor: torch.Tensor, params: dict) -> tuple[str, int] | None:
    """The vLLM parameter and row offset holding exactly `tensor` (vocabulary rows are padded and
    q/k/v, gate/up stacked, so the checkpoint tensor is a block of rows), or None."""
    # The names the modules' load_weights give (qwen3_dflash.py, qwen3_dspark.py): a reduced vocabulary's
    # d2t and lm_head sit beside the model, everything else inside it.
    if name in ("d2t", "lm_head.weight"):
        dest = {"d2t": "draft_id_to_target_id"}.get(name, name)
    else:
        dest = "model." + ".".join(STACKED.get(p, p) for p in name.split("."))
    param = params.get(dest)
    if param is None or param.shape[1:] != tensor.shape[1:]:
        return None
    for offset in range(param.shape[0] - tensor.shape[0] + 1):
        if torch.equal(param[offset : offset + tensor.shape[0]].float(), tensor.float()):
            return dest, offset
    return None


def load(model, vllm_config, export_dir: str) -> dict:
    """Runs the module's own `load_weights` on the export (an unknown name raises there) and reports
    where every checkpoint tensor landed and which vLLM parameters none filled."""
    state = load_file(f"{export_dir}/model.safetensors")
    with set_current_vllm_config(vllm_config):
        model.load_weights(iter(state.items()))
    params = dict(model.named_parameters())
    where = {name: landed(name, t, params) for name, t in state.items()}
    filled = {w[0] for w in where.values() if w}
    return {
        "loaded": sorted(n for n, w in where.items() if w),
        "not_landed": sorted(n for n, w in where.items() if not w),
        "landed": where,
        "not_from_checkpoint": sorted(set(params) - filled),
    }
