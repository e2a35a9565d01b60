"""Capture of one megatron-core TransformerLayer at a real tensor-parallel size in one process, for benchmarks.

torch's fake process group (`torch.testing._internal.distributed.fake_pg`) stands in for TP ranks that do not
exist: Megatron builds its groups on it and Dynamo captures the layer's collectives as functional ops, so the
forward and backward graphs are those rank 0 of a TP=8 job would run. Parameters and inputs live on the meta
device, so a layer of realistic size (hidden 4096, seq 4096, bf16) costs shapes, not memory or flops: the
compiled graphs run once on meta tensors to compile the backward. Values are meaningless; use the graphs for
capture, cost and schedule, never for numerics.

Setting up the fake group and Megatron's model-parallel state is global to a process, so
`capture_layer_fake_pg` runs in a fresh process; `capture_layer_here` is the same in the calling process, for a
process dedicated to it.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch


@dataclasses.dataclass
class LayerCapture:
    """What one forward + backward of the layer compiled to. Graphs are kept only in the capturing process."""

    forward_code: str  # readable aten code (empty when another backend compiled the layer)
    backward_code: str
    collectives: dict[str, dict[str, int]]  # "forward" / "backward" -> {collective op name: count}
    dynamo_graphs: int
    graph_breaks: int
    seconds: dict[str, float]  # set-up, build, compile + run (meta), in seconds
    reports: list[dict[str, Any]]  # npu_compile report.json contents, when backend="ascend"
    analysis: Any = None  # what `analyze` returned
    forward: torch.fx.GraphModule | None = dataclasses.field(default=None, repr=False)
    backward: torch.fx.GraphModule | None = dataclasses.field(default=None, repr=False)


def capture_layer_fake_pg(tp: int = 8, sp: bool = True, hidden: int = 4096, heads: int = 32, seq: int = 4096,
                          micro_batch: int = 1, dtype: torch.dtype = torch.bfloat16, backend: Any = None,
                          options: dict | None = None, analyze: Callable[[LayerCapture], Any] | None = None,
                          timeout: float = 600.0) -> LayerCapture:
    """`capture_layer_here` in a fresh process; returns its LayerCapture without the GraphModules (they do not
    cross processes; pass `analyze`, a module-level function of the LayerCapture, to work on them there)."""
    from megatron_glue.capture.distributed import run_on_ranks

    (capture,) = run_on_ranks(_capture_and_strip, tp, sp, hidden, heads, seq, micro_batch, dtype, backend, options,
                              analyze, world_size=1, timeout=timeout)
    return capture


def _capture_and_strip(*args) -> LayerCapture:
    capture = capture_layer_here(*args)
    return dataclasses.replace(capture, forward=None, backward=None)


def capture_layer_here(tp: int = 8, sp: bool = True, hidden: int = 4096, heads: int = 32, seq: int = 4096,
                       micro_batch: int = 1, dtype: torch.dtype = torch.bfloat16, backend: Any = None,
                       options: dict | None = None,
                       analyze: Callable[[LayerCapture], Any] | None = None) -> LayerCapture:
    """Build one TransformerLayer (local spec, GPT style) at TP=`tp` over a fake process group (this process's
    own of `tp` ranks, or a new one) and compile one forward + backward with `backend`, in this process, which
    it takes over: Megatron's model-parallel state, adaptations "cpu" to "sp", Megatron's cuda device on meta.

    backend None: aot_autograd as the ascend backend calls it (min-cut partition, input mutations kept), whose
    forward and backward graphs are returned. Any other torch.compile backend (e.g. "ascend", with `options`)
    compiles the layer itself; then only its reports and counts come back.
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    from megatron_glue.capture import quiet_megatron
    from megatron_glue.capture.adaptations import set_current_device
    from megatron_glue.capture.distributed import init_distributed
    from npu_compile.debug.report import collect

    seconds = {}
    start = time.perf_counter()
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    elif dist.get_backend() != "fake" or dist.get_world_size() != tp:
        raise RuntimeError(f"capture_layer_here needs a fake process group of {tp} ranks or none, not "
                           f"{dist.get_backend()} x {dist.get_world_size()}; use capture_layer_fake_pg")
    # Megatron's gloo side groups cannot be built on the fake backend; nothing here needs them.
    init_distributed(tp, create_gloo_process_groups=False)
    set_current_device("meta")  # Megatron's torch.cuda.current_device() buffers, like everything else
    seconds["set-up"] = time.perf_counter() - start

    with quiet_megatron():
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.transformer_layer import TransformerLayer

        from megatron_glue.capture.models import gpt_config

    start = time.perf_counter()
    config = gpt_config(
        num_layers=1, hidden_size=hidden, num_attention_heads=heads, tensor_model_parallel_size=tp,
        sequence_parallel=sp, params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
    )
    with torch.device("meta"), quiet_megatron():  # shapes only: weights, buffers and activations
        # .to(dtype): the torch norms are built in fp32; Megatron's Float16Module casts the whole model so.
        layer = TransformerLayer(config, get_gpt_layer_local_spec().submodules, layer_number=1).to(dtype)
        tokens = seq // tp if sp else seq  # under SP each rank holds its shard of the sequence
        hidden_states = torch.randn(tokens, micro_batch, hidden, dtype=dtype, requires_grad=True)
        mask = torch.ones(1, 1, seq, seq, dtype=torch.bool).triu(1)
    seconds["build"] = time.perf_counter() - start

    graphs: dict[str, torch.fx.GraphModule] = {}
    compile_backend = _recording_backend(graphs) if backend is None else backend
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    start = time.perf_counter()
    with torch.device("meta"), collect() as reports:
        compiled = torch.compile(layer, backend=compile_backend, options=options)
        output, _ = compiled(hidden_states, attention_mask=mask)
        output.backward(torch.ones_like(output))
    seconds["compile + run on meta"] = time.perf_counter() - start
    counters = torch._dynamo.utils.counters

    capture = LayerCapture(
        forward_code=_code(graphs.get("forward")),
        backward_code=_code(graphs.get("backward")),
        collectives={kind: _count_collectives(gm) for kind, gm in graphs.items()},
        dynamo_graphs=counters["stats"]["unique_graphs"],
        graph_breaks=sum(counters["graph_break"].values()),
        seconds=seconds,
        reports=[r.to_json() for r in reports],
        forward=graphs.get("forward"),
        backward=graphs.get("backward"),
    )
    if analyze is not None:
        capture.analysis = analyze(capture)
    return capture


def _recording_backend(graphs: dict[str, torch.fx.GraphModule]):
    """aot_autograd as the ascend backend sets it up, keeping the forward and backward graphs it hands over."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def keep(kind):
        def compiler(gm, example_inputs):
            graphs[kind] = gm
            return make_boxed_func(gm)  # runs on meta tensors: what it keeps alive costs nothing

        return compiler

    return aot_autograd(
        fw_compiler=keep("forward"), bw_compiler=keep("backward"), partition_fn=min_cut_rematerialization_partition,
        keep_inference_input_mutations=True,
    )


def _count_collectives(gm: torch.fx.GraphModule) -> dict[str, int]:
    from npu_compile import comm

    return dict(collections.Counter(n.target._opname for n in comm.collectives(gm)))


def _code(gm: torch.fx.GraphModule | None) -> str:
    return "" if gm is None else gm.print_readable(print_output=False, include_stride=True, include_device=True)
