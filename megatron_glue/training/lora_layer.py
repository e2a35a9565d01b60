"""peft's LoRA layer for megatron-core's parallel linears, as the job uses it (megatron_glue.training.lora; its own
module, imported only when LoRA is on: peft is needed then only)."""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from megatron.core import parallel_state, tensor_parallel
from peft.tuners.lora.tp_layer import LoraParallelLinear as PeftLoraParallelLinear


class LoraParallelLinear(PeftLoraParallelLinear):
    """peft's LoraParallelLinear (A split over TP on a row-parallel base, B on a column-parallel one) whose forward
    reads megatron-core's linears: peft 0.21's feeds lora_A's (output, bias) tuple into lora_B; MindSpeed-LLM
    replaces it for the same reason (tasks/posttrain/lora/lora_moe.py:199-207). A row-parallel A is drawn whole and
    split, so that the adapters are the same at every TP size (peft draws each rank's shard on its own)."""

    def __init__(self, target, adapter_name: str, config, **kwargs):
        # peft sets params_dtype float32 on the config it is given: a copy, not the model's
        super().__init__(target, adapter_name, config=config, backend=tensor_parallel,
                         megatron_config=copy.copy(config.megatron_config), **kwargs)

    def update_layer(self, adapter_name, *args, **kwargs):
        # peft 0.21's parallel layer never sets its adapter's lora_bias, which reset_lora_parameters reads
        # (MindSpeed-LLM sets it too: lora_moe.py:94-96); LoraConfig(lora_bias=True) is refused by peft here
        self.lora_bias[adapter_name] = False
        super().update_layer(adapter_name, *args, **kwargs)

    def reset_lora_parameters(self, adapter_name, init_lora_weights):
        if not (init_lora_weights is True and self.is_parallel_a and adapter_name in self.lora_A):
            super().reset_lora_parameters(adapter_name, init_lora_weights)
            return
        # peft's default init (A as nn.Linear's kaiming-uniform, B zero) with A drawn whole, [r, in], and this rank's
        # columns taken: the same draws at every TP size, the same adapters as at TP=1
        weight = self.lora_A[adapter_name].weight
        whole = torch.empty(weight.shape[0], self.in_features, dtype=torch.float32)
        torch.nn.init.kaiming_uniform_(whole, a=math.sqrt(5))
        rank = parallel_state.get_tensor_model_parallel_rank()
        with torch.no_grad():
            weight.copy_(whole.chunk(parallel_state.get_tensor_model_parallel_world_size(), dim=1)[rank])
            torch.nn.init.zeros_(self.lora_B[adapter_name].weight)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any):
        result, bias = self.base_layer(x, *args, **kwargs)
        if self.disable_adapters or self.merged:
            return result, bias
        dtype = result.dtype
        for name in self.active_adapters:
            if name not in self.lora_A:
                continue
            lora_a, lora_b = self.lora_A[name], self.lora_B[name]
            low = lora_a(self.lora_dropout[name](x.to(lora_a.weight.dtype)))
            low = low[0] if isinstance(low, tuple) else low
            delta = lora_b(low)
            delta = delta[0] if isinstance(delta, tuple) else delta
            result = result + delta * self.scaling[name]
        return result.to(dtype), bias
