"""Adaptations (group "training") that megatron-core's training machinery needs off CUDA, and three fixes to its
DistributedOptimizer resume that any device needs without Apex/TE.

megatron-core's optimizer, grad scaler, grad clipping, schedules and tied-embedding code build small tensors with
`device='cuda'`, check `param.type()` against CUDA type strings and call `torch.cuda.synchronize()`. Most of
these sit inside long functions, so an adaptation here is a *source edit*: the function's own source with named
text substitutions, compiled again in its own module. Every substitution must match its expected number of
times, so a megatron-core release that changed the code fails loudly at `adapt()` instead of running unpatched.
`device='cuda'` becomes `device=torch.cuda.current_device()`, which the "sp" group's `current_device_stand_in`
answers with the CPU (and torch_npu's `transfer_to_npu` answers with the NPU).
"""

from __future__ import annotations

import __future__
import functools
import inspect
import queue
import textwrap

import torch

from megatron_glue.capture.adaptations import Adaptation, registry

GROUP = "training"

_CUDA = "device=torch.cuda.current_device()"
# (old, new) pairs used by several edits; an `old` that is a tuple lists spellings of one thing (at least one
# must occur; every one that does is replaced): megatron-core's lines quote 'cuda' differently
DEVICE = (("device='cuda'", 'device="cuda"'), _CUDA)
LOW_PRECISION_TYPES = ("param.type() in ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']",
                       "param.dtype in (torch.float16, torch.bfloat16)")
FP32_TYPE = ("param.type() == 'torch.cuda.FloatTensor'", "param.dtype == torch.float32")


def source_edit(function, edits: list[tuple[str | tuple[str, ...], str]], where: str):
    """`function` recompiled from its source with each (old, new) substitution applied; each `old` must occur
    (a tuple of spellings: one of them at least).

    The new function runs in the original's module globals. Zero-argument `super()` needs the class cell that
    only a class body gives, so it is spelled out with the owning class's name."""
    raw = inspect.unwrap(function)
    if set(raw.__code__.co_freevars) - {"__class__"}:  # __class__: zero-argument super(), spelled out below
        raise RuntimeError(f"adaptation of {where}: a closure cannot be recompiled from source")
    source = inspect.getsource(raw)
    for olds, new in edits:  # on the text as the file has it, indentation included
        olds = (olds,) if isinstance(olds, str) else olds
        if not any(old in source for old in olds):
            raise RuntimeError(f"adaptation of {where}: {' or '.join(map(repr, olds))} is no longer in its source; "
                               "this megatron-core release needs the adaptation revised")
        for old in olds:
            source = source.replace(old, new)
    source = textwrap.dedent(source)
    qualname = raw.__qualname__
    if "." in qualname and "super()" in source:
        owner = qualname.rsplit(".", 1)[0]
        source = source.replace("super()", f"super({owner}, self)")
    lines = source.splitlines(keepends=True)
    while lines and lines[0].lstrip().startswith("@"):  # decorators were applied to the original already
        lines.pop(0)
    namespace: dict = {}
    future = raw.__code__.co_flags & __future__.annotations.compiler_flag  # the module's own future imports
    code = compile("".join(lines), f"<megatron_glue edit of {inspect.getsourcefile(raw)}:{raw.__name__}>", "exec",
                   flags=future, dont_inherit=True)
    exec(code, raw.__globals__, namespace)
    new = namespace[raw.__name__]
    new.__qualname__ = qualname
    new.__kwdefaults__ = raw.__kwdefaults__
    new.__defaults__ = raw.__defaults__
    if function is not raw:  # a wrapped original (e.g. by a decorator): keep the wrapping, swap the core
        raise RuntimeError(f"adaptation of {where}: the target is a decorated function; edit its inner function")
    new.__megatron_glue_edit__ = edits
    return new


def edit(name: str, target: str, reason: str, *edits: tuple[str, str], group: str = GROUP, **extra) -> Adaptation:
    """Register a source edit of `target` (a dotted path to a function or method)."""
    def build(original):
        is_static = isinstance(original, staticmethod)
        fn = source_edit(original.__func__ if is_static else original, list(edits), target)
        return staticmethod(fn) if is_static else fn

    return registry.add(Adaptation(name, target, group, reason, build=build, **extra))


# -- device='cuda' literals -------------------------------------------------------------------------------------

edit("optimizer_scalars_on_device", "megatron.core.optimizer.optimizer.MixedPrecisionOptimizer.__init__",
     "found_inf, overflow buffer and the unit scale are made with device='cuda' (optimizer/optimizer.py:473-485)",
     DEVICE)
edit("fp32_optimizer_scale_on_device", "megatron.core.optimizer.optimizer.FP32Optimizer.__init__",
     "the constant scale is made with device='cuda' (optimizer/optimizer.py:907)", DEVICE)
edit("grad_scaler_on_device", "megatron.core.optimizer.grad_scaler.MegatronGradScaler.__init__",
     "the loss scale is made with device='cuda' (optimizer/grad_scaler.py:15)", DEVICE)
edit("dynamic_grad_scaler_on_device", "megatron.core.optimizer.grad_scaler.DynamicGradScaler.__init__",
     "min scale, growth and backoff factors are made with device='cuda' (optimizer/grad_scaler.py:88-94)", DEVICE)
edit("grad_scaler_loads_to_device", "megatron.core.optimizer.grad_scaler.DynamicGradScaler.load_state_dict",
     "the loaded scale is moved with .cuda(torch.cuda.current_device()) (optimizer/grad_scaler.py:140)",
     (".cuda(torch.cuda.current_device())", ".to(torch.cuda.current_device())"))
edit("grad_norm_on_device", "megatron.core.optimizer.clip_grads.get_grad_norm_fp32",
     "the norm and the overflow buffer are made with device='cuda' (optimizer/clip_grads.py:90,103,115)", DEVICE)
edit("clip_grads_on_device", "megatron.core.optimizer.clip_grads.clip_grad_by_total_norm_fp32",
     "asserts grads are 'torch.cuda.FloatTensor' and makes its buffer with device='cuda' "
     "(optimizer/clip_grads.py:167,174)",
     ("param.grad.type() == 'torch.cuda.FloatTensor'", "param.grad.dtype == torch.float32"), DEVICE)
edit("count_zeros_on_device", "megatron.core.optimizer.clip_grads.count_zeros_fp32",
     "the zero count is made with device='cuda' (optimizer/clip_grads.py:207)", DEVICE)
edit("l2_norm_on_device", "megatron.core.utils.local_multi_tensor_l2_norm",
     "the no-Apex/TE l2 norm returns a tensor made with device=\"cuda\" (utils.py:1207; 0.12: utils.py:916)", DEVICE)
edit("clip_grads_l2_norm_on_device", "megatron.core.optimizer.clip_grads.l2_norm_impl",
     "grad clipping holds the same l2 norm under its own name (optimizer/clip_grads.py:42)", DEVICE)
edit("no_pipelining_token_count_on_device", "megatron.core.pipeline_parallel.schedules.forward_backward_no_pipelining",
     "the token count is made with device=\"cuda\" (pipeline_parallel/schedules.py:596)", DEVICE)
TOKEN_COUNT_CUDA = ("torch.tensor(0, dtype=torch.int).cuda()",
                    "torch.tensor(0, dtype=torch.int, device=torch.cuda.current_device())")
edit("interleaved_token_count_on_device",
     "megatron.core.pipeline_parallel.schedules.forward_backward_pipelining_with_interleaving",
     "the token count is made with device=\"cuda\" (pipeline_parallel/schedules.py:983)", DEVICE,
     megatron_versions=">=0.13")
edit("interleaved_token_count_on_device_0_12",
     "megatron.core.pipeline_parallel.schedules.forward_backward_pipelining_with_interleaving",
     "the token count is made with .cuda() (0.12: pipeline_parallel/schedules.py:765)", TOKEN_COUNT_CUDA,
     megatron_versions="<0.13")
edit("1f1b_token_count_on_device",
     "megatron.core.pipeline_parallel.schedules.forward_backward_pipelining_without_interleaving",
     "the token count is made with device=\"cuda\" (pipeline_parallel/schedules.py:2138)", DEVICE,
     megatron_versions=">=0.13")
edit("1f1b_token_count_on_device_0_12",
     "megatron.core.pipeline_parallel.schedules.forward_backward_pipelining_without_interleaving",
     "the token count is made with .cuda() (0.12: pipeline_parallel/schedules.py:1828)", TOKEN_COUNT_CUDA,
     megatron_versions="<0.13")
edit("tied_embedding_on_device",
     "megatron.core.models.common.language_module.language_module.LanguageModule.setup_embeddings_and_output_layer",
     "the tied output weight of the last pipeline stage is moved with .cuda() (models/common/language_module/"
     "language_module.py:244)",
     ("weight.data = weight.data.cuda()", "weight.data = weight.data.to(torch.cuda.current_device())"))

# -- CUDA type strings ------------------------------------------------------------------------------------------

edit("float16_optimizer_param_types", "megatron.core.optimizer.optimizer.Float16OptimizerWithFloat16Params.__init__",
     "params must have type() 'torch.cuda.{Half,BFloat16,Float}Tensor' (optimizer/optimizer.py:671,690); test the "
     "dtype instead", LOW_PRECISION_TYPES, FP32_TYPE)
edit("distributed_optimizer_param_types",
     "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer._build_model_and_main_param_groups",
     "params must have type() 'torch.cuda.{Half,BFloat16,Float}Tensor' (optimizer/distrib_optimizer.py:361,420); "
     "test the dtype instead",
     ("model_param.type() in ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']",
      "model_param.dtype in (torch.float16, torch.bfloat16)"),
     ("model_param.type() == 'torch.cuda.FloatTensor'", "model_param.dtype == torch.float32"))
edit("distributed_optimizer_main_param_types",
     "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.__init__",
     "params must have type() 'torch.cuda.{Half,BFloat16}Tensor' (optimizer/distrib_optimizer.py:582); test the "
     "dtype instead", LOW_PRECISION_TYPES)

# -- DistributedOptimizer resume without Apex/TE (any device) ----------------------------------------------------

edit("distributed_optimizer_state_dict_before_first_step",
     "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.state_dict",
     "state_dict() asserts every param has an Adam 'step', which a fresh optimizer has not "
     "(optimizer/distrib_optimizer.py:641-643); loading calls it on a fresh one (:1268), so every resume failed",
     ("steps = list(set([s[\"step\"].item() for s in inner_state_dict[\"state\"].values()]))\n"
      "            assert len(steps) == 1\n"
      "            step = steps[0]",
      "steps = list(set([s[\"step\"].item() for s in inner_state_dict[\"state\"].values()]))\n"
      "            assert len(steps) <= 1\n"
      "            step = steps[0] if steps else 0"))
edit("distributed_optimizer_step_per_param",
     "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.load_state_dict",
     "every param's state gets the same 'step' tensor (optimizer/distrib_optimizer.py:825); torch's AdamW "
     "increments it once per param, so the bias correction after a resume was wrong",
     ('s["step"] = step\n', 's["step"] = step.clone()\n'))
edit("distributed_optimizer_load_keeps_step",
     "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer._set_main_param_and_optimizer_states",
     "copies into views of leaf params outside no_grad, needs a 'step' that fully_reshardable lacks, and under "
     "dp_reshardable overwrites the loaded step with the template's 0 (optimizer/distrib_optimizer.py:938-940)",
     ("            for key in dst_tensors:\n"
      "                dst_tensors[key].copy_(tensors[key])",
      "            with torch.no_grad():\n"
      "                for key in dst_tensors:\n"
      "                    if key != \"step\" and key in tensors:\n"
      "                        dst_tensors[key].copy_(tensors[key])"))


# -- torch.cuda.synchronize ---------------------------------------------------------------------------------------

@registry.wraps(
    "synchronize_without_cuda", "torch.cuda.synchronize", GROUP,
    reason="dist_checkpointing's writer and the p2p ops call torch.cuda.synchronize() "
    "(dist_checkpointing/strategies/filesystem_async.py:230, pipeline_parallel/p2p_communication.py:242,398); "
    "without CUDA there is nothing to wait for",
)
def _synchronize(cuda_synchronize):
    @functools.wraps(cuda_synchronize)
    def synchronize(device=None):
        if torch.cuda.is_available():
            return cuda_synchronize(device)
        return None

    return synchronize


@registry.wraps(
    "no_fp8_params_no_quantize", "megatron.core.fp8_utils._quantize_param_shard_impl", GROUP,
    reason="0.12: without Transformer Engine, the distributed optimizer's step raises 'Invalid Transformer Engine "
    "version for FP8 distributed optimizer' even with no fp8 params to quantize (fp8_utils.py:302, called from "
    "distrib_optimizer.py:2019); with none there is nothing to do",
    megatron_versions="<0.13",
)
def _no_fp8_params_no_quantize(quantize):
    @functools.wraps(quantize)
    def quantize_param_shard_impl(model_params, *args, **kwargs):
        if len(model_params) == 0:
            return None
        return quantize(model_params, *args, **kwargs)

    return quantize_param_shard_impl


# -- numpy 2 (0.12 line) ------------------------------------------------------------------------------------------

NP_PRODUCT = ("np.product(", "np.prod(")  # numpy 2 removed the alias product of prod
for _name, _target, _where in (
    ("flattened_shard_coordinates_numpy2", "megatron.core.dist_checkpointing.mapping.ShardedTensor.local_coordinates",
     "dist_checkpointing/mapping.py:207"),
    ("flattened_shard_validation_numpy2",
     "megatron.core.dist_checkpointing.validation._validate_sharding_for_key_flattened",
     "dist_checkpointing/validation.py:497"),
    ("shard_size_numpy2", "megatron.core.dist_checkpointing.exchange_utils._shard_size",
     "dist_checkpointing/exchange_utils.py:65"),
):
    edit(_name, _target, f"0.12: np.product, which numpy 2 removed, sizes flattened shards of the distributed "
         f"optimizer's checkpoint ({_where})", NP_PRODUCT, megatron_versions="<0.13")


@registry.wraps(
    "checkpoint_writer_serialization_format", "megatron.core.dist_checkpointing.strategies.filesystem_async._write_item",
    GROUP,
    reason="0.12: the checkpoint writer calls torch's _write_item without the serialization_format argument torch "
    "2.13 requires (dist_checkpointing/strategies/filesystem_async.py:320,326); pass torch.save's format, as "
    "0.16 does (filesystem_async.py:374-376)",
    megatron_versions="<0.13",
)
def _write_item_with_format(write_item):
    import inspect

    if "serialization_format" not in inspect.signature(write_item).parameters:
        return write_item  # an older torch: the call is already right
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    @functools.wraps(write_item)
    def write_item_torch_save(*args, **kwargs):
        kwargs.setdefault("serialization_format", SerializationFormat.TORCH_SAVE)
        return write_item(*args, **kwargs)

    return write_item_torch_save


class _InProcessResultsQueue(queue.Queue):
    """The checkpoint writer's results queue, in the saving process: it cannot go to another one."""

    def __reduce__(self):
        raise TypeError("the checkpoint writer's results queue is in-process (adaptation "
                        "'checkpoint_write_results_in_process'): an asynchronous save, whose writer runs in another "
                        "process, needs megatron-core's own queue; revert that adaptation to save asynchronously")


_WRITE_RESULTS: _InProcessResultsQueue | None = None


@registry.wraps(
    "checkpoint_write_results_in_process",
    "megatron.core.dist_checkpointing.strategies.filesystem_async._get_write_results_queue", GROUP,
    reason="the checkpoint writer returns its write results through a queue served by a multiprocessing Manager "
    "made at the first save (dist_checkpointing/strategies/filesystem_async.py:51-56): a spawned process that imports "
    "the job's main module again (torch, megatron-core: 5-7 s of CPU a rank) and stays for the rest of the job "
    "(about 350 MiB a rank). The job saves synchronously (--async-save is refused), and from 0.15 a synchronous "
    "save writes in the saving process (strategies/base.py:212-215, AsyncRequest.execute_sync; before, it went "
    "through a forked caller): the results are put and read there (write_preloaded_data_multiproc, "
    "retrieve_write_results), and an in-process queue holds them",
    megatron_versions=">=0.15",
)
def _in_process_write_results(get_write_results_queue):
    @functools.wraps(get_write_results_queue)
    def write_results_queue():
        global _WRITE_RESULTS
        if _WRITE_RESULTS is None:
            _WRITE_RESULTS = _InProcessResultsQueue()
        return _WRITE_RESULTS

    return write_results_queue


# -- --overlap-param-gather with compiled layers ------------------------------------------------------------------

COMPILED_FORWARD = "_megatron_glue_compiled_forward"  # set on a module whose forward runs as a compiled graph


@registry.wraps(
    "param_gather_waits_before_compiled_forward",
    "megatron.core.distributed.distributed_data_parallel.DistributedDataParallel.enable_forward_pre_hook", GROUP,
    reason="with --overlap-param-gather DDP puts a pre-hook on every submodule that waits for its params' "
    "all-gather (distributed/distributed_data_parallel.py:362-365, 390-414; 0.12: :337-340, 365-389); inside a "
    "compiled layer those hooks are async collectives, Work.wait and warnings.warn: graph breaks. The layer's own "
    "pre-hook, which runs before its compiled forward, waits for the whole layer instead",
)
def _param_gather_before_compiled_forward(enable_forward_pre_hook):
    @functools.wraps(enable_forward_pre_hook)
    def enable(self):
        enable_forward_pre_hook(self)
        handles = self.remove_forward_pre_hook_handles
        for root in [m for m in self.module.modules() if getattr(m, COMPILED_FORWARD, False)]:
            for module in root.modules():
                handles.pop(module).remove()
            wait = self._make_forward_pre_hook()
            inside = list(root.modules())

            def wait_for_subtree(module, *unused, wait=wait, inside=inside):
                for sub in inside:
                    wait(sub)

            handles[root] = root.register_forward_pre_hook(wait_for_subtree)

    return enable
