"""What the op tests share: tolerances per dtype, and the settings of the fuzz twins."""

import torch
from hypothesis import settings


def fuzz_settings() -> settings:
    return settings(settings.get_profile("fuzz"))


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol relative to the reference's largest magnitude).

    fp32: the 1e-5 relative bar of the project. bf16: the ops round once from fp32, the reference is the fp32
    computation on the same bf16 inputs, so a few bf16 ulps (2^-8 each) is the honest bar."""
    if dtype == torch.float64:
        return 1e-10, 1e-10
    if dtype == torch.float32:
        return 1e-5, 1e-5
    return 2e-2, 2e-2


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    """actual (computed in `dtype`) against an fp32/fp64 reference, scaled by the reference's magnitude."""
    rtol, atol = tolerance(dtype)
    scale = max(1.0, expected.detach().abs().max().item()) if expected.numel() else 1.0
    torch.testing.assert_close(actual.detach().to(expected.dtype), expected.detach(), rtol=rtol, atol=atol * scale,
                               msg=lambda m: f"{what}: {m}")


def leaf(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A fresh leaf copy that requires grad (optionally in another dtype)."""
    return t.detach().to(dtype or t.dtype).clone().requires_grad_()


def strided_leaf(t: torch.Tensor) -> torch.Tensor:
    """t's values with t's strides (a split or permuted view stays one), as a view of a fresh leaf that
    requires grad; take gradients with respect to the returned view."""
    base = (t if t._base is None else t._base).detach().clone().requires_grad_()
    return base.as_strided(t.shape, t.stride(), t.storage_offset())
