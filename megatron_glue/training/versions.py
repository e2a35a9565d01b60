"""Which megatron-core line is installed, and what the job must say differently to each.

The job runs on 0.16.1 and on the 0.12.1 line. Where their APIs differ, the difference lives here, named, so
that the job's code reads the same on both.
"""

from __future__ import annotations

from megatron_glue.capture.adaptations import megatron_core_in


def transformer_config_extras() -> dict:
    """TransformerConfig fields that exist only on some lines."""
    extras = {}
    if megatron_core_in(">=0.16"):  # its default "full" earns a deprecation warning (transformer_config.py:1705)
        extras["cuda_graph_scope"] = []
    return extras


def _accepts(function, name: str) -> bool:
    import inspect

    return name in inspect.signature(function).parameters


def pipeline_position(vp_stage: int | None) -> tuple[bool, bool]:
    """(first stage, last stage) of this rank's virtual stage `vp_stage`. 0.16 asks with vp_stage=; 0.12 reads
    the virtual rank from parallel state, so it is set first (as Megatron-LM 0.12's get_model does)."""
    from megatron.core import parallel_state as ps

    if _accepts(ps.is_pipeline_first_stage, "vp_stage"):
        return (ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage))
    if vp_stage is not None:
        ps.set_virtual_pipeline_model_parallel_rank(vp_stage)
    return ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()


def gpt_model_kwargs(vp_stage: int | None) -> dict:
    """GPTModel learns its virtual stage from vp_stage= on 0.13 on; before, from parallel state."""
    from megatron.core.models.gpt import GPTModel

    return {"vp_stage": vp_stage} if vp_stage is not None and _accepts(GPTModel.__init__, "vp_stage") else {}


def optimizer_sharded_state_dict(optimizer, model_state: dict, *, loading: bool, metadata: dict):
    """The optimizer's sharded state dict with the distributed optimizer's sharding chosen: 0.16 reads it from
    `metadata`; 0.12 takes `sharding_type`, whose reshardable choice is 'fully_sharded_model_space'."""
    from megatron.core.optimizer import ChainedOptimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    # asked of the class: ChainedOptimizer, which get_megatron_optimizer returns, takes **kwargs on both lines
    if _accepts(DistributedOptimizer.sharded_state_dict, "metadata"):
        return optimizer.sharded_state_dict(model_state, is_loading=loading, metadata=metadata)

    inner = optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]
    if any(isinstance(o, DistributedOptimizer) for o in inner):
        return optimizer.sharded_state_dict(model_state, is_loading=loading, sharding_type="fully_sharded_model_space")
    return optimizer.sharded_state_dict(model_state, is_loading=loading)


def checkpoint_save_kwargs(metadata: dict) -> dict:
    """dist_checkpointing.save records the sharding metadata with the checkpoint from 0.14 on."""
    from megatron.core import dist_checkpointing

    return {"content_metadata": dict(metadata)} if _accepts(dist_checkpointing.save, "content_metadata") else {}


def unwrap_model(chunks: list) -> list:
    """The GPTModels inside DDP and Float16Module (megatron.core.utils.unwrap_model, which 0.12 lacks)."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import Float16Module

    out = []
    for chunk in chunks:
        while isinstance(chunk, (DistributedDataParallel, Float16Module)):
            chunk = chunk.module
        out.append(chunk)
    return out


def model_chunks(chunks: list):
    """(index, GPTModel) for each virtual-pipeline chunk, with parallel state's virtual rank set to it while the
    caller works on it: 0.12's layers find their global layer numbers there when they build a sharded state dict
    (as Megatron-LM's checkpointing sets it per chunk); 0.16's know their vp_stage and ignore it."""
    from megatron.core import parallel_state as ps

    models = unwrap_model(chunks)
    if len(models) == 1:
        yield 0, models[0]
        return
    before = ps.get_virtual_pipeline_model_parallel_rank()
    try:
        for i, model in enumerate(models):
            ps.set_virtual_pipeline_model_parallel_rank(i)
            yield i, model
    finally:
        ps.set_virtual_pipeline_model_parallel_rank(before)


def uneven_stages(counts: list[int]) -> dict:
    """TransformerConfig fields that build pipeline stages of `counts` transformer layers (MindSpeed-LLM's
    --num-layer-list) with megatron-core's own uneven stages; ValueError naming why where the installed line cannot.

    Both lines: `num_layers_in_first_pipeline_stage` / `num_layers_in_last_pipeline_stage`, the stages between them
    equal (transformer_block.py `get_num_layers_to_build`; at PP=2 only the first is given: with both, 0.12.1's
    TransformerConfig divides the rest by zero stages). 0.16 also takes any list as `pipeline_model_parallel_layout`
    (the embedding on the first stage, the loss on the last)."""
    pp = len(counts)
    if len(set(counts)) == 1:
        return {}
    if len(set(counts[1:])) == 1:
        return {"num_layers_in_first_pipeline_stage": counts[0]}
    if len(set(counts[:-1])) == 1:
        return {"num_layers_in_last_pipeline_stage": counts[-1]}
    if pp > 2 and len(set(counts[1:-1])) == 1:
        return {"num_layers_in_first_pipeline_stage": counts[0], "num_layers_in_last_pipeline_stage": counts[-1]}
    if megatron_core_in(">=0.16"):
        layout = [["decoder"] * n for n in counts]
        layout[0].insert(0, "embedding")
        layout[-1].append("loss")
        return {"pipeline_model_parallel_layout": layout}
    from importlib.metadata import version

    raise ValueError(f"megatron-core {version('megatron-core')} builds uneven stages only as a first and a last "
                     "stage of their own sizes with equal stages between (num_layers_in_first/last_pipeline_stage); "
                     "give such a list, or run on megatron-core 0.16, whose pipeline_model_parallel_layout takes any")


def moe_block_spec(config, normalization: str, vp_stage: int | None):
    """megatron-core's decoder block spec with local modules (MoE and dense layers by config.moe_layer_freq) for
    this pipeline (virtual) stage: 0.16 takes vp_stage=; 0.12 reads the virtual rank from parallel state."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    kwargs = {"vp_stage": vp_stage} if _accepts(get_gpt_decoder_block_spec, "vp_stage") else {}
    return get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=normalization, **kwargs)


def moe_track_names(args) -> list[str]:
    """The MoE losses Megatron-LM logs (training.py training_log: core_v0.16.1 lines 1957-1967, core_v0.12.1 lines
    1487-1492): 0.16 names the sequence-level loss apart; 0.12 logs either as load_balancing_loss."""
    types = args.moe_router_load_balancing_type
    if megatron_core_in(">=0.13"):
        names = [name for kind, name in (("aux_loss", "load_balancing_loss"),
                                         ("seq_aux_loss", "seq_load_balancing_loss")) if kind in types]
    else:
        names = ["load_balancing_loss"] if types[0] in ("aux_loss", "seq_aux_loss") else []
    return names + (["z_loss"] if args.moe_z_loss_coeff is not None else [])


def average_load_balancing_over_dp(args) -> None:
    """megatron-core 0.12 logs the load-balancing loss of the last rank's data-parallel replica alone: its tracker
    reduces over the pipeline and the router's TP x CP group, never over DP (0.12.1
    `transformer/moe/moe_utils.py:634-651`, the router passes no avg_group: `router.py:297-303`), so at DP > 1 the
    logged value is that replica's micro-batches' (EP=2 on 2 processes: 3.1e-4 relative off one process of the
    same global batch). 0.13 on average it over DP (0.16.1 `moe_utils.py:940-948`, the router's tp_cp
    reduce group). The job logs 0.16's value on both lines: the average over the DP group, set on the tracker
    before megatron-core reduces it (the router sets the entry's avg_group to None at each forward)."""
    if megatron_core_in(">=0.13"):
        return
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group(with_context_parallel=False)
    if group.size() == 1:
        return
    tracker = moe_tracker()
    for name in moe_track_names(args):
        if name != "z_loss" and name in tracker:  # 0.16 averages z_loss over no group either (router.py:505-507)
            tracker[name]["avg_group"] = group


def moe_tracker() -> dict:
    """megatron-core's per-layer MoE loss tracker (0.16: moe_utils; 0.12: parallel_state)."""
    try:
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker
    except ImportError:
        from megatron.core.parallel_state import get_moe_layer_wise_logging_tracker
    return get_moe_layer_wise_logging_tracker()


def loss_times_cp_size() -> bool:
    """Whether megatron-core's schedule multiplies a (loss, num_tokens, report) loss by the CP size: 0.12 does
    (0.12.1 `pipeline_parallel/schedules.py:289-292`), and Megatron-LM 0.12's loss_func all-reduces the loss sum and
    the token count over the CP group to match (core_v0.12.1 `pretrain_gpt.py:175-179`); 0.13 on does neither
    (core_v0.13.0 `schedules.py`, 0.16.1 `schedules.py:256-263`)."""
    return megatron_core_in("<0.13")
