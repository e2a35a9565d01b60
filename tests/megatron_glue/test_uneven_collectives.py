"""The "moe" group's stand-ins for megatron-core's gather / reduce-scatter in per-rank row counts over gloo
(uneven_gather_on_gloo, uneven_reduce_scatter_on_gloo: what the alltoall dispatcher does over the expert-tensor-
parallel group, docs/moe.md "Adaptations"), on 2 gloo processes: megatron-core's own functions, eager and compiled,
equal to one process in output and input gradient; without the stand-ins gloo refuses them; for other backends the
stand-ins stand aside."""

import pytest
import torch

from megatron_glue.capture.distributed import run_on_ranks

pytestmark = pytest.mark.gloo

SIZES = (3, 5)  # rows on rank 0 and rank 1
HIDDEN = 4


def _data():
    """Each rank's rows, each rank's weight and each rank's output gradient, the same in every process."""
    gen = torch.Generator().manual_seed(11)
    rows = [torch.randn(n, HIDDEN, generator=gen) for n in SIZES]
    weights = [torch.randn(HIDDEN, HIDDEN, generator=gen) for _ in SIZES]
    grads = [torch.randn(n, HIDDEN, generator=gen) for n in SIZES]
    return rows, weights, grads


def _one_process():
    """What the two ranks compute together: every rank's rows gathered, each rank's expert-like transform, the
    results summed and split back by rank; the rows' gradients."""
    rows, weights, grads = _data()
    rows = [r.clone().requires_grad_() for r in rows]
    gathered = torch.cat(rows)
    total = sum(torch.tanh(gathered @ w) for w in weights)
    outputs = list(torch.split(total, list(SIZES)))
    torch.autograd.backward(outputs, grads)
    return [o.detach() for o in outputs], [r.grad for r in rows]


def _step(x, sizes, weight, group):
    from megatron.core.tensor_parallel.mappings import (
        gather_from_sequence_parallel_region, reduce_scatter_to_sequence_parallel_region)

    split_sizes = sizes.tolist()  # as the dispatcher gives them (token_dispatcher.py:695): from a tensor
    gathered = gather_from_sequence_parallel_region(x, group=group, output_split_sizes=split_sizes)
    return reduce_scatter_to_sequence_parallel_region(torch.tanh(gathered @ weight), group=group,
                                                      input_split_sizes=split_sizes)


def _on_ranks():
    """Each mode on this rank: megatron-core's own collectives (the stand-ins reverted), eager and compiled; then
    the stand-ins, eager and compiled (backend "ascend", one graph): outputs and row gradients, or the error."""
    from megatron.core import parallel_state

    from megatron_glue.capture.distributed import init_distributed
    from megatron_glue.capture.testing import adaptations_reverted
    from megatron_glue.training.training import moe_dynamo_config

    init_distributed(2)
    moe_dynamo_config()
    group = parallel_state.get_tensor_model_parallel_group()
    rank = group.rank()
    rows, weights, grads = _data()
    results = {}

    def run(mode):
        torch._dynamo.reset()
        x = rows[rank].clone().requires_grad_()
        step = _step
        if mode.endswith("compiled"):
            step = torch.compile(_step, backend="ascend", fullgraph=True, options={"target": "reference"})
        try:
            out = step(x, torch.tensor(SIZES), weights[rank], group)
            out.backward(grads[rank])
        except Exception as e:  # noqa: BLE001 (the error itself is the result)
            results[mode] = f"{type(e).__name__}: {e}"
            return
        results[mode] = out.detach(), x.grad

    with adaptations_reverted("uneven_gather_on_gloo", "uneven_reduce_scatter_on_gloo"):
        run("reverted eager")
        run("reverted compiled")
    run("eager")
    run("compiled")
    get_backend = torch.distributed.get_backend
    torch.distributed.get_backend = lambda group=None: "hccl"  # a group of another backend: megatron-core's own call
    try:
        run("other backend")
    finally:
        torch.distributed.get_backend = get_backend
    return results


@pytest.fixture(scope="module")
def ranks():
    """Both ranks' results, from one launch (a launch costs tens of seconds of start-up on 2 cores)."""
    return run_on_ranks(_on_ranks, world_size=2, timeout=300)


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_uneven_gather_and_reduce_scatter_equal_one_process(ranks, mode):
    """Rank r holds SIZES[r] rows: megatron-core's gather_from_sequence_parallel_region with output_split_sizes and
    reduce_scatter_to_sequence_parallel_region with input_split_sizes (each the other's backward) give each rank
    the one-process rows and gradients (fp32, 1e-6: a sum of two terms, in rank order)."""
    outputs, row_grads = _one_process()
    for rank, results in enumerate(ranks):
        assert not isinstance(results[mode], str), results[mode]
        out, grad = results[mode]
        torch.testing.assert_close(out, outputs[rank], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grad, row_grads[rank], rtol=1e-6, atol=1e-6)


def test_gloo_and_dynamo_refuse_megatron_cores_uneven_collectives(ranks):
    """Without the stand-ins: gloo refuses the all_gather of unequal tensors, and Dynamo cannot capture it (its
    remap of all_gather to a functional collective compares the per-rank sizes, data-dependent here)."""
    for results in ranks:
        assert "ProcessGroupGloo::allgather: invalid tensor size" in results["reverted eager"]
        assert "Could not guard on data-dependent expression Eq(u0, " in results["reverted compiled"]


def test_other_backends_keep_megatron_cores_collectives(ranks):
    """The stand-ins act over gloo only: for a group of another backend (HCCL, NCCL) megatron-core's own
    all_gather runs, here met by gloo's refusal."""
    for results in ranks:
        assert "ProcessGroupGloo::allgather: invalid tensor size" in results["other backend"]
