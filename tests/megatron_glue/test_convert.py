"""`npu-compile convert` against transformers: every family's random-init HF model converted to a Megatron
checkpoint and loaded by the training job's own load at TP=1, TP=2, PP=2 and TP=2 x PP=2 gives transformers'
logits; converted back it is the original, bitwise, from the converter's checkpoint and from one the job saved
at TP=2."""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch
from safetensors.torch import load_file

import hf_models as H
from megatron_glue.convert import core, main

pytestmark = pytest.mark.usefixtures("process_state_kept")

TOL = 1e-5  # fp32 logits, |logits| ~ 1-2


def _weights(folder: str) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        out.update(load_file(f))
    return out


def _assert_same_weights(original: str, converted: str) -> None:
    a, b = _weights(original), _weights(converted)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """{family: (hf dir, mg dir, HF config dict, token ids, transformers' logits)}, converted for TP=2 x PP=2."""
    root = tmp_path_factory.mktemp("convert")
    out = {}
    for i, name in enumerate(H.FAMILIES):
        hf, mg = str(root / name / "hf"), str(root / name / "mg")
        H.save_random_hf(name, hf, seed=i)
        assert main(["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", hf, "--save-dir", mg,
                     "--model-type-hf", name, "--target-tensor-parallel-size", "2",
                     "--target-pipeline-parallel-size", "2"]) == 0
        ids = H.tokens(seed=i)
        out[name] = (hf, mg, H.read_config(hf), ids, H.hf_logits(hf, ids))
    return out


def test_layout_and_flags(converted):
    hf, mg, cfg, *_ = converted["llama3"]
    assert open(os.path.join(mg, "latest_checkpointed_iteration.txt")).read() == "release"
    assert sorted(os.listdir(os.path.join(mg, "release"))) == [".metadata", "__0_0.distcp", "common.pt",
                                                               "metadata.json"]
    assert json.load(open(os.path.join(mg, "release", "metadata.json")))["sharded_backend"] == "torch_dist"
    flags = open(os.path.join(mg, core.FLAGS_FILE)).read().split()
    for want in (["--num-layers", "2"], ["--num-query-groups", "2"], ["--rotary-base", "500000"],
                 ["--use-rope-scaling"], ["--rope-scaling-factor", "8.0"], ["--untie-embeddings-and-output-weights"],
                 ["--norm-epsilon", "1e-05"], ["--swiglu"]):
        i = flags.index(want[0])
        assert flags[i:i + len(want)] == want
    from megatron.core import dist_checkpointing

    saved = dist_checkpointing.load_common_state_dict(os.path.join(mg, "release"))["args"]
    # vocab 100 padded for TP=2: 2 x 128
    assert (saved["orig_vocab_size"], saved["padded_vocab_size"]) == (100, 256)
    assert saved["hf_config"] == cfg


def test_every_family_tp1_equals_transformers(converted):
    runs = [(mg, cfg, ids) for _, mg, cfg, ids, _ in converted.values()]
    for (name, (*_, ref)), got in zip(converted.items(), H.megatron_logits(runs)):
        assert (got - ref).abs().max().item() <= TOL, name


def test_round_trip_is_bitwise(converted, tmp_path):
    for name, (hf, mg, cfg, ids, ref) in converted.items():
        back = str(tmp_path / name)
        assert main(["--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", mg, "--save-dir", back]) == 0
        _assert_same_weights(hf, back)
        config = H.read_config(back)
        assert {k: v for k, v in config.items() if k != "architectures"} == \
            {k: v for k, v in cfg.items() if k != "architectures"}
        assert (H.hf_logits(back, ids) - ref).abs().max().item() == 0.0, name


@pytest.mark.training
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_every_family_across_layouts_equals_transformers(converted, tp, pp, tmp_path):
    names = list(converted) if tp * pp == 2 else ["llama3", "qwen2", "gpt2"]  # 4 processes: the three layouts
    runs = [converted[n][1:4] for n in names]
    if (tp, pp) == (2, 1):  # the job saves each model again at TP=2; that checkpoint converts back to the original
        runs = [(*run, str(tmp_path / n / "saved")) for run, n in zip(runs, names)]
    for name, got in zip(names, H.megatron_logits(runs, tp, pp)):
        assert (got - converted[name][4]).abs().max().item() <= TOL, name
    if (tp, pp) == (2, 1):
        for name in names:
            hf = converted[name][0]
            back = str(tmp_path / name / "hf")
            assert main(["--load-model-type", "mg", "--save-model-type", "hf", "--load-dir",
                         str(tmp_path / name / "saved"), "--save-dir", back, "--hf-cfg-dir", hf]) == 0
            _assert_same_weights(hf, back)


def test_bf16_weights_stay_bf16_and_load_into_fp32(tmp_path):
    """A bf16 HF checkpoint: the Megatron checkpoint holds bf16 (norms too), the fp32 job loads it (upcast) with
    the logits of transformers' fp32 model of those weights, and the way back is bitwise bf16."""
    from transformers import AutoModelForCausalLM

    H.save_random_hf("qwen2.5", str(tmp_path / "hf32")).to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    hf, mg, back = str(tmp_path / "hf"), str(tmp_path / "mg"), str(tmp_path / "back")
    assert main(["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", hf, "--save-dir", mg]) == 0
    from megatron_glue.convert import torch_dist

    assert {dtype for _, dtype in torch_dist.tensor_metadata(os.path.join(mg, "release")).values()} == {torch.bfloat16}
    ids = H.tokens()
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()(ids).logits
    (got,) = H.megatron_logits([(mg, H.read_config(hf), ids)])
    assert (got - ref).abs().max().item() <= TOL
    assert main(["--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", mg, "--save-dir", back]) == 0
    _assert_same_weights(hf, back)
    assert H.read_config(back)["dtype"] == "bfloat16"


def test_phi35_longrope_short_factors_and_a_given_attention_factor(tmp_path):
    """Phi-3.5's LongRoPE below its original context (the short factors; mscale 1 at max = original) and with
    config.json's own attention_factor (--long-mscale / --short-mscale): transformers' logits."""
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 1.0,
            "long_factor": H.LONG_FACTOR, "short_factor": H.SHORT_FACTOR}
    cases = {"short": dict(original_max_position_embeddings=H.SEQ, max_position_embeddings=H.SEQ),
             "attention_factor": dict(rope_parameters={**rope, "attention_factor": 1.3,
                                                       "original_max_position_embeddings": 8})}
    runs, refs = [], []
    for i, (case, over) in enumerate(cases.items()):
        hf, mg = str(tmp_path / case / "hf"), str(tmp_path / case / "mg")
        H.save_random_hf("phi3.5", hf, seed=10 + i, **over)
        assert main(["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", hf, "--save-dir", mg,
                     "--model-type-hf", "phi3.5"]) == 0
        flags = open(os.path.join(mg, core.FLAGS_FILE)).read().split()
        assert flags[flags.index("--rope-scaling-type") + 1] == "longrope"
        assert ("--long-mscale" in flags) == (case == "attention_factor")
        ids = H.tokens(seed=i)
        runs.append((mg, H.read_config(hf), ids))
        refs.append(H.hf_logits(hf, ids))
    for case, ref, got in zip(cases, refs, H.megatron_logits(runs)):
        assert (got - ref).abs().max().item() <= TOL, case


@pytest.mark.parametrize("name,fused", [("gpt2", {"attention": 1, "add_layer_norm": 1, "bias_gelu": 1}),
                                        ("phi3.5", {"attention": 1, "add_rms_norm": 1, "swiglu": 1}),
                                        ("llama3", {"attention": 1, "add_rms_norm": 1, "swiglu": 1, "rotary": 2})])
def test_converted_model_compiled_equals_transformers(converted, name, fused, tmp_path):
    """The converted model as the job runs it: each layer compiled with backend="ascend" (GPT-2's tanh GeLU and
    Llama 3's scaled RoPE fuse), logits still transformers'."""
    import types

    from megatron_glue.training import checkpointing, gpt, training
    from megatron_glue.convert.families import family_for
    from megatron_glue.capture.models import init_single_process, teardown_single_process

    import megatron_glue
    from megatron_glue.capture.adaptations import groups_for

    _, mg, cfg, ids, ref = converted[name]
    # the adaptations the job applies (megatron_glue.training.device.init); process_state_kept takes them off after
    megatron_glue.adapt(groups_for(torch.device("cpu"), training=True))
    init_single_process()
    try:
        args = core.architecture(family_for(None, cfg), cfg)
        args.load, args.finetune = mg, True
        args.npu_compile_options = {"dump_dir": str(tmp_path)}
        config = training.transformer_config(args, types.SimpleNamespace(device=torch.device("cpu")))
        model = gpt.model_provider(args, config).eval()
        checkpointing.load_checkpoint(args, [model], None, None)
        training.compile_model(model, args)
        with torch.no_grad():
            got = model(ids, torch.arange(ids.shape[1]).expand_as(ids), None)[..., :cfg["vocab_size"]]
    finally:
        teardown_single_process()
    assert (got - ref).abs().max().item() <= TOL
    reports = [json.load(open(p)) for p in glob.glob(str(tmp_path / "**" / "report.json"), recursive=True)]
    layer = [r["fusions"] for r in reports if r["fusions"]["attention"]]
    assert len(layer) == 1 and {k: layer[0][k] for k in fused} == fused
