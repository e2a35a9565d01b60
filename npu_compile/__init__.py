"""npu_compile: ``torch.compile(model, backend="ascend")`` for Megatron-LM training on Huawei Ascend NPUs.

The backend registers itself with Dynamo through the ``torch_dynamo_backends`` entry point, so
``backend="ascend"`` works without importing this package; importing it also registers it directly.
"""

from torch._dynamo import list_backends, register_backend

from npu_compile import config, ops  # ops: registers torch.ops.npu_compile.*
from npu_compile.backend import ascend
from npu_compile.explain import Explanation, explain

if "ascend" not in list_backends(exclude_tags=()):
    register_backend(ascend, name="ascend")

__all__ = ["Explanation", "ascend", "config", "explain"]
