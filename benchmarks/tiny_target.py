"""A tiny target of a real architecture, built from its config and trained in seconds, with no hub.

    python -m benchmarks.tiny_target OUT [--arch Qwen/Qwen3-8B] [--layers 4] [--steps 160] [--device cuda]

The test suite's fixtures and `scripts/gpu-check.sh` share it: a character-level tokenizer (one token
per character, ChatML turns), the architecture's config at test size (models/known.py `tiny_config`:
its RoPE, norms, biases and tying), and a short training on `pattern_chat` conversations, so its
greedy answers are varied and learnable: a drafter of it has real acceptance, where a random target
repeats one token and any drafter is accepted. OUT also gets `train.jsonl` and `holdout.jsonl`.
"""

from __future__ import annotations

import argparse
import json
import string
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

from draftsmith.models.known import tiny_config

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]


# Every family at a size a 3-layer tiny target takes (`recipe key: value` overrides), and the LoRA
# variants (their frozen base can be bf16): the precision matrix and the export digests train these.
TINY_DRAFTERS = {
    "eagle": {},
    "eagle3": {"drafter.aux_layers": [0, 1, 2], "drafter.draft_vocab_size": 60},
    "peagle": {"drafter.aux_layers": [0, 1, 2], "drafter.draft_vocab_size": 60, "drafter.depths": 3},
    "dflash": {"drafter.aux_layers": [0, 1], "drafter.block_size": 4},
    "dspark": {"drafter.aux_layers": [0, 1], "drafter.block_size": 4, "drafter.markov_rank": 8},
    "dflash2": {
        "drafter.aux_layers": [0, 1],
        "drafter.block_size": 4,
        "drafter.selector_rank": 8,
        "drafter.selector_top_k": 4,
    },
    "medusa": {"drafter.num_heads": 2},
    "distill": {"drafter.num_layers": 1},
}
TINY_LORA = {
    "medusa": {"drafter.backbone": "lora", "drafter.lora_rank": 4, "drafter.backbone_lr": 1e-3},
    "distill": {"drafter.lora_rank": 4},
}


def make_tokenizer(chat_template: str | None = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    chars = sorted(set(string.printable))
    vocab = {tok: i for i, tok in enumerate(SPECIALS + chars)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Split(
        Regex(r"[\s\S]"), behavior="isolated"
    )  # one token per character, newlines too
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=SPECIALS[3:],
    )
    tok.chat_template = chat_template
    return tok


def pattern_chat(i: int) -> list[dict]:
    """A chat whose answer is an alphabet walk: start from the prompt's letters, stride 1..5."""
    start, stride = i % 26, 1 + i % 5
    walk = "".join(string.ascii_lowercase[(start + stride * j) % 26] for j in range(24))
    return [{"role": "user", "content": walk[:3]}, {"role": "assistant", "content": walk}]


def write_pattern_chats(path, ids) -> str:
    Path(path).write_text("".join(json.dumps({"messages": pattern_chat(i)}) + "\n" for i in ids))
    return str(path)


def plain_config(vocab: int, layers: int):
    """A tied Llama of head dim 32 (the smallest vLLM's CPU attention takes)."""
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=True,
    )


def train_pattern_target(path, config, tok, steps: int = 160, device: str = "cpu"):
    """Train a model of `config` on `pattern_chat` for `steps` AdamW steps (batch 16) and save it with
    `tok`. Its chat turns end in <|im_end|>, which generation stops at."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(device)
    seqs = torch.tensor(
        [tok.apply_chat_template(pattern_chat(i), tokenize=True, return_dict=False) for i in range(130)], device=device
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(steps):
        x = seqs[torch.arange(step * 16, step * 16 + 16, device=device) % len(seqs)]
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    model.generation_config.eos_token_id = [2, tok.convert_tokens_to_ids("<|im_end|>")]
    model.cpu().eval().save_pretrained(path)
    tok.save_pretrained(path)
    return path


def main(argv=None) -> None:

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--arch", default="Qwen/Qwen3-8B", help="a config models/known.py ships (no download)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=160)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    tok = make_tokenizer()
    out = Path(args.out)
    train_pattern_target(
        out,
        tiny_config(args.arch, len(tok), layers=args.layers, tie_word_embeddings=True),
        tok,
        args.steps,
        args.device,
    )
    write_pattern_chats(out / "train.jsonl", range(0, 120))
    write_pattern_chats(out / "holdout.jsonl", range(200, 212))  # prompts the target was not trained on
    print(f"wrote {out}: {args.arch} at {args.layers} layers, trained {args.steps} steps on {args.device}")


if __name__ == "__main__":
    main()
