"""Tokenizers for the training job's data, in Megatron-LM's contract, offline.

`build_tokenizer("GPT2BPETokenizer", vocab_file=..., merge_file=...)` reads GPT-2's `vocab.json` + `merges.txt`
from disk; `build_tokenizer("HuggingFaceTokenizer", tokenizer_model=dir)` loads a local directory written by
`save_pretrained`; `NullTokenizer(vocab_size)` (Megatron's, for mock data) reads text as space-separated ids.
Each returns an object with what megatron-core's datasets and Megatron-LM's scripts read:
`vocab_size` (true, unpadded), `eod`, `tokenize(text) -> list[int]`, `detokenize(ids) -> str`, `vocab`,
`inv_vocab` and `unique_identifiers` (GPTDataset hashes it into its cache file names). `padded_vocab_size` is
Megatron-LM's rule for the embedding size.

We do not go through megatron-core's own `megatron.core.tokenizers` for GPT-2: in 0.16.1 its GPT2BPETokenizer
path resolves "gpt2" on the Hugging Face hub and hands the vocab file over as the merges file
(megatron/core/tokenizers/text/libraries/megatron_hf_tokenizer.py:98).

Every bad input is one line naming the file (or flag) and what was expected.
"""

from __future__ import annotations

import base64
import json
import numbers
import os
from collections import OrderedDict
from typing import Any


class DataError(ValueError):
    """Bad input data, vocabulary or tokenizer: the message names the file or flag and what was expected."""

# the ones with files, which preprocess takes
SUPPORTED = ("GPT2BPETokenizer", "HuggingFaceTokenizer", "MagistralTokenizer")
EOD_TOKEN = "<|endoftext|>"  # GPT-2's end-of-document token


def padded_vocab_size(orig: int, make_vocab_size_divisible_by: int, tensor_model_parallel_size: int) -> int:
    """The embedding rows Megatron-LM allocates for `orig` tokens: the next multiple of
    make_vocab_size_divisible_by × tensor_model_parallel_size (Megatron-LM's `vocab_size_with_padding`)."""
    for name, value in (("orig", orig), ("make_vocab_size_divisible_by", make_vocab_size_divisible_by),
                        ("tensor_model_parallel_size", tensor_model_parallel_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise DataError(f"padded_vocab_size: {name} must be a positive int, got {value!r}")
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    # Integer ceiling: Megatron's float math.ceil(orig / multiple) gives the same for any real vocabulary.
    return -(-orig // multiple) * multiple


class _Tokenizer:
    """What both kinds share. `pad` is deliberately absent (raises NotImplementedError, as in Megatron's legacy
    tokenizers): megatron-core's MegatronDataset then pads with -1, an id no document contains, and masks the
    loss on padding only (megatron/core/datasets/megatron_dataset.py:74); a real pad id would also mask every
    genuine occurrence of that token in the corpus."""

    tokenizer_type: str

    def __init__(self, paths: list[str]) -> None:
        self.unique_identifiers = OrderedDict(
            [("class", self.tokenizer_type), ("tokenizer_path", [os.path.abspath(p) for p in paths])])
        self.unique_description = json.dumps(self.unique_identifiers, indent=4)

    vocab_size: int
    eod: int

    def tokenize(self, text: str) -> list[int]:
        raise NotImplementedError

    def detokenize(self, ids) -> str:
        raise NotImplementedError

    @property
    def vocab(self) -> dict[str, int]:
        return self._vocab

    @property
    def inv_vocab(self) -> dict[int, str]:
        return {i: t for t, i in self._vocab.items()}

    @property
    def eos(self) -> int:
        return self.eod

    @property
    def pad(self) -> int:
        raise NotImplementedError(f"{self.tokenizer_type} has no pad token")

    def __repr__(self) -> str:
        return f"{self.tokenizer_type}(vocab_size={self.vocab_size}, eod={self.eod})"


class GPT2BPETokenizer(_Tokenizer):
    """Byte-level BPE from GPT-2's two files, built from HF `tokenizers` pieces (the same BPE model, ByteLevel
    pre-tokenizer and decoder transformers' GPT2Tokenizer is made of).

    As in Megatron-LM's GPT2BPETokenizer (OpenAI's encoder with no special tokens), `<|endoftext|>` written in a
    document's text is ordinary text, split by BPE like any other; only `eod` is the end-of-document id.
    """

    tokenizer_type = "GPT2BPETokenizer"

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        vocab = _read_vocab(vocab_file)
        merges = _read_merges(merge_file, vocab, vocab_file)
        if EOD_TOKEN not in vocab:
            raise DataError(f"--vocab-file {vocab_file}: has no {EOD_TOKEN!r} token, GPT2BPETokenizer's "
                             f"end-of-document token")
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, continuing_subword_prefix="", end_of_word_suffix="",
                                   fuse_unk=False))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2's regex split, bytes -> chars
        tok.decoder = decoders.ByteLevel()
        self._tok = tok
        self._vocab = vocab
        self.vocab_size = len(vocab)  # Megatron: len(encoder)
        self.eod = vocab[EOD_TOKEN]
        super().__init__([vocab_file, merge_file])

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


class HuggingFaceTokenizer(_Tokenizer):
    """`AutoTokenizer.from_pretrained(dir, local_files_only=True)`, read as Megatron-LM's legacy
    _HuggingFaceTokenizer does: vocab_size = len(tokenizer) (added tokens included), eod = eos id, tokenize = the
    tokenizer's own call (so its BOS/EOS template applies, as in Megatron)."""

    tokenizer_type = "HuggingFaceTokenizer"
    flag = "--tokenizer-model"  # the flag that names the directory, in messages

    def __init__(self, tokenizer_model: str, use_fast: bool = True) -> None:
        flag, kind = self.flag, self.tokenizer_type
        if not os.path.isdir(tokenizer_model):
            raise FileNotFoundError(f"{flag} {tokenizer_model}: no such directory ({kind} loads a local directory "
                                    f"written by save_pretrained; no hub downloads)")
        if not any(os.path.isfile(os.path.join(tokenizer_model, f)) for f in _HF_FILES):
            raise DataError(f"{flag} {tokenizer_model}: no tokenizer files in it (expected one of "
                             f"{', '.join(_HF_FILES)}, as written by save_pretrained)")
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(tokenizer_model, local_files_only=True, use_fast=use_fast)
        except Exception as error:  # transformers' messages run over many lines: keep the first
            first = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise DataError(f"{flag} {tokenizer_model}: AutoTokenizer cannot load it: {first}") from error
        if tok.eos_token_id is None:
            raise DataError(f"{flag} {tokenizer_model}: the tokenizer has no eos token, which {kind} uses as its "
                             f"end-of-document id (eod)")
        self._tok = tok
        self._vocab = tok.get_vocab()
        self.vocab_size = len(tok)
        self.eod = tok.eos_token_id
        super().__init__([tokenizer_model])

    def tokenize(self, text: str) -> list[int]:
        return list(self._tok(text).input_ids)

    def detokenize(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


class PretrainedFromHF(HuggingFaceTokenizer):
    """MindSpeed-LLM's PretrainedFromHF (mindspeed_llm/training/tokenizer/tokenizer.py, `_AutoTokenizer`): the same
    AutoTokenizer read of a local directory (its `--tokenizer-name-or-path`), fast unless
    `--tokenizer-not-use-fast`; vocab_size = len(tokenizer), eod = eos id; tokenize = `encode(text)`. Remote code
    in the directory is not run (MindSpeed-LLM passes trust_remote_code=True; the families converted here need
    none)."""

    tokenizer_type = "PretrainedFromHF"
    flag = "--tokenizer-name-or-path"

    def tokenize(self, text: str) -> list[int]:
        return list(self._tok.encode(text))


_HF_FILES = ("tokenizer.json", "tokenizer_config.json")


class MagistralTokenizer(_Tokenizer):
    """MindSpeed-LLM's MagistralTokenizer (mindspeed_llm/training/tokenizer/magistral_tokenizer.py): Mistral's
    Tekken byte-level BPE read from the `tekken.json` its HF repo ships (`--tokenizer-model`: the file, or a folder
    holding it), tokenizing as mistral-common's Tekkenizer does, without BOS/EOS (MindSpeed-LLM's `tokenize(text)`
    calls `encode(text, bos=False, eos=False)`); eod = the `</s>` id.

    The format (mistral-common's `Tekkenizer.from_file`, transformers' `MistralConverter`): `special_tokens` take
    ids 0..n-1 (n = config `default_num_special_tokens`, filled up to it); `vocab` entries, base64 bytes in rank
    order, take ids n + rank, the first `default_vocab_size - n` of them only; text is split by config `pattern`
    and each piece merged by rank (tiktoken's BPE), a piece that is a whole token being that token. Special-token
    strings written in a document are ordinary text, as in the Tekkenizer. vocab_size is `default_vocab_size`
    (mistral-common's n_words; MindSpeed-LLM counts `default_vocab_size` + n, which its scripts override with
    `--padded-vocab-size`)."""

    tokenizer_type = "MagistralTokenizer"

    def __init__(self, tokenizer_model: str) -> None:
        path = tokenizer_model
        if os.path.isdir(path):
            path = os.path.join(path, "tekken.json")
        expected = "expected Mistral's tekken.json: {config, vocab, special_tokens}"
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--tokenizer-model {path}: no such file ({expected}, or a folder holding "
                                    f"it)")
        try:
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
            config, entries, specials = raw["config"], raw["vocab"], raw["special_tokens"]
            pattern = config["pattern"]
            ranks = [base64.b64decode(e["token_bytes"]) for e in entries]
            special = {e["token_str"]: e["rank"] for e in specials}
        except (ValueError, KeyError, TypeError) as error:
            raise DataError(f"--tokenizer-model {path}: not a tekken.json ({type(error).__name__}: {error}); "
                            f"{expected}") from None
        if sorted(special.values()) != list(range(len(special))):
            raise DataError(f"--tokenizer-model {path}: special_tokens ranks are not 0..{len(special) - 1}")
        if "</s>" not in special:
            raise DataError(f"--tokenizer-model {path}: no </s> special token, the end-of-document id (eod)")
        n = config.get("default_num_special_tokens") or len(special)
        size = config.get("default_vocab_size") or n + len(ranks)
        ranks = ranks[: size - n]
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        chars = bytes_to_unicode()

        def text(b: bytes) -> str:
            return "".join(chars[x] for x in b)

        rank = {b: i for i, b in enumerate(ranks)}
        merges = sorted(((b[:k], b[k:], r) for b, r in rank.items() for k in range(1, len(b))
                         if b[:k] in rank and b[k:] in rank), key=lambda m: (m[2], rank[m[0]], rank[m[1]]))
        bpe = models.BPE({text(b): n + r for b, r in rank.items()}, [(text(a), text(b)) for a, b, _ in merges],
                         fuse_unk=False, ignore_merges=True)
        tok = Tokenizer(bpe)
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        self._tok, self._n_special = tok, n
        self._specials = {r: s for s, r in special.items()}
        self._vocab = {**tok.get_vocab(), **special}
        self.vocab_size = size
        self.eod = special["</s>"]
        self.bos = special.get("<s>")
        super().__init__([path])

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids) -> str:
        out, run = [], []
        for i in (int(i) for i in ids):
            if i < self._n_special:
                out.append(self._tok.decode(run))
                out.append(self._specials.get(i, f"<SPECIAL_{i}>"))
                run = []
            else:
                run.append(i)
        return "".join(out) + self._tok.decode(run)


class NullTokenizer(_Tokenizer):
    """Megatron-LM's NullTokenizer: ids 0..vocab_size-1 are themselves (text is ids separated by spaces), and
    eod is one more, vocab_size; so its vocab_size counts vocab_size + 1, as Megatron's does."""

    tokenizer_type = "NullTokenizer"

    def __init__(self, vocab_size: int) -> None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, numbers.Integral) or vocab_size < 1:
            raise DataError(f"NullTokenizer needs --vocab-size, a positive int, got {vocab_size!r}")
        vocab_size = int(vocab_size)
        self.vocab_size = vocab_size + 1
        self.eod = vocab_size
        super().__init__([])
        self.unique_identifiers["vocab_size"] = str(vocab_size)
        self.unique_description = json.dumps(self.unique_identifiers, indent=4)

    def tokenize(self, text: str) -> list[int]:
        return [int(x) for x in text.split()]

    def detokenize(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)

    @property
    def vocab(self) -> dict[str, int]:
        return {str(i): i for i in range(self.vocab_size)}


def build_tokenizer(tokenizer_type: str, *, vocab_file: str | None = None, merge_file: str | None = None,
                    tokenizer_model: str | None = None, vocab_size: int | None = None,
                    tokenizer_name_or_path: str | None = None, use_fast: bool = True) -> _Tokenizer:
    """Megatron-LM's `--tokenizer-type` with its file flags (`vocab_size` for NullTokenizer only; MindSpeed-LLM's
    PretrainedFromHF with `tokenizer_name_or_path` and `use_fast`); the flags a type does not use are ignored."""
    if tokenizer_type == "GPT2BPETokenizer":
        if vocab_file is None:
            raise DataError("GPT2BPETokenizer needs --vocab-file (GPT-2's vocab.json)")
        if merge_file is None:
            raise DataError("GPT2BPETokenizer needs --merge-file (GPT-2's merges.txt)")
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "HuggingFaceTokenizer":
        if tokenizer_model is None:
            raise DataError("HuggingFaceTokenizer needs --tokenizer-model (a local directory written by "
                             "save_pretrained)")
        return HuggingFaceTokenizer(tokenizer_model)
    if tokenizer_type == "PretrainedFromHF":
        if tokenizer_name_or_path is None:
            raise DataError("PretrainedFromHF needs --tokenizer-name-or-path (a local directory written by "
                             "save_pretrained)")
        return PretrainedFromHF(tokenizer_name_or_path, use_fast=use_fast)
    if tokenizer_type == "MagistralTokenizer":
        if tokenizer_model is None:
            raise DataError("MagistralTokenizer needs --tokenizer-model (Mistral's tekken.json, or its folder)")
        return MagistralTokenizer(tokenizer_model)
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    raise DataError(f"--tokenizer-type {tokenizer_type} is not implemented here (supported: "
                     f"{', '.join(SUPPORTED + ('PretrainedFromHF', 'NullTokenizer'))})")


# -- GPT-2 file readers ------------------------------------------------------------------------------------

def _read_vocab(path: str) -> dict[str, int]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--vocab-file {path}: no such file (expected GPT-2's vocab.json)")
    expected = "expected GPT-2's vocab.json, a JSON object of token string -> integer id"
    try:
        with open(path, encoding="utf-8") as f:
            vocab: Any = json.load(f)
    except UnicodeDecodeError as error:
        raise DataError(f"--vocab-file {path}: not UTF-8 text ({error.reason} at byte {error.start}); "
                         f"{expected}") from None
    except json.JSONDecodeError as error:
        raise DataError(f"--vocab-file {path}: not valid JSON ({error.msg} at line {error.lineno} column "
                         f"{error.colno}); {expected}") from None
    if not isinstance(vocab, dict):
        raise DataError(f"--vocab-file {path}: holds a JSON {type(vocab).__name__}; {expected}")
    for token, index in vocab.items():
        if isinstance(index, bool) or not isinstance(index, int):
            raise DataError(f"--vocab-file {path}: token {token!r} maps to {index!r}; {expected}")
    # The ids index the embedding rows: GPT-2's are 0..N-1, each once. Gaps or repeats would make vocab_size
    # (len, as Megatron counts it) disagree with the largest id.
    if sorted(vocab.values()) != list(range(len(vocab))):
        raise DataError(f"--vocab-file {path}: the ids are not 0..{len(vocab) - 1}, each once; {expected}")
    return vocab


def _read_merges(path: str, vocab: dict[str, int], vocab_path: str) -> list[tuple[str, str]]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--merge-file {path}: no such file (expected GPT-2's merges.txt)")
    merges = []
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except UnicodeDecodeError as error:
        raise DataError(f"--merge-file {path}: not UTF-8 text ({error.reason} at byte {error.start}); expected "
                         f"GPT-2's merges.txt") from None
    for lineno, line in enumerate(lines, start=1):
        line = line.rstrip("\r")
        if not line or (lineno == 1 and line.startswith("#version")):
            continue
        parts = line.split(" ")
        if len(parts) != 2 or not all(parts):
            raise DataError(f"--merge-file {path}: line {lineno} is {line!r}; expected two tokens separated by "
                             f"one space (GPT-2's merges.txt)")
        # tokenizers' BPE panics (a BaseException, not an Exception) on a merge whose result is not in the
        # vocabulary (tokenizers 0.23, models/bpe/model.rs:267), so check each piece here, with the line.
        for piece in (parts[0], parts[1], parts[0] + parts[1]):
            if piece not in vocab:
                raise DataError(f"--merge-file {path}: line {lineno} ({line!r}) needs the token {piece!r}, "
                                 f"which --vocab-file {vocab_path} does not have")
        merges.append((parts[0], parts[1]))
    return merges

