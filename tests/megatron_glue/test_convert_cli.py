"""`npu-compile convert` (megatron_glue.convert.main) on bad input: one line on stderr naming what was wrong and what
would be right, exit status 2 for a bad command line and 1 for bad input files; and its peak memory on a model
whose layers are tens of MB."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import hf_models as H
from megatron_glue.convert import main

# The CLI's refusals come before any megatron-core code runs: the same on every megatron-core line
pytestmark = [pytest.mark.any_megatron_line, pytest.mark.usefixtures("process_state_kept")]

PREFIX = "npu-compile convert: error: "


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """HF folders: "llama3" (2 key/value heads), "llama2" (4), and a torch_dist conversion of llama3 ("mg")."""
    root = tmp_path_factory.mktemp("cli")
    out = {name: str(root / name) for name in ("llama3", "llama2")}
    for name, folder in out.items():
        H.save_random_hf(name, folder)
    out["mg"] = str(root / "mg")
    assert main(_hf_to_mg(out["llama3"], out["mg"])) == 0
    return out


def _hf_to_mg(src, dst, *flags):
    return ["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", str(src), "--save-dir", str(dst),
            *flags]


def _mg_to_hf(src, dst, *flags):
    return ["--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", str(src), "--save-dir", str(dst),
            *flags]


def _fails(argv, capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(PREFIX), err  # one line, no traceback
    return code, err[len(PREFIX):].rstrip("\n")


def test_an_unknown_flag(hf, tmp_path, capsys):
    assert _fails(_hf_to_mg(hf["llama3"], tmp_path, "--target-tp", "2"), capsys) == (
        2, "unrecognized arguments: --target-tp 2")


def test_hf_to_hf(hf, tmp_path, capsys):
    argv = ["--load-model-type", "hf", "--save-model-type", "hf", "--load-dir", hf["llama3"], "--save-dir",
            str(tmp_path)]
    assert _fails(argv, capsys) == (2, "--load-model-type hf --save-model-type hf: converts hf -> mg, mg -> hf or "
                                       "tf -> mg")


def test_a_folder_without_config_json(tmp_path, capsys):
    (tmp_path / "in").mkdir()
    assert _fails(_hf_to_mg(tmp_path / "in", tmp_path / "out"), capsys) == (
        1, f"{tmp_path / 'in'}: no config.json; expected a folder written by save_pretrained")


def test_a_corrupt_config_json(tmp_path, capsys):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "config.json").write_text('{"model_type": "llama", ')
    assert _fails(_hf_to_mg(tmp_path / "in", tmp_path / "out"), capsys) == (
        1, f"{tmp_path / 'in' / 'config.json'} is not JSON (Expecting property name enclosed in double quotes at "
           "line 1)")
    (tmp_path / "in" / "config.json").write_text('["llama"]')
    assert _fails(_hf_to_mg(tmp_path / "in", tmp_path / "out"), capsys) == (
        1, f"{tmp_path / 'in' / 'config.json'} holds a JSON list, not an object; expected the config "
           "save_pretrained writes")


def test_a_llama_with_attention_bias_is_refused(tmp_path, capsys):
    H.save_random_hf("llama3", str(tmp_path / "in"), attention_bias=True)
    assert _fails(_hf_to_mg(tmp_path / "in", tmp_path / "out"), capsys) == (
        1, "llama: config.json is not convertible: attention_bias adds an o_proj bias, which megatron-core's "
           "--add-qkv-bias does not cover")
    assert not (tmp_path / "out").exists()


def test_a_seed_oss_with_an_o_proj_bias_is_refused_and_one_without_qkv_bias_converts(tmp_path, capsys):
    H.save_random_hf("seed-oss", str(tmp_path / "in"), attention_out_bias=True)
    assert _fails(_hf_to_mg(tmp_path / "in", tmp_path / "out", "--model-type-hf", "seed-oss"), capsys) == (
        1, "seed_oss: config.json is not convertible: attention_out_bias: an o_proj bias without an MLP bias has no "
           "megatron-core counterpart (--disable-bias-linear drops both)")
    assert not (tmp_path / "out").exists()
    H.save_random_hf("seed-oss", str(tmp_path / "nobias"), attention_bias=False, attention_dropout=0.1)
    assert main(_hf_to_mg(tmp_path / "nobias", tmp_path / "mg", "--model-type-hf", "seed-oss")) == 0
    assert "--add-qkv-bias" not in (tmp_path / "mg" / "model_flags.txt").read_text().split()
    assert "note: seed_oss: attention_dropout / residual_dropout in config.json are training settings" in \
        capsys.readouterr().err


def test_a_tensor_the_table_has_no_place_for_is_refused(hf, tmp_path, capsys):
    folder = tmp_path / "in"
    folder.mkdir()
    for name in ("config.json", "generation_config.json"):
        (folder / name).write_bytes((open(os.path.join(hf["llama3"], name), "rb")).read())
    tensors = load_file(os.path.join(hf["llama3"], "model.safetensors"))
    tensors["model.layers.1.self_attn.o_proj.bias"] = torch.zeros(64)
    save_file(tensors, str(folder / "model.safetensors"))
    assert _fails(_hf_to_mg(folder, tmp_path / "out"), capsys) == (
        1, f"{folder}: the checkpoint has 'model.layers.1.self_attn.o_proj.bias', which the llama table has no "
           "place for; converting would drop it")


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_an_embedding_of_another_vocabulary_than_config_json(hf, tmp_path, capsys, fmt):
    folder = tmp_path / "in"
    folder.mkdir()
    cfg = H.read_config(hf["llama3"])
    cfg["vocab_size"] = 96
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "model.safetensors").write_bytes(open(os.path.join(hf["llama3"], "model.safetensors"), "rb").read())
    assert _fails(_hf_to_mg(folder, tmp_path / "out", "--ckpt-format", fmt), capsys) == (
        1, "model.embed_tokens.weight: the embedding has 100 rows, config.json's vocab_size is 96")


def test_key_value_heads_not_divisible_by_tp(hf, tmp_path, capsys):
    assert _fails(_hf_to_mg(hf["llama3"], tmp_path, "--target-tensor-parallel-size", "4"), capsys) == (
        1, "--target-tensor-parallel-size 4: the model has 2 key/value heads (num_key_value_heads), not divisible "
           "by 4; megatron-core would replicate and slice them. Use a TP size that divides 2")


def test_num_layer_list(hf, tmp_path, capsys):
    pp2 = ("--target-pipeline-parallel-size", "2")
    assert _fails(_hf_to_mg(hf["llama3"], tmp_path, *pp2, "--num-layer-list", "1,2", "--ckpt-format", "torch"),
                  capsys) == (1, "--num-layer-list 1,2: needs 2 stages (--target-pipeline-parallel-size) of at least "
                                 "one layer summing to the model's 2 layers")
    assert _fails(_hf_to_mg(hf["llama3"], tmp_path, *pp2, "--num-layer-list", "1;1", "--ckpt-format", "torch"),
                  capsys) == (2, "--num-layer-list '1;1': expected comma-separated layer counts, e.g. 3,5")
    assert _fails(_hf_to_mg(hf["llama3"], tmp_path, *pp2, "--num-layer-list", "2,1"), capsys) == (
        1, "--num-layer-list 2,1: needs 2 stages (--target-pipeline-parallel-size) of at least one layer summing to "
           "the model's 2 layers")  # checked for torch_dist too
    capsys.readouterr()
    assert main(_hf_to_mg(hf["llama3"], tmp_path / "dist", *pp2, "--num-layer-list", "1,1")) == 0
    assert capsys.readouterr().err.splitlines()[0] == (
        "npu-compile convert: note: --num-layer-list 1,1 leaves a torch_dist checkpoint as it is (layout-free: the "
        "job splits it when it loads, with its own flag)")
    assert "num_layer_list" not in torch.load(tmp_path / "dist" / "release" / "common.pt", weights_only=False)["args"] \
        or torch.load(tmp_path / "dist" / "release" / "common.pt", weights_only=False)["args"]["num_layer_list"] is None


def test_hf_to_mg_flags_on_mg_to_hf(hf, tmp_path, capsys):
    for flag, value in (("--target-tensor-parallel-size", "2"), ("--ckpt-format", "torch")):
        assert _fails(_mg_to_hf(hf["mg"], tmp_path, flag, value), capsys) == (
            2, f"{flag} is for hf -> mg; mg -> hf reads the checkpoint's own layout and format")


def test_mg_to_hf_of_a_checkpoint_without_its_hf_config(hf, tmp_path, capsys):
    """A legacy checkpoint as the job or Megatron-LM would write it: no recorded config.json."""
    mg = tmp_path / "mg"
    capsys.readouterr()
    assert main(_hf_to_mg(hf["llama3"], mg, "--ckpt-format", "torch")) == 0
    assert capsys.readouterr().err.startswith(f"npu-compile convert: wrote {mg} (release, torch, for --ckpt-format "
                                              "torch --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1)")
    path = mg / "release" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    del state["args"]["hf_config"], state["args"]["model_type_hf"]
    torch.save(state, path)
    assert _fails(_mg_to_hf(mg, tmp_path / "back"), capsys) == (
        1, f"{mg / 'release'} was not written by `npu-compile convert`: give --hf-cfg-dir, the HF folder whose "
           "config.json describes this model")
    assert main(_mg_to_hf(mg, tmp_path / "back", "--hf-cfg-dir", hf["llama3"])) == 0
    assert json.load(open(tmp_path / "back" / "config.json"))["num_key_value_heads"] == 2


def test_mg_to_hf_of_a_checkpoint_saved_with_the_default_kv_channels(hf, tmp_path):
    """A checkpoint the job saved while it still stored --kv-channels unresolved (None: the head size) converts
    back with --hf-cfg-dir, whose head_dim is that head size: compared resolved, they agree. Bitwise."""
    import shutil

    mg = tmp_path / "mg"
    shutil.copytree(hf["mg"], mg)
    common = mg / "release" / "common.pt"
    state = torch.load(common, weights_only=False)
    assert state["args"]["kv_channels"] == 16
    state["args"]["kv_channels"] = None
    del state["args"]["hf_config"], state["args"]["model_type_hf"]  # as the job saves it: no recorded config.json
    torch.save(state, common)
    assert main(_mg_to_hf(mg, tmp_path / "back", "--hf-cfg-dir", hf["llama3"])) == 0
    original, back = _weights(hf["llama3"]), _weights(tmp_path / "back")
    assert sorted(original) == sorted(back)
    assert all(torch.equal(original[k], back[k]) for k in original)


def _weights(folder) -> dict:
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, name)))
    return out


def test_mg_to_hf_with_the_config_of_another_model(hf, tmp_path, capsys):
    assert _fails(_mg_to_hf(hf["mg"], tmp_path, "--hf-cfg-dir", hf["llama2"]), capsys) == (
        1, f"{hf['mg']}/release was saved with num_query_groups 2; --hf-cfg-dir {hf['llama2']} gives 4: it "
           "describes another model")


@pytest.mark.training
def test_peak_memory_stays_below_two_layers(tmp_path):
    """8 layers of 43 MiB (bench.convert_memory), each direction in a fresh process: the peak resident set above
    the one before the conversion is under two layers' bytes (the legacy write holds one stage: under a stage and
    a layer)."""
    from bench import convert_memory

    m = convert_memory.measure(str(tmp_path))
    print(convert_memory.table(m))
    layer = m["sizes"]["layer_bytes"]
    assert layer > 40 * 2**20 and m["layers"] == 8
    above = {name: r["above"] for name, r in m["results"].items()}
    streamed = {name: a for name, a in above.items() if not name.startswith("hf -> mg (torch,")}
    assert max(streamed.values()) < 2 * layer, {k: round(v / layer, 2) for k, v in above.items()}
    stage = 4 * layer + m["sizes"]["vocab_bytes"]  # TP=2 PP=2: 4 layers a stage, the embedding on the first
    assert above["hf -> mg (torch, TP=2 PP=2)"] < stage + layer


# -- MindSpeed-LLM's conversion scripts' flags (examples/mcore/*/ckpt_convert_*.sh) ----------------------------

def _tensor_dtypes(mg) -> set:
    from megatron_glue.convert import torch_dist

    return {dtype for _, dtype in torch_dist.tensor_metadata(os.path.join(mg, "release")).values()}


def test_convert_ckpt_v1_llama_line(hf, tmp_path, capsys):
    """Its 2.x convert_ckpt.py line for Llama (llama3's script: --model-type-hf llama2, bf16, a tokenizer file),
    scaled to TP=2: bf16 weights, the tokenizer recorded; back to fp32 HF with --params-dtype fp32."""
    tok = tmp_path / "tokenizer.json"
    tok.write_text("{}")
    mg = tmp_path / "mg"
    assert main(["--use-mcore-models", "--model-type-hf", "llama2", "--model-type", "GPT", "--load-model-type", "hf",
                 "--save-model-type", "mg", "--params-dtype", "bf16", "--target-tensor-parallel-size", "2",
                 "--target-pipeline-parallel-size", "1", "--load-dir", hf["llama3"], "--save-dir", str(mg),
                 "--tokenizer-model", str(tok), "--save-layer-by-layer"]) == 0
    assert _tensor_dtypes(mg) == {torch.bfloat16}
    args = torch.load(mg / "release" / "common.pt", weights_only=False)["args"]
    assert args["tokenizer_model"] == str(tok) and args["params_dtype"] == "bfloat16"
    back = tmp_path / "back"
    assert main(["--use-mcore-models", "--model-type-hf", "llama2", "--model-type", "GPT", "--load-model-type", "mg",
                 "--save-model-type", "hf", "--params-dtype", "fp32", "--load-dir", str(mg), "--save-dir",
                 str(back)]) == 0
    original, got = _weights(hf["llama3"]), _weights(back)
    assert sorted(original) == sorted(got)
    for name, t in original.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], t.to(torch.bfloat16).float()), name
    assert _fails(_hf_to_mg(hf["llama3"], tmp_path / "x", "--tokenizer-model", str(tmp_path / "none.model")),
                  capsys) == (1, f"--tokenizer-model {tmp_path / 'none.model'}: no such file or folder")


def test_model_type_hf_names(hf, tmp_path, capsys):
    """qwen25 and qwen3 (convert_ckpt_v2.py's names) are families; llama2 with --add-qkv-bias (convert_ckpt.py's
    Qwen lines) takes a Qwen2-layout folder and checks the biases; a name it does not have names the ones it has."""
    qwen = tmp_path / "qwen25"
    H.save_random_hf("qwen2.5", str(qwen))
    for i, line in enumerate((["--model-type-hf", "qwen25"], ["--model-type-hf", "llama2", "--add-qkv-bias"])):
        assert main(_hf_to_mg(qwen, tmp_path / f"mg{i}", *line, "--target-tensor-parallel-size", "2",
                              "--target-pipeline-parallel-size", "2")) == 0
        assert "--add-qkv-bias" in (tmp_path / f"mg{i}" / "model_flags.txt").read_text().split()
    mistral = tmp_path / "magistral"  # MindSpeed-LLM's magistral: a MistralForCausalLM checkpoint
    H.save_random_hf("mistral", str(mistral))
    assert main(_hf_to_mg(mistral, tmp_path / "mg-magistral", "--model-type-hf", "magistral")) == 0
    assert _fails(_hf_to_mg(qwen, tmp_path / "y", "--model-type-hf", "magistral"), capsys) == (
        1, "--model-type-hf magistral expects config.json model_type mistral, the config says 'qwen2'")
    assert _fails(_hf_to_mg(hf["llama2"], tmp_path / "y", "--model-type-hf", "llama2", "--add-qkv-bias"),
                  capsys)[1].startswith("--add-qkv-bias: the llama model has no add qkv bias (its architecture flags: ")
    assert _fails(_hf_to_mg(hf["llama2"], tmp_path / "y", "--model-type-hf", "llama2", "--post-norm"),
                  capsys)[1].startswith("--post-norm: the llama model has no post norm (its architecture flags: ")
    assert _fails(_hf_to_mg(qwen, tmp_path / "z", "--model-type-hf", "llama3"), capsys) == (
        1, "--model-type-hf llama3 expects config.json model_type llama, the config says 'qwen2'")
    known = ("llama2, llama3, mistral, magistral, qwen2, qwen2.5, qwen25, qwen3, seed-oss, phi3, phi3.5, gpt2, "
             "gemma2, mixtral, qwen2-moe, qwen3-moe, qwen3-next")
    assert _fails(_hf_to_mg(qwen, tmp_path / "z", "--model-type-hf", "deepseek3"), capsys) == (
        2, f"--model-type-hf deepseek3: not a family this converter has (deepseek3 is a mixture-of-experts model "
           f"other than Mixtral, Qwen2-MoE and Qwen3-MoE: not converted here); it converts {known}")
    assert _fails(_hf_to_mg(qwen, tmp_path / "z", "--model-type-hf", "chatglm3"), capsys) == (
        2, f"--model-type-hf chatglm3: not a family this converter has; it converts {known}")


@pytest.mark.parametrize("flags,message", [
    (["--noop-layers", "1"], "--noop-layers is not implemented here: this converter does not convert noop layers "
                             "(MindSpeed-LLM's empty layers that pad the pipeline)"),
    (["--moe-grouped-gemm"], "--moe-grouped-gemm is not implemented here: this converter does not convert "
                             "this mixture-of-experts layout (Mixtral, Qwen2-MoE and Qwen3-MoE convert with "
                             "SequentialMLP experts at expert-parallel size 1, every layer MoE)"),
    (["--mtp-num-layers", "1"], "--mtp-num-layers is not implemented here: this converter does not convert "
                                "multi-token prediction (MTP) layers"),
    (["--lora-r", "8"], "--lora-r is not implemented here: this converter does not convert LoRA weights"),
    (["--transformer-impl", "transformer_engine"], "--transformer-impl is not implemented here: this converter does "
                                                   "not convert Transformer Engine layers (the local layer spec is "
                                                   "what is written)"),
    (["--model-type", "BERT"], "--model-type BERT: converts GPT models only"),
    (["--spec", "mindspeed_llm.tasks.models.spec.gemma2_spec"],
     "--spec mindspeed_llm.tasks.models.spec.gemma2_spec: the spec modules converted here: "
     "mindspeed_llm.tasks.models.spec.qwen3_spec (megatron-core's local layer spec with q/k norms)"),
    (["--target-pipeline-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1", "--ckpt-format",
      "torch"], "--num-layers-per-virtual-pipeline-stage 1 with --ckpt-format torch is not implemented here: "
                "virtual-pipeline legacy files (model0, model1, ... per rank) are not written; leave --ckpt-format "
                "out for a torch_dist checkpoint, which the job loads at any VPP"),
])
def test_flags_of_features_not_converted(flags, message, hf, tmp_path, capsys):
    assert _fails(_hf_to_mg(hf["llama3"], tmp_path / "out", *flags), capsys) == (2, message)
    assert not (tmp_path / "out").exists()


def test_vpp_spec_and_harmless_values(hf, tmp_path, capsys):
    """--num-layers-per-virtual-pipeline-stage: checked, no effect on a torch_dist checkpoint (bitwise the same
    files); the values of refused flags that mean "not used" pass; --spec qwen3_spec needs a Qwen3."""
    plain, vpp = tmp_path / "plain", tmp_path / "vpp"
    pp2 = ("--target-pipeline-parallel-size", "2")
    assert main(_hf_to_mg(hf["llama3"], plain, *pp2)) == 0
    capsys.readouterr()
    assert main(_hf_to_mg(hf["llama3"], vpp, *pp2, "--num-layers-per-virtual-pipeline-stage", "1",
                          "--target-expert-parallel-size", "1", "--mtp-num-layers", "0", "--transformer-impl",
                          "local")) == 0
    assert capsys.readouterr().err.splitlines()[0] == (
        "npu-compile convert: note: --num-layers-per-virtual-pipeline-stage 1 leaves a torch_dist checkpoint as it "
        "is (layout-free: the job splits it when it loads, with its own flag)")
    for name in os.listdir(plain / "release"):
        if name.endswith(".distcp"):
            assert (plain / "release" / name).read_bytes() == (vpp / "release" / name).read_bytes()
    assert _fails(_hf_to_mg(hf["llama3"], tmp_path / "x", "--num-layers-per-virtual-pipeline-stage", "1"),
                  capsys) == (1, "--num-layers-per-virtual-pipeline-stage 1: with --target-pipeline-parallel-size 1 "
                                 "the model's 2 layers need PP > 1 and layers per stage divisible by it "
                                 "(Megatron-LM's virtual pipeline)")
    assert _fails(_hf_to_mg(hf["llama3"], tmp_path / "x", "--spec", "mindspeed_llm.tasks.models.spec.qwen3_spec"),
                  capsys)[1].startswith("--spec mindspeed_llm.tasks.models.spec.qwen3_spec: the llama model has no "
                                        "qk layernorm")
    qwen3 = tmp_path / "qwen3"
    H.save_random_hf("qwen3", str(qwen3))
    assert main(_hf_to_mg(qwen3, tmp_path / "q3", "--model-type-hf", "qwen3", "--spec",
                          "mindspeed_llm.tasks.models.spec.qwen3_spec", "layer_spec")) == 0
    assert "--qk-layernorm" in (tmp_path / "q3" / "model_flags.txt").read_text().split()


def test_mg_to_hf_into_a_folder_with_weights_is_refused(hf, tmp_path, capsys):
    """MindSpeed-LLM's convert_ckpt.py mcore2hf lines give the original HF folder as --save-dir (it writes into
    mg2hf/ there): the weights there are not overwritten."""
    assert _fails(_mg_to_hf(hf["mg"], hf["llama3"]), capsys) == (
        1, f"--save-dir {hf['llama3']} already holds model weights; give an empty or new folder (e.g. "
           f"{os.path.join(hf['llama3'], 'mg2hf')}, where MindSpeed-LLM's convert_ckpt.py writes)")
