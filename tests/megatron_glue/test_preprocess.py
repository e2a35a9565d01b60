"""`npu-compile preprocess` (megatron_glue.data.preprocess): Megatron-LM's preprocess_data.py contract end to end
through the command line, read back with megatron-core's IndexedDataset, and each bad input's message."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_glue.data import preprocess as pp
from megatron_glue.capture import quiet_megatron
from megatron_glue.data.demo_data import train_bpe
from megatron_glue.data.tokenizer import build_tokenizer

TEXTS = [f"document {i}: " + " ".join(["alpha", "beta", "gamma", "delta"][: i % 4 + 1]) * (i % 5 + 1)
         for i in range(70)]  # more than one chunk of 32 per worker
TITLES = [f"Title {i}" for i in range(70)]


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    vocab, merges = train_bpe(TEXTS + TITLES, str(tmp_path_factory.mktemp("gpt2")), vocab_size=320)
    return vocab, merges, build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for i, (text, title) in enumerate(zip(TEXTS, TITLES)):
            f.write(json.dumps({"text": text, "title": title, "id": i}) + "\n")
            if i == 10:
                f.write("\n")  # a blank line: skipped
        f.write(json.dumps({"text": "", "title": "empty"}) + "\n")  # an empty document: kept, with no tokens
    return str(path)


def _args(corpus, prefix, gpt2, *extra):
    return ["--input", corpus, "--output-prefix", prefix, "--tokenizer-type", "GPT2BPETokenizer",
            "--vocab-file", gpt2[0], "--merge-file", gpt2[1], *extra]


def _documents(prefix):
    """Each document's tokens, read back with megatron-core's reader."""
    with quiet_megatron():
        from megatron.core.datasets.indexed_dataset import IndexedDataset
    ds = IndexedDataset(prefix)
    bounds = ds.document_indices
    docs = []
    for d in range(len(bounds) - 1):
        docs.append([int(t) for s in range(bounds[d], bounds[d + 1]) for t in ds[s]])
    return docs, ds.index.dtype


def test_cli_writes_megatrons_indexed_dataset(corpus, gpt2, tmp_path, capsys, monkeypatch):
    with quiet_megatron():  # npu_compile's own import warns about torch.jit
        from npu_compile.__main__ import main as npu_compile_main
    pids = tmp_path / "pids"
    init = pp._init_worker

    def recording_init(*args):  # forked workers inherit this patched module: each notes its pid
        with open(pids, "a") as f:
            f.write(f"{os.getpid()}\n")
        init(*args)

    monkeypatch.setattr(pp, "_init_worker", recording_init)
    prefix = str(tmp_path / "out" / "corpus")
    assert npu_compile_main(["preprocess", *_args(corpus, prefix, gpt2, "--append-eod", "--workers", "2",
                                                   "--json-keys", "text", "title", "--log-interval", "25")]) == 0
    tok = gpt2[2]
    for key, texts in (("text", TEXTS), ("title", TITLES)):
        docs, dtype = _documents(f"{prefix}_{key}_document")
        expected = [tok.tokenize(t) + [tok.eod] for t in texts]
        expected.append(tok.tokenize("empty") + [tok.eod] if key == "title" else [])  # no eod on an empty one
        assert docs == expected
        assert dtype.__name__ == "uint16"  # DType.optimal_dtype for a vocabulary this small
    workers = set(pids.read_text().split())
    assert len(workers) == 2 and str(os.getpid()) not in workers  # --workers 2: two pool processes tokenized
    err = capsys.readouterr().err
    assert "Processed 50 documents" in err and "Processed 75" not in err  # 71 documents, every 25th logged


def test_without_append_eod_and_one_worker_same_as_two(corpus, gpt2, tmp_path):
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    assert pp.main(_args(corpus, one, gpt2, "--workers", "1")) == 0
    assert pp.main(_args(corpus, two, gpt2, "--workers", "2")) == 0
    docs, _ = _documents(f"{one}_text_document")
    assert docs == [gpt2[2].tokenize(t) for t in TEXTS] + [[]]
    for ext in (".bin", ".idx"):  # the pool keeps the input order: byte-identical output
        assert Path(f"{one}_text_document{ext}").read_bytes() == Path(f"{two}_text_document{ext}").read_bytes()


def test_huggingface_tokenizer_dir(corpus, gpt2, tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE.from_file(gpt2[0], gpt2[1]))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(str(tmp_path / "hf"))
    prefix = str(tmp_path / "hf_out")
    assert pp.main(["--input", corpus, "--output-prefix", prefix, "--tokenizer-type", "HuggingFaceTokenizer",
                    "--tokenizer-model", str(tmp_path / "hf"), "--append-eod", "--workers", "2"]) == 0
    docs, _ = _documents(f"{prefix}_text_document")
    assert docs == [gpt2[2].tokenize(t) + [gpt2[2].eod] for t in TEXTS] + [[]]


def test_importing_the_cli_does_not_import_megatron():
    code = ("import sys, npu_compile.__main__, megatron_glue.data.preprocess; "
            "sys.exit(any(m == 'megatron' or m.startswith('megatron.') for m in sys.modules))")
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0"))


# -- bad inputs --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("line,why", [
    ('{"text": "ok"', "not valid JSON (Expecting ',' delimiter at column 14)"),
    ('["text"]', "expected a JSON object, got a JSON list"),
    ('{"body": "x", "id": 3}', "no key 'text' (--json-keys); the object has ['body', 'id']"),
    ('{"text": 5}', "key 'text' holds a int, expected a string"),
])
def test_bad_line_names_file_line_and_problem(line, why, gpt2, tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n' * 40 + line + "\n" + '{"text": "after"}\n', encoding="utf-8")
    prefix = str(tmp_path / "bad")
    assert pp.main(_args(str(path), prefix, gpt2, "--workers", "2")) == 1
    assert capsys.readouterr().err == f"npu-compile preprocess: error: {path}:41: {why}\n"
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl"]  # no partial output left behind


def test_bad_utf8_and_missing_input(gpt2, tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"text": "a"}\n{"text": "\xff"}\n')
    assert pp.main(_args(str(path), str(tmp_path / "o"), gpt2)) == 1
    assert capsys.readouterr().err == (f"npu-compile preprocess: error: {path}:2: not UTF-8 (invalid start byte at "
                                       f"byte 10 of the line)\n")
    missing = str(tmp_path / "none.jsonl")
    assert pp.main(_args(missing, str(tmp_path / "o"), gpt2)) == 1
    assert capsys.readouterr().err == (f"npu-compile preprocess: error: --input {missing}: no such file (expected a "
                                       f".jsonl file, one JSON object per line)\n")


def test_tokenizer_errors_reach_the_cli(corpus, tmp_path, capsys):
    assert pp.main(["--input", corpus, "--output-prefix", str(tmp_path / "o"), "--tokenizer-type",
                    "GPT2BPETokenizer"]) == 1
    assert capsys.readouterr().err == ("npu-compile preprocess: error: GPT2BPETokenizer needs --vocab-file (GPT-2's "
                                       "vocab.json)\n")


@pytest.mark.parametrize("extra,flag", [
    (["--split-sentences"], "--split-sentences"),
    (["--keep-newlines"], "--keep-newlines"),
    (["--partitions", "2"], "--partitions"),
    (["--lang", "english"], "--lang"),
])
def test_unimplemented_megatron_flags_are_refused(extra, flag, corpus, gpt2, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        pp.main(_args(corpus, str(tmp_path / "o"), gpt2, *extra))
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"npu-compile preprocess: error: {flag} is not implemented here (Megatron-LM's tools/preprocess_data.py "
        f"has it; this command tokenizes one document per line, in one partition)")


def test_default_partitions_is_accepted_and_unknown_tokenizer_type_refused(corpus, gpt2, tmp_path, capsys):
    assert pp.main(_args(corpus, str(tmp_path / "o"), gpt2, "--partitions", "1")) == 0
    with pytest.raises(SystemExit):
        pp.main(["--input", corpus, "--output-prefix", str(tmp_path / "o"), "--tokenizer-type", "TikTokenizer"])
    assert capsys.readouterr().err.splitlines()[-1] == (
        "npu-compile preprocess: error: --tokenizer-type TikTokenizer is not implemented here (supported: "
        "GPT2BPETokenizer, HuggingFaceTokenizer)")


def test_demo_data_is_made_once_and_remade_when_broken(tmp_path):
    from megatron_glue.data.demo_data import corpus_documents, make_demo_data

    out = make_demo_data(str(tmp_path / "demo"))
    docs = corpus_documents()
    assert any(d["path"] == os.path.join("megatron_glue", "data", "demo_data.py") for d in docs)
    assert [d["path"] for d in docs] == sorted(d["path"] for d in docs)
    assert out["documents"] == len(docs) and 2000 <= out["vocab_size"] <= 4000
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=out["vocab_file"], merge_file=out["merge_file"])
    read, _ = _documents(out["data_prefix"])
    assert read[0] == tokenizer.tokenize(docs[0]["text"]) + [tokenizer.eod] and len(read) == len(docs)
    stamp = os.stat(out["data_prefix"] + ".bin").st_mtime_ns
    assert make_demo_data(str(tmp_path / "demo")) == out
    assert os.stat(out["data_prefix"] + ".bin").st_mtime_ns == stamp  # reused, not rewritten
    os.remove(out["data_prefix"] + ".idx")
    assert make_demo_data(str(tmp_path / "demo")) == out and os.path.exists(out["data_prefix"] + ".idx")
