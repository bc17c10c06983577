"""Prepacked oneDNN linears for fp32 inference on CPU: what makes verification cheap there.

Speculative decoding pays off when the target scores 1 + K draft tokens for about the price of one.
On a CPU a small target's forward is bound by reading its weights from memory, so that should hold;
but torch's default fp32 matmul (MKL) repacks the weight matrix on every call with more than one
input row, and on a 2-core AMD EPYC (AVX2) a forward over 9 tokens measured about 1.8x a one-token
forward. oneDNN with each weight reordered once into its blocked layout reads the weights once per
call: 9 tokens then cost about 1.3x one token (benchmarks/verify_cost.py prints both on the machine
at hand). Its rows are also batch-invariant (row i of a 9-row product equals the 1-row product
bit for bit), so greedy verification sees exactly the logits that one-token decoding sees.

`packed_linears(*modules)` patches every fp32 CPU nn.Linear of the given modules for the duration of
a `with` block, only on no-grad calls (training and anything that backpropagates keep the default
kernel), and restores them after. The weights must not change inside the block: the eval stage
(eval/run.py) and benchmarks use it, never training.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TypeGuard

import torch

# The batch size the weight layout is tuned for: measured, a layout for 16 rows serves 1..16 rows
# within a few percent of the best layout for each (and 64 rows still correctly).
_LAYOUT_ROWS = 16


def available() -> bool:
    """oneDNN is in every CPU build of torch; the two private ops are inductor's (torch.compile's
    frozen-weight path). If a torch build lacks them, decoding keeps the default kernels."""
    ops = getattr(torch.ops, "mkldnn", None)
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


def _packable(m: torch.nn.Module) -> TypeGuard[torch.nn.Linear]:
    w = getattr(m, "weight", None)
    return (
        type(m) is torch.nn.Linear
        and isinstance(w, torch.Tensor)
        and w.device.type == "cpu"
        and w.dtype == torch.float32
        and "forward" not in vars(m)
    )  # not patched already (nesting)


def _packed_forward(m: torch.nn.Linear):
    packed = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), _LAYOUT_ROWS)
    bias = None if m.bias is None else m.bias.detach()
    default = type(m).forward.__get__(m)

    def forward(x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or x.dtype != torch.float32:
            return default(x)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    return forward


@contextmanager
def packed_linears(*modules: torch.nn.Module | None, enabled: bool = True):
    """Within the block, no-grad fp32 CPU linears of `modules` run on prepacked oneDNN weights."""
    patched = []
    if enabled and available():
        for module in modules:
            for m in module.modules() if isinstance(module, torch.nn.Module) else ():
                if _packable(m):
                    setattr(m, "forward", _packed_forward(m))  # an instance attribute: it shadows the method
                    patched.append(m)
    try:
        yield len(patched)
    finally:
        for m in patched:
            del m.forward  # back to the class's forward
