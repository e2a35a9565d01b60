"""Packed pretraining rows: --reset-attention-mask, --reset-position-ids and --eod-mask-loss with Megatron-LM's
meanings (megatron-core's GPTDataset), the compiled job's batches carrying the documents' lengths, the flags
still refused with their reasons, and a packed run compiled equal to --no-npu-compile with varlen_attention
firing."""

from __future__ import annotations

import json
import os

import pytest
import torch

from megatron_glue.training.arguments import ArgumentError, parse_args
from pretrain_runs import TINY, assert_close, pretrain

JOB = [*TINY, "--train-iters", "5"]
PACKING = ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]


def error(argv, world_size=1) -> str:
    with pytest.raises(ArgumentError) as info:
        parse_args(argv, world_size=world_size)
    return info.value.message


def test_the_flags_parse_with_megatron_lms_names():
    args = parse_args([*JOB, *PACKING])
    assert (args.reset_attention_mask, args.reset_position_ids, args.eod_mask_loss) == (True, True, True)
    args = parse_args(JOB)
    assert (args.reset_attention_mask, args.reset_position_ids, args.eod_mask_loss) == (False, False, False)


def test_what_stays_refused_says_why():
    """Instruction data's flags belong to posttrain_gpt (test_instruction_data.py): pretrain_gpt refuses them at
    its start; --pack only feeds MindSpeed-LLM's start-time preprocessing of raw data (no effect on a prefix)."""
    from megatron_glue.training import sft

    assert sft.pretrain_refusal(parse_args([*JOB, "--pack"])) is None
    for flags in (["--neat-pack"], ["--no-pad-to-seq-lengths"]):
        assert sft.pretrain_refusal(parse_args([*JOB, *flags])) == (
            "--stage / --is-instruction-dataset / --prompt-type / --neat-pack / --no-pad-to-seq-lengths / "
            "--padded-samples / --pad-to-multiple-of: instruction tuning runs as MindSpeed-LLM's posttrain_gpt.py "
            "does, through -m megatron_glue.posttrain_gpt")


def test_more_than_two_pipeline_stages_are_refused():
    argv = [*JOB, "--reset-attention-mask", "--pipeline-model-parallel-size", "4", "--num-layers", "4",
            "--global-batch-size", "2"]
    assert error(argv, world_size=4) == "pretrain_gpt: error: " + (
        "--reset-attention-mask at --pipeline-model-parallel-size 4: the stages between the first and the last read "
        "no batch, so their layers would not see the documents; use at most 2 pipeline stages")


def test_the_compiled_jobs_batches_carry_the_documents_as_megatron_cuts_them():
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    from megatron_glue.training.gpt import packed_documents

    tokens = torch.tensor([[5, 9, 1, 9, 9, 3, 4, 2], [1, 2, 3, 4, 5, 6, 7, 9]])
    batch = packed_documents({"tokens": tokens}, eod=9)
    params = batch["packed_seq_params"]
    assert params.qkv_format == "sbhd" and params.max_seqlen_q == 8
    assert params.cu_seqlens_q is params.cu_seqlens_kv and params.cu_seqlens_q.shape == (16,)  # b·s entries
    assert params.cu_seqlens_q.tolist() == [2, 4, 5, 8, 16] + [16] * 11
    # rows of more than 1024 tokens: the device's 1024 entries, unless the batch holds more documents
    long = torch.ones(1, 4096, dtype=torch.int64)
    long[0, 99::100] = 9
    assert packed_documents({"tokens": long}, eod=9)["packed_seq_params"].cu_seqlens_q.shape == (1024,)
    long[0, ::2] = 9
    assert packed_documents({"tokens": long}, eod=9)["packed_seq_params"].cu_seqlens_q.shape == (4096,)
    mask = torch.ops.npu_compile.document_mask(params.cu_seqlens_q, 2, 8)
    for row in range(2):
        megatron, _, _ = _get_ltor_masks_and_position_ids(tokens[row], 9, False, True, False, True)
        assert torch.equal(mask[row, 0], megatron[0])


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory):
    from megatron_glue.data.demo_data import make_demo_data

    return make_demo_data(str(tmp_path_factory.mktemp("demo_data")))


@pytest.fixture(scope="module")
def short_documents(demo_data, tmp_path_factory):
    """The demo corpus cut into documents of 8 words (several per row of 64 tokens), written by the
    job's preprocessing with an end-of-document token after each, the demo tokenizer's files."""
    from megatron_glue.data.preprocess import preprocess

    folder = tmp_path_factory.mktemp("short_documents")
    words = " ".join(json.loads(line)["text"] for line in open(demo_data["corpus"])).split()
    corpus = folder / "short.jsonl"
    corpus.write_text("".join(json.dumps({"text": " ".join(words[i:i + 8])}) + "\n"
                              for i in range(0, min(len(words), 40000), 8)))
    with open(os.devnull, "w") as quiet:
        preprocess(str(corpus), str(folder / "short"), tokenizer_type="GPT2BPETokenizer",
                   vocab_file=demo_data["vocab_file"], merge_file=demo_data["merge_file"], append_eod=True,
                   workers=1, log=quiet)
    return dict(demo_data, data_prefix=str(folder / "short_text_document"))


def _on_demo_data(demo_data) -> list[str]:
    """TINY on the demo tokenizer and a corpus (documents end with an end-of-document token), rows of 64 tokens."""
    base = list(TINY)
    del base[base.index("--mock-data")]
    del base[base.index("--vocab-size"):base.index("--vocab-size") + 2]
    for flag in ("--seq-length", "--max-position-embeddings"):
        base[base.index(flag) + 1] = "64"
    return [*base, "--data-path", demo_data["data_prefix"], "--vocab-file", demo_data["vocab_file"],
            "--merge-file", demo_data["merge_file"], "--tokenizer-type", "GPT2BPETokenizer", "--split", "98,1,1",
            "--train-iters", "2", "--eval-iters", "0"]


@pytest.mark.slow
@pytest.mark.training
def test_packed_run_compiled_equals_eager(short_documents, tmp_path):
    """A packed pretraining run: losses and gradient norms of the compiled job (varlen_attention, no s×s mask)
    within 1e-5 of --no-npu-compile (megatron-core's dense reset mask); rows of several documents are among
    every row, read with the flags' meanings."""
    from megatron_glue.data.datasets import build_datasets
    from megatron_glue.data.tokenizer import build_tokenizer

    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=short_documents["vocab_file"],
                                merge_file=short_documents["merge_file"])
    train, _, _ = build_datasets(data_path=[short_documents["data_prefix"]], split="98,1,1", seq_length=64, seed=7,
                                 tokenizer=tokenizer, num_samples=(16, 0, 0), data_cache_path=str(tmp_path / "cache"),
                                 mock=False, reset_attention_mask=True, reset_position_ids=True, eod_mask_loss=True)
    samples = [train[i] for i in range(16)]  # the run's 2 iterations x global batch 8
    packed = [x for x in samples if (x["tokens"] == tokenizer.eod).any()]
    assert len(packed) >= 12  # rows of several documents (most), read with the flags' meanings:
    causal = torch.ones(64, 64, dtype=torch.bool).triu(1)
    for x in packed:
        assert not torch.equal(x["attention_mask"][0], causal) and x["position_ids"][-1] < 63
        assert (x["loss_mask"][x["tokens"] == tokenizer.eod] == 0).all()

    argv = [*_on_demo_data(short_documents), "--data-cache-path", str(tmp_path / "cache")]
    dumps = tmp_path / "dumps"
    compiled = pretrain(tmp_path / "compiled", *PACKING, "--npu-compile-options", json.dumps({"dump_dir": str(dumps)}),
                        base=argv).check()
    eager = pretrain(tmp_path / "eager", *PACKING, "--no-npu-compile", base=argv).check()
    assert_close(compiled.losses, eager.losses, what="losses")
    norms = [[r["grad_norm"] for r in run.rows("train")] for run in (compiled, eager)]
    assert_close(*norms, what="grad norms")
    reports = [json.loads(p.read_text()) for p in dumps.glob("*/report.json")]
    fired = [r for r in reports if r["fusions"].get("varlen_attention")]
    assert fired and all(r["lowered_ops"].get("npu_compile.varlen_attention") for r in fired)
    assert not any("npu_compile.document_mask" in r["lowered_ops"] for r in reports)
