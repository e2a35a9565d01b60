"""The "tp_compile" and "sp" adaptations one by one, in this process (a gloo group of one rank), and the
2-process launcher's failure handling. The 2-rank models themselves are in test_tensor_parallel.py."""

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.testing import CompileCounterWithBackend

from megatron_glue.capture.adaptations import registry
from megatron_glue.capture.distributed import run_on_ranks

# torch 2.13 deprecates the names Megatron calls (all_gather_into_tensor, reduce_scatter_tensor).
pytestmark = pytest.mark.filterwarnings("ignore:`torch.distributed.(all_gather_into_tensor|reduce_scatter_tensor)`")


@contextlib.contextmanager
def applied(*groups):
    """The groups applied for one test, and taken off again after: they change torch.distributed and torch.cuda."""
    before = set(registry.applied())
    registry.apply_groups(groups)
    try:
        yield
    finally:
        registry.revert(*[n for n in registry.applied() if n not in before])


def _functional_collectives(gm):
    """Names of the `_c10d_functional` ops a Dynamo graph calls, in order."""
    names = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    return [name.split(".")[1] for name in names if name.startswith("_c10d_functional.")]


def test_async_collectives_are_captured_as_functional_ones(megatron_cpu, fresh_dynamo):
    from megatron.core.tensor_parallel import layers

    def step(x):
        # What Megatron's linear backward and cross-entropy do (tensor_parallel/layers.py, cross_entropy.py).
        handle = torch.distributed.all_reduce(x, async_op=True)
        handle.wait()
        torch.distributed.all_reduce(x, op=torch.distributed.ReduceOp.MAX)
        gathered = torch.empty_like(x)  # one rank: the gather and the scatter keep the shape
        layers.dist_all_gather_func(gathered, x * 2, async_op=True).wait()
        scattered = torch.empty_like(x)
        layers.dist_reduce_scatter_func(scattered, x * 3, async_op=True).wait()
        return gathered + scattered

    x = torch.randn(4, 3)
    with applied("tp_compile"):
        backend = CompileCounterWithBackend("aot_eager")
        got = torch.compile(step, backend=backend, fullgraph=True)(x.clone())
        (graph,) = backend.graphs
        ops = _functional_collectives(graph)
        expected = step(x.clone())  # eager: the collectives stay async, with real Work handles
    assert ops == ["all_reduce", "wait_tensor", "all_reduce", "wait_tensor",
                   "all_gather_into_tensor", "wait_tensor", "reduce_scatter_tensor", "wait_tensor"]
    assert "'max'" in str(graph.code)  # ReduceOp.MAX reached the functional collective by name
    assert torch.equal(got, expected)


def test_eager_collectives_stay_async(megatron_cpu):
    with applied("tp_compile"):
        work = dist.all_reduce(torch.ones(2), async_op=True)
        assert isinstance(work, dist.Work)
        work.wait()
        assert dist.all_reduce(torch.ones(2)) is None


def test_no_cuda_max_connections_warning(megatron_cpu):
    from megatron.core.tensor_parallel import layers

    before = layers.linear_with_grad_accumulation_and_async_allreduce.warned
    with applied("tp_compile"):
        assert layers.linear_with_grad_accumulation_and_async_allreduce.warned is True
    assert layers.linear_with_grad_accumulation_and_async_allreduce.warned is before


def test_sequence_parallel_norm_is_a_tagged_torch_norm(megatron_cpu):
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megatron_glue.capture.models import gpt_config, llama_config

    with applied("sp"):
        norm = WrappedTorchNorm(llama_config(tensor_model_parallel_size=2, sequence_parallel=True), 64)
        plain = WrappedTorchNorm(gpt_config(), 64)
    assert isinstance(norm, torch.nn.RMSNorm) and all(p.sequence_parallel for p in norm.parameters())
    assert isinstance(plain, torch.nn.LayerNorm)
    assert not any(hasattr(p, "sequence_parallel") for p in plain.parameters())


def test_current_device_stand_in_folds_to_a_constant(megatron_cpu, fresh_dynamo):
    def make(x):
        return x + torch.zeros(x.shape, device=torch.cuda.current_device())

    with applied("sp"):
        assert torch.cuda.current_device() == torch.device("cpu")
        explanation = torch._dynamo.explain(make)(torch.ones(3))
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0)


# -- the launcher ---------------------------------------------------------------------------------------------

def _rank_and_world(offset):
    import os

    return int(os.environ["RANK"]) + offset, int(os.environ["WORLD_SIZE"])


def _fails_on_rank_1():
    import os
    import time

    if os.environ["RANK"] == "1":
        raise ValueError("rank 1 gives up")
    time.sleep(600)  # rank 0 would wait for ever: the launcher must kill it


def _sleeps():
    import time

    time.sleep(600)


@pytest.mark.gloo
def test_run_on_ranks_returns_each_ranks_result():
    assert run_on_ranks(_rank_and_world, 10, world_size=2, timeout=120) == [(10, 2), (11, 2)]


@pytest.mark.gloo
def test_run_on_ranks_raises_the_failing_ranks_traceback_and_kills_the_rest():
    with pytest.raises(RuntimeError, match=r"(?s)failed on rank 1 of 2.*ValueError: rank 1 gives up"):
        run_on_ranks(_fails_on_rank_1, world_size=2, timeout=120)


@pytest.mark.gloo
def test_run_on_ranks_times_out():
    with pytest.raises(TimeoutError, match="ran past 3 s"):
        run_on_ranks(_sleeps, world_size=2, timeout=3)


def test_run_on_ranks_refuses_main_functions():
    def local():
        pass

    local.__module__ = "__main__"
    with pytest.raises(ValueError, match="importable module"):
        run_on_ranks(local)
