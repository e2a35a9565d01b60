"""The vocab_parallel_cross_entropy rule fires on megatron-core's loss after its output layer,
``vocab_parallel_cross_entropy(output_layer(h)[0].float(), labels, α)`` on a ColumnParallelLinear, as Dynamo
captures it (both autograd.Functions' forwards and backwards in the joint graph), at TP=1 in this process and
at TP=2 on 2 gloo processes (its all-reduces as functional collectives), with and without sequence parallelism,
with labels out of the vocabulary
(Megatron's padding, masked by the caller) and label smoothing; the loss and the gradients of the hidden states
and the weight shard equal eager within 1e-5 (fp32)."""

import socket
import time

import pytest
import torch

from megatron_glue.testing import megatron_cpu  # noqa: F401  (fixture)

SEQ, BATCH, HIDDEN, VOCAB = 6, 2, 16, 32
SMOOTHINGS = (0.0, 0.1)
IGNORED = -100  # a label in no shard: Megatron counts its logit as 0 and the loss mask drops the token


def _relative(actual, expected):
    return ((actual.double() - expected.double()).abs().max() / expected.double().abs().max()).item()


def _case(tp: int, smoothing: float, dtype=torch.float32, sp: bool = False, target: str = "reference"):
    """Compiled (backend ascend, target reference) against eager on one rank: (fusions, unfused, errors)."""
    from megatron.core import tensor_parallel
    from megatron.core.model_parallel_config import ModelParallelConfig

    from npu_compile.debug.report import collect

    config = ModelParallelConfig(tensor_model_parallel_size=tp, params_dtype=dtype,
                                 use_cpu_initialization=True, sequence_parallel=sp)
    torch.manual_seed(0)  # the same master weight on every rank, each keeps its shard
    layer = tensor_parallel.ColumnParallelLinear(HIDDEN, VOCAB, config=config, init_method=torch.nn.init.normal_,
                                                 bias=False, gather_output=False)
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=gen).to(dtype)
    labels = torch.randint(0, VOCAB, (SEQ, BATCH), generator=gen)
    labels.view(-1)[::5] = IGNORED
    seed = torch.randn(SEQ, BATCH, generator=gen)
    if sp:  # each rank holds its part of the sequence; the output layer all-gathers it
        hidden = hidden.chunk(tp)[torch.distributed.get_rank()]

    def loss(h, t):
        return tensor_parallel.vocab_parallel_cross_entropy(layer(h)[0].float(), t, smoothing)

    def run(fn):
        layer.weight.grad = None
        h = hidden.clone().requires_grad_()
        out = fn(h, labels)
        out.backward(seed)
        return out.detach(), h.grad, layer.weight.grad.clone()

    expected = run(loss)
    torch._dynamo.reset()
    with collect() as reports:
        got = run(torch.compile(loss, backend="ascend", options={"target": target}))
    torch._dynamo.reset()
    (report,) = reports
    errors = {name: _relative(g, e) for name, g, e in zip(("loss", "grad_hidden", "grad_weight"), got, expected)}
    return report.fusions, report.unfused, report.lowered_ops, errors


def _check(fusions, unfused, ops, errors, tp=1, sp=False, tolerance=1e-5):
    print(f"TP={tp}{' SP' if sp else ''}: {errors}")
    # what stays of the collectives: the output layer's dgrad all-reduce at TP=2 (none at TP=1: Megatron makes
    # none for one rank), with SP its all-gather and its gradient's reduce-scatter (the backward's second
    # all-gather, for the weight's gradient, went with the pattern)
    assert ops.get("_c10d_functional.all_reduce", 0) == (1 if tp > 1 and not sp else 0), ops
    if sp:
        assert ops["_c10d_functional.all_gather_into_tensor"] == 1, ops
        assert ops["_c10d_functional.reduce_scatter_tensor"] == 1, ops
    assert fusions["vocab_parallel_cross_entropy"] == 1 and unfused == []
    assert ops["npu_compile.vocab_parallel_linear_cross_entropy"] == 1
    assert ops["npu_compile.vocab_parallel_linear_cross_entropy_backward"] == 1
    assert "aten.max" not in ops and "aten.exp" not in ops  # the whole loss went into the fused op
    assert max(errors.values()) <= tolerance, errors


@pytest.mark.parametrize("smoothing", SMOOTHINGS)
def test_megatron_loss_tp1_fused_and_equal_to_eager(megatron_cpu, smoothing):
    _check(*_case(1, smoothing))


def test_megatron_loss_tp1_bf16_fused(megatron_cpu):
    """bf16 weights: the logits' .float() is in the pattern; the fused op rounds the matmul once as eager does,
    the gradients within two bf16 ulps of eager's."""
    _check(*_case(1, 0.1, torch.bfloat16), tolerance=2 * 2.0**-8)


def test_megatron_loss_lowered_for_npu_sim(megatron_cpu):
    """On the npu targets the fused op becomes per-chunk aten ops (and the forward's all-reduces), said in
    report.json; still equal to eager."""
    fusions, unfused, ops, errors = _case(1, 0.1, target="npu-sim")
    assert fusions["vocab_parallel_cross_entropy"] == 1
    assert not [op for op in ops if op.startswith("npu_compile.")], ops
    assert ops["_c10d_functional.all_reduce"] == 3, ops  # max, target logit, sum of exponentials
    assert {u["op"] for u in unfused} == {"npu_compile.vocab_parallel_linear_cross_entropy",
                                          "npu_compile.vocab_parallel_linear_cross_entropy_backward"}
    assert all("no torch_npu kernel" in u["reason"] for u in unfused), unfused
    assert max(errors.values()) <= 1e-5, errors


def _tp2_worker():
    import torch.distributed as dist

    import megatron_glue
    from megatron_glue import quiet_megatron

    dist.init_process_group("gloo")
    with quiet_megatron():
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    megatron_glue.adapt()
    start = time.perf_counter()
    results = {(smoothing, sp): _case(2, smoothing, sp=sp) for smoothing in SMOOTHINGS for sp in (False, True)}
    return results, time.perf_counter() - start


@pytest.fixture(scope="module")
def tp2():
    from megatron_glue.distributed import run_on_ranks

    with socket.socket() as s, pytest.MonkeyPatch.context() as env:
        s.bind(("127.0.0.1", 0))
        env.setenv("MASTER_ADDR", "127.0.0.1")
        env.setenv("MASTER_PORT", str(s.getsockname()[1]))
        s.close()
        return run_on_ranks(_tp2_worker, world_size=2, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
@pytest.mark.parametrize("smoothing", SMOOTHINGS)
def test_megatron_loss_tp2_fused_and_equal_to_eager(tp2, smoothing, sp):
    for rank, (results, _seconds) in enumerate(tp2):
        _check(*results[smoothing, sp], tp=2, sp=sp)
