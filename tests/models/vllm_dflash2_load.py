"""Runs in the vLLM environment (.venv-vllm), never imported by draftsmith or its tests:

    .venv-vllm/bin/python tests/models/vllm_dflash2_load.py EXPORT_DIR TARGET_DIR

feeds a draftsmith DFlash2 export through vLLM 0.32's own code: its speculators config parser
(`SpeculatorsConfig.from_pretrained`, i.e. `update_dflash2`, and `build_vllm_speculative_config`,
which maps `dflash2` to method `dflash`), the module it builds (`DFlash2Qwen3ForCausalLM`, with
`DFlash2Qwen3Model`, its convolutions and its `CandidateSelector`) and that module's `load_weights`.
Set up past vLLM's CPU refusal to serve DFlash2 as tests/models/vllm_loading.py says (the module reads
the draft's hf config and num_speculative_tokens, which sets the convolution's block of 1 + K rows).
Prints one JSON line: the parsed config, the method, every checkpoint tensor and the vLLM parameter
(and row offset) its values landed in, every vLLM parameter's shape, the parameters no checkpoint
tensor filled, and vLLM's own CPU (torch) convolution and selector scores on fixed inputs (`parity`).
"""

import json
import sys

import torch
from vllm.config import set_current_vllm_config
from vllm.model_executor.model_loader.utils import process_weights_after_loading
from vllm.model_executor.models.qwen3_dflash2 import DFlash2Qwen3ForCausalLM, _score_edges
from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig
from vllm_loading import build, load  # this folder (the script's own, first on sys.path)

KEYS = ("architectures", "dflash_config", "eagle_aux_hidden_state_layer_ids", "draft_vocab_size", "vocab_size")


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
    config = json.loads(open(f"{export_dir}/config.json").read())
    method = SpeculatorsConfig.build_vllm_speculative_config(config)  # dflash2 -> method dflash
    hf, vllm_config, model = build(
        export_dir, target_dir, DFlash2Qwen3ForCausalLM, method["method"], method["num_speculative_tokens"]
    )
    report = {"config": {key: getattr(hf, key, None) for key in KEYS}, "method": method["method"]}
    report.update(load(model, vllm_config, export_dir))
    report["conv_block"] = model.model.layers[0].attention_conv.block_size
    report["shapes"] = {n: list(p.shape) for n, p in model.named_parameters()}
    with set_current_vllm_config(vllm_config):
        # The loader's last step before drafting (it sets up the CPU GEMMs of the linear layers).
        process_weights_after_loading(model, vllm_config.model_config, torch.device("cpu"))
        report["parity"] = parity(model, hf)
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
