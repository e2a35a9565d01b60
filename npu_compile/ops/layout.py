"""Where batch, heads, sequence and head dim sit in each ``fused_attention`` layout: the one table of it.

    sbnd  [s, b, n, d]  Megatron's core attention (torch_npu "SBH" once heads are flattened)
    bsnd  [b, s, n, d]  HF models after their q/k/v projections (torch_npu "BSH" / "BSND")
    bnsd  [b, n, s, d]  SDPA's (torch_npu "BNSD")

Ops, rules, lowering and the cost model all read shapes through this table; it imports nothing.
"""

from __future__ import annotations

from typing import Any

LAYOUTS = ("sbnd", "bsnd", "bnsd")

# layout -> the positions, in a tensor of that layout, of its b, n, s and d dims
BNSD_DIMS: dict[str, tuple[int, int, int, int]] = {
    "bnsd": (0, 1, 2, 3),
    "sbnd": (1, 2, 0, 3),
    "bsnd": (0, 2, 1, 3),
}


def bnsd_shape(shape: Any, layout: str) -> tuple:
    """(b, n, s, d) of a shape in ``layout``."""
    shape = tuple(shape)
    return tuple(shape[i] for i in BNSD_DIMS[layout])


def layout_shape(layout: str, b: Any, n: Any, s: Any, d: Any) -> tuple:
    """The shape in ``layout`` of a [b, n, s, d] tensor."""
    out: list[Any] = [None] * 4
    for size, at in zip((b, n, s, d), BNSD_DIMS[layout]):
        out[at] = size
    return tuple(out)


def to_bnsd(t: Any, layout: str) -> Any:
    """A [b, n, s, d] view of a tensor in ``layout``."""
    return t if layout == "bnsd" else t.permute(*BNSD_DIMS[layout])
