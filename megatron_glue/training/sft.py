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


def sample_documents(start: int, count: int, num_samples: int, seed: int) -> np.ndarray:
    """The document of each sample: epochs of [start, start + count), each shuffled by one RandomState(seed)."""
    rng = np.random.RandomState(seed=seed)
    order: list[int] = []
    while len(order) < num_samples:
        epoch = np.arange(start, start + count, dtype=np.int64)
        rng.shuffle(epoch)
        order.extend(epoch.tolist())
    return np.asarray(order, dtype=np.int64)


class InstructionDataset(torch.utils.data.Dataset):
    """One split: sample i -> its document's three rows, padded to seq_length, as the job's batch fields."""

    def __init__(self, prefix: str, start: int, count: int, num_samples: int, seq_length: int, seed: int,
                 pad_id: int) -> None:
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        self.data = {key: IndexedDataset(f"{prefix}_packed_{key}_document") for key in KEYS}
        self.order = sample_documents(start, count, num_samples, seed)
        self.seq_length, self.pad_id = seq_length, pad_id

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, idx: int) -> dict:
        doc = int(self.order[idx])
        ids = self.data["input_ids"][doc].astype(np.int64)
        labels = self.data["labels"][doc].astype(np.int64)
        n, s = len(ids), self.seq_length
        if n > s:
            raise DataError(f"instruction document {doc} has {n} tokens, more than --seq-length {s}; preprocess "
                            f"with --seq-length {s} (it drops longer records)")
        tokens = np.full(s, self.pad_id, dtype=np.int64)
        tokens[:n] = ids
        padded = np.full(s, IGNORE_INDEX, dtype=np.int64)
        padded[:n] = labels
        target = np.full(s, IGNORE_INDEX, dtype=np.int64)
        target[:-1] = padded[1:]  # position i predicts label i + 1
        mask = target != IGNORE_INDEX
        return {"tokens": torch.from_numpy(tokens), "labels": torch.from_numpy(np.where(mask, target, 0)),
                "loss_mask": torch.from_numpy(mask.astype(np.float32)),
                "position_ids": torch.arange(s, dtype=torch.int64)}


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
    pad = pad_id_for(args)
    out = []
    for i in range(3):
        count = bounds[i + 1] - bounds[i]
        out.append(InstructionDataset(prefix, bounds[i], count, num_samples[i], args.seq_length, args.seed, pad)
                   if count > 0 and num_samples[i] > 0 else None)
    return tuple(out)


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
    if args.reset_attention_mask or args.reset_position_ids or args.eod_mask_loss:
        return ("--reset-attention-mask, --reset-position-ids and --eod-mask-loss read packed instruction data "
                "(--pack / --neat-pack), which is not implemented here; padded samples need none of them")
    return None


def pretrain_refusal(args) -> str | None:
    """pretrain_gpt takes no instruction data."""
    if args.stage or args.is_instruction_dataset or args.prompt_type:
        return ("--stage / --is-instruction-dataset / --prompt-type: instruction tuning runs as MindSpeed-LLM's "
                "posttrain_gpt.py does, through -m megatron_glue.posttrain_gpt")
    return None
