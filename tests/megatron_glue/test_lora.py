"""LoRA fine-tuning (MindSpeed-LLM's --lora-* flags, docs/lora.md): peft's adapters on megatron-core's parallel
linears. The layer against a hand reference (outputs and the gradients of A, B and the input), step 0 equal to the
base model, compiled equal to eager; the job: only the adapters train (base weights bitwise unchanged, optimizer
state for the adapters alone), compiled equals --no-npu-compile, an adapters-only checkpoint (--lora-ckpt-filter)
resumes with --lora-load exactly where the uninterrupted run went, TP=2 with sequence parallelism equals TP=1; the
refusals of bad values."""

from __future__ import annotations

import argparse

import pytest
import torch

from pretrain_runs import assert_close, parse_error, parse_tiny, pretrain

pytest.importorskip("peft", reason="peft (pyproject's megatron extra) is not installed; the job's LoRA is peft's")

TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
R, ALPHA = 4, 8  # scaling alpha / r = 2


def _lora_args(targets=TARGETS):
    return argparse.Namespace(lora_r=R, lora_alpha=ALPHA, lora_target_modules=list(targets))


@pytest.fixture
def model(megatron_cpu, fresh_dynamo):
    """A small Llama-style GPTModel (RMSNorm, SwiGLU, RoPE) with adapters on every target, and its config."""
    from megatron_glue.capture import models
    from megatron_glue.training import lora

    config = models.llama_config(num_layers=2, hidden_size=64, num_attention_heads=4)
    m = models.build_gpt_model(config, vocab_size=128, seq_len=16)
    base_logits = m(**_inputs()).detach()
    lora.inject(m, config, _lora_args())
    return m, base_logits


def _inputs():
    from megatron_glue.capture import models

    batch = models.synthetic_batch(2, 16, 128)
    return {k: v for k, v in batch.items() if k != "labels"}


def _perturb_b(m, seed=1):
    """Non-zero B everywhere (B starts at zero: the adapters would add nothing to check)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def test_only_adapters_train_and_step_0_is_the_base_model(model):
    m, base_logits = model
    trainable = sorted(n for n, p in m.named_parameters() if p.requires_grad)
    assert trainable == sorted(f"decoder.layers.{i}.{mod}.{t}.lora_{ab}.default.weight" for i in range(2)
                               for mod, ts in (("self_attention", TARGETS[:2]), ("mlp", TARGETS[2:])) for t in ts
                               for ab in "AB")
    assert all(torch.count_nonzero(p) == 0 for n, p in m.named_parameters() if ".lora_B." in n)
    assert all(torch.count_nonzero(p) > 0 for n, p in m.named_parameters() if ".lora_A." in n)
    assert torch.equal(m(**_inputs()), base_logits)  # B = 0: the base model, bitwise


@pytest.mark.parametrize("target", ["linear_qkv", "linear_proj"])  # column- and row-parallel base
def test_layer_equals_the_hand_reference(model, target):
    """y = x W^T + (alpha / r) (x A^T) B^T, and the gradients of x, A and B as autograd gives them for it; the
    frozen base weight gets none."""
    m, _ = model
    _perturb_b(m)
    layer = m.decoder.layers[0].self_attention.get_submodule(target)
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    w = layer.base_layer.weight
    assert layer.scaling["default"] == ALPHA / R
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 2, w.shape[1], generator=g, requires_grad=True)
    y, bias = layer(x)
    assert bias is None
    grad_y = torch.randn(y.shape, generator=g)
    y.backward(grad_y)

    x_ref, a_ref, b_ref = (t.detach().clone().requires_grad_(True) for t in (x, a, b))
    y_ref = x_ref @ w.detach().T + (ALPHA / R) * (x_ref @ a_ref.T) @ b_ref.T
    y_ref.backward(grad_y)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    for got, want in ((x.grad, x_ref.grad), (a.grad, a_ref.grad), (b.grad, b_ref.grad)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert w.grad is None


def test_compiled_layers_equal_eager(model):
    """Each layer compiled with backend="ascend" as the job compiles it: the logits and the adapters' gradients
    of eager within 1e-5; the graph holds the whole layer (no break at the adapters)."""
    from torch._dynamo.utils import counters

    m, _ = model
    _perturb_b(m)

    def run():
        m.zero_grad(set_to_none=True)
        out = m(**_inputs())
        out.float().pow(2).mean().backward()
        return out.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad}

    eager_out, eager_grads = run()
    counters.clear()
    for layer in m.decoder.layers:
        layer.forward = torch.compile(layer.forward, backend="ascend")
    compiled_out, compiled_grads = run()
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] >= 1
    torch.testing.assert_close(compiled_out, eager_out, rtol=1e-5, atol=1e-5)
    assert compiled_grads.keys() == eager_grads.keys() and len(eager_grads) == 16
    for name in eager_grads:
        torch.testing.assert_close(compiled_grads[name], eager_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_full_recompute_gives_the_adapters_gradients(megatron_cpu):
    """megatron-core's full recompute checkpoints each layer; its input (the frozen embedding's output) is made to
    require grad, or the checkpointed layers' adapters would get none."""
    from megatron_glue.capture import models
    from megatron_glue.training import lora

    config = models.llama_config(num_layers=2, hidden_size=64, num_attention_heads=4, recompute_granularity="full",
                                 recompute_method="uniform", recompute_num_layers=1)
    m = models.build_gpt_model(config, vocab_size=128, seq_len=16)
    lora.inject(m, config, _lora_args())
    m(**_inputs()).float().pow(2).mean().backward()
    grads = {n: p.grad for n, p in m.named_parameters() if p.requires_grad}
    assert len(grads) == 16 and all(g is not None and torch.count_nonzero(g) > 0
                                    for n, g in grads.items() if ".lora_B." in n), \
        [n for n, g in grads.items() if g is None]


def test_a_base_checkpoint_loads_under_peft_names(model):
    """The base model's state dict (names without base_layer.) loads into the adapted model, as MindSpeed-LLM
    renames it; the adapters keep their values, and an adapters-only state dict leaves the base as it is."""
    from megatron_glue.training import lora

    m, _ = model
    args = _lora_args()
    state = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in m.state_dict().items()}
    base = {k.replace(".base_layer.", "."): v + 1 if k.endswith("base_layer.weight") else v
            for k, v in state.items() if not lora.is_adapter(k)}
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in base
    assert lora.load_model_state(m, base, args) == "base"
    qkv = m.decoder.layers[0].self_attention.linear_qkv
    assert torch.equal(qkv.base_layer.weight, state["decoder.layers.0.self_attention.linear_qkv.base_layer.weight"] + 1)
    assert torch.equal(qkv.lora_A["default"].weight,
                       state["decoder.layers.0.self_attention.linear_qkv.lora_A.default.weight"])
    adapters = {k: torch.zeros_like(v) if k.endswith("lora_A.default.weight") else v
                for k, v in lora.adapters_of(state).items()}
    assert lora.load_model_state(m, adapters, args) == "adapters"
    assert torch.count_nonzero(qkv.lora_A["default"].weight) == 0
    with pytest.raises(lora.LoraError, match=r"the checkpoint's model does not fit this LoRA model \(missing "
                                             r"\['decoder.layers.0.self_attention.linear_proj.lora_A"):
        lora.load_model_state(m, {k: v for k, v in state.items() if "linear_proj.lora_A" not in k}, args)


# -- the command line ---------------------------------------------------------------------------------------------

LORA = ["--lora-target-modules", *TARGETS, "--lora-r", str(R), "--lora-alpha", str(ALPHA)]


def test_flags_parse_with_mindspeed_llms_defaults():
    args = parse_tiny("--lora-target-modules", "linear_qkv", "--lora-fusion")
    assert (args.lora_r, args.lora_alpha, args.lora_target_modules, args.lora_fusion) == (16, 32, ["linear_qkv"], True)
    assert parse_tiny().lora_target_modules == []


@pytest.mark.parametrize("flags, message", [
    (["--lora-target-modules", "linear_qkv", "linear_q"],
     "--lora-target-modules linear_q: not a linear of this job's layers; choose from linear_qkv linear_proj "
     "linear_fc1 linear_fc2"),
    (["--lora-target-modules", "linear_qkv", "--lora-r", "0"],
     "--lora-r 0: the adapters' rank must be a positive integer (MindSpeed-LLM's tune scripts give 8 or 16)"),
    (["--lora-r", "8", "--lora-ckpt-filter"],
     "--lora-r, --lora-ckpt-filter without --lora-target-modules: LoRA is on only with --lora-target-modules (any "
     "of linear_qkv linear_proj linear_fc1 linear_fc2); give it, or drop --lora-r, --lora-ckpt-filter"),
    (["--lora-target-modules", "linear_qkv", "--lora-fusion", "--no-npu-compile"],
     "--lora-fusion is the compiled layer graph (base matmul, collective and adapters together), which "
     "--no-npu-compile turns off; drop one of them"),
    (["--lora-target-modules", "linear_qkv", "--save", "/tmp/lora-refused"],
     "--lora-target-modules with --ckpt-format torch_dist: LoRA checkpoints are written and read in the torch "
     "format here (MindSpeed-LLM's tune scripts give --ckpt-format torch, and its --lora-ckpt-filter applies to "
     "that format only); give --ckpt-format torch"),
    (["--lora-target-modules", "linear_qkv", "--num-experts", "4", "--disable-bias-linear"],
     "--lora-target-modules with --num-experts: LoRA on MoE layers (MindSpeed-LLM's LoRA experts) is not "
     "implemented here; LoRA adapts dense models"),
])
def test_bad_values_are_refused(flags, message):
    assert parse_error(*flags) == "pretrain_gpt: error: " + message


# -- the job ------------------------------------------------------------------------------------------------------

def _model_state(folder, iteration):
    path = folder / f"iter_{iteration:07d}" / "mp_rank_00" / "model_optim_rng.pt"
    return torch.load(path, map_location="cpu", weights_only=False)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A base model's checkpoint (torch format, one step of full training), as the LoRA runs start from."""
    folder = tmp_path_factory.mktemp("base")
    pretrain(folder, "--train-iters", "1", "--save", str(folder / "ckpt"), "--ckpt-format", "torch",
             "--no-npu-compile").check()
    return folder / "ckpt"


@pytest.fixture(scope="module")
def compiled(base, tmp_path_factory):
    """4 LoRA steps from the base, compiled, --lora-fusion, full checkpoints at 2 and 4."""
    folder = tmp_path_factory.mktemp("compiled")
    return pretrain(folder, *LORA, "--lora-fusion", "--load", str(base), "--finetune", "--ckpt-format", "torch",
                    "--train-iters", "4", "--save", str(folder / "ckpt"), "--save-interval", "2").check()


@pytest.mark.training
@pytest.mark.megatron_lines
def test_job_trains_only_the_adapters(base, compiled):
    from megatron_glue.training import lora

    assert " LoRA on (tensor, pipeline) model parallel rank (0, 0): trainable params: 8,192 || all params: " \
        in compiled.output
    start = _model_state(base, 1)["model"]
    after = _model_state(compiled.folder / "ckpt", 4)
    trained = after["model"]
    renamed = lora.base_names(start, TARGETS)
    frozen = [k for k in trained if not lora.is_adapter(k) and not k.endswith("_extra_state")]
    assert set(frozen) == {k for k in renamed if not k.endswith("_extra_state")}
    for key in frozen:  # embedding, norms, output layer, the adapted linears' own weights: bitwise as loaded
        assert torch.equal(trained[key], renamed[key]), key
    b = [k for k in trained if ".lora_B." in k and k.endswith("weight")]
    assert len(b) == 8 and all(torch.count_nonzero(trained[k]) > 0 for k in b)  # B left zero: it trained
    # the optimizer's state (Adam's moments) is the adapters' alone: 16 tensors of their shapes
    state = after["optimizer"]["state"] if "state" in after["optimizer"] else after["optimizer"]["optimizer"]["state"]
    adapters = sorted(tuple(v.shape) for k, v in trained.items() if lora.is_adapter(k) and k.endswith("weight"))
    assert len(state) == 16
    assert sorted(tuple(s["exp_avg"].shape) for s in state.values()) == adapters
    assert len(compiled.losses) == 4


@pytest.mark.training
@pytest.mark.megatron_lines
def test_adapters_only_checkpoint_resumes_with_lora_load(base, compiled, tmp_path):
    """--no-npu-compile equals the compiled run; its --lora-ckpt-filter checkpoint holds the adapters alone and,
    with the base model as --load and it as --lora-load, resumes at iteration 2 to the compiled run's losses."""
    from megatron_glue.training import lora

    common = [*LORA, "--load", str(base), "--ckpt-format", "torch", "--no-npu-compile"]
    eager = pretrain(tmp_path / "eager", *common, "--finetune", "--train-iters", "4", "--exit-interval", "2",
                     "--save", str(tmp_path / "adapters"), "--save-interval", "2", "--lora-ckpt-filter").check()
    assert_close(eager.losses, compiled.losses[:2], what="--no-npu-compile vs compiled")
    saved = _model_state(tmp_path / "adapters", 2)
    assert saved["model"] and all(lora.is_adapter(k) for k in saved["model"])
    assert len([k for k in saved["model"] if k.endswith("weight")]) == 16
    assert "optimizer" in saved and "opt_param_scheduler" in saved

    resumed = pretrain(tmp_path / "resumed", *common, "--lora-load", str(tmp_path / "adapters"),
                       "--train-iters", "4").check()
    assert "successfully loaded checkpoint from " + str(tmp_path / "adapters") in resumed.output
    assert [r["iteration"] for r in resumed.rows("train")] == [3, 4]
    assert_close(resumed.losses, compiled.losses[2:], what="resumed from the adapters vs uninterrupted")

    wrong = pretrain(tmp_path / "wrong", *common, "--finetune", "--train-iters", "1", "--load",
                     str(tmp_path / "adapters"))
    assert wrong.returncode == 1
    assert (f"pretrain_gpt: error: --load {tmp_path / 'adapters' / 'iter_0000002'} holds only LoRA adapters (saved "
            "with --lora-ckpt-filter): give it as --lora-load, and the base model's checkpoint as --load") \
        in wrong.output


@pytest.mark.slow
@pytest.mark.training
@pytest.mark.gloo
def test_tensor_parallel_equals_one_process(tmp_path):
    """TP=2 with sequence parallelism, compiled (A split over TP on row-parallel linears, B on column-parallel
    ones, the whole adapter weights' gradients summed over TP) trains as one process eager does: losses and
    gradient norms within 1e-5, from the same initial model (no --load: TP splits the same full weights)."""
    common = [*LORA, "--train-iters", "3"]
    one = pretrain(tmp_path / "tp1", *common, "--no-npu-compile").check()
    tp2 = pretrain(tmp_path / "tp2", *common, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                   "--lora-fusion", nproc=2).check()
    assert_close(tp2.losses, one.losses, what="TP=2 SP compiled vs TP=1 eager: losses")
    norms = [[r["grad_norm"] for r in run.rows("train")] for run in (tp2, one)]
    assert_close(*norms, what="TP=2 SP compiled vs TP=1 eager: grad norms")
