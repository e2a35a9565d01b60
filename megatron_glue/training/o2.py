"""MindSpeed-LLM's O2: Adam's moments kept in bf16 (`--o2-optimizer`), gradients accumulated and reduced in bf16
(`--o2-gradient`), on megatron-core's own optimizer and DDP.

`--o2-gradient` is Megatron-LM's `--grad-reduce-in-bf16`: megatron-core's DDP keeps its gradient buffer in the
parameters' dtype (`DistributedDataParallelConfig.grad_reduce_in_fp32` False), 2 bytes x parameters less than the
fp32 buffer Megatron-LM uses under --bf16 (MindSpeed-LLM 2.3.0 mindspeed_llm/training/arguments.py, `o2_gradient`
turns `accumulate_allreduce_grads_in_fp32` off after Megatron's validation; its docs/*/features/mcore/o2.md: 2N).

`--o2-optimizer` keeps exp_avg and exp_avg_sq in bf16 between steps and computes each step in fp32: per parameter,
the moments are widened, torch's own Adam/AdamW step (`torch.optim.adam.adam`, the function torch.optim.AdamW
runs) updates the fp32 master weight and the fp32 moments, and the moments are rounded back to bf16 (MindSpeed-LLM
master mindspeed_llm/tasks/models/common/adamw.py: the same widen-step-narrow around torch_npu's npu_apply_adam_w,
installed in place of apex's FusedAdam; its o2.md: 4N/DP bytes less). megatron-core's own form of it
(`--use-precision-aware-optimizer --exp-avg-dtype bf16`) passes dtype arguments only Transformer Engine's FusedAdam
takes, which is CUDA-only; here megatron-core builds its torch AdamW over its fp32 master weights as always and
`enable` turns each inner optimizer into `BF16MomentsAdamW`, which differs from it only in where the moments live.

Checkpoints: megatron-core saves and loads the moments through its own state-dict code; a load (or megatron-core's
`init_state_fn`, which makes fp32 moments) leaves fp32 moments that the next step narrows to bf16 again, exactly,
since they were bf16 values.
"""

from __future__ import annotations

import torch
from torch.optim.adam import adam as torch_adam  # the function torch.optim.Adam and AdamW step with

MOMENTS = ("exp_avg", "exp_avg_sq")


class BF16MomentsAdamW(torch.optim.AdamW):
    """torch's Adam/AdamW (as the group says: `decoupled_weight_decay`) with both moments stored in bf16."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group.get("amsgrad"):
                raise ValueError("--o2-optimizer keeps Adam's two moments in bf16; amsgrad's third is not built")
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "step" not in state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                for name in MOMENTS:
                    if name not in state:
                        state[name] = torch.zeros_like(p, dtype=torch.bfloat16, memory_format=torch.preserve_format)
                    elif state[name].dtype != torch.bfloat16:  # loaded, or megatron-core's init_state_fn
                        state[name] = state[name].to(torch.bfloat16)
                exp_avg, exp_avg_sq = (state[name].float() for name in MOMENTS)
                torch_adam(
                    [p], [p.grad], [exp_avg], [exp_avg_sq], [], [state["step"]], foreach=False,
                    decoupled_weight_decay=group.get("decoupled_weight_decay", True), amsgrad=False, beta1=beta1,
                    beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                    maximize=group.get("maximize", False))
                state["exp_avg"].copy_(exp_avg)
                state["exp_avg_sq"].copy_(exp_avg_sq)
        return loss


def _inner_optimizers(optimizer) -> list:
    """The torch optimizers megatron-core's (chained) optimizer steps (a torch optimizer: itself)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [o.optimizer for o in chained if getattr(o, "optimizer", None) is not None]


def enable(optimizer) -> list[torch.optim.Optimizer]:
    """Make every inner torch Adam/AdamW of megatron-core's `optimizer` keep its moments in bf16, before its first
    step. Returns the inner optimizers changed."""
    inner = _inner_optimizers(optimizer)
    for opt in inner:
        if type(opt) not in (torch.optim.AdamW, torch.optim.Adam):
            raise TypeError(f"--o2-optimizer works on torch's Adam/AdamW, which megatron-core builds without apex or "
                            f"Transformer Engine; this optimizer is {type(opt).__module__}.{type(opt).__name__}")
        if any(opt.state.values()):
            raise RuntimeError("--o2-optimizer must be enabled before the optimizer's first step")
        opt.__class__ = BF16MomentsAdamW
    return inner


def moment_bytes(inner: list[torch.optim.Optimizer], dtype: torch.dtype) -> int:
    """Bytes the two moments of `inner`'s parameters take in `dtype`."""
    n = sum(p.numel() for opt in inner for g in opt.param_groups for p in g["params"])
    return 2 * n * torch.empty((), dtype=dtype).element_size()
