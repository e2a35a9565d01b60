"""megatron_glue.data.tokenizer: GPT-2 files and HF directories made here (a tiny BPE trained in the test), their
round trips, Megatron's vocab padding, and each bad input's one-line message."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from megatron_glue.data.demo_data import train_bpe
from tekken_files import write_tekken
from megatron_glue.data.tokenizer import EOD_TOKEN, DataError, NullTokenizer, build_tokenizer, padded_vocab_size

CORPUS = [
    "The quick brown fox jumps over the lazy dog.\n" * 3,
    "def add(a, b):\n    return a + b  # sums\n\n\tindented\ttabs   and  spaces",
    "Ünïcödé: naïve café, 東京, emoji 🙂, and ¿preguntas?",
    "numbers 0123456789 and symbols !@#$%^&*()_+-=[]{};':\",./<>?",
]
SAMPLES = CORPUS + ["text it never saw: zebra xylophone QUIZ", "  leading and trailing  ", "\n\n", "a"]


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory):
    return train_bpe(CORPUS, str(tmp_path_factory.mktemp("gpt2")), vocab_size=400)


@pytest.fixture(scope="module")
def gpt2(gpt2_files):
    vocab_file, merge_file = gpt2_files
    return build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)


@pytest.fixture(scope="module")
def hf_dir(gpt2_files, tmp_path_factory):
    """An HF tokenizer directory saved from the same BPE, eos = <|endoftext|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE.from_file(*gpt2_files))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    path = str(tmp_path_factory.mktemp("hf"))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOD_TOKEN).save_pretrained(path)
    return path


def test_gpt2_round_trips_and_counts_like_megatron(gpt2, gpt2_files):
    vocab = json.loads(Path(gpt2_files[0]).read_text(encoding="utf-8"))
    assert gpt2.vocab_size == len(vocab) > 257  # 256 bytes, <|endoftext|>, then merges
    assert gpt2.eod == vocab[EOD_TOKEN]
    for text in SAMPLES:
        ids = gpt2.tokenize(text)
        assert all(isinstance(i, int) and 0 <= i < gpt2.vocab_size for i in ids)
        assert gpt2.detokenize(ids) == text
    assert len(gpt2.tokenize(CORPUS[0])) < len(CORPUS[0].encode()) / 2  # the merges are used, not just bytes
    assert gpt2.detokenize([gpt2.eod]) == EOD_TOKEN


def test_gpt2_matches_transformers_gpt2_tokenizer_on_the_same_files(gpt2, gpt2_files):
    """The same ids as transformers' GPT2Tokenizer built from the two files: GPT-2's split and byte mapping."""
    from transformers import GPT2Tokenizer

    vocab = json.loads(Path(gpt2_files[0]).read_text(encoding="utf-8"))
    lines = Path(gpt2_files[1]).read_text(encoding="utf-8").split("\n")[1:]
    reference = GPT2Tokenizer(vocab=vocab, merges=[tuple(line.split(" ")) for line in lines if line])
    for text in SAMPLES:
        assert gpt2.tokenize(text) == reference(text)["input_ids"]


def test_gpt2_treats_the_eod_text_as_text_like_megatrons_legacy_encoder(gpt2):
    ids = gpt2.tokenize(f"end{EOD_TOKEN}")
    assert gpt2.eod not in ids and gpt2.detokenize(ids) == f"end{EOD_TOKEN}"


def test_huggingface_dir_round_trips(hf_dir, gpt2):
    hf = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=hf_dir)
    assert hf.vocab_size == gpt2.vocab_size and hf.eod == gpt2.eod
    for text in SAMPLES:
        ids = hf.tokenize(text)
        assert ids == gpt2.tokenize(text)  # the same BPE behind both
        assert hf.detokenize(ids) == text
    assert hf.unique_identifiers["class"] == "HuggingFaceTokenizer"


def test_null_tokenizer_is_megatrons():
    null = build_tokenizer("NullTokenizer", vocab_size=100)
    assert (null.vocab_size, null.eod) == (101, 100)  # eod is one past the ids, and counted
    assert null.tokenize("3 1 4 99") == [3, 1, 4, 99] and null.detokenize([3, 1, 100]) == "3 1 100"
    assert NullTokenizer(100).unique_identifiers == null.unique_identifiers != NullTokenizer(7).unique_identifiers
    with pytest.raises(DataError, match=r"^NullTokenizer needs --vocab-size, a positive int, got None$"):
        build_tokenizer("NullTokenizer")


@pytest.mark.parametrize("orig,divisible_by,tp", [
    (50257, 128, 1), (50257, 128, 8), (50257, 1, 1), (3000, 128, 1), (3072, 128, 1), (3073, 128, 1),
    (32000, 64, 4), (1, 1, 1), (1, 128, 3), (128000, 128, 2),
])
def test_padded_vocab_size_is_megatrons(orig, divisible_by, tp):
    megatron = int(math.ceil(orig / (divisible_by * tp)) * divisible_by * tp)  # vocab_size_with_padding
    assert padded_vocab_size(orig, divisible_by, tp) == megatron
    assert padded_vocab_size(orig, divisible_by, tp) % (divisible_by * tp) == 0


def test_padded_vocab_size_figures():
    assert padded_vocab_size(50257, 128, 1) == 50304  # GPT-2 in Megatron-LM
    assert padded_vocab_size(50257, 128, 8) == 51200
    assert padded_vocab_size(3072, 128, 1) == 3072
    with pytest.raises(DataError, match=r"^padded_vocab_size: tensor_model_parallel_size must be a positive int, "
                                         r"got 0$"):
        padded_vocab_size(100, 128, 0)


# -- bad inputs --------------------------------------------------------------------------------------------

def _error(kind, **kwargs):
    with pytest.raises((DataError, FileNotFoundError)) as info:
        build_tokenizer(kind, **kwargs)
    assert "\n" not in str(info.value)
    return type(info.value), str(info.value)


def _write(path, text):
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_gpt2_missing_flags_and_files(gpt2_files, tmp_path):
    vocab, merges = gpt2_files
    assert _error("GPT2BPETokenizer", merge_file=merges) == (
        DataError, "GPT2BPETokenizer needs --vocab-file (GPT-2's vocab.json)")
    assert _error("GPT2BPETokenizer", vocab_file=vocab) == (
        DataError, "GPT2BPETokenizer needs --merge-file (GPT-2's merges.txt)")
    missing = str(tmp_path / "nope.json")
    assert _error("GPT2BPETokenizer", vocab_file=missing, merge_file=merges) == (
        FileNotFoundError, f"--vocab-file {missing}: no such file (expected GPT-2's vocab.json)")
    assert _error("GPT2BPETokenizer", vocab_file=vocab, merge_file=missing) == (
        FileNotFoundError, f"--merge-file {missing}: no such file (expected GPT-2's merges.txt)")


def test_gpt2_malformed_vocab(gpt2_files, tmp_path):
    merges = gpt2_files[1]
    expected = "expected GPT-2's vocab.json, a JSON object of token string -> integer id"
    for text, why in [
        ('{"a": 0,', "not valid JSON (Expecting property name enclosed in double quotes at line 1 column 9)"),
        ('["a", "b"]', "holds a JSON list"),
        ('{"a": 0, "b": "1"}', "token 'b' maps to '1'"),
        ('{"a": 0, "b": 2}', "the ids are not 0..1, each once"),
    ]:
        path = _write(tmp_path / "vocab.json", text)
        assert _error("GPT2BPETokenizer", vocab_file=path, merge_file=merges) == (
            DataError, f"--vocab-file {path}: {why}; {expected}")


def test_gpt2_malformed_merges_and_vocab_without_eod(tmp_path):
    vocab = _write(tmp_path / "vocab.json", json.dumps({EOD_TOKEN: 0, "a": 1, "b": 2, "ab": 3}))
    for text, lineno, why in [
        ("#version: 0.2\na b c\n", 2, "is 'a b c'; expected two tokens separated by one space (GPT-2's merges.txt)"),
        ("ab\n", 1, "is 'ab'; expected two tokens separated by one space (GPT-2's merges.txt)"),
        ("a b\nab b\n", 2, f"('ab b') needs the token 'abb', which --vocab-file {vocab} does not have"),
    ]:
        merges = _write(tmp_path / "merges.txt", text)
        assert _error("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges) == (
            DataError, f"--merge-file {merges}: line {lineno} {why}")
    merges = _write(tmp_path / "merges.txt", "#version: 0.2\na b\n")
    assert build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges).tokenize("ab") == [3]
    no_eod = _write(tmp_path / "no_eod.json", json.dumps({"a": 0, "b": 1, "ab": 2}))
    assert _error("GPT2BPETokenizer", vocab_file=no_eod, merge_file=merges) == (
        DataError, f"--vocab-file {no_eod}: has no '<|endoftext|>' token, GPT2BPETokenizer's end-of-document token")


def test_huggingface_bad_dirs_and_unknown_type(tmp_path):
    assert _error("HuggingFaceTokenizer") == (
        DataError, "HuggingFaceTokenizer needs --tokenizer-model (a local directory written by save_pretrained)")
    missing = str(tmp_path / "nope")
    assert _error("HuggingFaceTokenizer", tokenizer_model=missing) == (
        FileNotFoundError, f"--tokenizer-model {missing}: no such directory (HuggingFaceTokenizer loads a local "
                           f"directory written by save_pretrained; no hub downloads)")
    (tmp_path / "empty").mkdir()
    empty = str(tmp_path / "empty")
    assert _error("HuggingFaceTokenizer", tokenizer_model=empty) == (
        DataError, f"--tokenizer-model {empty}: no tokenizer files in it (expected one of tokenizer.json, "
                    f"tokenizer_config.json, as written by save_pretrained)")
    assert _error("SentencePieceTokenizer", tokenizer_model=empty) == (
        DataError, "--tokenizer-type SentencePieceTokenizer is not implemented here (supported: GPT2BPETokenizer, "
                    "HuggingFaceTokenizer, MagistralTokenizer, PretrainedFromHF, NullTokenizer)")


def test_pretrained_from_hf_is_mindspeed_llms_auto_tokenizer(gpt2_files, tmp_path):
    """MindSpeed-LLM's PretrainedFromHF: AutoTokenizer on --tokenizer-name-or-path; vocab_size = len(tokenizer),
    eod = eos; tokenize = encode(text). --tokenizer-not-use-fast (use_fast=False) asks for the slow tokenizer,
    which transformers 5 no longer has: the same fast one comes back (hence its place among the no-effect flags)."""
    from transformers import GPT2Tokenizer

    folder = str(tmp_path / "hf")
    GPT2Tokenizer(*gpt2_files, eos_token=EOD_TOKEN).save_pretrained(folder)  # slow and fast both load from it
    fast = build_tokenizer("PretrainedFromHF", tokenizer_name_or_path=folder)
    slow = build_tokenizer("PretrainedFromHF", tokenizer_name_or_path=folder, use_fast=False)
    assert (fast._tok.is_fast, slow._tok.is_fast) == (True, True)
    vocab = json.loads(Path(gpt2_files[0]).read_text(encoding="utf-8"))
    for tok in (fast, slow):
        assert (tok.vocab_size, tok.eod, tok.tokenizer_type) == (len(vocab), vocab[EOD_TOKEN], "PretrainedFromHF")
    for text in SAMPLES:
        assert fast.tokenize(text) == slow.tokenize(text) == fast._tok.encode(text)
    assert _error("PretrainedFromHF") == (
        DataError, "PretrainedFromHF needs --tokenizer-name-or-path (a local directory written by save_pretrained)")
    missing = str(tmp_path / "nope")
    assert _error("PretrainedFromHF", tokenizer_name_or_path=missing) == (
        FileNotFoundError, f"--tokenizer-name-or-path {missing}: no such directory (PretrainedFromHF loads a local "
                           "directory written by save_pretrained; no hub downloads)")


@pytest.fixture(scope="module")
def tekken(gpt2_files, tmp_path_factory):
    return write_tekken(gpt2_files[1], tmp_path_factory.mktemp("tekken") / "tekken.json")


def test_magistral_tokenizer_reads_tekken_as_mistral_does(tekken):
    """MindSpeed-LLM's MagistralTokenizer: ids as transformers' own tekken.json reader (MistralConverter, which
    follows mistral-common's Tekkenizer) gives them, no BOS/EOS added, eod = </s>, vocab = default_vocab_size."""
    from transformers.integrations.mistral.tokenizer import MistralConverter

    path, ranks = tekken
    tok = build_tokenizer("MagistralTokenizer", tokenizer_model=path)
    reference = MistralConverter(path).converted()
    assert (tok.vocab_size, tok.eod, tok.bos) == (10 + len(ranks) - 3, 2, 1)
    assert build_tokenizer("MagistralTokenizer", tokenizer_model=str(Path(path).parent)).vocab_size == tok.vocab_size
    for text in SAMPLES:
        ids = tok.tokenize(text)
        assert ids == reference.encode(text, add_special_tokens=False).ids, text
        assert tok.detokenize(ids) == text
        assert min(ids) >= 10 and max(ids) < tok.vocab_size
    # a byte is its own token, 10 + its value; the cut-off merges are not tokens
    assert tok.tokenize("\x00") == [10] and tok.tokenize("A") == [10 + ord("A")]
    assert all(tok.tokenize(r.decode("latin-1")) != [10 + i] for i, r in enumerate(ranks[-3:], len(ranks) - 3)
               if r.isascii())
    # special-token strings in a document are text, as in the Tekkenizer; special ids detokenize to their names
    assert all(i >= 10 for i in tok.tokenize("<s>[INST] hi [/INST]</s>"))
    assert tok.detokenize([1, *tok.tokenize("hi"), 2]) == "<s>hi</s>"


def test_magistral_tokenizer_bad_files(tmp_path):
    assert _error("MagistralTokenizer") == (DataError, "MagistralTokenizer needs --tokenizer-model (Mistral's "
                                                       "tekken.json, or its folder)")
    with pytest.raises(FileNotFoundError, match=r"--tokenizer-model .*tekken.json: no such file \(expected "
                                                 r"Mistral's tekken.json"):
        build_tokenizer("MagistralTokenizer", tokenizer_model=str(tmp_path))
    bad = _write(tmp_path / "tekken.json", json.dumps({"config": {}, "vocab": []}))
    assert _error("MagistralTokenizer", tokenizer_model=bad) == (
        DataError, f"--tokenizer-model {bad}: not a tekken.json (KeyError: 'special_tokens'); expected Mistral's "
                   "tekken.json: {config, vocab, special_tokens}")
