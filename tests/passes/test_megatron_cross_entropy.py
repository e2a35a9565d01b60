"""The vocab_parallel_cross_entropy rule fires on megatron-core's loss after its output layer,
``vocab_parallel_cross_entropy(output_layer(h)[0].float(), labels, α)`` on a ColumnParallelLinear, and on its
other loss, ``fused_vocab_parallel_cross_entropy(output_layer(h)[0], labels, tp_group)`` (GPTModel's with
cross_entropy_loss_fusion, impl "native"), as Dynamo captures them (both autograd.Functions' forwards and
backwards in the joint graph), at TP=1 in this process and at TP=2 on 2 gloo processes (their all-reduces as
functional collectives), with and without sequence parallelism, with labels out of the vocabulary (Megatron's
padding, masked by the caller) and label smoothing (the first loss only); the loss and the gradients of the
hidden states and the weight shard equal eager within 1e-5 (fp32)."""

import socket
import time

import pytest
import torch

from megatron_glue.capture.testing import megatron_cpu  # noqa: F401  (fixture)

SEQ, BATCH, HIDDEN, VOCAB = 6, 2, 16, 32
SMOOTHINGS = (0.0, 0.1)
# (native fusion, smoothing): tensor_parallel.vocab_parallel_cross_entropy(α), or fused_vocab_parallel_cross_entropy
LOSSES = [(False, s) for s in SMOOTHINGS] + [(True, 0.0)]
LOSS_IDS = [f"smoothing{s}" for s in SMOOTHINGS] + ["fused"]
IGNORED = -100  # a label in no shard: Megatron counts its logit as 0 and the loss mask drops the token


def _relative(actual, expected):
    return ((actual.double() - expected.double()).abs().max() / expected.double().abs().max()).item()


def _case(tp: int, smoothing: float, dtype=torch.float32, sp: bool = False, target: str = "reference",
          native: bool = False, cast: bool = True):
    """Compiled (backend ascend, target reference) against eager on one rank: (fusions, unfused, errors).
    native: Megatron's fused_vocab_parallel_cross_entropy (smoothing 0) instead of vocab_parallel_cross_entropy;
    cast: the logits' .float() before vocab_parallel_cross_entropy (without, as GPTModel calls it)."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
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
        if native:
            return fused_vocab_parallel_cross_entropy(layer(h)[0], t, parallel_state.get_tensor_model_parallel_group())
        logits = layer(h)[0]
        return tensor_parallel.vocab_parallel_cross_entropy(logits.float() if cast else logits, t, smoothing)

    def run(fn):
        layer.weight.grad = None
        h = hidden.clone().requires_grad_()
        out = fn(h, labels)
        out.backward(seed)
        return out.detach(), h.grad, layer.weight.grad.clone()

    with torch.compiler.set_stance("force_eager"):  # Megatron's jit_fuser helpers (torch.compile) as plain ops
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


def test_megatron_fused_loss_tp1_fused_and_equal_to_eager(megatron_cpu):
    """fused_vocab_parallel_cross_entropy: one all-reduce of the target logits and sums of exponentials
    concatenated, and the logits' gradient rounded to bf16 in an fp32 model too, which the fused op does as well:
    equal to eager within 1e-5 (without that rounding the gradients are 2e-3 off)."""
    _check(*_case(1, 0.0, native=True))


def test_gpt_model_fused_loss_tp1(megatron_cpu):
    """A GPTModel with cross_entropy_loss_fusion (impl "native") compiled whole: its loss is fused, and the loss
    and every parameter's gradient equal eager's within 1e-5."""
    from megatron_glue.capture.models import build_gpt_model, gpt_config, synthetic_batch

    from npu_compile.debug.report import collect

    def config():
        return gpt_config(hidden_size=64, num_attention_heads=4, num_layers=1, cross_entropy_loss_fusion=True,
                          cross_entropy_fusion_impl="native")

    def step(model):
        out = model(**synthetic_batch(BATCH, 16, 256, seed=0))
        out.sum().backward()
        return out.detach(), {n.removeprefix("_orig_mod."): p.grad for n, p in model.named_parameters()}

    with torch.compiler.set_stance("force_eager"):  # Megatron's jit_fuser helpers (torch.compile) as plain ops
        expected = step(build_gpt_model(config(), 256, 16))
    model = build_gpt_model(config(), 256, 16)
    torch._dynamo.reset()
    with collect() as reports:
        got = step(torch.compile(model, backend="ascend"))
    torch._dynamo.reset()
    (report,) = reports
    assert report.fusions["vocab_parallel_cross_entropy"] == 1, report.fusions
    assert not [u for u in report.unfused if u["rule"] == "vocab_parallel_cross_entropy"], report.unfused
    assert got[1].keys() == expected[1].keys() and len(got[1]) == len(list(model.parameters()))
    errors = {"loss": _relative(got[0], expected[0]),
              **{n: _relative(got[1][n], expected[1][n]) for n in expected[1]}}
    print(f"GPT: {errors}")
    assert max(errors.values()) <= 1e-5, errors


@pytest.mark.parametrize("native, cast", [(False, True), (False, False), (True, False)],
                         ids=["float-smoothing0.1", "as-given-smoothing0.1", "fused"])
def test_megatron_loss_tp1_bf16_fused(megatron_cpu, native, cast):
    """bf16 weights: the logits' .float() before the loss, or inside it (GPTModel hands Megatron's loss its bf16
    logits, which the loss's forward casts: autograd then casts their gradient back), or in the fused loss's
    forward for native; the fused op rounds the matmul once as eager does, the gradients within two bf16 ulps
    of eager's."""
    _check(*_case(1, 0.0 if native else 0.1, torch.bfloat16, native=native, cast=cast), tolerance=2 * 2.0**-8)


@pytest.mark.parametrize("native", [False, True], ids=["smoothing0.1", "fused"])
def test_megatron_loss_lowered_for_npu_sim(megatron_cpu, native):
    """On the npu targets the fused op becomes per-chunk aten ops (and the forward's all-reduces), said in
    report.json; still equal to eager (for the fused loss with its logits' gradient rounded to bf16)."""
    fusions, unfused, ops, errors = _case(1, 0.0 if native else 0.1, target="npu-sim", native=native)
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
    from megatron_glue.capture import quiet_megatron

    dist.init_process_group("gloo")
    with quiet_megatron():
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    megatron_glue.adapt()
    start = time.perf_counter()
    results = {(native, smoothing, sp): _case(2, smoothing, sp=sp, native=native)
               for native, smoothing in LOSSES for sp in (False, True)}
    return results, time.perf_counter() - start


@pytest.fixture(scope="module")
def tp2():
    from megatron_glue.capture.distributed import run_on_ranks

    with socket.socket() as s, pytest.MonkeyPatch.context() as env:
        s.bind(("127.0.0.1", 0))
        env.setenv("MASTER_ADDR", "127.0.0.1")
        env.setenv("MASTER_PORT", str(s.getsockname()[1]))
        s.close()
        return run_on_ranks(_tp2_worker, world_size=2, timeout=300)


@pytest.mark.slow
@pytest.mark.gloo
@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
@pytest.mark.parametrize(("native", "smoothing"), LOSSES, ids=LOSS_IDS)
def test_megatron_loss_tp2_fused_and_equal_to_eager(tp2, native, smoothing, sp):
    for rank, (results, _seconds) in enumerate(tp2):
        _check(*results[native, smoothing, sp], tp=2, sp=sp)
