"""npu_cross_entropy_loss and its backward on the CPU.

- loss_i = −(1 − ε)·log p_i[t_i] − ε·mean_j log p_ij, 0 where t_i = ignore_index >= 0 (a negative ignore_index
  ignores nothing); "mean" divides by the tokens not ignored, "sum" sums; both give shape [1] (the documented
  loss shape), "none" [N]. log_prob is log_softmax(input) in input's dtype; zloss and lse_for_zloss are not
  enabled on the device and come back as zeros of their documented shapes.
- The backward's gradient is (softmax − (1 − ε)·onehot(t) − ε/C)·grad_loss per row, rows of ignored tokens 0,
  in log_prob's dtype. Class weights and zloss are not emulated (never emitted).
"""

from __future__ import annotations

import torch

from npu_compile.lowering.npu_sim.common import ACC, check, check_float, unsupported

REDUCTIONS = ("mean", "sum", "none")


def _checks(log_prob, target, weight, reduction, ignore_index, label_smoothing):
    check(log_prob.dim() == 2 and target.shape == log_prob.shape[:1] and target.dtype == torch.int64,
          f"input {tuple(log_prob.shape)} must be [N, C] and target {tuple(target.shape)} int64 [N]")
    check(reduction in REDUCTIONS, f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    check(ignore_index < log_prob.shape[1], f"ignore_index {ignore_index} must be below C = {log_prob.shape[1]}")
    check(0.0 <= label_smoothing < 1.0, f"label_smoothing must be in [0, 1), got {label_smoothing}")
    unsupported(weight is None, "class weights")
    valid = target != ignore_index if ignore_index >= 0 else torch.ones_like(target, dtype=torch.bool)
    check(bool(((target[valid] >= 0) & (target[valid] < log_prob.shape[1])).all()), "targets must lie in [0, C)")
    return valid


def npu_cross_entropy_loss(input, target, weight=None, reduction="mean", ignore_index=-100, label_smoothing=0.0,
                           lse_square_scale_for_zloss=0.0, return_zloss=False):
    check_float(input=input)
    unsupported(lse_square_scale_for_zloss == 0.0 and not return_zloss, "zloss")
    valid = _checks(input, target, weight, reduction, ignore_index, label_smoothing)
    log_p = torch.log_softmax(input.to(ACC), dim=1)
    picked = log_p.gather(1, torch.where(valid, target, 0).unsqueeze(1)).squeeze(1)
    loss = -(1.0 - label_smoothing) * picked - label_smoothing * log_p.mean(1)
    loss = torch.where(valid, loss, 0.0)
    if reduction != "none":
        loss = loss.sum() / (valid.sum() if reduction == "mean" else 1)
        loss = loss.reshape(1)
    n = input.shape[0]
    return (loss.to(input.dtype), log_p.to(input.dtype), input.new_zeros(loss.shape), input.new_zeros(n))


def npu_cross_entropy_loss_backward(grad_loss, log_prob, target, weight=None, grad_zloss=None, lse_for_zloss=None,
                                    reduction="mean", ignore_index=-100, label_smoothing=0.0,
                                    lse_square_scale_for_zloss=0.0):
    unsupported(grad_zloss is None and lse_for_zloss is None and lse_square_scale_for_zloss == 0.0, "zloss")
    valid = _checks(log_prob, target, weight, reduction, ignore_index, label_smoothing)
    n, classes = log_prob.shape
    g = grad_loss.to(ACC).reshape(-1)
    if reduction != "none":
        g = (g / valid.sum() if reduction == "mean" else g).expand(n)
    grad = log_prob.to(ACC).exp() - label_smoothing / classes
    grad[torch.arange(n), torch.where(valid, target, 0)] -= 1.0 - label_smoothing
    grad = grad * torch.where(valid, g, 0.0).unsqueeze(1)
    return grad.to(log_prob.dtype)


def _loss_fake(input, target, weight=None, reduction="mean", ignore_index=-100, label_smoothing=0.0,
               lse_square_scale_for_zloss=0.0, return_zloss=False):
    loss_shape = (input.shape[0],) if reduction == "none" else (1,)
    return (input.new_empty(loss_shape), input.new_empty(input.shape), input.new_empty(loss_shape),
            input.new_empty((input.shape[0],)))


KERNELS = {  # op name -> (CPU kernel, fake kernel giving torch_npu's output shapes and dtypes)
    "npu_cross_entropy_loss": (npu_cross_entropy_loss, _loss_fake),
    "npu_cross_entropy_loss_backward": (
        npu_cross_entropy_loss_backward, lambda grad_loss, log_prob, *args, **kwargs: torch.empty_like(log_prob)),
}
