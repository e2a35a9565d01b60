"""Target ``npu-sim``: the graph target ``npu`` runs, run on the CPU by an emulation of the torch_npu ops.

Lowering is target npu's: its MC2 stage and its table, call for call; only where the calls run differs, and
what names a communicator (here the c10d group name, over which the emulation runs the collective). ``prepare``
registers the emulator under the ``npu`` namespace with torch_npu's schemas (npu/schemas.py); it refuses where
torch_npu is installed (its own ``npu`` library would collide). The lowered graph then runs op by op like any FX
graph: GE and aclgraph need the device, so this target proves the graph and its numerics, not torchair's
compilation of it.

    common       argument checks, dense outputs
    attention    npu_fusion_attention, npu_fusion_attention_grad (+ _v3, the graph-mode versions)
    norms        npu_rms_norm, npu_add_rms_norm, npu_add_layer_norm (+ backwards)
    activations  npu_gelu, npu_fast_gelu, npu_swiglu (+ backwards)
    rotary       npu_rotary_mul (+ backward)
    cross_entropy  npu_cross_entropy_loss (+ backward)
    moe          npu_grouped_matmul (list form), npu_moe_token_permute_with_routing_map,
                 npu_moe_token_unpermute_with_routing_map,
                 npu_moe_gating_top_k_softmax_v2, npu_moe_gating_top_k
    mc2          npu_all_gather_base_mm, npu_mm_reduce_scatter_base, npu_mm_all_reduce_base

The kernels are written from the documented semantics (docs/npu_ops.md), densely and in fp32, and share no
code with the npu_compile reference kernels: agreeing with them is evidence, not a tautology. Where the
documentation is silent, the choice made is written beside the kernel.
"""

from __future__ import annotations

import functools
import importlib.util
import sys

import torch

from npu_compile.executor import boxed_executor
from npu_compile.lowering import Target
from npu_compile.lowering import npu
from npu_compile.lowering.npu import graph_modes
from npu_compile.lowering.npu import mc2 as npu_mc2
from npu_compile.lowering.npu.schemas import SCHEMAS, TAGS
from npu_compile.lowering.npu_sim import activations, attention, mc2, norms, rotary
from npu_compile.lowering.npu_sim import cross_entropy, moe
from npu_compile.lowering.npu_sim.common import dense_outputs

# op name -> (CPU kernel, fake kernel): every op of npu/schemas.py
KERNELS = {**attention.KERNELS, **norms.KERNELS, **activations.KERNELS, **rotary.KERNELS, **mc2.KERNELS,
           **cross_entropy.KERNELS, **moe.KERNELS}
_library: torch.library.Library | None = None


def torch_npu_installed() -> bool:
    return "torch_npu" in sys.modules or importlib.util.find_spec("torch_npu") is not None


def register() -> None:
    """Define the ``npu`` ops with CPU and fake kernels, once per process."""
    global _library
    if _library is not None:
        return
    if torch_npu_installed():
        raise RuntimeError(
            "target 'npu-sim' emulates torch_npu's ops under their own names and cannot run where torch_npu is "
            "installed; use target='npu' there (or a Python environment without torch-npu)")
    lib = torch.library.Library("npu", "DEF")
    for name, schema in SCHEMAS.items():
        lib.define(schema, tags=TAGS.get(name, ()))
        kernel, fake = KERNELS[name]
        # MC2 kernels return what the collective wrote; the others are made dense as the device writes them
        lib.impl(name, kernel if name in mc2.KERNELS else dense_outputs(kernel), "CPU")
        torch.library.register_fake(f"npu::{name}", fake, lib=lib)
    _library = lib


def c10d_group_name(pg: torch.distributed.ProcessGroup) -> str:
    """npu-sim's ``hcom``: the c10d group name, which its MC2 emulation resolves back to the group."""
    return pg.group_name


TARGET = Target(
    name="npu-sim",
    prepare=register,
    stages=(("mc2", functools.partial(npu_mc2.mc2_stage, hcom=c10d_group_name)),),
    communicator=c10d_group_name,
    table=npu.TABLE,
    lower=npu.lower_table,  # the npu emission for opts.graph_mode; the plan is target npu's (no torchair here)
    executor=lambda gm, example_inputs, opts: boxed_executor(gm),
    describe=graph_modes.describe,  # what target npu would run, and torchair's conversion of it (torchair_check)
)
