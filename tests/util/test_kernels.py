"""Prepacked oneDNN linears (draftsmith/util/kernels.py): same numbers as torch's default, batch-invariant rows,
training untouched, and everything restored after the block."""

import pytest
import torch

from draftsmith.util.kernels import available, packed_linears

pytestmark = pytest.mark.skipif(not available(), reason="this torch build has no oneDNN linear ops")


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(48, 96), torch.nn.SiLU(), torch.nn.Linear(96, 40, bias=False))


def test_packed_equals_default_within_fp32_tolerance_and_rows_are_batch_invariant():
    mlp, x = _mlp(), torch.randn(9, 48)
    with torch.no_grad():
        want = mlp(x)
        with packed_linears(mlp) as patched:
            got, first_alone = mlp(x), mlp(x[:1])
    assert patched == 2
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Row 0 of a 9-row pass is bit-identical to a 1-row pass: verification sees decoding's logits.
    assert torch.equal(got[:1], first_alone)


def test_grad_calls_keep_the_default_kernel_and_the_block_restores_modules():
    mlp, x = _mlp(), torch.randn(3, 48)
    with packed_linears(mlp):
        assert all("forward" in vars(m) for m in mlp if isinstance(m, torch.nn.Linear))
        mlp(x).sum().backward()  # with grad enabled: the default kernel, so autograd works
    assert mlp[0].weight.grad is not None
    assert not any("forward" in vars(m) for m in mlp)


def test_nesting_patches_once_and_skips_what_cannot_be_packed():
    mlp = _mlp()
    half = torch.nn.Linear(8, 8).to(torch.bfloat16)
    with packed_linears(mlp, half, None) as outer:
        with packed_linears(mlp) as inner:
            assert inner == 0
        assert "forward" in vars(mlp[0])  # the inner block did not undo the outer one
    assert outer == 2 and "forward" not in vars(half)
    with packed_linears(mlp, enabled=False) as off:
        assert off == 0
