"""MindSpeed's --noop-layers: empty layers that pass their input through (megatron_glue/training/noop_layers.py)."""

from __future__ import annotations

import argparse

import pytest
import torch

from megatron_glue.training import noop_layers
from megatron_glue.training.log import num_floating_point_operations

from pretrain_runs import TINY, assert_close, parse_error, parse_tiny, pretrain


def test_the_flag_parses_as_mindspeed_checks_it():
    args = parse_tiny("--num-layers", "4", "--noop-layers", "3,1")
    assert args.noop_layers == [1, 3]
    assert parse_error("--num-layers", "4", "--noop-layers", "2,4") == (
        "pretrain_gpt: error: --noop-layers 2,4: layer 4 is not in 0..3; each index must be at least 0 and smaller than --num-layers 4")
    assert parse_error("--num-layers", "4", "--noop-layers", "2;3") == (
        "pretrain_gpt: error: --noop-layers '2;3': expected comma-separated layer indices (0-based), e.g. 94,95")
    assert parse_error("--num-layers", "2", "--noop-layers", "0,1") == (
        "pretrain_gpt: error: --noop-layers 0,1: every layer of --num-layers 2 is empty; leave at least one real layer")


def test_flops_and_moe_mean_count_the_real_layers():
    """--log-throughput's FLOPs as a model of the real layers alone (MindSpeed's calc_flop), and the MoE losses'
    mean over the MoE layers less the empty ones (its get_mean)."""
    base = dict(num_attention_heads=4, hidden_size=64, seq_length=32, num_query_groups=4, group_query_attention=False,
                kv_channels=16, swiglu=False, ffn_hidden_size=256, padded_vocab_size=512, noop_layers=None)
    real = num_floating_point_operations(argparse.Namespace(**base, num_layers=3), 8)
    padded = num_floating_point_operations(argparse.Namespace(**{**base, "noop_layers": [3]}, num_layers=4), 8)
    assert padded == real
    assert noop_layers.moe_mean_scale(argparse.Namespace(num_layers=4, noop_layers=[3], moe_layer_freq=1)) == 4 / 3
    assert noop_layers.moe_mean_scale(argparse.Namespace(num_layers=4, noop_layers=None, moe_layer_freq=1)) == 1.0


def test_a_noop_layer_returns_a_copy_and_holds_nothing():
    layer = noop_layers.NoopTransformerLayer(4)
    x, context = torch.randn(3, 2, 8, requires_grad=True), object()
    out, same = layer(x, None, context=context, rotary_pos_emb=None)
    assert torch.equal(out, x) and out.data_ptr() != x.data_ptr() and same is context
    out.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
    assert not list(layer.parameters()) and layer.sharded_state_dict("decoder.layers.3.") == {}


@pytest.mark.training
def test_empty_layers_train_as_the_model_without_them(tmp_path):
    """--num-layers 4 --noop-layers 1 at PP=2 (stage 0: layer 0 and the empty layer 1; stage 1: layers 2, 3) trains
    as --num-layers 3 --num-layer-list 1,2 from the same weights, compiled: losses and gradient norms bit for bit.
    The weights are one checkpoint, saved by the job with the empty layer (torch_dist: its layer axis holds the 3
    real layers) and loaded by both (the initial weights differ by design: megatron-core scales the output
    projections' initialisation by --num-layers, empty layers counted, as in MindSpeed)."""
    pp = ["--pipeline-model-parallel-size", "2", "--eval-iters", "0"]
    with_noop = [*pp, "--num-layers", "4", "--noop-layers", "1"]
    without = [*pp, "--num-layers", "3", "--num-layer-list", "1,2"]
    pretrain(tmp_path / "start", *with_noop, "--train-iters", "1", "--save", str(tmp_path / "ckpt"),
             "--no-npu-compile", nproc=2).check()
    start = ["--load", str(tmp_path / "ckpt"), "--finetune", "--train-iters", "3"]
    run = pretrain(tmp_path / "noop", *with_noop, *start, nproc=2).check()
    ref = pretrain(tmp_path / "ref", *without, *start, nproc=2).check()
    assert run.losses == ref.losses and len(run.losses) == 3
    assert [r["grad_norm"] for r in run.rows("train")] == [r["grad_norm"] for r in ref.rows("train")]
