"""`npu-compile convert` of MoE families against transformers: a random-init Mixtral, Qwen2-MoE (gated shared
expert, norm_topk_prob false) and Qwen3-MoE (softmax router, top 2 of 4 experts) converted to a torch_dist
checkpoint and loaded by the training job's own load gives transformers' logits and routes every token to the
same experts, at EP=1 and (over gloo) EP=2; converted back it is the original, bitwise. Qwen without
norm_topk_prob converts with --moe-router-pre-softmax (docs/convert.md, "Mixture of experts")."""

from __future__ import annotations

import os
import types

import pytest
import torch

import hf_models as H
from megatron_glue.convert import core, main
from test_convert import TOL, _assert_same_weights

pytestmark = pytest.mark.usefixtures("process_state_kept")


def _families() -> tuple[str, ...]:
    """Qwen2-MoE's gated shared expert is megatron-core 0.16's (moe_shared_expert_gate): on 0.12 it is refused
    (test_qwen2_moe_refused_on_megatron_core_0_12)."""
    from megatron_glue.capture.adaptations import megatron_core_in

    return H.MOE_FAMILIES if megatron_core_in(">=0.16") else tuple(f for f in H.MOE_FAMILIES if f != "qwen2-moe")


def _convert(name: str, root, seed: int, **over):
    hf, mg = str(root / name / "hf"), str(root / name / "mg")
    H.save_random_hf(name, hf, seed=seed, **over)
    assert main(["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", hf, "--save-dir", mg,
                 "--model-type-hf", name]) == 0
    return hf, mg


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """{family: (hf dir, mg dir, HF config dict, token ids)}."""
    root = tmp_path_factory.mktemp("convert_moe")
    out = {}
    for i, name in enumerate(_families()):
        hf, mg = _convert(name, root, 20 + i)
        out[name] = (hf, mg, H.read_config(hf), H.tokens(seed=i))
    return out


def _hf_run(folder: str, ids: torch.Tensor):
    """transformers' logits and, per layer, the experts each token is routed to ([b*s, k] sorted)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    cfg = model.config
    k = cfg.num_experts_per_tok
    with torch.no_grad():
        out = model(ids, output_router_logits=True)
    chosen = [logits.topk(k, dim=-1).indices.sort(dim=-1).values for logits in out.router_logits]
    return out.logits, chosen


def _megatron_run(mg: str, cfg: dict, ids: torch.Tensor):
    """The job's model (gpt.model_provider with the converted flags) loaded by its load_checkpoint, eager: logits
    over the true vocabulary and, per layer, each token's experts (megatron-core's routing_map; tokens in HF's
    [batch, sequence] order)."""
    import megatron_glue
    from megatron_glue.capture import quiet_megatron
    from megatron_glue.capture.models import init_single_process, teardown_single_process
    from megatron_glue.convert.families import family_for
    from megatron_glue.training import checkpointing, gpt, training

    megatron_glue.adapt(("cpu", "compile", "sp", "moe"))
    teardown_single_process()
    init_single_process()
    try:
        args = core.architecture(family_for(None, cfg), cfg)
        args.load, args.finetune = mg, True
        config = training.transformer_config(args, types.SimpleNamespace(device=torch.device("cpu")))
        with quiet_megatron():
            model = gpt.model_provider(args, config).eval()
        checkpointing.load_checkpoint(args, [model], None, None)
        maps = []
        b, s = ids.shape
        for layer in model.decoder.layers:  # routing_map [s*b, experts] -> the chosen experts in [b*s] order
            layer.mlp.router.register_forward_hook(lambda m, i, o: maps.append(
                o[1].reshape(s, b, -1).transpose(0, 1).reshape(b * s, -1)))
        with torch.no_grad():
            logits = model(ids, torch.arange(s).expand(b, s), None)[..., : cfg["vocab_size"]]
    finally:
        teardown_single_process()
    k = args.moe_router_topk
    chosen = [m.nonzero()[:, 1].reshape(-1, k) for m in maps]  # nonzero is row-major: each row's experts ascending
    return logits, chosen


@pytest.mark.parametrize("name", _families())
def test_moe_family_equals_transformers_and_routes_the_same(converted, name):
    hf, mg, cfg, ids = converted[name]
    ref, ref_chosen = _hf_run(hf, ids)
    got, chosen = _megatron_run(mg, cfg, ids)
    assert (got - ref).abs().max().item() <= TOL * ref.abs().max().item()
    assert len(chosen) == len(ref_chosen) == cfg["num_hidden_layers"]
    for layer, (a, b) in enumerate(zip(chosen, ref_chosen)):
        assert torch.equal(a, b), f"{name} layer {layer}: other experts chosen"


def test_moe_flags(converted):
    flags = {name: open(os.path.join(mg, core.FLAGS_FILE)).read().split() for name, (_, mg, *_) in converted.items()}
    for name, want in (("mixtral", ["--num-experts", "4", "--moe-ffn-hidden-size", "96", "--moe-router-topk", "2"]),
                       ("qwen2-moe", ["--num-experts", "4", "--moe-ffn-hidden-size", "32", "--moe-router-topk", "2",
                                      "--moe-router-pre-softmax", "--moe-shared-expert-intermediate-size", "48",
                                      "--moe-shared-expert-gate", "--add-qkv-bias"]),
                       ("qwen3-moe", ["--num-experts", "4", "--moe-ffn-hidden-size", "32", "--moe-router-topk", "2"])):
        if name not in flags:
            continue
        i = flags[name].index("--num-experts")
        assert flags[name][i:i + len(want)] == want, name
    assert "--qk-layernorm" in flags["qwen3-moe"] and "--qk-layernorm" not in flags["mixtral"]
    # Mixtral and Qwen3-MoE (norm_topk_prob) renormalise the top k: megatron-core's router without pre-softmax
    assert "--moe-router-pre-softmax" not in flags["mixtral"] + flags["qwen3-moe"]
    assert "--moe-shared-expert-gate" not in flags["mixtral"] + flags["qwen3-moe"]


def test_moe_round_trip_is_bitwise(converted, tmp_path):
    for name, (hf, mg, cfg, ids) in converted.items():
        back = str(tmp_path / name)
        assert main(["--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", mg, "--save-dir", back]) == 0
        _assert_same_weights(hf, back)
        assert {k: v for k, v in H.read_config(back).items() if k != "architectures"} == \
            {k: v for k, v in cfg.items() if k != "architectures"}


def test_qwen3_moe_without_norm_topk_prob_is_pre_softmax(tmp_path):
    """norm_topk_prob false: the top k of the softmax over all experts, not renormalised: --moe-router-pre-softmax
    gives transformers' logits."""
    hf, mg = _convert("qwen3-moe", tmp_path, 30, norm_topk_prob=False)
    flags = open(os.path.join(mg, core.FLAGS_FILE)).read().split()
    assert "--moe-router-pre-softmax" in flags
    ids = H.tokens(seed=3)
    ref, ref_chosen = _hf_run(hf, ids)
    got, chosen = _megatron_run(mg, H.read_config(hf), ids)
    assert (got - ref).abs().max().item() <= TOL * ref.abs().max().item()
    assert all(torch.equal(a, b) for a, b in zip(chosen, ref_chosen))


def test_moe_refusals(converted, tmp_path, capsys):
    hf, *_ = converted["qwen3-moe"]
    # a family not converted: named, with the ones that are
    assert main(["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", hf, "--save-dir",
                 str(tmp_path / "a"), "--model-type-hf", "deepseek3"]) != 0
    err = capsys.readouterr().err
    assert ("--model-type-hf deepseek3: not a family this converter has (deepseek3 is a mixture-of-experts model "
            "other than Mixtral, Qwen2-MoE and Qwen3-MoE: not converted here)") in err
    assert "mixtral, qwen2-moe, qwen3-moe" in err
    # --target-expert-parallel-size: checked against the experts (the torch_dist checkpoint does not depend on it)
    assert main(["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", hf, "--save-dir",
                 str(tmp_path / "ep"), "--target-expert-parallel-size", "3"]) != 0
    assert ("--target-expert-parallel-size 3: the model's 4 experts are not divisible by 3; use a size that divides "
            "them") in capsys.readouterr().err
    assert main(["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", hf, "--save-dir",
                 str(tmp_path / "ep"), "--target-expert-parallel-size", "2"]) == 0
    assert ("note: --target-expert-parallel-size 2 leaves a torch_dist checkpoint as it is"
            in capsys.readouterr().err)
    dense = str(tmp_path / "llama")
    H.save_random_hf("llama2", dense)
    assert main(["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", dense, "--save-dir",
                 str(tmp_path / "ep2"), "--target-expert-parallel-size", "2"]) != 0
    assert ("--target-expert-parallel-size 2: the llama model has no experts; leave it 1"
            in capsys.readouterr().err)
    # the legacy format of an MoE model
    assert main(["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", hf, "--save-dir",
                 str(tmp_path / "b"), "--ckpt-format", "torch"]) != 0
    assert ("--ckpt-format torch: the legacy format of an MoE model (qwen3_moe) is not written here; use "
            "--ckpt-format torch_dist") in capsys.readouterr().err
    # dense layers among the MoE layers
    dense = str(tmp_path / "dense")
    H.save_random_hf("qwen3-moe", dense, mlp_only_layers=[1])
    assert main(["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", dense, "--save-dir",
                 str(tmp_path / "c")]) != 0
    assert ("qwen3_moe: config.json is not convertible: mlp_only_layers / decoder_sparse_step != 1 (dense MLP "
            "layers among the MoE layers) are not converted here") in capsys.readouterr().err


def test_qwen2_moe_refused_on_megatron_core_0_12(tmp_path, capsys):
    from megatron_glue.capture.adaptations import megatron_core_in

    if megatron_core_in(">=0.16"):
        pytest.skip("megatron-core 0.16 has the shared experts' gate")
    hf = str(tmp_path / "hf")
    H.save_random_hf("qwen2-moe", hf)
    assert main(["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", hf, "--save-dir",
                 str(tmp_path / "mg")]) != 0
    assert ("qwen2_moe config.json gives pretrain_gpt flags it refuses: pretrain_gpt: error: --moe-shared-expert-gate "
            "needs megatron-core 0.16") in capsys.readouterr().err


@pytest.mark.gloo
@pytest.mark.training
@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_converted_moe_loads_at_expert_parallel_2(converted, dispatcher, tmp_path):
    """The torch_dist checkpoint is expert-parallel-layout free: at EP=2 (2 gloo processes) each rank loads its 2 of
    the 4 experts and the model gives transformers' logits on every rank; the job saves it again at EP=2, and that
    checkpoint converts back to the original HF weights, bitwise."""
    runs = [(*converted[n][1:4], str(tmp_path / n / "saved")) for n in converted]
    refs = [H.hf_logits(converted[n][0], converted[n][3]) for n in converted]
    for rank in H.megatron_logits_ep(runs, 2, dispatcher):
        for name, ref, (got, local) in zip(converted, refs, rank):
            assert local == 2, name
            assert (got - ref).abs().max().item() <= TOL * ref.abs().max().item(), name
    for name in converted:
        hf, back = converted[name][0], str(tmp_path / name / "hf")
        saved = str(tmp_path / name / "saved")
        assert main(["--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", saved, "--save-dir", back,
                     "--hf-cfg-dir", hf]) == 0
        _assert_same_weights(hf, back)
