"""Counter-based dropout keep masks shared by the fused ops that drop.

A fused op that drops must drop the same elements in its forward and in its backward without saving the mask.
Both kernels therefore rebuild the mask from the op's seed input and a block index: block `i` of an op's mask
comes from a `torch.Generator` seeded with `mix(seed, i)`. The seed input is an int64 tensor the caller draws
(e.g. with `torch.randint`): 0-dim (the seed), or a generator state of two, (seed, offset), whose int is
`mix(seed, offset)`. Attention draws the pair: it is the slot an NPU lowering fills with the (seed, offset) its
device generator drew, so that the backward graph reads it where the forward wrote it
(lowering/npu/attention.py). Blocks keep the working memory of the reference kernels bounded (one block of the mask at a
time) and let a kernel make the blocks in whatever order it computes.

Only the reference kernels use this. They read the seed on the host (one sync per call on an accelerator).
An NPU lowering uses the device's own Philox generator; it is bound to forward/backward consistency, not to
these exact bits.
"""

import torch
from torch import Tensor

_MASK64 = (1 << 64) - 1


def seed_value(seed: Tensor | None, p: float) -> int:
    """The Python int behind a seed tensor (0-dim, or a (seed, offset) pair); checks that a dropping op was given
    one."""
    if p == 0.0:
        return 0
    if seed is None:
        raise ValueError(f"dropout p={p} needs a seed tensor (0-dim int64, or int64 (seed, offset)), got None")
    if seed.dtype != torch.int64 or tuple(seed.shape) not in ((), (2,)):
        raise ValueError(f"seed must be a 0-dim int64 tensor or an int64 (seed, offset) pair of shape (2,), got "
                         f"{tuple(seed.shape)} {seed.dtype}")
    if seed.dim() == 0:
        return int(seed.item())
    value, offset = (int(v) for v in seed.tolist())
    return mix(value, offset)


def mix(seed: int, block: int) -> int:
    """splitmix64 of (seed, block): neighbouring blocks and neighbouring seeds get unrelated streams."""
    z = (seed + 0x9E3779B97F4A7C15 * (block + 1)) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def drop_mask(seed: int, block: int, shape: tuple[int, ...], p: float, device: torch.device) -> Tensor:
    """Bool mask of `shape`, True = dropped, each element dropped with probability p.

    Dropped, not kept, because kernels apply it with `masked_fill_(drop, 0)`: multiplying by a bool mask
    would first copy it to the float dtype, a full-size temporary."""
    generator = torch.Generator(device=device)
    generator.manual_seed(mix(seed, block))
    # Bernoulli straight into bool: no float block of uniforms on the way.
    return torch.empty(shape, dtype=torch.bool, device=device).bernoulli_(p, generator=generator)


def keep_scale(p: float) -> float:
    """What kept elements are multiplied by: 1/(1-p), and 0 when everything is dropped (p == 1)."""
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - p)


def check_p(p: float) -> None:
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout p must lie in [0, 1], got {p}")
