"""Training data for the job: megatron-core's GPT datasets and a Megatron-LM-style pretraining loader.

`build_datasets` turns Megatron-LM's `--data-path` (a prefix, several, or weight/prefix pairs), `--split` and the
per-split sample counts into train/valid/test datasets with megatron-core's BlendedMegatronDatasetBuilder over
GPTDataset (or MockGPTDataset); `build_loader` reads one of them in order, each data-parallel rank its slice of
every global micro-batch, starting after `consumed_samples` (so a resumed job goes on with the next samples).

Batches are GPTDataset's dicts: `tokens`, `labels` (tokens shifted by one) [mbs, seq] int64, `loss_mask`
[mbs, seq] float, `position_ids` [mbs, seq], and, when asked for, `attention_mask` [mbs, 1, seq, seq] bool, True
where attention is masked. A blend of several prefixes adds `dataset_id` [mbs] (megatron-core's BlendedDataset
does, blended_dataset.py:108).

The builder is collective when torch.distributed is initialised: every rank calls it, rank 0 builds and
caches the index files first, the others load them after a barrier. The cache goes to `data_cache_path`, or
(megatron-core's default) to a directory named after each prefix, `<prefix>/cache/GPTDataset_indices`.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterator

import torch

from megatron_glue.capture import quiet_megatron
from megatron_glue.data.tokenizer import DataError

with quiet_megatron():
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import (GPTDataset, GPTDatasetConfig, MockGPTDataset,
                                                    MockGPTLowLevelDataset)
    from megatron.core.datasets.utils import get_blend_from_list


def build_datasets(*, data_path: list[str] | None, split: str, seq_length: int, seed: int, tokenizer,
                   num_samples: tuple[int, int, int], data_cache_path: str | None, mock: bool,
                   create_attention_mask: bool = True, reset_position_ids: bool = False,
                   reset_attention_mask: bool = False, eod_mask_loss: bool = False,
                   is_built_on_rank: Callable[[], bool] | None = None) -> tuple[Any, Any, Any]:
    """(train, valid, test), each None where `split` gives it nothing (or where `is_built_on_rank()` is False).

    `tokenizer` needs `vocab_size` and `eod` (megatron_glue.data.tokenizer's have everything megatron-core reads).
    `reset_position_ids`, `reset_attention_mask`, `eod_mask_loss`: Megatron-LM's flags of those names, given to
    megatron-core's GPTDatasetConfig (documents end at the tokenizer's eod; the dense mask only where
    `create_attention_mask`).
    `is_built_on_rank` defaults to every rank; Megatron-LM builds on TP rank 0 of the first/last PP stages only.
    """
    if mock and data_path:
        raise DataError("build_datasets: mock=True and data_path are exclusive (Megatron-LM: --mock-data or "
                         "--data-path, not both)")
    if not mock and not data_path:
        raise DataError("build_datasets: give data_path (--data-path) or mock=True (--mock-data)")
    if seq_length < 1:
        raise DataError(f"build_datasets: seq_length must be >= 1, got {seq_length}")
    if len(num_samples) != 3 or any(n is None or n < 0 for n in num_samples):
        raise DataError(f"build_datasets: num_samples must be three counts >= 0 (train, valid, test), got "
                         f"{num_samples!r}")
    blend = None if mock else _blend(data_path)
    blended = blend is not None and (len(blend[0]) > 1 or blend[1] is not None)  # built as a BlendedDataset
    if blended and data_cache_path and not torch.distributed.is_initialized():
        # BlendedDataset asks torch.distributed for the rank when it writes its cache (blended_dataset.py:153).
        raise DataError("build_datasets: a blend (several prefixes, or weights) with data_cache_path needs "
                         "torch.distributed initialised (megatron-core's BlendedDataset asks for the rank)")
    with quiet_megatron():
        config = GPTDatasetConfig(
            random_seed=seed,
            sequence_length=seq_length,
            blend=blend,
            split=split,
            path_to_cache=data_cache_path,
            tokenizer=_for_megatron(tokenizer),
            reset_position_ids=reset_position_ids,
            reset_attention_mask=reset_attention_mask,
            eod_mask_loss=eod_mask_loss,
            create_attention_mask=create_attention_mask,
        )
        if blend is not None:
            _check_splits_have_tokens(blend[0], config.split_matrix, split)
        builder = BlendedMegatronDatasetBuilder(
            _MockGPTDataset if mock else GPTDataset, list(num_samples),
            is_built_on_rank if is_built_on_rank is not None else _always, config)
        train, valid, test = builder.build()
    return train, valid, test


def _check_splits_have_tokens(prefixes: list[str], split_matrix, split: str) -> None:
    """A split whose documents hold no tokens makes megatron-core count epochs for ever (gpt_dataset.py
    `_get_num_epochs`: tokens per epoch 0), even when no samples are asked of it: refuse it. The document ranges
    are megatron-core's own (blended_megatron_dataset_builder.py `_build_megatron_dataset_splits`:
    round(fraction x documents))."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    names = ("train", "validation", "test")
    for prefix in prefixes:
        indexed = IndexedDataset(prefix)  # held: its lengths are a view of the index's memory map
        lengths = indexed.sequence_lengths
        for i, bounds in enumerate(split_matrix):
            if bounds is None:
                continue
            begin, end = (int(round(b * float(len(lengths)))) for b in bounds)
            if int(lengths[begin:end].sum()) == 0:
                raise DataError(
                    f"--split {split!r} gives the {names[i]} split {end - begin} of the {len(lengths)} documents "
                    f"of {prefix}, with no tokens, and megatron-core cannot build a split without tokens; give "
                    f"that split more weight (e.g. --split 90,5,5) or use more data")


LOADER_SEED = 0  # the loader's own generator: seeds only its worker processes (the samples are the sampler's)


def build_loader(dataset, *, consumed_samples: int, micro_batch_size: int, data_parallel_rank: int,
                 data_parallel_size: int, num_workers: int = 0) -> Iterator[dict] | None:
    """Iterator of this DP rank's micro-batches, in dataset order from `consumed_samples` on (a global count:
    all DP ranks together); the last incomplete global micro-batch is dropped. None for a None or empty dataset."""
    if dataset is None or len(dataset) == 0:
        return None
    sampler = PretrainingSampler(len(dataset), consumed_samples, micro_batch_size, data_parallel_rank,
                                 data_parallel_size)
    # A DataLoader draws its workers' base seed when an iterator is made, from torch's default generator
    # unless given its own. The job makes its iterators after a checkpoint restored the RNG state (Megatron-LM's
    # order), and on a device whose dropout runs on the default generator (the CPU) that draw would shift every
    # dropout mask after a resume: the loader draws from a generator of its own.
    # a dataset may batch its samples itself (instruction data: megatron_glue.training.sft.collate)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                         collate_fn=getattr(dataset, "collate", None),
                                         persistent_workers=num_workers > 0,
                                         generator=torch.Generator().manual_seed(LOADER_SEED))
    return iter(loader)


class PretrainingSampler:
    """Megatron-LM's MegatronPretrainingSampler: sample indices in order, in global micro-batches of
    micro_batch_size × data_parallel_size; rank r takes the r-th micro_batch_size of each. Resumes at
    consumed_samples (a multiple of the global micro-batch on a job that only ran whole steps)."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int, data_parallel_rank: int,
                 data_parallel_size: int) -> None:
        if micro_batch_size < 1 or data_parallel_size < 1:
            raise DataError(f"micro_batch_size ({micro_batch_size}) and data_parallel_size "
                             f"({data_parallel_size}) must be >= 1")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise DataError(f"data_parallel_rank {data_parallel_rank} is not in [0, {data_parallel_size})")
        if not 0 <= consumed_samples < total_samples:
            raise DataError(f"consumed_samples {consumed_samples} leaves nothing to read from a dataset of "
                             f"{total_samples} samples")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.global_micro_batch = micro_batch_size * data_parallel_size

    def __len__(self) -> int:  # batches this rank yields (Megatron's returns total_samples, which is not that)
        return (self.total_samples - self.consumed_samples) // self.global_micro_batch

    def __iter__(self) -> Iterator[list[int]]:
        first = self.consumed_samples + self.data_parallel_rank * self.micro_batch_size
        for start in range(first, first + len(self) * self.global_micro_batch, self.global_micro_batch):
            yield list(range(start, start + self.micro_batch_size))


# -- helpers -----------------------------------------------------------------------------------------------

def _always() -> bool:
    return True


def _blend(data_path: list[str]) -> tuple[list[str], list[float] | None]:
    """megatron-core's blend from Megatron's --data-path list, with the checks it lacks: its own test that the
    weights are all numbers or none is an exhausted iterator (utils.py:84-86), so a mixed list would silently
    become prefixes named "0.3"; and each prefix's .bin and .idx must exist (before megatron's bare assert)."""
    data_path = [str(p) for p in data_path]
    if len(data_path) % 2 == 0:
        numbers = [_is_number(w) for w in data_path[0::2]]
        if any(numbers) and not all(numbers):
            raise DataError(f"data_path {data_path}: mixes weights and prefixes; give prefixes only, or "
                             f"weight prefix pairs")
    prefixes, weights = get_blend_from_list(data_path)
    if weights is not None and any(w <= 0 for w in weights):
        raise DataError(f"data_path {data_path}: blend weights must be > 0, got {weights}")
    for prefix in prefixes:
        missing = [f"{prefix}{ext}" for ext in (".bin", ".idx") if not os.path.isfile(f"{prefix}{ext}")]
        if missing:
            hint = (" (give the prefix, without .bin/.idx)" if prefix.endswith((".bin", ".idx"))
                    else " (write them with `npu-compile preprocess`)")
            raise FileNotFoundError(f"data prefix {prefix}: expected {prefix}.bin and {prefix}.idx, missing "
                                    f"{' and '.join(missing)}{hint}")
    return prefixes, weights


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


class _MockDocuments:
    """megatron-core's mock documents (token i+1 at position i, eod last) with the ids kept inside the
    vocabulary: 0.16.1 folds them (gpt_dataset.py:817), the 0.12 line does not (its ids run up to 4095 whatever
    the vocabulary, which a small embedding cannot look up). Folding again is a no-op on 0.16.1."""

    def __init__(self, tokenizer) -> None:
        self._documents = MockGPTLowLevelDataset(tokenizer)
        self.sequence_lengths = self._documents.sequence_lengths
        self._vocab_size = tokenizer.vocab_size

    def __len__(self) -> int:
        return len(self._documents)

    def __getitem__(self, idx: int):
        sample = self._documents[idx].copy()
        sample[:-1] %= self._vocab_size  # the last is eod, left as it is
        return sample

    def get(self, idx: int, offset: int = 0, length: int | None = None):
        if length is None:
            length = self.sequence_lengths[idx] - offset
        return self[idx][offset:offset + length]


class _MockGPTDataset(MockGPTDataset):
    @staticmethod
    def build_low_level_dataset(dataset_path, config) -> _MockDocuments:
        return _MockDocuments(config.tokenizer)


class _MegatronTokenizerView:
    """What megatron-core's datasets read of a tokenizer, for one without `unique_identifiers` (GPTDataset
    json-dumps the tokenizer through that attribute into its cache key, megatron_dataset.py:66-68)."""

    def __init__(self, tokenizer) -> None:
        self.vocab_size = tokenizer.vocab_size
        self.eod = tokenizer.eod
        self.unique_identifiers = {"class": type(tokenizer).__name__, "vocab_size": self.vocab_size,
                                   "eod": self.eod}


def _for_megatron(tokenizer):
    for attr in ("vocab_size", "eod"):
        if not hasattr(tokenizer, attr):
            raise DataError(f"build_datasets: the tokenizer has no {attr!r} (megatron-core's GPT datasets read "
                             f"it)")
    return tokenizer if hasattr(tokenizer, "unique_identifiers") else _MegatronTokenizerView(tokenizer)
