"""Negative controls of the conversion tests: each known conversion mistake, put into the converter's own tables
(a wrong Transform, a wrong Family row), runs through the real code path and must make the logits of the
converted checkpoint differ from transformers' — the comparison that passes at <= 1e-5 for the right tables
would catch it. Each control's measured error is asserted above CAUGHT, far from the right conversion's error.

Max abs logit error measured (random-init families of hf_models, batch 2 x 16 tokens, logits about 1-2; the
same on megatron-core 0.16.1 and 0.12.1):

    right conversions, TP=1 (llama3, mistral, qwen2, gpt2)  <= 7.2e-7
    qkv as plain [q; k; v], not per query group (llama3)       2.12
    fc1 as [up; gate] (llama3)                                 0.436
    rope theta 10000 for 1e6 (mistral)                         0.081
    Qwen2 without --add-qkv-bias, its biases dropped           0.699
    GPT-2 square attn c_proj Conv1D not transposed             2.06
    GPT-2 c_attn not reordered per head                        1.40
    log-softmax over the padded vocabulary (llama3)            0.241 (log-probabilities; sliced first: 9.5e-7)
    TP=2 legacy fc1 split as a plain chunk of [gate; up]       1.26  (training-marked; right split: 6.0e-7)
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import hf_models as H
from megatron_glue.convert import core, families
from megatron_glue.convert.families import FAMILIES
from megatron_glue.convert.transforms import TRANSFORMS, Transform

# The tables' mistakes are the converter's own: they show the same on every megatron-core line
pytestmark = [pytest.mark.any_megatron_line, pytest.mark.usefixtures("process_state_kept")]

RIGHT = 1e-5     # the right conversion
CAUGHT = 1e-2    # every control is above this (the smallest, rope theta at 16 tokens, measures 0.081)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """family -> (HF folder, its config dict, transformers' logits on the shared tokens)."""
    root = tmp_path_factory.mktemp("hf")
    ids = H.tokens()
    out = {}
    for name in ("llama3", "mistral", "qwen2", "gpt2"):
        model = H.save_random_hf(name, str(root / name))
        with torch.no_grad():
            out[name] = (str(root / name), H.read_config(str(root / name)), model(ids).logits)
    return out


def _logits(hf, name, mg_dir, **kw):
    folder, cfg, _ = hf[name]
    return H.megatron_logits([(mg_dir, cfg, H.tokens())], **kw)[0]


def _error(hf, name, mg_dir) -> float:
    return (_logits(hf, name, mg_dir) - hf[name][2]).abs().max().item()


def _row(family, mcore: str, **change):
    """The family with its row `mcore` changed."""
    rows = tuple(dataclasses.replace(r, **change) if r.mcore == mcore else r for r in family.tensors)
    return dataclasses.replace(family, tensors=rows)


def test_the_right_conversions_match_transformers(hf, tmp_path):
    errors = {}
    for name in hf:
        core.hf_to_mg(hf[name][0], str(tmp_path / name))
        errors[name] = _error(hf, name, str(tmp_path / name))
    print("right conversions: max abs logit error", {k: f"{v:.2g}" for k, v in errors.items()})
    assert max(errors.values()) <= RIGHT, errors


# Each control: (family, a function of monkeypatch that injects the mistake).

def _qkv_not_grouped(mp):
    plain = Transform(lambda hf, a: torch.cat(hf, dim=0).contiguous(), TRANSFORMS["qkv"].to_hf)
    mp.setitem(TRANSFORMS, "qkv", plain)


def _gate_up_swapped(mp):
    swapped = Transform(lambda hf, a: torch.cat([hf[1], hf[0]], dim=0).contiguous(), TRANSFORMS["gate_up"].to_hf)
    mp.setitem(TRANSFORMS, "gate_up", swapped)


def _rope_theta_default(mp):
    # the table's rotary base replaced by Megatron's default: the flags, the checkpoint's recorded args and the
    # job's model (built from the same table by megatron_logits) all say 10000
    config = tuple((flag, (lambda c: 10000) if flag == "--rotary-base" else src)
                   for flag, src in FAMILIES["mistral"].config)
    mp.setitem(FAMILIES, "mistral", dataclasses.replace(FAMILIES["mistral"], config=config))


def _qwen2_bias_dropped(mp):
    qwen2 = FAMILIES["qwen2"]
    biases = tuple(f"model.layers.{{i}}.self_attn.{p}_proj.bias" for p in "qkv")
    mp.setitem(FAMILIES, "qwen2", dataclasses.replace(qwen2, flags=families.LLAMA_FLAGS,
                                                      ignored_hf=qwen2.ignored_hf + biases))


def _gpt2_conv1d_not_transposed(mp):
    # attn.c_proj is square [h, h]: the untransposed weight has megatron-core's shape, so nothing else notices
    mp.setitem(FAMILIES, "gpt2", _row(FAMILIES["gpt2"], "self_attention.linear_proj.weight", transform="copy"))


def _gpt2_c_attn_not_reordered(mp):
    gpt2 = _row(FAMILIES["gpt2"], "self_attention.linear_qkv.weight", transform="conv1d")
    mp.setitem(FAMILIES, "gpt2", _row(gpt2, "self_attention.linear_qkv.bias", transform="copy"))


CONTROLS = {
    "qkv_not_grouped_per_query_group": ("llama3", _qkv_not_grouped),
    "gate_up_swapped_in_fc1": ("llama3", _gate_up_swapped),
    "rope_theta_10000": ("mistral", _rope_theta_default),
    "qwen2_qkv_bias_dropped": ("qwen2", _qwen2_bias_dropped),
    "gpt2_conv1d_not_transposed": ("gpt2", _gpt2_conv1d_not_transposed),
    "gpt2_c_attn_not_reordered_per_head": ("gpt2", _gpt2_c_attn_not_reordered),
}


@pytest.mark.parametrize("control", list(CONTROLS))
def test_a_conversion_mistake_shows_in_the_logits(control, hf, tmp_path, monkeypatch):
    name, inject = CONTROLS[control]
    inject(monkeypatch)
    core.hf_to_mg(hf[name][0], str(tmp_path / "mg"))
    error = _error(hf, name, str(tmp_path / "mg"))
    print(f"{control}: max abs logit error {error:.3g}")
    assert error > CAUGHT, f"{control}: the logits differ by only {error:.3g}"


def test_the_qwen2_table_without_its_qkv_bias_refuses_the_biases(hf, tmp_path, monkeypatch):
    """The bias control needs its biases ignored as well: a table that merely forgets --add-qkv-bias is refused,
    since the checkpoint then has tensors the table has no place for."""
    monkeypatch.setitem(FAMILIES, "qwen2", dataclasses.replace(FAMILIES["qwen2"], flags=families.LLAMA_FLAGS))
    with pytest.raises(core.ConvertError) as e:
        core.hf_to_mg(hf["qwen2"][0], str(tmp_path / "mg"))
    assert str(e.value) == (f"{hf['qwen2'][0]}: the checkpoint has 'model.layers.0.self_attn.k_proj.bias' (and 5 "
                            "more), which the qwen2 table has no place for; converting would drop it")


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_a_non_square_conv1d_not_transposed_is_refused_by_its_shape(hf, tmp_path, monkeypatch, fmt):
    monkeypatch.setitem(FAMILIES, "gpt2", _row(FAMILIES["gpt2"], "mlp.linear_fc1.weight", transform="copy"))
    with pytest.raises(core.ConvertError) as e:
        core.hf_to_mg(hf["gpt2"][0], str(tmp_path / "mg"), ckpt_format=fmt)
    assert str(e.value) == ("the gpt2 table's 'copy' of transformer.h.{i}.mlp.c_fc.weight gives "
                            "mlp.linear_fc1.weight the shape (64, 256); megatron-core's model has (256, 64)")


def test_log_probabilities_over_the_padded_vocabulary_are_off(hf, tmp_path):
    """Megatron's padding rows (zero embedding rows: logit 0, not -inf) take probability mass unless the logits
    are sliced to config.json's vocabulary before the softmax."""
    folder, cfg, ref = hf["llama3"]
    core.hf_to_mg(folder, str(tmp_path / "mg"))
    padded = _logits(hf, "llama3", str(tmp_path / "mg"), full_vocab=True)
    vocab = cfg["vocab_size"]
    assert padded.shape[-1] == 128 and vocab == 100
    want = torch.log_softmax(ref, dim=-1)
    right = (torch.log_softmax(padded[..., :vocab], dim=-1) - want).abs().max().item()
    wrong = (torch.log_softmax(padded, dim=-1)[..., :vocab] - want).abs().max().item()
    print(f"log-softmax over the padded vocabulary: max abs error {wrong:.3g} (sliced first: {right:.3g})")
    assert right <= RIGHT and wrong > CAUGHT, (right, wrong)


@pytest.mark.training
def test_a_tp2_fc1_split_as_a_plain_chunk_shows_in_the_logits(hf, tmp_path, monkeypatch):
    """Legacy checkpoints are split by the converter (transforms.split_tp per the table's tp_dim): rank r's fc1
    must be [gate_r; up_r]; a plain chunk of [gate; up] gives rank 0 both halves of gate."""
    folder, cfg, ref = hf["llama3"]
    core.hf_to_mg(folder, str(tmp_path / "right"), tp=2, ckpt_format="torch")
    with monkeypatch.context() as mp:
        mp.setitem(FAMILIES, "llama", _row(FAMILIES["llama"], "mlp.linear_fc1.weight", tp_dim=0))
        core.hf_to_mg(folder, str(tmp_path / "chunked"), tp=2, ckpt_format="torch")
    right, chunked = H.megatron_logits([(str(tmp_path / "right"), cfg, H.tokens()),
                                        (str(tmp_path / "chunked"), cfg, H.tokens())], tp=2, ckpt_format="torch")
    right, chunked = ((x - ref).abs().max().item() for x in (right, chunked))
    print(f"TP=2 fc1 as a plain chunk: max abs logit error {chunked:.3g} (right split: {right:.3g})")
    assert right <= RIGHT and chunked > CAUGHT, (right, chunked)
