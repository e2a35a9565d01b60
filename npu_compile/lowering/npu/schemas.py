"""The torch_npu 2.13.0 op schemas the npu lowering emits: facts we must match, not code of ours.

Each string is the ``func:`` line of ``torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml`` in the
torch-npu 2.13.0 wheel, verbatim; tests/lowering/test_npu_schemas.py reads that yaml from the wheel and fails if
a string here, or any call in a lowered graph, stops binding to it. npu-sim defines exactly these under the
``npu`` namespace, so a graph lowered for the NPU runs unchanged on the CPU.
"""

from __future__ import annotations

import torch

# Ops npu-sim emulates (kernels in lowering/npu_sim/, one module per family), by name.
EMULATED: dict[str, str] = {
    "npu_fusion_attention": (
        "npu_fusion_attention(Tensor query, Tensor key, Tensor value, int head_num, str input_layout, "
        "Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, float scale=1., "
        "float keep_prob=1., int pre_tockens=2147483647, int next_tockens=2147483647, int inner_precise=0, "
        "int[]? prefix=None, int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, int sparse_mode=0, "
        "bool gen_mask_parallel=True, bool sync=False, str softmax_layout=\"\", Tensor? sink=None, "
        "Tensor? dropout_mask=None, int seed=0, int offset=0) -> (Tensor, Tensor, Tensor, Tensor, int, int, int)"
    ),
    "npu_fusion_attention_grad": (
        "npu_fusion_attention_grad(Tensor query, Tensor key, Tensor value, Tensor dy, int head_num, "
        "str input_layout, *, Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, "
        "Tensor? softmax_max=None, Tensor? softmax_sum=None, Tensor? softmax_in=None, Tensor? attention_in=None, "
        "float scale_value=1., float keep_prob=1., int pre_tockens=2147483647, int next_tockens=2147483647, "
        "int inner_precise=0, int seed=0, int offset=0, int numels=0, int[]? prefix=None, "
        "int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, int sparse_mode=0, "
        "bool gen_mask_parallel=True, bool sync=False, str softmax_layout=\"\", Tensor? sink=None) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)"
    ),
    # The graph-mode versions (torch_npu/_op_plugin_docs.py, npu_fusion_attention_v3): seed and offset are tensors.
    "npu_fusion_attention_v3": (
        "npu_fusion_attention_v3(Tensor query, Tensor key, Tensor value, int head_num, str input_layout, "
        "Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, float scale=1., "
        "float keep_prob=1., int pre_tockens=2147483647, int next_tockens=2147483647, int inner_precise=0, "
        "SymInt[]? prefix=None, Tensor? actual_seq_qlen=None, Tensor? actual_seq_kvlen=None, int sparse_mode=0, "
        "bool gen_mask_parallel=True, bool sync=False, str softmax_layout=\"\", Tensor? sink=None) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
    ),
    "npu_fusion_attention_grad_v3": (
        "npu_fusion_attention_grad_v3(Tensor query, Tensor key, Tensor value, Tensor dy, int head_num, "
        "str input_layout, *, Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, "
        "Tensor? softmax_max=None, Tensor? softmax_sum=None, Tensor? softmax_in=None, Tensor? attention_in=None, "
        "float scale_value=1., float keep_prob=1., int pre_tockens=2147483647, int next_tockens=2147483647, "
        "int inner_precise=0, Tensor? seed=None, Tensor? offset=None, SymInt[]? prefix=None, "
        "Tensor? actual_seq_qlen=None, Tensor? actual_seq_kvlen=None, int sparse_mode=0, "
        "bool gen_mask_parallel=True, bool sync=False, str softmax_layout=\"\", Tensor? sink=None) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)"
    ),
    "npu_rms_norm": "npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)",
    "npu_rms_norm_backward": (
        "npu_rms_norm_backward(Tensor dy, Tensor self, Tensor gamma, Tensor rstd) -> (Tensor, Tensor)"
    ),
    "npu_add_rms_norm": (
        "npu_add_rms_norm(Tensor x1, Tensor x2, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor, Tensor)"
    ),
    "npu_add_layer_norm": (
        "npu_add_layer_norm(Tensor x1, Tensor x2, Tensor gamma, Tensor beta, float epsilon=1e-05, "
        "bool additional_output=False) -> (Tensor, Tensor, Tensor, Tensor)"
    ),
    "npu_add_layer_norm_backward": (
        "npu_add_layer_norm_backward(Tensor? dy_opt, Tensor x1, Tensor x2, Tensor rstd, Tensor mean, "
        "Tensor gamma, Tensor? dsum_opt) -> (Tensor, Tensor, Tensor, Tensor)"
    ),
    "npu_gelu": "npu_gelu(Tensor self, *, str approximate='none') -> Tensor",
    "npu_gelu_backward": (
        "npu_gelu_backward(Tensor grad_output, Tensor self, *, str approximate='none') -> Tensor"
    ),
    "npu_fast_gelu": "npu_fast_gelu(Tensor self) -> Tensor",
    "npu_fast_gelu_backward": "npu_fast_gelu_backward(Tensor grad, Tensor self) -> Tensor",
    "npu_swiglu": "npu_swiglu(Tensor self, int dim=-1) -> Tensor",
    "npu_swiglu_backward": "npu_swiglu_backward(Tensor grad_output, Tensor self, int dim=-1) -> Tensor",
    "npu_rotary_mul": (
        "npu_rotary_mul(Tensor self, Tensor r1, Tensor r2, str rotary_mode='half', Tensor? rotate=None) -> Tensor"
    ),
    "npu_cross_entropy_loss": (
        "npu_cross_entropy_loss(Tensor input, Tensor target, Tensor? weight=None, str reduction='mean', "
        "int ignore_index=-100, float label_smoothing=0.0, float lse_square_scale_for_zloss=0.0, "
        "bool return_zloss=False) -> (Tensor, Tensor, Tensor, Tensor)"
    ),
    "npu_cross_entropy_loss_backward": (
        "npu_cross_entropy_loss_backward(Tensor grad_loss, Tensor log_prob, Tensor target, Tensor? weight=None, "
        "Tensor? grad_zloss=None, Tensor? lse_for_zloss=None, str reduction='mean', int ignore_index=-100, "
        "float label_smoothing=0.0, float lse_square_scale_for_zloss=0.0) -> Tensor"
    ),
    "npu_rotary_mul_backward": (
        "npu_rotary_mul_backward(Tensor grad, Tensor self, Tensor r1, Tensor r2, str rotary_mode='half') "
        "-> (Tensor, Tensor, Tensor)"
    ),
    # One independent matmul per list entry (x, weight and y lists): the routed experts (lowering/npu/moe.py).
    "npu_grouped_matmul": (
        "npu_grouped_matmul(Tensor[] x, Tensor[] weight, *, Tensor[]? bias=None, Tensor[]? scale=None, "
        "Tensor[]? offset=None, Tensor[]? antiquant_scale=None, Tensor[]? antiquant_offset=None, "
        "Tensor[]? per_token_scale=None, Tensor? group_list=None, Tensor[]? activation_input=None, "
        "Tensor[]? activation_quant_scale=None, Tensor[]? activation_quant_offset=None, int? split_item=0, "
        "int? group_type=None, int? group_list_type=0, int? act_type=0, int[]? tuning_config=None, "
        "int? output_dtype=None, int? x_dtype=None, int? weight_dtype=None, int? scale_dtype=None, "
        "int? per_token_scale_dtype=None) -> Tensor[]"
    ),
    # The experts' output rows summed back into their tokens (lowering/npu/moe.py).
    "npu_moe_token_unpermute_with_routing_map": (
        "npu_moe_token_unpermute_with_routing_map(Tensor permuted_tokens, Tensor sorted_indices, int[] restore_shape, "
        "*, Tensor? probs=None, Tensor? routing_map=None, bool drop_and_pad=False) -> Tensor"
    ),
    # The tokens' routed copies, expert by expert (lowering/npu/moe.py).
    "npu_moe_token_permute_with_routing_map": (
        "npu_moe_token_permute_with_routing_map(Tensor tokens, Tensor routing_map, *, Tensor? probs=None, "
        "int? num_out_tokens=None, bool drop_and_pad=False) -> (Tensor, Tensor, Tensor)"
    ),
    # The router's softmax over each token's top-k logits (lowering/npu/moe.py).
    "npu_moe_gating_top_k_softmax_v2": (
        "npu_moe_gating_top_k_softmax_v2(Tensor x, *, int k=1, Tensor? finished=None, int? renorm=0, "
        "bool? output_softmax=False) -> (Tensor, Tensor, Tensor)"
    ),
    # The router's score function, expert bias, group choice and top-k (lowering/npu/moe.py).
    "npu_moe_gating_top_k": (
        "npu_moe_gating_top_k(Tensor x, int k, *, Tensor? bias=None, Tensor? input_ids=None, Tensor? tid2eid=None, "
        "int k_group=1, int group_count=1, int group_select_mode=0, int renorm=0, int norm_type=0, "
        "bool out_flag=False, float routed_scaling_factor=1.0, float eps=1e-20) -> (Tensor, Tensor, Tensor)"
    ),
}

# MC2 (matmul fused with a collective): npu-sim runs them over the c10d process group their `hcom` names.
MC2: dict[str, str] = {
    "npu_all_gather_base_mm": (
        "npu_all_gather_base_mm(Tensor self, Tensor x2, str hcom, int world_size, *, Tensor? bias=None, "
        "Tensor? x1_scale=None, Tensor? x2_scale=None, int gather_index=0, bool gather_output=True, "
        "int comm_turn=0, ScalarType? output_dtype=None, str? comm_mode=None) -> (Tensor, Tensor)"
    ),
    "npu_mm_reduce_scatter_base": (
        "npu_mm_reduce_scatter_base(Tensor self, Tensor x2, str hcom, int world_size, *, str reduce_op='sum', "
        "Tensor? bias=None, Tensor? x1_scale=None, Tensor? x2_scale=None, int comm_turn=0, "
        "ScalarType? output_dtype=None, str? comm_mode=None) -> Tensor"
    ),
    "npu_mm_all_reduce_base": (
        "npu_mm_all_reduce_base(Tensor x1, Tensor x2, str hcom, *, str reduce_op='sum', Tensor? bias=None, "
        "Tensor? antiquant_scale=None, Tensor? antiquant_offset=None, Tensor? x3=None, "
        "Tensor? dequant_scale=None, Tensor? pertoken_scale=None, Tensor? comm_quant_scale_1=None, "
        "Tensor? comm_quant_scale_2=None, int antiquant_group_size=0, int comm_turn=0, int[]? group_sizes=None, "
        "int? y_dtype=None, int? x1_dtype=None, int? x2_dtype=None, int? dequant_scale_dtype=None, "
        "int? pertoken_scale_dtype=None, int comm_quant_mode=0, str? comm_mode=None) -> Tensor"
    ),
}

SCHEMAS: dict[str, str] = {**EMULATED, **MC2}

# The yaml's `tags:` of these ops. nondeterministic_seeded tells the partitioner never to recompute the node.
TAGS: dict[str, tuple[torch.Tag, ...]] = {"npu_fusion_attention": (torch.Tag.nondeterministic_seeded,)}
