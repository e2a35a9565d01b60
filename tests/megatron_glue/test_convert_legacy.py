"""hf -> mg `--ckpt-format torch`: Megatron-LM's legacy mp_rank_XX[_PPP]/model_optim_rng.pt files split for the
target TP x PP (even stages, or --num-layer-list), loaded by the job's own load_checkpoint at that layout, and
converted back to HF bitwise."""

from __future__ import annotations

import glob
import os

import pytest
import torch
from safetensors.torch import load_file

import hf_models as H
from megatron_glue.convert import core

pytestmark = pytest.mark.usefixtures("process_state_kept")

LAYERS = 4
# untied GQA with rope scaling; tied with qkv bias; untied with q/k norms (replicated across TP); tied LayerNorm + biases
FAMILIES = ("llama3", "qwen2", "qwen3", "gpt2")


def _over(name: str) -> dict:
    if name == "gpt2":
        return {"n_layer": LAYERS}
    return {"num_hidden_layers": LAYERS, "layer_types": ["full_attention"] * LAYERS}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """name -> (HF folder, legacy checkpoint at TP=2 PP=2, transformers' logits); "uneven": llama3 with
    --num-layer-list 1,3."""
    root = tmp_path_factory.mktemp("legacy")
    out = {}
    for name in FAMILIES:
        model = H.save_random_hf(name, str(root / name), **_over(name))
        with torch.no_grad():
            ref = model(H.tokens()).logits
        core.hf_to_mg(str(root / name), str(root / f"{name}-mg"), tp=2, pp=2, ckpt_format="torch")
        out[name] = (str(root / name), str(root / f"{name}-mg"), ref)
    core.hf_to_mg(out["llama3"][0], str(root / "uneven"), tp=2, pp=2, num_layer_list=[1, 3], ckpt_format="torch")
    out["uneven"] = (out["llama3"][0], str(root / "uneven"), out["llama3"][2])
    return out


def _rank(mg_dir: str, tp_rank: int, pp_rank: int | None = None) -> dict:
    name = f"mp_rank_{tp_rank:02d}" if pp_rank is None else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return torch.load(os.path.join(mg_dir, "release", name, "model_optim_rng.pt"), weights_only=False)


def _hf_tensors(folder: str) -> dict:
    out = {}
    for f in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        out.update(load_file(f))
    return out


LINEARS = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2")


def _layer_keys(i: int, *, biases: bool = False, qkv_bias: bool = False) -> set:
    keys = {f"decoder.layers.{i}.{n}.weight" for n in ("input_layernorm", "pre_mlp_layernorm") + LINEARS}
    keys |= {f"decoder.layers.{i}.{n}._extra_state" for n in LINEARS}
    if biases:
        keys |= {f"decoder.layers.{i}.{n}.bias" for n in ("input_layernorm", "pre_mlp_layernorm") + LINEARS}
    if qkv_bias:
        keys.add(f"decoder.layers.{i}.self_attention.linear_qkv.bias")
    return keys


def test_a_tp2_pp2_checkpoint_is_megatron_lms_legacy_layout(ckpts):
    folder, mg, _ = ckpts["llama3"]
    assert open(os.path.join(mg, "latest_checkpointed_iteration.txt")).read() == "release"
    assert sorted(os.listdir(os.path.join(mg, "release"))) == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000",
                                                              "mp_rank_01_001"]
    first, last = _rank(mg, 1, 0), _rank(mg, 1, 1)
    assert set(first) == {"model", "args", "checkpoint_version", "iteration", "consumed_train_samples",
                          "consumed_valid_samples"}
    assert (first["checkpoint_version"], first["iteration"]) == (3.0, 0)
    args = first["args"]
    assert (args["tensor_model_parallel_size"], args["pipeline_model_parallel_size"]) == (2, 2)
    assert args["hf_config"]["model_type"] == "llama" and args["num_layers"] == LAYERS
    # megatron-core's local-spec names, layers numbered within the stage, each linear layer's _extra_state (None)
    assert set(first["model"]) == {"embedding.word_embeddings.weight"} | _layer_keys(0) | _layer_keys(1)
    assert set(last["model"]) == _layer_keys(0) | _layer_keys(1) | {
        "decoder.final_layernorm.weight", "output_layer.weight", "output_layer._extra_state"}
    assert all(v is None for k, v in last["model"].items() if k.endswith("_extra_state"))

    # rank 1's shards of global layer 2 (stage 1's local layer 0), from the HF tensors directly
    hf = _hf_tensors(folder)
    layer, sd = "model.layers.2.", last["model"]
    assert torch.equal(sd["decoder.layers.0.self_attention.linear_proj.weight"],
                       hf[layer + "self_attn.o_proj.weight"][:, 32:])  # RowParallel: the second half of the inputs
    ffn = 48  # 96 / TP 2
    assert torch.equal(sd["decoder.layers.0.mlp.linear_fc1.weight"],  # [gate_1; up_1]
                       torch.cat([hf[layer + "mlp.gate_proj.weight"][ffn:], hf[layer + "mlp.up_proj.weight"][ffn:]]))
    d = 16  # query group 1 (heads 2, 3) and its key and value head
    assert torch.equal(sd["decoder.layers.0.self_attention.linear_qkv.weight"],
                       torch.cat([hf[layer + "self_attn.q_proj.weight"][2 * d:4 * d],
                                  hf[layer + "self_attn.k_proj.weight"][d:2 * d],
                                  hf[layer + "self_attn.v_proj.weight"][d:2 * d]]))
    assert torch.equal(sd["decoder.layers.0.input_layernorm.weight"], hf[layer + "input_layernorm.weight"])
    # the vocabulary of 100 padded to 256 at TP 2 with zero rows: rank 0 rows 0-127, rank 1 rows 128-255
    emb0 = _rank(mg, 0, 0)["model"]["embedding.word_embeddings.weight"]
    assert emb0.shape == (128, 64) and torch.equal(emb0[:100], hf["model.embed_tokens.weight"])
    assert not emb0[100:].any() and not first["model"]["embedding.word_embeddings.weight"].any()
    assert torch.equal(_rank(mg, 0, 1)["model"]["output_layer.weight"][:100], hf["lm_head.weight"])


@pytest.mark.parametrize("name", ["qwen2", "gpt2"])
def test_the_last_stage_of_a_tied_model_holds_the_embedding_as_its_output_layer(ckpts, name):
    _, mg, _ = ckpts[name]
    gpt2 = name == "gpt2"
    for t in range(2):
        first, last = _rank(mg, t, 0)["model"], _rank(mg, t, 1)["model"]
        assert "output_layer.weight" not in first
        assert torch.equal(last["output_layer.weight"], first["embedding.word_embeddings.weight"])
        top = {"decoder.final_layernorm.weight", "output_layer.weight", "output_layer._extra_state"}
        if gpt2:
            top.add("decoder.final_layernorm.bias")
        assert set(last) == _layer_keys(0, biases=gpt2, qkv_bias=not gpt2) | _layer_keys(
            1, biases=gpt2, qkv_bias=not gpt2) | top
    if gpt2:
        assert "embedding.position_embeddings.weight" in _rank(mg, 0, 0)["model"]


@pytest.mark.parametrize("name", ["llama3", "qwen2", "qwen3", "gpt2", "uneven"])
def test_mg_to_hf_of_a_legacy_checkpoint_gives_the_original_weights_bitwise(ckpts, name, tmp_path):
    folder, mg, _ = ckpts[name]
    core.mg_to_hf(mg, str(tmp_path / "back"))
    want, got = _hf_tensors(folder), _hf_tensors(str(tmp_path / "back"))
    assert sorted(got) == sorted(want)
    assert [k for k in want if not torch.equal(want[k], got[k])] == []


def test_num_layer_list_writes_uneven_stages(ckpts):
    folder, mg, _ = ckpts["uneven"]
    assert _rank(mg, 0, 0)["args"]["num_layer_list"] == [1, 3]
    for t in range(2):
        first, last = _rank(mg, t, 0)["model"], _rank(mg, t, 1)["model"]
        assert {k.split(".")[2] for k in first if k.startswith("decoder.layers.")} == {"0"}
        assert {k.split(".")[2] for k in last if k.startswith("decoder.layers.")} == {"0", "1", "2"}
    hf = _hf_tensors(folder)
    assert torch.equal(_rank(mg, 0, 1)["model"]["decoder.layers.0.pre_mlp_layernorm.weight"],
                       hf["model.layers.1.post_attention_layernorm.weight"])  # global layer 1 opens stage 1


def test_a_tp1_legacy_checkpoint_loads_into_the_job_here(ckpts, tmp_path):
    folder, _, ref = ckpts["llama3"]
    mg = str(tmp_path / "mg")
    core.hf_to_mg(folder, mg, ckpt_format="torch")
    assert os.listdir(os.path.join(mg, "release")) == ["mp_rank_00"]
    (logits,) = H.megatron_logits([(mg, H.read_config(folder), H.tokens())], ckpt_format="torch")
    assert (logits - ref).abs().max().item() <= 1e-5


@pytest.mark.training
def test_tp2_pp2_legacy_checkpoints_load_into_the_job_at_that_layout(ckpts):
    """One launch of 4 gloo processes: each family's logits from the job's load_checkpoint (--ckpt-format torch)
    against transformers', and the uneven checkpoint refused by a job of even stages, naming both."""
    names = FAMILIES + ("uneven",)
    runs = [(ckpts[n][1], H.read_config(ckpts[n][0]), H.tokens()) for n in names]
    results = dict(zip(names, H.megatron_outcomes(runs, tp=2, pp=2, ckpt_format="torch")))
    errors = {n: (results[n] - ckpts[n][2]).abs().max().item() for n in FAMILIES}
    assert max(errors.values()) <= 1e-5, errors
    assert results["uneven"] == (f"{ckpts['uneven'][1]}/release holds pipeline stages of 1,3 layers, this job "
                                 "builds 2,2; give --num-layer-list 1,3, or convert for this job's stages")


def test_a_legacy_checkpoint_at_another_layout_is_refused_naming_both(ckpts):
    """TP=2 x PP=2 files read by a TP=1 job: refused with the layouts, before the architecture check (whose
    vocabulary padding is the TP's) and before a missing rank file could be reported as such."""
    from megatron_glue.training.checkpointing import CheckpointError

    folder, mg, _ = ckpts["llama3"]
    with pytest.raises(CheckpointError) as e:
        H.megatron_logits([(mg, H.read_config(folder), H.tokens())], ckpt_format="torch")
    assert str(e.value) == (f"{mg}/release is a --ckpt-format torch checkpoint saved at TP=2, PP=2; this job runs "
                            "at TP=1, PP=1. It loads only at its own layout: run at TP=2, PP=2, or take it through "
                            "`npu-compile convert` to hf and back to a torch_dist checkpoint, which reshards")
