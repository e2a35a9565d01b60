"""The fused-op vocabulary: torch.library custom ops in namespace `npu_compile`, one module per family.

Importing this package registers every op under `torch.ops.npu_compile`. Each op has a reference kernel in
plain torch (any device), a fake kernel with the real kernel's shapes and strides, and autograd through a
backward op that is itself a custom op, so the partitioner sees one opaque node each way:

    attention    fused_attention, fused_attention_backward
    attention_lse  attention_with_lse (+ _backward): attention whose log-sum-exp is a differentiable output
                 (ring attention's per-step attention, merged by its statistics)
    norms        rms_norm, add_rms_norm, add_layer_norm (+ _backward each)
    activations  bias_gelu, swiglu (+ _backward each)
    rotary       rotary, rotary_backward
    dropout_add  bias_dropout_add, bias_dropout_add_backward
    cross_entropy  linear_cross_entropy, vocab_parallel_linear_cross_entropy (+ _backward each)
    varlen_attention  varlen_attention (+ _backward), document_mask (packed documents)
    moe          grouped_matmul (+ grouped_matmul_weight_grad): the routed experts' matmuls as one op;
                 permute_tokens: the tokens' routed copies, expert by expert;
                 unpermute_tokens: the experts' output rows summed back into their tokens
    offload      offload (device → host copy), prefetch (host → device copy): saved activations in host memory

Rules (passes/) insert these ops; targets (lowering/) map them to device calls. Argument conventions follow
the torch_npu ops they lower to (documented per module).
"""

from npu_compile.ops import activations, attention, dropout_add, norms, rotary
from npu_compile.ops import cross_entropy
from npu_compile.ops import varlen_attention
from npu_compile.ops import moe
from npu_compile.ops import offload
from npu_compile.ops import attention_lse

__all__ = ["activations", "attention", "attention_lse", "cross_entropy", "dropout_add", "norms", "offload", "rotary", "varlen_attention",
           "moe"]
