"""Runs in the vLLM environment (.venv-vllm), never imported by draftsmith or its tests:

    .venv-vllm/bin/python tests/models/vllm_dspark_load.py EXPORT_DIR TARGET_DIR

feeds a draftsmith DSpark export through vLLM 0.32's own code: its speculators config parser
(`SpeculatorsConfig.from_pretrained`, i.e. `update_dspark`), the module it builds
(`Qwen3DSparkForCausalLM`, with `Qwen3DSparkModel` inside) and that module's `load_weights`, set up
past vLLM's CPU refusal to serve dspark as tests/models/vllm_loading.py says. Prints one JSON line: the parsed config, every checkpoint tensor and the vLLM parameter
(and row offset) its values landed in, and the vLLM parameters no checkpoint tensor filled.
"""

import json
import sys

from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM
from vllm_loading import build, load  # this folder (the script's own, first on sys.path)

KEYS = ("architectures", "markov_rank", "enable_confidence_head", "confidence_head_with_markov", "mask_token_id")
KEYS += ("eagle_aux_hidden_state_layer_ids", "draft_vocab_size", "vocab_size", "sample_from_anchor")
KEYS += ("dspark_bonus_anchor", "block_size")


def main(export_dir: str, target_dir: str) -> None:
    config = json.loads(open(f"{export_dir}/config.json").read())
    k = config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    hf, vllm_config, model = build(export_dir, target_dir, Qwen3DSparkForCausalLM, "dspark", k)
    report = {"config": {key: getattr(hf, key, None) for key in KEYS}, **load(model, vllm_config, export_dir)}
    report["confidence_head"] = model.model.confidence_head is not None
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
