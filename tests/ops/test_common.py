"""npu_compile.ops.common: the helpers the op families share."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import npu_compile.ops  # noqa: F401  (importing registers the ops)
from npu_compile.ops.common import broadcasts_to

shapes = st.lists(st.integers(1, 4), max_size=4)


@given(shapes, shapes)
def test_broadcasts_to_agrees_with_torch(shape, target):
    try:
        want = tuple(torch.broadcast_shapes(target, shape)) == tuple(target)
    except RuntimeError:
        want = False
    assert broadcasts_to(shape, target) == want


def test_reference_kernels_keep_off_the_symbolic_shape_machinery(monkeypatch):
    """torch.broadcast_shapes costs about a hundred times a small kernel per call; a bias check on plain sizes
    must not go through it (it ran on every bias_gelu, bias_dropout_add and rotary call)."""
    def refuse(*shapes):
        raise AssertionError(f"torch.broadcast_shapes{shapes} on plain sizes")

    monkeypatch.setattr(torch._refs, "_broadcast_shapes", refuse)
    x, bias = torch.randn(4, 2, 8), torch.randn(8)
    y = torch.ops.npu_compile.bias_gelu(x, bias)
    torch.testing.assert_close(y, torch.nn.functional.gelu(x + bias))
    grad_x, grad_bias = torch.ops.npu_compile.bias_gelu_backward(torch.ones_like(x), x, bias, "none", True)
    assert grad_x.shape == x.shape and grad_bias.shape == bias.shape
    with pytest.raises(ValueError, match=r"bias \(3,\) torch.float32 must broadcast to x \(4, 2, 8\)"):
        torch.ops.npu_compile.bias_gelu(x, torch.randn(3))
