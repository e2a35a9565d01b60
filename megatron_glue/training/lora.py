"""LoRA fine-tuning in the job: MindSpeed-LLM's `--lora-*` flags (docs/lora.md).

The adapters are peft's (`LoraConfig`, `inject_adapter_in_model`, its `LoraParallelLinear` on megatron-core's
ColumnParallelLinear / RowParallelLinear), injected into each model chunk in place, before it is compiled and
wrapped in Float16Module and DDP, as MindSpeed-LLM's `model_provider_func_wrapper` does
(mindspeed_llm/training/training.py:151-228). Each targeted linear computes

    y = base(x) + (alpha / r) * B(A(x))

with A split over TP where the base layer is row-parallel (A a RowParallelLinear, B whole) and B split where it is
column-parallel (A whole, B a ColumnParallelLinear), B initialized to zero (step 0 is the base model). Everything else
is frozen (requires_grad False): megatron-core's DDP buckets and the optimizer hold only the adapters.

Parameter names are peft's, as MindSpeed-LLM saves them: `...linear_qkv.base_layer.weight`,
`...linear_qkv.lora_A.default.weight`, `...linear_qkv.lora_B.default.weight`. A checkpoint of the base model (names
without `base_layer.`) loads into the adapted model by the same renaming MindSpeed-LLM's `_load_base_checkpoint_wrapper`
does (training/checkpointing.py:91-95), its adapters keeping their initial values.
"""

from __future__ import annotations

import re

import torch

# the linears of megatron-core's GPT layer that MindSpeed-LLM's tune scripts adapt
TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
ADAPTER = "default"  # peft's adapter name, part of every adapter's parameter name


def enabled(args) -> bool:
    """Whether the job trains LoRA adapters (MindSpeed-LLM's is_enable_lora: --lora-target-modules given)."""
    return bool(getattr(args, "lora_target_modules", None))


class LoraError(ValueError):
    """A LoRA setting or checkpoint that does not fit the model (the job prints it as one line)."""


def inject(model: torch.nn.Module, config, args) -> torch.nn.Module:
    """LoRA adapters on the --lora-target-modules linears of one model chunk, in place; everything else frozen.
    Returns the chunk."""
    from megatron.core import tensor_parallel
    from peft import LoraConfig, inject_adapter_in_model

    from megatron_glue.training.lora_layer import LoraParallelLinear

    targets = list(args.lora_target_modules)
    # MindSpeed-LLM's LoraConfig (training.py:182-190); our layer for megatron-core's two parallel linears
    lora_config = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, target_modules=targets, lora_dropout=0.0,
                             bias="none", megatron_config=config, megatron_core="megatron.core")
    parallel = (tensor_parallel.ColumnParallelLinear, tensor_parallel.RowParallelLinear)
    lora_config._register_custom_module({kind: LoraParallelLinear for kind in parallel})
    found = {name: module for name, module in model.named_modules() if name.rsplit(".", 1)[-1] in targets}
    if not found:
        raise LoraError(f"--lora-target-modules {' '.join(targets)}: this model chunk has no such linear "
                        f"(a layer's are {', '.join(TARGETS)})")
    for name, module in found.items():
        if not isinstance(module, parallel):
            raise LoraError(f"--lora-target-modules: {name} is a {type(module).__name__}, not one of megatron-core's "
                            "ColumnParallelLinear / RowParallelLinear that LoRA adapts here")
    inject_adapter_in_model(lora_config, model, adapter_name=ADAPTER)
    for name, param in model.named_parameters():  # peft's _mark_only_adapters_as_trainable, checked
        param.requires_grad_(is_adapter(name))
    for module in model.modules():
        if isinstance(module, LoraParallelLinear):
            for name in module.lora_A:
                # the whole (unsplit) adapter weight of a sequence-parallel layer sees this rank's tokens only: its
                # gradient is summed over TP by finalize_model_grads, as MindSpeed-LLM marks it (training.py:215-218)
                whole = module.lora_B[name] if module.is_parallel_a else module.lora_A[name]
                whole.weight.sequence_parallel = config.sequence_parallel
    for param in model.parameters():
        if not param.requires_grad and hasattr(param, "sequence_parallel"):
            del param.sequence_parallel  # frozen: nothing to sum (MindSpeed-LLM: training.py:219-221)
    if config.recompute_granularity == "full" and getattr(model, "pre_process", False):
        # full recompute's checkpoint gives grads only when an input needs them: the frozen embedding's output is
        # made to (MindSpeed-LLM's --lora-register-forward-hook, training.py:199-213)
        model.embedding.register_forward_hook(output_requires_grad)
    return model


def is_adapter(name: str) -> bool:
    """Whether a parameter (or state-dict key) is a LoRA adapter's."""
    return ".lora_A." in name or ".lora_B." in name


def output_requires_grad(module, inputs, output):
    """A forward hook: the module's output needs grad although its weights are frozen."""
    if isinstance(output, torch.Tensor) and not output.requires_grad:
        output.requires_grad_(True)


def trainable_line(chunks, tp_rank: int, pp_rank: int) -> str:
    """peft's print_trainable_parameters line, for this model-parallel rank's chunks."""
    params = [p for c in chunks for p in c.parameters()]
    trainable = sum(p.numel() for p in params if p.requires_grad)
    total = sum(p.numel() for p in params)
    return (f" LoRA on (tensor, pipeline) model parallel rank ({tp_rank}, {pp_rank}): trainable params: "
            f"{trainable:,} || all params: {total:,} || "
            f"trainable%: {100 * trainable / max(total, 1):.4f}")


def base_names(state: dict, targets) -> dict:
    """A state dict of the base model (`...linear_qkv.weight`) with the adapted linears' entries under peft's
    `base_layer.` (`...linear_qkv.base_layer.weight`), as MindSpeed-LLM's modify_keys_with_dict renames them;
    entries already so named, and the adapters', as they are."""
    pattern = re.compile(r"(^|\.)(" + "|".join(map(re.escape, targets)) + r")\.(?!base_layer\.|lora_)")
    return {pattern.sub(lambda m: f"{m.group(1)}{m.group(2)}.base_layer.", key, count=1): value
            for key, value in state.items()}


def load_model_state(model: torch.nn.Module, state: dict, args, where: str = "") -> str:
    """Load a checkpoint's model entries into an adapted chunk; returns what it held ("full", "base" or
    "adapters"). A base-model checkpoint (no adapter entries) leaves the adapters as they are; an adapters-only one
    (--lora-ckpt-filter) leaves the rest; anything else missing or unexpected is an error naming it."""
    state = base_names(state, args.lora_target_modules)
    expected = set(model.state_dict())
    given = set(state)
    unexpected = sorted(given - expected)
    missing = sorted(expected - given)
    has_adapters = any(is_adapter(k) for k in given)
    kind = "full"
    if not has_adapters:
        kind = "base"
        missing = [k for k in missing if not is_adapter(k)]
    elif all(is_adapter(k) for k in given):
        kind = "adapters"
        missing = [k for k in missing if is_adapter(k)]
    if unexpected or missing:
        what = (f"unexpected {unexpected[:3]}" if unexpected else "") + \
               (" and " if unexpected and missing else "") + (f"missing {missing[:3]}" if missing else "")
        raise LoraError(f"{where}: the checkpoint's model does not fit this LoRA model ({what}); check "
                        f"--lora-target-modules ({' '.join(args.lora_target_modules)}) against the job that saved it")
    model.load_state_dict(state, strict=False)
    return kind


def adapters_of(state: dict) -> dict:
    """The adapter entries of a model state dict (MindSpeed-LLM's filter_lora_keys, utils.py:65-77)."""
    return {k: v for k, v in state.items() if is_adapter(k)}
