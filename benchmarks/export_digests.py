"""Export digests: a refactor must not change a byte of any export. Trains every family (and the LoRA
variants) 3 steps in fp32 on a tiny plain target, exports every format each family writes, and prints
one line per file: family, format, file, sha256 (16 hex digits). Run it before and after a change,
in the same folder, on the same machine, and diff the two outputs:

    python -m benchmarks.export_digests /tmp/digests --out before.txt   # on the old commit
    python -m benchmarks.export_digests /tmp/digests --out after.txt    # on the new one
    diff before.txt after.txt

(Paths are written into exports' configs, so both runs use the same folder.)"""

import argparse
import hashlib
import os
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from benchmarks.tiny_target import TINY_RUNS, make_tokenizer, plain_config, write_pattern_chats
from draftsmith.cli import main as cli
from draftsmith.models.registry import DRAFTERS
from draftsmith.train.config import load_config
from draftsmith.train.loop import train
from draftsmith.util.precision import CPU_BF16_ENV

# Each registered family at the tiny target's size; `+lora`: the variant whose backbone trains with LoRA.
RUNS = TINY_RUNS


def digests(root: Path) -> list[str]:
    os.environ[CPU_BF16_ENV] = "0"  # fp32 on every CPU: the digests compare code, not kernels
    torch.set_num_threads(1)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    tok = make_tokenizer()
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(plain_config(len(tok), 3)).save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    data = write_pattern_chats(root / "chats.jsonl", range(8))
    lines = []
    for run, extra in RUNS.items():
        family = run.split("+")[0]
        overrides = {
            "target": root / "target",
            "output_dir": root,
            "run": run,
            "data.train": data,
            "data.holdout": data,
            "data.max_length": 64,
            "optim.batch_size": 4,
            "optim.max_steps": 3,
            "optim.warmup_steps": 1,
            "optim.mixed_precision": "no",
            "target_dtype": "float32",
            "eval.enabled": False,
            "drafter.type": family,
            **extra,
        }
        final = train(load_config(None, [f"{k}={v}" for k, v in overrides.items()])) / "final"
        for fmt in DRAFTERS[family].EXPORTS:
            out = root / "exports" / run / fmt
            cli(["export", str(final), "--format", fmt, "--out", str(out)])
            for f in sorted(p for p in out.rglob("*") if p.is_file()):
                lines.append(f"{run} {fmt} {f.relative_to(out)} {hashlib.sha256(f.read_bytes()).hexdigest()[:16]}")
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", help="work folder (emptied first; use the same one before and after)")
    p.add_argument("--out", help="also write the lines to this file")
    args = p.parse_args(argv)
    lines = digests(Path(args.folder))
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
