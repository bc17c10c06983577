"""Runs in the vLLM environment (.venv-vllm), never imported by draftsmith or its tests:

    .venv-vllm/bin/python tests/models/vllm_dflash2_load.py EXPORT_DIR TARGET_DIR

feeds a draftsmith DFlash2 export through vLLM 0.32's own code: its speculators config parser
(`SpeculatorsConfig.from_pretrained`, i.e. `update_dflash2`, and `build_vllm_speculative_config`,
which maps `dflash2` to method `dflash`), the module it builds (`DFlash2Qwen3ForCausalLM`, with
`DFlash2Qwen3Model`, its convolutions and its `CandidateSelector`) and that module's `load_weights`.
vLLM's CPU build refuses to *serve* DFlash2 (`VllmConfig._validate_v1_model_runner`: "Model Runner V1
does not support: DFlash candidate-head drafts"), so the speculative config is given to the module as
a plain namespace (what the module reads of it: the draft's hf config and num_speculative_tokens,
which sets the convolution's block of 1 + K rows) instead of through that check; the target's
ModelConfig, the distributed groups (1 process, gloo) and the attention layers are vLLM's own.
Prints one JSON line: the parsed config, the method, every checkpoint tensor and the vLLM parameter
(and row offset) its values landed in, every vLLM parameter's shape, the parameters no checkpoint
tensor filled, and vLLM's own CPU (torch) convolution and selector scores on fixed inputs (`parity`).
"""

import json
import socket
import sys
from types import SimpleNamespace

import torch
from safetensors.torch import load_file
from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.model_loader.utils import process_weights_after_loading
from vllm.model_executor.models.qwen3_dflash2 import DFlash2Qwen3ForCausalLM, _score_edges
from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

# vLLM stacks q/k/v into qkv_proj and gate/up into gate_up_proj (qwen3_dflash.py stacked params).
STACKED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj"}
STACKED["up_proj"] = "gate_up_proj"
KEYS = ("architectures", "dflash_config", "eagle_aux_hidden_state_layer_ids", "draft_vocab_size", "vocab_size")


def build(export_dir: str, target_dir: str):
    hf = SpeculatorsConfig.from_pretrained(export_dir)
    raw = json.loads(open(f"{export_dir}/config.json").read())
    method = SpeculatorsConfig.build_vllm_speculative_config(raw)
    vllm_config = VllmConfig(model_config=ModelConfig(model=target_dir, dtype="float32"))
    draft = SimpleNamespace(hf_config=hf, quantization=None, model=export_dir, revision=None, dtype=torch.float32)
    spec = SimpleNamespace(
        draft_model_config=draft,
        num_speculative_tokens=method["num_speculative_tokens"],
        method=method["method"],
        enable_adaptive_verification=False,
    )
    object.__setattr__(vllm_config, "speculative_config", spec)  # past the V1 runner's refusal (see above)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, backend="gloo")
        initialize_model_parallel(1, 1)
        return hf, method["method"], vllm_config, DFlash2Qwen3ForCausalLM(vllm_config=vllm_config)


def landed(name: str, tensor: torch.Tensor, params: dict) -> tuple[str, int] | None:
    """The vLLM parameter and row offset holding exactly `tensor` (q/k/v, gate/up are stacked, so
    the checkpoint tensor is a block of rows), or None."""
    dest = "model." + ".".join(STACKED.get(p, p) for p in name.split("."))
    param = params.get(dest)
    if param is None or param.shape[1:] != tensor.shape[1:]:
        return None
    for offset in range(param.shape[0] - tensor.shape[0] + 1):
        if torch.equal(param[offset : offset + tensor.shape[0]].float(), tensor.float()):
            return dest, offset
    return None


@torch.no_grad()
def parity(model, hf) -> dict:
    """vLLM's own CPU paths on fixed random inputs, for draftsmith to recompute: layer 0's attention
    convolution (`DFlashGroupedConv.prepare` / `finish`, the torch fallback `_grouped_conv` off CUDA)
    over one block of 1 + K rows, and the selector's edge scores (`_score_edges`, what the walk reads:
    E[i, a, c] = u[i, c] + <P[pred_i(a)] * W_hp h_i, S[ids[i, c]]>, pred_0 = the anchor)."""
    torch.manual_seed(0)
    conv, sel = model.model.layers[0].attention_conv, model.model.candidate_selector
    rows, h, top_k = conv.block_size, hf.hidden_size, sel.top_k
    x, y = torch.randn(rows, h), torch.randn(rows, h)
    prepared, kernel = conv.prepare(x)
    finished = conv.finish(y, kernel)
    steps = rows - 1  # K drafts per block
    ids = torch.stack([torch.randperm(hf.vocab_size)[:top_k] for _ in range(steps)])
    unary, hidden, anchor = torch.randn(steps, top_k), torch.randn(steps, h), torch.randint(hf.vocab_size, (1,))
    hp = sel.hidden_projection(hidden)
    edges = _score_edges(
        sel.predecessor_codebook, sel.successor_codebook, ids[None], unary[None], hp[None], anchor, top_k
    )[0]
    out = {"x": x, "y": y, "prepared": prepared, "finished": finished, "ids": ids, "unary": unary}
    out.update({"hidden": hidden, "anchor": anchor, "edges": edges})
    return {k: v.tolist() for k, v in out.items()}


def main(export_dir: str, target_dir: str) -> None:
    hf, method, vllm_config, model = build(export_dir, target_dir)
    state = load_file(f"{export_dir}/model.safetensors")
    with set_current_vllm_config(vllm_config):
        model.load_weights(iter(state.items()))  # an unknown name raises here
    params = dict(model.named_parameters())
    where = {name: landed(name, t, params) for name, t in state.items()}
    filled = {w[0] for w in where.values() if w}
    conv = model.model.layers[0].attention_conv
    with set_current_vllm_config(vllm_config):
        # The loader's last step before drafting (it sets up the CPU GEMMs of the linear layers).
        process_weights_after_loading(model, vllm_config.model_config, torch.device("cpu"))
        checks = parity(model, hf)
    print(
        json.dumps(
            {
                "config": {k: getattr(hf, k, None) for k in KEYS},
                "method": method,
                "conv_block": conv.block_size,
                "loaded": sorted(n for n, w in where.items() if w),
                "not_landed": sorted(n for n, w in where.items() if not w),
                "landed": where,
                "shapes": {n: list(p.shape) for n, p in params.items()},
                "not_from_checkpoint": sorted(set(params) - filled),
                "parity": checks,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
