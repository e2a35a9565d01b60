"""Host offload of saved activations: ``offload`` copies a tensor to host memory after its forward, ``prefetch``
copies it back to the device before its backward (option ``offload``, passes/offload.py).

    offload(x)               -> a host (CPU) copy of x, same shape, strides and dtype
    prefetch(host, device)   -> a copy of ``host`` on ``device``, same shape, strides and dtype

Both are real copies into a new buffer (the source is never returned or aliased), so a graph that offloads
computes what it would without: the tests compare it with eager bit for bit. The npu targets lower them to
``aten._to_copy(..., non_blocking=True)`` (the host side in pinned memory, lowering/npu/offload.py); the
reference target runs these kernels. Only dense (non-overlapping) tensors are offloaded, so keeping the strides
is a plain allocation.
"""

import torch
from torch import Tensor

HOST = torch.device("cpu")


def _dense_like(x: Tensor, device: torch.device) -> Tensor:
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=device)


@torch.library.custom_op("npu_compile::offload", mutates_args=())
def offload(x: Tensor) -> Tensor:
    """x copied to host memory."""
    return _dense_like(x, HOST).copy_(x)


@offload.register_fake
def _(x):
    return _dense_like(x, HOST)


@torch.library.custom_op("npu_compile::prefetch", mutates_args=())
def prefetch(host: Tensor, device: torch.device) -> Tensor:
    """``host`` copied back to ``device``."""
    return _dense_like(host, device).copy_(host)


@prefetch.register_fake
def _(host, device):
    return _dense_like(host, device)
