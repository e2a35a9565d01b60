"""What every npu-sim kernel shares: argument checks with torch_npu's errors, dense outputs, empty likes."""

from __future__ import annotations

import functools

import torch
from torch import Tensor

FLOATS = (torch.float16, torch.bfloat16, torch.float32)
ACC = torch.float32


def dense_outputs(kernel):
    """``kernel`` with its tensor outputs made contiguous, as the device writes them and as the fakes say. An
    elementwise emulation keeps its input's strides: a transposed gradient would come out transposed, and a view
    that the graph was traced with (the fake's contiguous strides) fails on it at run time."""

    @functools.wraps(kernel)
    def dense(*args, **kwargs):
        out = kernel(*args, **kwargs)
        if isinstance(out, Tensor):
            return out.contiguous()
        if isinstance(out, tuple):
            return tuple(o.contiguous() if isinstance(o, Tensor) else o for o in out)
        return out

    return dense


def check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"npu-sim: {message}")


def unsupported(ok: bool, message: str) -> None:
    """Arguments the device takes but the emulator does not implement (we never emit them)."""
    if not ok:
        raise NotImplementedError(f"npu-sim does not emulate {message}")


def check_float(**tensors: Tensor) -> None:
    for name, t in tensors.items():
        check(t.dtype in FLOATS, f"{name} must be float16, bfloat16 or float32, got {t.dtype}")


def like(t: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    return t.new_empty(t.shape, dtype=dtype or t.dtype)
