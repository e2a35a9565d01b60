"""Instruction tuning as MindSpeed-LLM's `posttrain_gpt.py --stage sft --is-instruction-dataset` runs it, on data
written by `npu-compile preprocess --handler-name AlpacaStyleInstructionHandler` (docs/instruction_tuning.md).

The data (MindSpeed-LLM master c77308a): `--data-path PREFIX` names `PREFIX_packed_{input_ids,attention_mask,labels}
_document` (mtf_dataset.py get_packed_indexed_dataset); documents are split by `--split` as legacy Megatron splits
them (get_train_valid_test_split_); each split's samples are whole epochs of its documents, each epoch shuffled by
one `numpy.random.RandomState(--seed)` (decoder_packed_mtf_dataset.py `_build_index_mappings`, shuffle on, no
--padded-samples), until the split's sample count is reached. A batch is padded on the right to --seq-length
(DataCollatorForSeq2Seq with pad_to_multiple_of=seq_length): tokens with the pad id, labels with -100.

The loss (sft_trainer.py get_batch / loss_func, gpt_model.py with is_instruction_dataset): position i predicts
labels[i + 1], counted where that label is not -100 — the answer tokens; the prompt and the padding are masked.
Here that is the job's usual batch: `labels` = the stored labels shifted left by one (-100 at the end), `loss_mask`
= labels != -100, the -100 entries set to 0 for the cross entropy (masked anyway). The attention stays causal
without a mask: the padding is on the right, so no real token sees it (MindSpeed-LLM's padding mask changes only
the padded rows, whose loss is masked).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from megatron_glue.data.tokenizer import DataError

IGNORE_INDEX = -100
KEYS = ("input_ids", "attention_mask", "labels")


def split_bounds(split: str, size: int) -> list[int]:
    """Legacy Megatron's get_train_valid_test_split_: [train start, valid start, test start, end]."""
    weights = [float(s) for s in split.replace("/", ",").split(",") if s.strip()]
    weights = (weights + [0.0, 0.0, 0.0])[:3]
    total = sum(weights)
    if total <= 0:
        raise DataError(f"--split {split!r}: the weights must add up to more than 0")
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w / total * float(size))))
    diff = bounds[-1] - size
    return [bounds[0]] + [b - diff for b in bounds[1:]]


def sample_documents(start: int, count: int, num_samples: int, seed: int, padded_to: int = 0) -> np.ndarray:
    """The document of each sample: epochs of [start, start + count), each shuffled by one RandomState(seed).
    `padded_to` (MindSpeed-LLM's --padded-samples, the global batch size): each epoch is first filled up to a
    multiple of it with the documents 0, 1, ... (decoder_packed_mtf_dataset.py `_build_sequential_idx`)."""
    rng = np.random.RandomState(seed=seed)
    order: list[int] = []
    while len(order) < num_samples:
        epoch = np.arange(start, start + count, dtype=np.int64)
        if padded_to and count % padded_to:
            epoch = np.append(epoch, np.arange(0, padded_to - count % padded_to, dtype=np.int64))
        rng.shuffle(epoch)
        order.extend(epoch.tolist())
    return np.asarray(order, dtype=np.int64)


@dataclass(frozen=True)
class Batching:
    """How samples become the job's micro-batches (MindSpeed-LLM's DataCollatorForSeq2Seq and SFTTrainer.get_batch).

    seq_length: --seq-length; pad_to_multiple_of: None pads every batch to seq_length, else the longest sample of
    the micro-batch rounded up to a multiple of it (--no-pad-to-seq-lengths with --pad-to-multiple-of, 8 by
    default); documents: None (a sample is one causal row), "eos" (--reset-attention-mask: a document ends after
    each eos token of the stored row) or "neat" (with --neat-pack: the stored attention mask numbers the documents,
    0 for the padding); reset_position_ids: positions restart at each document; lengths: the documents go to the
    model as their lengths (PackedSeqParams, the compiled job) rather than as a dense mask."""

    seq_length: int
    pad_id: int
    pad_to_multiple_of: int | None = None
    documents: str | None = None
    eos_id: int | None = None
    reset_position_ids: bool = False
    lengths: bool = False


def row_documents(ids: np.ndarray, mask: np.ndarray, length: int, batching: Batching) -> list[int]:
    """A row's document ends (exclusive, in [1, length]), the row's end last. "eos": after each eos token of the
    stored row (decoder_packed_mtf_dataset.py: `actual_seq_len = eod_index + 1`); "neat": where the stored attention
    mask's document number changes (its `_get_neat_pack_position_ids` / `compute_actual_seq_len`). The stored
    row's padding, and what the batch adds after it, is one document at the end: MindSpeed-LLM makes each padding
    token a document of its own; padding is after every real token and outside the loss, so no loss or gradient
    sees the difference, and the row keeps at most one padding document (docs/instruction_tuning.md)."""
    n = len(ids)
    if batching.documents == "eos":
        ends = (np.nonzero(ids == batching.eos_id)[0] + 1).tolist()
    else:
        ends = (np.nonzero(mask[1:] != mask[:-1])[0] + 1).tolist() + ([n] if n and mask[-1] != 0 else [])
    ends = [e for e in ends if e < length]
    return ends + [length]


def collate(samples: list[dict], batching: Batching) -> dict:
    """Samples (their stored rows) -> the job's micro-batch: tokens and labels padded on the right (pad id, -100)
    to seq_length or, without padding to it, to the longest sample rounded up; labels shifted (position i predicts
    label i + 1), loss_mask where that label is not -100; with documents, position ids per document (with
    reset_position_ids) and the documents as a dense [b, 1, s, s] mask (True = masked, eager) or as
    PackedSeqParams lengths (compiled; no s x s tensor)."""
    longest = max(len(s["input_ids"]) for s in samples)
    if batching.pad_to_multiple_of is None:
        length = batching.seq_length
    else:
        m = batching.pad_to_multiple_of
        length = -(-longest // m) * m
    b = len(samples)
    tokens = np.full((b, length), batching.pad_id, dtype=np.int64)
    padded = np.full((b, length), IGNORE_INDEX, dtype=np.int64)
    positions = np.tile(np.arange(length, dtype=np.int64), (b, 1))
    cu: list[int] = []
    for r, sample in enumerate(samples):
        n = len(sample["input_ids"])
        tokens[r, :n] = sample["input_ids"]
        padded[r, :n] = sample["labels"]
        if batching.documents:
            ends = row_documents(sample["input_ids"], sample["attention_mask"], length, batching)
            if batching.reset_position_ids:
                start = 0
                for end in ends:
                    positions[r, start:end] = np.arange(end - start)
                    start = end
            cu += [r * length + e for e in ends]
    target = np.full((b, length), IGNORE_INDEX, dtype=np.int64)
    target[:, :-1] = padded[:, 1:]
    mask = target != IGNORE_INDEX
    batch = {"tokens": torch.from_numpy(tokens), "labels": torch.from_numpy(np.where(mask, target, 0)),
             "loss_mask": torch.from_numpy(mask.astype(np.float32)), "position_ids": torch.from_numpy(positions)}
    if batching.documents:
        from npu_compile.ops.varlen_attention import DEVICE_MAX_DOCUMENTS

        ends = torch.tensor(cu, dtype=torch.int64)
        if batching.lengths:
            from megatron.core.packed_seq_params import PackedSeqParams

            # one length for every batch of this shape, so that the number of documents compiles nothing new
            # (docs/packed_sequences.md "Dynamic document counts")
            total = b * length
            pad_to = total if ends.numel() > DEVICE_MAX_DOCUMENTS else min(total, DEVICE_MAX_DOCUMENTS)
            ends = torch.cat([ends, ends.new_full((pad_to - ends.numel(),), total)])
            batch["packed_seq_params"] = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=ends, cu_seqlens_kv=ends,
                                                         max_seqlen_q=length, max_seqlen_kv=length)
        else:
            from npu_compile.ops.varlen_attention import document_mask

            batch["attention_mask"] = document_mask(ends, b, length)
    return batch


class InstructionDataset(torch.utils.data.Dataset):
    """One split: sample i -> its document's stored rows; `collate` makes the micro-batches (Batching)."""

    def __init__(self, prefix: str, start: int, count: int, num_samples: int, seed: int, batching: Batching,
                 padded_to: int = 0) -> None:
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        self.data = {key: IndexedDataset(f"{prefix}_packed_{key}_document") for key in KEYS}
        self.order = sample_documents(start, count, num_samples, seed, padded_to)
        self.batching = batching
        self.seq_length, self.pad_id = batching.seq_length, batching.pad_id

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, idx: int) -> dict:
        doc = int(self.order[idx])
        ids = self.data["input_ids"][doc].astype(np.int64)
        n, s = len(ids), self.seq_length
        if n > s:
            raise DataError(f"instruction document {doc} has {n} tokens, more than --seq-length {s}; preprocess "
                            f"with --seq-length {s} (it drops longer records, and packs rows of that length)")
        return {"input_ids": ids, "labels": self.data["labels"][doc].astype(np.int64),
                "attention_mask": self.data["attention_mask"][doc].astype(np.int64)}

    def collate(self, samples: list[dict]) -> dict:
        return collate(samples, self.batching)


def pad_id_of(tokenizer) -> int:
    """The pad id MindSpeed-LLM pads with: the tokenizer's, or its eos where it has none (fix_model_tokenizer)."""
    hf = getattr(tokenizer, "_tok", None)
    pad = getattr(hf, "pad_token_id", None) if hf is not None else None
    return int(tokenizer.eod if pad is None else pad)


def datasets_provider(args):
    """(train, valid, test) InstructionDatasets over --data-path (one prefix, as MindSpeed-LLM takes)."""
    import os

    if not args.data_path or len(args.data_path) != 1:
        raise DataError(f"--data-path: give one prefix (the --output-prefix of `npu-compile preprocess --handler-name "
                        f"AlpacaStyleInstructionHandler`), got {args.data_path}")
    prefix = args.data_path[0]
    missing = [f"{prefix}_packed_{k}_document{e}" for k in KEYS for e in (".bin", ".idx")
               if not os.path.isfile(f"{prefix}_packed_{k}_document{e}")]
    if missing:
        raise FileNotFoundError(f"--data-path {prefix}: instruction data needs {prefix}_packed_<key>_document.bin/.idx"
                                f" for input_ids, attention_mask and labels; missing {', '.join(missing)} (write "
                                f"them with `npu-compile preprocess --handler-name AlpacaStyleInstructionHandler`)")
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    size = len(IndexedDataset(f"{prefix}_packed_input_ids_document"))
    bounds = split_bounds(args.split or "969,30,1", size)
    gbs = args.global_batch_size
    eval_runs = (args.train_iters // args.eval_interval + 1) if args.eval_interval else 1
    num_samples = (args.train_iters * gbs, eval_runs * args.eval_iters * gbs, args.eval_iters * gbs)
    from megatron_glue.training.gpt import passes_lengths

    documents = ("neat" if args.neat_pack else "eos") if args.reset_attention_mask else None
    batching = Batching(seq_length=args.seq_length, pad_id=pad_id_for(args),
                        pad_to_multiple_of=pad_to_multiple_of(args) if args.no_pad_to_seq_lengths else None,
                        documents=documents, eos_id=eos_id_for(args), reset_position_ids=args.reset_position_ids,
                        lengths=passes_lengths(args))
    padded_to = args.global_batch_size if args.padded_samples else 0
    out = []
    for i in range(3):
        count = bounds[i + 1] - bounds[i]
        out.append(InstructionDataset(prefix, bounds[i], count, num_samples[i], args.seed, batching, padded_to)
                   if count > 0 and num_samples[i] > 0 else None)
    return tuple(out)


def pad_to_multiple_of(args) -> int:
    """--pad-to-multiple-of, MindSpeed-LLM's training default 8 (features_manager/dataset/dataset.py)."""
    return 8 if args.pad_to_multiple_of is None else args.pad_to_multiple_of


def eos_id_for(args) -> int:
    """The eos MindSpeed-LLM's packed rows are cut at (`tokenizer.eos` after fix_model_tokenizer): the template's
    first stop word where it replaces eos, else the tokenizer's eos."""
    from megatron_glue.data.instruction import TEMPLATES

    hf = getattr(args.tokenizer, "_tok", None)
    template = TEMPLATES.get(args.prompt_type)
    if hf is not None and template is not None and template.replace_eos:
        return int(hf.convert_tokens_to_ids(template.stop_words[0]))
    return int(args.tokenizer.eod)


def pad_id_for(args) -> int:
    """pad_id_of, with the template's eos replacement: a tokenizer without a pad pads with the template's first
    stop word where the template replaces eos (templates.py fix_model_tokenizer)."""
    from megatron_glue.data.instruction import TEMPLATES

    hf = getattr(args.tokenizer, "_tok", None)
    template = TEMPLATES.get(args.prompt_type)
    if hf is not None and hf.pad_token_id is None and template is not None and template.replace_eos:
        return int(hf.convert_tokens_to_ids(template.stop_words[0]))
    return pad_id_of(args.tokenizer)


def posttrain_refusal(args) -> str | None:
    """What megatron_glue.posttrain_gpt needs and refuses (one line, or None)."""
    from megatron_glue.data.instruction import template_refusal

    if args.stage != "sft":
        return (f"--stage {args.stage}: only --stage sft is implemented here (MindSpeed-LLM's posttrain_gpt.py has "
                f"dpo, orm, prm, ... too)" if args.stage else "posttrain_gpt needs --stage sft")
    if not args.is_instruction_dataset:
        return ("--stage sft needs --is-instruction-dataset here (instruction data written by `npu-compile "
                "preprocess --handler-name AlpacaStyleInstructionHandler`)")
    refusal = template_refusal(args.prompt_type)
    if refusal:
        return refusal
    if args.mock_data:
        return "--mock-data is not taken by posttrain_gpt: give --data-path with instruction data"
    if args.tokenizer_padding_side != "right":
        return ("--tokenizer-padding-side left is not implemented here (instruction batches are padded on the right, "
                "MindSpeed-LLM's default)")
    if args.eod_mask_loss:
        return ("--eod-mask-loss is not taken by posttrain_gpt: the loss mask of instruction data is its labels "
                "(-100 on the prompt), as in MindSpeed-LLM's SFT")
    if args.reset_position_ids and not args.reset_attention_mask:
        return ("--reset-position-ids needs --reset-attention-mask here: MindSpeed-LLM's instruction dataset resets "
                "positions only for packed rows read with --reset-attention-mask")
    if args.neat_pack and not args.reset_attention_mask:
        return ("--neat-pack needs --reset-attention-mask: it says how packed rows are cut into documents, which "
                "only --reset-attention-mask does (MindSpeed-LLM refuses it alone too)")
    if args.pad_to_multiple_of is not None and not args.no_pad_to_seq_lengths:
        return ("--pad-to-multiple-of rounds the batches of --no-pad-to-seq-lengths; without it every batch is "
                "padded to --seq-length: give both or neither")
    if args.pad_to_multiple_of is not None and args.pad_to_multiple_of < 1:
        return f"--pad-to-multiple-of must be >= 1, got {args.pad_to_multiple_of}"
    cp = getattr(args, "context_parallel_size", 1)
    if args.no_pad_to_seq_lengths and cp > 1 and pad_to_multiple_of(args) % (2 * cp):
        return (f"--no-pad-to-seq-lengths at --context-parallel-size {cp}: each batch is padded to a multiple of "
                f"{pad_to_multiple_of(args)} (--pad-to-multiple-of), and megatron-core splits its sequence into "
                f"2 x CP = {2 * cp} chunks; give --pad-to-multiple-of a multiple of {2 * cp}")
    return None


def pretrain_refusal(args) -> str | None:
    """pretrain_gpt takes no instruction data."""
    if (args.stage or args.is_instruction_dataset or args.prompt_type or args.neat_pack or args.no_pad_to_seq_lengths
            or args.padded_samples or args.pad_to_multiple_of is not None):
        return ("--stage / --is-instruction-dataset / --prompt-type / --neat-pack / --no-pad-to-seq-lengths / "
                "--padded-samples / --pad-to-multiple-of: instruction tuning runs as MindSpeed-LLM's "
                "posttrain_gpt.py does, through -m megatron_glue.posttrain_gpt")
    return None


def before_start(args) -> None:
    """MindSpeed-LLM's FinetuneFeature.pre_validate_args: with --no-pad-to-seq-lengths the throughput (TFLOP/s from
    --seq-length) is not what the batches hold, so --log-throughput is switched off, with its warning."""
    if args.no_pad_to_seq_lengths and getattr(args, "log_throughput", False):
        import warnings

        warnings.warn("--no-pad-to-seq-lengths: batches are shorter than --seq-length, so --log-throughput's "
                      "TFLOP/s would be wrong; it is switched off (as MindSpeed-LLM does)", RuntimeWarning)
        args.log_throughput = False
