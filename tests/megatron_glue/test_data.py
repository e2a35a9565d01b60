"""megatron_glue.data.datasets: megatron-core GPT datasets built from our preprocess output over a gloo group, read by
the Megatron-style pretraining loader (order, DP slices, resume), blends, mock data, and the error texts."""

from __future__ import annotations

import os
import random
import types

import numpy
import pytest
import torch
import torch.distributed as dist

from megatron_glue.data.datasets import build_datasets, build_loader
from megatron_glue.data.demo_data import train_bpe
from megatron_glue.capture.distributed import run_on_ranks, worker_store
from megatron_glue.data.preprocess import preprocess
from megatron_glue.data.tokenizer import DataError, build_tokenizer

SEQ = 16
_rng = random.Random(0)
LETTERS = [" ".join("".join(_rng.choice("abcdefgh") for _ in range(_rng.randint(2, 6)))
                    for _ in range(_rng.randint(3, 12))) for _ in range(150)]
DIGITS = [" ".join("".join(_rng.choice("0123456789") for _ in range(_rng.randint(2, 6)))
                   for _ in range(_rng.randint(3, 12))) for _ in range(150)]


@pytest.fixture(scope="module")
def gloo():
    """A one-process gloo group (megatron-core's builder calls barriers); an existing group is reused."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Two preprocessed corpora over one tokenizer: "letters" (only a-h) and "digits" (only 0-9)."""
    root = tmp_path_factory.mktemp("data")
    vocab, merges = train_bpe(LETTERS + DIGITS, str(root), vocab_size=300)
    out = types.SimpleNamespace(vocab=vocab, merges=merges, root=root,
                                tokenizer=build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges))
    for name, texts in (("letters", LETTERS), ("digits", DIGITS)):
        jsonl = root / f"{name}.jsonl"
        jsonl.write_text("".join(f'{{"text": "{t}"}}\n' for t in texts))
        with open(os.devnull, "w") as quiet:
            prefix = preprocess(str(jsonl), str(root / name), tokenizer_type="GPT2BPETokenizer", vocab_file=vocab,
                                merge_file=merges, append_eod=True, log=quiet)["text"]
        setattr(out, name, prefix)
    return out


def _build(data, tmp_path, data_path, split="8,1,1", num_samples=(64, 8, 8), seed=1234, **kwargs):
    return build_datasets(data_path=data_path, split=split, seq_length=SEQ, seed=seed, tokenizer=data.tokenizer,
                          num_samples=num_samples, data_cache_path=str(tmp_path / "cache"),
                          mock=kwargs.pop("mock", False), **kwargs)


def _batches(dataset, n, **kwargs):
    it = build_loader(dataset, **{"consumed_samples": 0, "data_parallel_rank": 0, "data_parallel_size": 1,
                                  **kwargs})
    return [next(it) for _ in range(n)]


def test_samples_are_megatron_gpt_batches(gloo, data, tmp_path):
    train, valid, test = _build(data, tmp_path, [data.letters])
    assert all(type(d).__name__ == "GPTDataset" for d in (train, valid, test))
    assert len(train) >= 64 and train.config.sequence_length == SEQ and train.config.random_seed == 1234
    batch = _batches(train, 1, micro_batch_size=4)[0]
    assert set(batch) == {"tokens", "labels", "loss_mask", "position_ids", "attention_mask"}
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        assert batch[key].shape == (4, SEQ)
    assert batch["tokens"].dtype == torch.int64 and batch["loss_mask"].dtype == torch.float32
    assert torch.equal(batch["labels"][:, :-1], batch["tokens"][:, 1:])  # next-token labels
    assert torch.equal(batch["position_ids"], torch.arange(SEQ).expand(4, SEQ))
    assert batch["attention_mask"].shape == (4, 1, SEQ, SEQ) and batch["attention_mask"].dtype == torch.bool
    assert torch.equal(batch["attention_mask"][0, 0], torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1))
    assert bool((batch["loss_mask"] == 1).all())
    # the text is the corpus's: letters, spaces and the eod token only
    eod = data.tokenizer.eod
    for row in torch.cat([batch["tokens"], batch["labels"][:, -1:]], 1).tolist():
        pieces = [data.tokenizer.detokenize([t]) for t in row if t != eod]
        assert set("".join(pieces)) <= set("abcdefgh ")
    assert bool((batch["tokens"] == eod).any())  # documents are joined with eod (--append-eod)


def test_loader_reads_in_order_and_dp_ranks_take_their_slices(gloo, data, tmp_path):
    train = _build(data, tmp_path, [data.letters])[0]
    mbs, dp = 2, 2
    ranks = [_batches(train, 5, micro_batch_size=mbs, data_parallel_rank=r, data_parallel_size=dp)
             for r in range(dp)]
    whole = _batches(train, 5, micro_batch_size=mbs * dp)
    for step in range(5):
        # Megatron's sampler: global micro-batch `step` is samples [step*4, step*4+4); rank r gets its r-th pair
        expected = torch.stack([train[i]["tokens"] for i in range(step * 4, step * 4 + 4)])
        assert torch.equal(whole[step]["tokens"], expected)
        assert torch.equal(torch.cat([ranks[0][step]["tokens"], ranks[1][step]["tokens"]]), expected)
    seen = [tuple(row) for r in ranks for b in r for row in b["tokens"].tolist()]
    assert len(set(seen)) == len(seen) == 20  # the two ranks never see the same sample


def test_resume_at_consumed_samples_continues_with_the_next_samples(gloo, data, tmp_path):
    train = _build(data, tmp_path, [data.letters])[0]
    full = _batches(train, 6, micro_batch_size=2, data_parallel_rank=1, data_parallel_size=2)
    resumed = _batches(train, 3, micro_batch_size=2, data_parallel_rank=1, data_parallel_size=2,
                       consumed_samples=3 * 4)  # three global micro-batches of 2 x 2 consumed
    for a, b in zip(full[3:], resumed):
        assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["labels"], b["labels"])
    with_worker = _batches(train, 3, micro_batch_size=2, data_parallel_rank=1, data_parallel_size=2,
                           consumed_samples=12, num_workers=1)
    assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(resumed, with_worker))
    with pytest.raises(ValueError, match=rf"^consumed_samples {len(train)} leaves nothing to read from a dataset "
                                         rf"of {len(train)} samples$"):
        build_loader(train, consumed_samples=len(train), micro_batch_size=1, data_parallel_rank=0,
                     data_parallel_size=1)


def test_the_loader_leaves_the_global_rng_alone(gloo, data, tmp_path):
    """The job makes its loaders after a checkpoint restored the RNG state; a draw from torch's default generator
    there (a DataLoader's worker base seed) would shift every dropout mask after a resume on the CPU."""
    train = _build(data, tmp_path, [data.letters])[0]
    before = torch.get_rng_state()
    for workers in (0, 1):
        next(build_loader(train, consumed_samples=0, micro_batch_size=2, data_parallel_rank=0, data_parallel_size=1,
                          num_workers=workers))
    assert torch.equal(torch.get_rng_state(), before)


def test_seed_split_and_attention_mask_options(gloo, data, tmp_path):
    first = lambda ds: _batches(ds, 1, micro_batch_size=4)[0]["tokens"]  # noqa: E731
    a = _build(data, tmp_path, [data.letters], seed=1)[0]
    assert torch.equal(first(a), first(_build(data, tmp_path, [data.letters], seed=1)[0]))
    assert not torch.equal(first(a), first(_build(data, tmp_path, [data.letters], seed=2)[0]))
    train, valid, test = _build(data, tmp_path, [data.letters], split="100,0,0", num_samples=(32, 0, 0))
    assert train is not None and valid is None and test is None
    assert build_loader(valid, consumed_samples=0, micro_batch_size=1, data_parallel_rank=0,
                        data_parallel_size=1) is None
    no_mask = _build(data, tmp_path, [data.letters], create_attention_mask=False)[0]
    assert "attention_mask" not in _batches(no_mask, 1, micro_batch_size=2)[0]


def test_weighted_blend_of_two_prefixes(gloo, data, tmp_path):
    train, valid, _ = _build(data, tmp_path, ["0.25", data.letters, "0.75", data.digits], num_samples=(400, 40, 8))
    assert type(train).__name__ == "BlendedDataset" and len(train) == 400 and len(valid) == 40
    batches = _batches(train, 100, micro_batch_size=4)
    ids = torch.cat([b["dataset_id"] for b in batches])
    assert abs(int((ids == 0).sum()) - 100) <= 1 and abs(int((ids == 1).sum()) - 300) <= 1
    eod = data.tokenizer.eod
    for b in batches[:10]:
        for source, row in zip(b["dataset_id"].tolist(), b["tokens"].tolist()):
            text = data.tokenizer.detokenize([t for t in row if t != eod])
            assert set(text) <= (set("abcdefgh ") if source == 0 else set("0123456789 "))


def test_mock_data(gloo, data, tmp_path):
    train, valid, test = _build(data, tmp_path, None, mock=True, num_samples=(16, 4, 4))
    from megatron.core.datasets.gpt_dataset import MockGPTDataset

    assert isinstance(train, MockGPTDataset) and valid is not None and test is not None
    batches = _batches(train, 8, micro_batch_size=3)
    assert batches[0]["tokens"].shape == (3, SEQ)
    for batch in batches:
        assert torch.equal(batch["labels"][:, :-1], batch["tokens"][:, 1:])
        # ids stay inside the vocabulary (megatron-core 0.12's mock data would run past 300)
        assert int(torch.cat([batch["tokens"], batch["labels"]]).max()) < data.tokenizer.vocab_size
    # any object with vocab_size and eod will do (megatron-core also reads unique_identifiers, supplied for it)
    plain = types.SimpleNamespace(vocab_size=50, eod=0)
    mock = build_datasets(data_path=None, split="1,0,0", seq_length=8, seed=0, tokenizer=plain,
                          num_samples=(4, 0, 0), data_cache_path=None, mock=True)[0]
    assert int(_batches(mock, 1, micro_batch_size=2)[0]["tokens"].max()) < 50


def test_data_path_errors(gloo, data, tmp_path):
    missing = str(tmp_path / "nowhere" / "corpus_text_document")
    with pytest.raises(FileNotFoundError) as info:
        _build(data, tmp_path, ["0.5", data.letters, "0.5", missing])
    assert str(info.value) == (f"data prefix {missing}: expected {missing}.bin and {missing}.idx, missing "
                               f"{missing}.bin and {missing}.idx (write them with `npu-compile preprocess`)")
    only_bin = str(tmp_path / "half")
    open(only_bin + ".bin", "wb").close()
    with pytest.raises(FileNotFoundError, match=r"missing [^ ]*half\.idx \(write them with `npu-compile preprocess`\)$"):
        _build(data, tmp_path, [only_bin])
    with pytest.raises(FileNotFoundError, match=r"\(give the prefix, without \.bin/\.idx\)$"):
        _build(data, tmp_path, [data.letters + ".bin"])
    with pytest.raises(ValueError) as info:
        _build(data, tmp_path, ["0.3", data.letters, data.digits, data.letters])
    assert str(info.value).endswith(": mixes weights and prefixes; give prefixes only, or weight prefix pairs")
    with pytest.raises(ValueError, match=r"^build_datasets: mock=True and data_path are exclusive"):
        _build(data, tmp_path, [data.letters], mock=True)
    with pytest.raises(ValueError, match=r"^build_datasets: give data_path \(--data-path\) or mock=True"):
        _build(data, tmp_path, None)


def _read_on_rank(vocab, merges, prefix, cache):
    """A run_on_ranks worker: build over a 2-rank gloo group, read this rank's DP slice."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", store=worker_store(), rank=rank, world_size=world)
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    train = build_datasets(data_path=[prefix], split="8,1,1", seq_length=SEQ, seed=1234, tokenizer=tokenizer,
                           num_samples=(64, 8, 8), data_cache_path=cache, mock=False)[0]
    loaded = isinstance(train.shuffle_index, numpy.memmap)  # read from the cache rank 0 wrote, not built here
    it = build_loader(train, consumed_samples=0, micro_batch_size=2, data_parallel_rank=rank, data_parallel_size=world)
    return loaded, [next(it)["tokens"] for _ in range(3)]


@pytest.mark.gloo
def test_two_ranks_rank0_builds_the_cache_and_each_reads_its_slice(gloo, data, tmp_path):
    cache = str(tmp_path / "shared_cache")
    (loaded0, tokens0), (loaded1, tokens1) = run_on_ranks(
        _read_on_rank, data.vocab, data.merges, data.letters, cache, world_size=2, timeout=180)
    assert (loaded0, loaded1) == (False, True)
    whole = _batches(_build(data, tmp_path, [data.letters])[0], 3, micro_batch_size=4)  # DP=1, this process
    for step in range(3):
        assert torch.equal(torch.cat([tokens0[step], tokens1[step]]), whole[step]["tokens"])


def test_split_without_tokens_is_refused(gloo, data, tmp_path):
    """Megatron-LM's default split on few documents leaves the test split none: megatron-core would count epochs for
    ever (gpt_dataset.py _get_num_epochs), even asked for no samples; the error says so with the numbers."""
    for num_samples in ((8, 8, 8), (8, 8, 0)):
        with pytest.raises(DataError) as info:
            _build(data, tmp_path, [data.letters], split="969, 30, 1", num_samples=num_samples)
        assert str(info.value) == (
            f"--split '969, 30, 1' gives the test split 0 of the {len(LETTERS)} documents of {data.letters}, with "
            "no tokens, and megatron-core cannot build a split without tokens; give that split more weight (e.g. "
            "--split 90,5,5) or use more data")
