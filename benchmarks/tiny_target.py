"""A tiny target of a real architecture, built from its config and trained in seconds, with no hub.

    python -m benchmarks.tiny_target OUT [--arch Qwen/Qwen3-8B] [--layers 4] [--steps 160] [--device cuda]
    python -m benchmarks.tiny_target --families K    # the registered families' tiny runs, for gpu-check.sh

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
from draftsmith.models.registry import DRAFTERS

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]


def tiny_drafters() -> dict[str, dict]:
    """Every registered family at a size a 3-layer tiny target takes, as `recipe key: value` overrides
    (its record's `tiny`, models/family.py): the precision matrix, the export digests and the
    registry-wide tests train these."""
    return {name: {f"drafter.{k}": v for k, v in fam.tiny.items()} for name, fam in DRAFTERS.items()}


def tiny_lora() -> dict[str, dict]:
    """The families' LoRA variants (their frozen base can be bf16), as overrides on top of `tiny_drafters`."""
    return {
        name: {f"drafter.{k}": v for k, v in fam.tiny_lora.items()}
        for name, fam in DRAFTERS.items()
        if fam.tiny_lora is not None
    }


def tiny_runs() -> dict[str, dict]:
    """Run name -> its overrides, `drafter.type` included: every family, and `NAME+lora` for its LoRA variant."""
    plain, lora = tiny_drafters(), tiny_lora()
    return {
        **{name: {"drafter.type": name, **extra} for name, extra in plain.items()},
        **{f"{name}+lora": {"drafter.type": name, **plain[name], **extra} for name, extra in lora.items()},
    }


TINY_DRAFTERS, TINY_LORA, TINY_RUNS = tiny_drafters(), tiny_lora(), tiny_runs()  # at import: parametrizations


def family_lines(k: int) -> list[str]:
    """One line per registered family for scripts/gpu-check.sh: its name, the format vLLM serves it
    from (else its first), and its tiny run's overrides, `eval.k` the deepest draft up to `k` it takes."""
    lines = []
    for name, extra in tiny_drafters().items():
        fam = DRAFTERS[name]
        depth = fam.max_draft_depth(fam.DrafterConfig(**fam.tiny))
        args = {"drafter.type": name, **extra, "eval.k": k if depth is None else min(k, depth)}
        fmt = fam.SERVE_FORMAT or next(iter(fam.EXPORTS))
        lines.append(" ".join([name, fmt] + [f"{key}={_word(v)}" for key, v in args.items()]))
    return lines


def _word(value) -> str:
    """A value as one shell word the recipe parser reads back (YAML): lists without spaces."""
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


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
    p.add_argument("out", nargs="?")
    p.add_argument("--arch", default="Qwen/Qwen3-8B", help="a config models/known.py ships (no download)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=160)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--families",
        type=int,
        metavar="K",
        help="print each registered family's name, served format and tiny run (eval.k at most K); build nothing",
    )
    args = p.parse_args(argv)
    if args.families is not None:
        print("\n".join(family_lines(args.families)))
        return
    if args.out is None:
        p.error("OUT is required (or --families K)")
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
