"""Run by tests/train/test_fsdp.py under torchrun (2 CPU processes, gloo): the frozen target sharded by
`fsdp_shard_target` must give every family exactly what the whole target gives, and hold half."""

import json
import sys

import torch
from accelerate import Accelerator
from transformers import LlamaConfig, LlamaForCausalLM

from draftsmith.models.registry import drafter_family
from draftsmith.target.features import target_features
from draftsmith.target.load import freeze
from draftsmith.train.config import drafter_config, load_config
from draftsmith.train.distributed import _held_bytes, fsdp_shard_target

CASES = {  # family -> (overrides, tied embeddings, tokens on rank 0 / rank 1)
    # EAGLE-3 reads the target's lm_head in 4096-row chunks: rank 0 needs two calls, rank 1 one.
    "eagle3": (
        ["drafter.type=eagle3", "drafter.aux_layers=[0,1,2]", "drafter.draft_vocab_size=64", "drafter.ttt_steps=2"],
        True,
        (4200, 40),
    ),
    # EAGLE-1's loss goes through the target's lm_head: gradients must flow through the shards.
    "eagle": (["drafter.type=eagle", "drafter.feature_noise=0"], False, (64, 48)),
}


def main(out: str) -> None:
    acc = Accelerator(cpu=True)
    rank, result = acc.process_index, {}
    for family, (overrides, tied, lengths) in CASES.items():
        torch.manual_seed(0)  # the same target on every rank, as from_pretrained would load it
        target = freeze(
            LlamaForCausalLM(
                LlamaConfig(
                    vocab_size=128,
                    hidden_size=32,
                    intermediate_size=64,
                    num_hidden_layers=3,
                    num_attention_heads=4,
                    num_key_value_heads=2,
                    tie_word_embeddings=tied,
                )
            )
        )
        cfg = load_config(None, overrides)
        fam, dcfg = drafter_family(family), drafter_config(cfg)
        ids = torch.randint(0, 128, (1, lengths[rank]), generator=torch.Generator().manual_seed(rank))
        ones = torch.ones_like(ids)
        batch = {"input_ids": ids, "attention_mask": ones, "loss_mask": ones}
        drafter = fam.build(dcfg, target, {"input_ids": ids.tolist(), "loss_mask": ones.tolist()})
        names = fam.feature_names(dcfg, target.config)

        def step():
            feats = target_features(target, batch, names)
            drafter.zero_grad()
            loss, _, _ = fam.compute_loss(drafter, target, batch, feats, dcfg)
            loss.backward()
            return [*feats.values(), loss.detach()[None], *(p.grad for p in drafter.parameters() if p.grad is not None)]

        whole, full = step(), _held_bytes(target)
        fsdp_shard_target(acc, target)
        sharded = step()
        result[family] = {
            "max_diff": max((a - b).abs().max().item() for a, b in zip(whole, sharded)),
            "tensors": len(whole),
            "held": _held_bytes(target),
            "full": full,
            "loss": whole[len(names)].item(),
        }
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
