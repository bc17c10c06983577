"""Choose the compute precision from the hardware the run is on.

bf16 halves memory traffic and is the right default on CUDA GPUs that support it and on CPUs with
native bf16 (AVX512-BF16 or AMX). On an AVX2-only CPU, torch's bf16 kernels take a slow fallback
path: a 2048^3 bf16 matmul measured 58 s against 0.23 s in fp32 (../shared/models.md). So `auto`
(the default everywhere) is bf16 only where bf16 is native, fp32 otherwise, and an explicit bf16
on such a CPU still runs, after a one-line warning.

Names accepted everywhere (recipes, `key=value`, `--dtype`): auto; no / fp32 / float32; bf16 /
bfloat16; fp16 / float16 (CUDA only). YAML reads a bare `no` or `false` as a boolean: both mean fp32.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import warnings
from typing import TypeVar

import torch

from draftsmith import DraftsmithError

ALIASES = {
    "auto": "auto",
    "no": "float32",
    "false": "float32",
    "fp32": "float32",
    "float32": "float32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
}
VALID = "auto, no/fp32/float32, bf16/bfloat16, fp16/float16 (CUDA only)"
TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# accelerate's names for mixed precision; fp32 training is "no" mixed precision.
ACCELERATE = {"float32": "no", "bfloat16": "bf16", "float16": "fp16"}


def canonical(value, where: str) -> str:
    """Any accepted spelling -> auto | float32 | bfloat16 | float16, or a one-line error."""
    key = str(value).strip().lower() if not isinstance(value, bool) else str(value).lower()
    if key not in ALIASES:
        hint = " (YAML reads yes/on as true)" if key == "true" else ""
        raise DraftsmithError(f"{where}: unknown precision {value!r}{hint}; expected one of {VALID}")
    return ALIASES[key]


CPU_BF16_ENV = "DRAFTSMITH_CPU_BF16"


def cpu_native_bf16() -> bool:
    """True where the CPU runs bf16 matmuls natively (AVX512-BF16 or AMX tiles). $DRAFTSMITH_CPU_BF16=0/1
    overrides the detection (for this process and the ones it launches): the unit tests pin it to 0, so
    their token-for-token comparisons run in fp32 on every CPU."""
    if os.environ.get(CPU_BF16_ENV) in ("0", "1"):
        return os.environ[CPU_BF16_ENV] == "1"
    checks = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(bool(check()) for check in checks if check is not None)


def _on_cuda(device) -> bool:
    return torch.device(device).type == "cuda" if device is not None else torch.cuda.is_available()


def check(value, where: str, device=None) -> str:
    """canonical(), plus the one combination that cannot run: fp16 without CUDA."""
    name = canonical(value, where)
    if name == "float16" and not _on_cuda(device):
        raise DraftsmithError(f"{where}: fp16 needs a CUDA GPU; on CPU use auto, no/float32 or bf16")
    return name


def resolve(value, where: str, device=None) -> str:
    """The dtype a run will use, as float32 | bfloat16 | float16.

    `auto`: bf16 on CUDA devices that support it, on CPU only with native bf16; fp32 otherwise.
    An explicit bf16 on a CPU without native bf16 warns (it runs, slowly); fp16 off CUDA is an error.
    """
    name, cuda = check(value, where, device), _on_cuda(device)
    if name == "auto":
        native = torch.cuda.is_bf16_supported() if cuda else cpu_native_bf16()
        return "bfloat16" if native else "float32"
    if name == "bfloat16" and not cuda and not cpu_native_bf16():
        _warn_slow_bf16(where)
    return name


@functools.cache  # once per setting and process, not once per call
def _warn_slow_bf16(where: str) -> None:
    warnings.warn(
        f"{where}: bf16 requested, but this CPU ({cpu_name()}) has no native bf16 (no AVX512-BF16/AMX); "
        "torch falls back to slow kernels (tens of times slower than fp32); `auto` would pick fp32",
        stacklevel=3,
    )


def torch_dtype(value, where: str = "dtype", device=None) -> torch.dtype:
    return TORCH[resolve(value, where, device)]


def mixed_precision(value, where: str = "optim.mixed_precision", device=None) -> str:
    """The value accelerate's `Accelerator(mixed_precision=...)` takes: no | bf16 | fp16."""
    return ACCELERATE[resolve(value, where, device)]


@functools.cache
def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def hardware(device=None) -> dict:
    """Where a figure was measured, recorded in every report: device, its name, native bf16, threads."""
    cuda = _on_cuda(device)
    return {
        "device": "cuda" if cuda else "cpu",
        "device_name": torch.cuda.get_device_name() if cuda else cpu_name(),
        "native_bf16": bool(torch.cuda.is_bf16_supported() if cuda else cpu_native_bf16()),
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
    }


def describe(hw: dict) -> str:
    """One line: `AMD EPYC (cpu, 2 threads, no native bf16)`."""
    bf16 = "native bf16" if hw["native_bf16"] else "no native bf16"
    return f"{hw['device_name']} ({hw['device']}, {hw['threads']} threads, {bf16})"


DTYPE_HELP = (
    "auto (bf16 only where the hardware runs it natively, else fp32), no/fp32/float32, bf16/bfloat16, fp16 (CUDA)"
)


def dtype_arg(value: str) -> str:
    """--dtype (the CLI and every eval/bench script): any name `check` accepts; a bad one is an argparse error."""
    try:
        return check(value, "--dtype")
    except DraftsmithError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# --- RoPE frequencies stay fp32 ---------------------------------------------------------------------
# `module.to(torch.bfloat16)` casts every floating buffer, a rotary embedding's inverse frequencies
# included; rounded to bf16 (8 bits of mantissa) a frequency is off by up to 2^-9 of itself, and the
# angle at position p by p times that: at most 0.14 rad at position 100 and 1.4 rad at 1,000 for
# SmolLM2's RoPE (theta 1e5, head dim 64), 0.12 and 1.2 for Qwen3-8B's (1e6, 128).
# transformers' from_pretrained(dtype=bf16) keeps them fp32 and so do vLLM and speculators, which
# compute RoPE from the config: a drafter cast after it was built (loaded in the target's dtype for
# an eval, say) would draft at other angles than the engine serving it (measured: cos off by 4e-3 at
# position 21 on a bf16 EAGLE-3 head, 2e-4 in speculators' forward check). Every module cast (`.to`,
# `.bfloat16()`, deepcopy then `.float()`) goes through `nn.Module._apply`, so that is where the
# buffers are kept.


class _Fp32Rope:
    """Mixin for a rotary embedding module: its fp32 buffers keep fp32 through any cast; they still
    follow device moves."""

    def _apply(self, fn, recurse=True):
        kept = {n: b for n, b in self._buffers.items() if b is not None and b.dtype == torch.float32}
        super()._apply(fn, recurse)
        for name, before in kept.items():
            after = self._buffers[name]
            # Only a cast that changed the dtype is undone; a meta tensor has no values to restore
            # (`to_empty` from meta keeps the dtype, and the model re-initialises such buffers).
            if after is not None and after.dtype != torch.float32 and not before.is_meta:
                self._buffers[name] = before.to(after.device)
        return self


_FP32_ROPE_CLASSES: dict[type, type] = {}  # one subclass per rotary class, so isinstance checks hold


def _fp32_rope_class(cls: type) -> type:
    if cls not in _FP32_ROPE_CLASSES:
        _FP32_ROPE_CLASSES[cls] = type(cls.__name__, (_Fp32Rope, cls), {"__module__": cls.__module__})
    return _FP32_ROPE_CLASSES[cls]


M = TypeVar("M", bound=torch.nn.Module)


def keep_rope_fp32(module: M) -> M:
    """Give every rotary embedding in `module` (a submodule with an `inv_freq` buffer) fp32 buffers
    that survive casts -> module. Call it while they are still fp32: at build, before any cast."""
    for m in module.modules():
        if "inv_freq" in m._buffers and not isinstance(m, _Fp32Rope):
            if m.inv_freq.dtype != torch.float32:
                raise ValueError(f"{type(m).__name__}.inv_freq is already {m.inv_freq.dtype}: call before casting")
            m.__class__ = _fp32_rope_class(type(m))
    return module
