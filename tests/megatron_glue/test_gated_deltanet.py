"""Qwen3-Next's Gated DeltaNet layers (MindSpeed-LLM's qwen3_next_spec, --full-attention-interval) as the job builds
them from megatron-core 0.16's GatedDeltaNet (docs/linear_attention.md): the layer pattern, the FLA stand-ins of the
"linear_attention" adaptation group, the hybrid model compiled against eager, the flags at the door."""

from __future__ import annotations

import types

import pytest
import torch
from torch._dynamo.utils import counters

from megatron_glue.capture.adaptations import megatron_core_in, registry

# Dynamo traces through RotaryEmbedding.forward's lru_cache and says so (tests/megatron_glue/test_compile.py)
pytestmark = pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")
needs_gdn = pytest.mark.skipif(not megatron_core_in(">=0.16"), reason="megatron-core's GatedDeltaNet arrived in 0.16")

# A tiny Qwen3-Next: 4 layers, every 2nd full attention (with the output gate, q/k norms, RoPE on a quarter of each
# head), the others Gated DeltaNet with 2 key heads serving 4 value heads; chunks of 8 over 32 tokens
GDN = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
       "--full-attention-interval 2 --linear-key-head-dim 8 --linear-value-head-dim 8 --linear-num-key-heads 2 "
       "--linear-num-value-heads 4 --mamba-chunk-size 8 --swiglu --normalization RMSNorm --qk-layernorm "
       "--position-embedding-type rope --partial-rotary-factor 0.25 --add-rmsnorm-offset --disable-bias-linear "
       "--spec mindspeed_llm.tasks.models.spec.qwen3_next_spec layer_spec").split()
SEQ = 32


@pytest.fixture(scope="module")
def linear_attention(megatron_cpu):
    """The "linear_attention" group (with "sp": --add-rmsnorm-offset's norm) on top of the session's; reverted after."""
    from megatron_glue.capture import adapt

    before = set(registry.applied())
    adapt(("sp", "linear_attention"))
    yield
    registry.revert(*[n for n in registry.applied() if n not in before])


def _args(*flags: str):
    from pretrain_runs import parse_tiny

    from megatron_glue.training.gpt import set_vocabulary

    args = parse_tiny(*GDN, *flags)
    set_vocabulary(args)
    return args


def _model(args, seed: int = 0):
    """The job's model (training.transformer_config, gpt.model_provider) on CPU, the Gated DeltaNet decays set small
    (A = 0.02..0.2) so that the recurrent state carries across chunks: megatron-core's init (A up to 16,
    ssm/gated_delta_net.py:86,242-247) forgets within a token, and the gates' gradients then are rounding noise."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_glue.capture import quiet_megatron
    from megatron_glue.training import training
    from megatron_glue.training.gpt import model_provider

    config = training.transformer_config(args, types.SimpleNamespace(device=torch.device("cpu")))
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    with quiet_megatron():
        model = model_provider(args, config)
    decays = torch.Generator().manual_seed(seed + 1)
    for layer in model.decoder.layers:
        if hasattr(layer.self_attention, "A_log"):
            a = layer.self_attention.A_log
            a.data.copy_(torch.empty(a.shape).uniform_(0.02, 0.2, generator=decays).log())
    return model


def _loss(model, batch) -> torch.Tensor:
    return model(batch["input_ids"], batch["position_ids"], None, labels=batch["labels"]).mean()


@needs_gdn
def test_layers_follow_mindspeed_llms_pattern(linear_attention):
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    from megatron.core.transformer.attention import SelfAttention

    args = _args("--num-layers", "6", "--full-attention-interval", "3")
    model = _model(args)
    kinds = [type(layer.self_attention) for layer in model.decoder.layers]
    # MindSpeed-LLM (transformer_block.py:176-185): layer n (1-based) is full attention where n % interval == 0
    assert kinds == [GatedDeltaNet, GatedDeltaNet, SelfAttention] * 2
    attention, gdn = model.decoder.layers[2].self_attention, model.decoder.layers[0].self_attention
    # Qwen3-Next's full attention: the output gate (its q projection twice the query's width), q/k norms, a quarter
    # of each head rotated
    assert attention.config.attention_output_gate and attention.q_layernorm is not None
    assert attention.linear_qkv.weight.shape == ((2 * 4 + 2 * 2) * 8, 32)
    assert model.rotary_pos_emb.inv_freq.numel() == 8 // 4 // 2
    # the Gated DeltaNet's sizes from the --linear-* flags: q, k (2 heads of 8), v, z (4 heads of 8), b, a (4 each)
    assert gdn.in_proj.weight.shape == (2 * 16 + 2 * 32 + 2 * 4, 32)
    assert gdn.conv1d.weight.shape == (2 * 16 + 32, 1, 4)  # --mamba-d-conv 4 (MindSpeed-LLM's default)


@needs_gdn
def test_fla_stand_ins_are_megatron_cores_torch_path(linear_attention, fresh_dynamo):
    """The stand-in kernel is megatron-core's own torch_chunk_gated_delta_rule: the layer gives what its deterministic
    mode (which calls that function, ssm/gated_delta_net.py:370-380) gives, bit for bit, at its chunk length 64."""
    from megatron_glue.capture.adaptations import set_gated_delta_rule_chunk_size

    model = _model(_args())
    gdn = model.decoder.layers[0].self_attention
    x = torch.randn(SEQ, 2, 32, generator=torch.Generator().manual_seed(3))
    set_gated_delta_rule_chunk_size(64)
    counters.clear()
    try:
        ours, _ = gdn(x, None)
        # eager is eager: megatron-core's jit_fuser (torch.compile) on the gated norm is taken off
        assert not counters["stats"]["unique_graphs"]
        gdn.config.deterministic_mode = True
        megatrons, _ = gdn(x, None)
    finally:
        gdn.config.deterministic_mode = False
        set_gated_delta_rule_chunk_size(8)
    assert torch.equal(ours, megatrons)
    # the chunk length (--mamba-chunk-size) changes the rounding only: 4 chunks of 8 against one of 64
    chunked, _ = gdn(x, None)
    torch.testing.assert_close(chunked, ours, rtol=1e-5, atol=1e-6)


def test_l2norm_stand_in_is_flas_formula():
    _l2norm = registry.get("l2norm_in_torch").build(None)

    x = torch.randn(3, 5, 16, dtype=torch.float64)
    expected = x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(_l2norm(x.float()), expected.float(), rtol=1e-6, atol=1e-7)
    assert torch.equal(_l2norm(torch.zeros(2, 8)), torch.zeros(2, 8))  # eps under the root: no NaN at zero
    assert _l2norm(x.to(torch.bfloat16)).dtype == torch.bfloat16


@needs_gdn
def test_compiled_hybrid_model_trains_as_eager(linear_attention, fresh_dynamo):
    """Each layer compiled with backend="ascend" as the job compiles them: no graph break, and the loss and every
    gradient within 1e-5 of eager (fp32), over two optimizer steps."""
    from megatron_glue.capture.models import synthetic_batch
    from npu_compile.debug.report import collect

    args = _args()
    eager, compiled = _model(args), _model(args)
    for layer in compiled.decoder.layers:
        layer.forward = torch.compile(layer.forward, backend="ascend")
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, compiled)]
    counters.clear()
    with collect() as reports:
        for step in range(2):
            batch = synthetic_batch(2, SEQ, args.padded_vocab_size, seed=step)
            losses = []
            for model, optimizer in zip((eager, compiled), optimizers):
                optimizer.zero_grad(set_to_none=True)
                loss = _loss(model, batch)
                loss.backward()
                losses.append(loss.detach())
            torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=0)
            for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
                scale = p.grad.abs().max().item()
                assert scale > 0, name
                worst = (q.grad - p.grad).abs().max().item() / scale
                assert worst <= 1e-5, f"step {step}: grad of {name} differs by {worst:.1e} of its largest"
            for optimizer in optimizers:
                optimizer.step()
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    fusions = [r.to_json()["fusions"] for r in reports]
    # the Gated DeltaNet layer's graph (no attention) and the full-attention one, each with the backend's rules
    assert any(f["attention"] == 0 and f["rms_norm"] > 0 for f in fusions), fusions
    assert any(f["attention"] == 1 for f in fusions), fusions


# -- the door -------------------------------------------------------------------------------------------------------

@needs_gdn
def test_flags_map_onto_megatron_cores_config():
    from megatron_glue.training import training

    args = _args("--mamba-d-conv", "3", "--use-triton-gdn", "--mamba-expand", "2", "--no-enable-linear-qkv")
    config = training.transformer_config(args, types.SimpleNamespace(device=torch.device("cpu")))
    assert (config.experimental_attention_variant, config.linear_attention_freq, config.attention_output_gate) == (
        "gated_delta_net", 2, True)
    assert (config.linear_key_head_dim, config.linear_value_head_dim, config.linear_num_key_heads,
            config.linear_num_value_heads, config.linear_conv_kernel_dim) == (8, 8, 2, 4, 3)
    assert args.rotary_percent == 0.25 and args.mamba_chunk_size == 8


@needs_gdn
def test_no_effect_flags_say_why_in_help():
    from megatron_glue.training.arguments import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "--use-triton-gdn MindSpeed-LLM's choice of its Triton kernel for the chunked gated delta rule" in text
    assert "--mamba-expand MAMBA_EXPAND the inner-width factor of MindSpeed-LLM's Mamba mixer" in text
    assert "experimental_attention_variant 'gated_delta_net', linear_attention_freq N" in text


GDN_ONLY = "with Gated DeltaNet layers (--full-attention-interval) is not implemented here"


@needs_gdn
@pytest.mark.parametrize("flags, message", [
    (["--context-parallel-size", "2"], "--context-parallel-size 2: context parallelism " + GDN_ONLY),
    (["--reset-attention-mask"], "--reset-attention-mask: packing documents " + GDN_ONLY),
    (["--tensor-model-parallel-size", "2"], "--tensor-model-parallel-size 2: tensor parallelism " + GDN_ONLY),
    (["--num-experts", "4"], "--num-experts 4: MoE (Qwen3-Next's MoE layers) " + GDN_ONLY),
])
def test_combinations_megatron_cores_gdn_lacks_are_refused(flags, message):
    from pretrain_runs import parse_error

    assert message in parse_error(*GDN, *flags, world_size=4)


@needs_gdn
@pytest.mark.parametrize("flags, message", [
    (["--linear-num-value-heads", "3"], "--linear-num-value-heads 3 is not a multiple of --linear-num-key-heads 2"),
    (["--linear-key-head-dim", "0"], "--full-attention-interval needs the Gated DeltaNet sizes --linear-key-head-dim"),
    (["--full-attention-interval", "0"], "--full-attention-interval 0 must be >= 1"),
    (["--rotary-percent", "0.5"], "--partial-rotary-factor 0.25 and --rotary-percent 0.5 both set the rotated share"),
    (["--mamba-chunk-size", "0"], "--mamba-chunk-size 0 must be >= 1"),
])
def test_bad_sizes_are_named(flags, message):
    from pretrain_runs import parse_error

    assert message in parse_error(*GDN, *flags)


@needs_gdn
def test_qwen3_next_pieces_alone_are_refused_with_what_to_give():
    from pretrain_runs import parse_error

    at = GDN.index("--full-attention-interval")
    no_interval = GDN[:at] + GDN[at + 2:]
    assert ("--spec mindspeed_llm.tasks.models.spec.qwen3_next_spec layer_spec: Qwen3-Next's layers without "
            "--full-attention-interval") in parse_error(*no_interval)
    assert "--no-enable-linear-qkv goes with Qwen3-Next's layers" in parse_error("--no-enable-linear-qkv")
    assert "--full-attention-interval needs --swiglu" in parse_error(*[f for f in GDN if f != "--swiglu"])


@pytest.mark.skipif(megatron_core_in(">=0.16"), reason="the refusal of the lines before megatron-core 0.16")
def test_megatron_core_before_016_is_refused_on_one_line():
    from pretrain_runs import parse_error

    from megatron_glue.capture.adaptations import megatron_core_version

    assert parse_error(*GDN) == (
        "python -m megatron_glue.pretrain_gpt: error: --full-attention-interval 2: Gated DeltaNet layers need "
        f"megatron-core 0.16 or later (its megatron.core.ssm.gated_delta_net); this is {megatron_core_version()}: "
        "install megatron-core>=0.16 (this project's extras pin 0.16.1)")


@needs_gdn
@pytest.mark.training
def test_job_resumes_the_hybrid_model_exactly(tmp_path):
    """Saved at iteration 2 (torch_dist: megatron-core's GatedDeltaNet splits in_proj and conv1d into q/k/v/z/b/a
    pieces, ssm/gated_delta_net.py:423-509) and resumed: iterations 3 and 4 as a run straight through, bit for bit."""
    from pretrain_runs import pretrain

    flags = [*GDN, "--no-npu-compile", "--lr-decay-iters", "4", "--save-interval", "2"]
    ckpt = ["--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt")]
    pretrain(tmp_path / "first", *flags, *ckpt, "--train-iters", "2", nproc=2).check()
    resumed = pretrain(tmp_path / "resumed", *flags, *ckpt, "--train-iters", "4", nproc=2).check()
    straight = pretrain(tmp_path / "straight", *flags, "--train-iters", "4", nproc=2).check()
    assert "successfully loaded checkpoint" in resumed.output
    assert resumed.losses == straight.losses[2:], (resumed.losses, straight.losses)
    # another layer pattern is another model: refused at load, naming the flag (the checkpoint's architecture)
    other = pretrain(tmp_path / "other", *flags, *ckpt, "--train-iters", "4", "--full-attention-interval", "4",
                     nproc=2)
    assert other.returncode != 0
    assert "was saved with --full-attention-interval 2, this job has 4; use the checkpoint's value" in other.output
