"""GE converters target npu registers with torchair, through its public ``register_fx_node_ge_converter``.

npu_fusion_attention_grad: torch-npu 2.13.0's op returns five tensors, ``(dq, dk, dv, dpse, dsink)`` (dsink, the
gradient of the attention sink, was added in 2.13: torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml and
torch_npu/op_plugin/meta/_meta_registrations.py:2335-2347, dsink empty [0] when no ``sink`` is given), but the
wheel's own converter (torch_npu/dynamo/torchair/_ge_concrete_graph/ge_converter/custom/npu_fusion_attention.py:
75-156) returns FlashAttentionScoreGrad's four, and torchair then refuses every training graph with attention
("The length of ge_outputs must be equal to meta_outputs"). The override calls the wheel's converter unchanged
and appends dsink as an empty constant of the dtype the op's meta gives it. The project never passes ``sink``;
a call that does is refused here rather than given a wrong gradient.

Registered by target npu's ``prepare`` (where torchair is importable) and by the CPU conversion check
(torchair_check) before it converts anything.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

_registered: set[int] = set()


def register(torchair: Any) -> None:
    """Register the overrides with ``torchair`` (the module), once per torchair module."""
    if id(torchair) in _registered:
        return
    with warnings.catch_warnings():
        # the wheel's custom converters, imported now as torchair does on its first lookup that misses, so that
        # ours is registered after theirs; modules whose npu op npu-sim does not define warn and are skipped
        warnings.simplefilter("ignore")
        import torchair._ge_concrete_graph.ge_converter.custom  # noqa: F401, PLC0415
    grad = torch.ops.npu.npu_fusion_attention_grad.default
    wrapped = getattr(grad, "_ge_converter", None)
    if wrapped is None:
        raise RuntimeError("torchair registered no GE converter for npu_fusion_attention_grad: "
                           "the dsink override has nothing to extend")
    wheel_converter = getattr(wrapped, "__wrapped__", wrapped)  # the function, before torchair's meta wrapping
    from torchair import ge  # noqa: PLC0415

    @torchair.register_fx_node_ge_converter(grad)
    def npu_fusion_attention_grad_with_dsink(*args: Any, meta_outputs: Any = None, **kwargs: Any) -> Any:
        if kwargs.get("sink") is not None:
            raise NotImplementedError(
                "npu_fusion_attention_grad with a sink: torchair 2.13's converter has no dsink to give")
        kwargs.pop("sink", None)
        if kwargs.pop("softmax_layout", "") not in ("",):
            raise NotImplementedError("npu_fusion_attention_grad with a softmax_layout: torchair 2.13's converter "
                                      "does not take it")
        dq, dk, dv, dpse = wheel_converter(*args, meta_outputs=meta_outputs[:4], **kwargs)
        dsink = ge.Const([], dtype=meta_outputs[4].dtype)
        return dq, dk, dv, dpse, dsink

    _registered.add(id(torchair))
