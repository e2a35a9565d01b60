"""Small helpers the op families share: the dtype statistics are kept in, and the optional-gradient convention."""

import torch
from torch import Tensor


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Statistics and accumulations run in fp32 (what the NPU kernels keep), in fp64 for fp64 inputs so
    that float64 gradcheck sees exact recomputation."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def no_grad_placeholder(like: Tensor) -> Tensor:
    """What a backward op returns for a gradient it was told not to compute: an empty [0] tensor.

    Custom-op schemas cannot return `Tensor?`, so a backward with an optional gradient takes a bool flag
    (`bias_grad`, `cos_sin_grad`) and returns this when the flag is False; the autograd formula turns it
    into None.
    """
    return like.new_empty((0,))


def sum_to_shape(t: Tensor, shape) -> Tensor:
    """t summed down to `shape` (which broadcasts to t's shape): the gradient of a broadcast parameter.

    Always a new tensor: `sum_to_size` returns t itself when nothing is reduced, and a custom op's outputs
    must not alias each other (grad_x and grad_bias of an op whose bias is as large as x)."""
    reduced = t.sum_to_size(shape)
    return reduced.clone() if reduced is t else reduced


def broadcasts_to(shape, target) -> bool:
    """Whether a tensor of ``shape`` broadcasts to ``target`` without growing it.

    Plain ints are compared here: ``torch.broadcast_shapes`` goes through the symbolic-shape machinery and costs
    about a hundred times a small kernel on every call of a reference kernel. Symbolic sizes (the fake kernels
    under dynamic shapes) still take it, so that no guard is added."""
    shape, target = tuple(shape), tuple(target)
    if not all(type(s) is int for s in shape + target):
        try:
            return tuple(torch.broadcast_shapes(target, shape)) == target
        except RuntimeError:
            return False
    return len(shape) <= len(target) and all(s == 1 or s == t for s, t in zip(reversed(shape), reversed(target)))
