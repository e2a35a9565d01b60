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
    pools, make_pool = [], pp._pool
    monkeypatch.setattr(pp, "_pool", lambda job, workers: pools.append(workers) or make_pool(job, workers))
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
    # --workers 2: a pool of two processes tokenized (on a loaded machine the second may start after the work is done)
    assert pools == [2] and 1 <= len(workers) <= 2 and str(os.getpid()) not in workers
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


@pytest.mark.any_megatron_line  # what the CLI imports is this package's own import chain
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
    assert capsys.readouterr().err == (f"npu-compile preprocess: error: --input {missing}: no such file or folder "
                                       f"(expected a .jsonl, .json or .parquet file, or a folder of them)\n")


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
        "GPT2BPETokenizer, HuggingFaceTokenizer, MagistralTokenizer, PretrainedFromHF)")


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


# -- MindSpeed-LLM's preprocess_data.py flags (its examples/mcore/*/data_convert_*_pretrain.sh) -------------------

@pytest.fixture(scope="module")
def hf_dir(gpt2, tmp_path_factory):
    """A local HF tokenizer folder (save_pretrained), as --tokenizer-name-or-path takes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE.from_file(gpt2[0], gpt2[1]))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    path = str(tmp_path_factory.mktemp("hf_tokenizer"))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(path)
    return path


def _mindspeed_args(data, prefix, hf_dir, *extra):
    """A data_convert_*_pretrain.sh line (llama2's, scaled down: --workers 2)."""
    return ["--input", data, "--tokenizer-name-or-path", hf_dir, "--tokenizer-type", "PretrainedFromHF",
            "--handler-name", "GeneralPretrainHandler", "--output-prefix", prefix, "--json-keys", "text",
            "--workers", "2", "--log-interval", "1000", *extra]


def _reference_ids(hf_dir, texts, eod=True):
    """transformers' own tokenizer of the folder: what MindSpeed-LLM's handler calls for each text."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    return [list(tok(t).input_ids) + ([tok.eos_token_id] if eod else []) for t in texts]


def _write_parquet(path, rows):
    pa = pytest.importorskip("pyarrow", reason="the [megatron] extra installs pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), str(path), row_group_size=16)  # several row groups


def _job_samples(prefix, tokenizer, docs, seq):
    """The job's dataset code (megatron_glue.data.datasets) over `prefix`: each sample checked against the
    documents' tokens, concatenated in the dataset's document order."""
    from megatron_glue.data.datasets import build_datasets

    train = build_datasets(data_path=[prefix], split="1,0,0", seq_length=seq, seed=1234, tokenizer=tokenizer,
                           num_samples=(8, 0, 0), data_cache_path=None, mock=False)[0]
    stream = [t for d in train.document_index for t in docs[d]]
    for i in range(len(train)):
        sample = train[i]
        s = int(train.shuffle_index[i])
        assert sample["tokens"].tolist() == stream[s * seq: (s + 1) * seq]
        assert sample["labels"].tolist() == stream[s * seq + 1: (s + 1) * seq + 1]
    return len(train)


def test_mindspeed_pretrain_flags_jsonl_and_parquet_read_back_by_the_job(hf_dir, tmp_path):
    rows = [{"text": t, "title": title, "id": i} for i, (t, title) in enumerate(zip(TEXTS, TITLES))]
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    parquet = tmp_path / "train-00000-of-00001.parquet"
    _write_parquet(parquet, rows)
    expected = _reference_ids(hf_dir, TEXTS)
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=hf_dir)
    for data in (jsonl, parquet):
        prefix = str(tmp_path / data.suffix[1:] / "enwiki")
        assert pp.main(_mindspeed_args(str(data), prefix, hf_dir, "--append-eod")) == 0
        docs, _ = _documents(f"{prefix}_text_document")  # MindSpeed-LLM's name, what its --data-path takes
        assert docs == expected
        assert _job_samples(f"{prefix}_text_document", tokenizer, docs, seq=16) >= 8
    for ext in (".bin", ".idx"):
        assert (Path(f"{tmp_path}/jsonl/enwiki_text_document{ext}").read_bytes()
                == Path(f"{tmp_path}/parquet/enwiki_text_document{ext}").read_bytes())


def test_folder_input_json_array_and_n_subs(hf_dir, tmp_path):
    """A folder: its files of one format in name order (README.md skipped); a .json file holding an array; --n-subs
    cuts into subsets written in the pool and merged: byte-identical to one pass, no subset files left."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "README.md").write_text("not data")
    (folder / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[30:]), encoding="utf-8")
    (folder / "a.json").write_text(json.dumps([{"text": t} for t in TEXTS[:30]]), encoding="utf-8")
    expected = _reference_ids(hf_dir, TEXTS, eod=False)
    one = str(tmp_path / "one" / "corpus")
    assert pp.main(_mindspeed_args(str(folder), one, hf_dir)) == 0
    assert _documents(f"{one}_text_document")[0] == expected
    subs = str(tmp_path / "subs" / "corpus")
    assert pp.main(_mindspeed_args(str(folder), subs, hf_dir, "--n-subs", "4")) == 0
    for ext in (".bin", ".idx"):
        assert Path(f"{one}_text_document{ext}").read_bytes() == Path(f"{subs}_text_document{ext}").read_bytes()
    assert sorted(os.listdir(tmp_path / "subs")) == ["corpus_text_document.bin", "corpus_text_document.idx"]
    assert pp.subset_ranges(70, 4) == [(0, 17), (17, 34), (34, 51), (51, 68), (68, 70)]  # MindSpeed-LLM's cut


def test_n_subs_in_one_process_and_bad_record_in_a_subset(hf_dir, tmp_path, capsys):
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:9]) + '{"body": "x"}\n', encoding="utf-8")
    prefix = str(tmp_path / "o" / "c")
    args = _mindspeed_args(str(path), prefix, hf_dir, "--n-subs", "3")
    args[args.index("--workers") + 1] = "1"
    assert pp.main(args) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"npu-compile preprocess: error: {path}:10: no key 'text' (--json-keys); the object has ['body']")
    assert os.listdir(tmp_path / "o") == []  # neither the output nor a subset left behind
    assert pp.main(args[:-2] + ["--n-subs", "11"]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        "npu-compile preprocess: error: --n-subs 11: more subsets than the 10 documents of --input")


@pytest.mark.parametrize("make,why", [
    (lambda d: (d / "x.txt").write_text("a"), "--input {p}: not a .jsonl, .json or .parquet file"),
    (lambda d: (d / "README.md").write_text("a"), "--input {p}: the folder holds no .jsonl, .json or .parquet file"),
    (lambda d: ((d / "a.jsonl").write_text('{"text": "a"}\n'), _write_parquet(d / "b.parquet", [{"text": "b"}])),
     "--input {p}: the folder holds both JSON and parquet files; give a folder of one format"),
    (lambda d: _write_parquet(d / "b.parquet", [{"body": "b"}]),
     "{p}/b.parquet: no column 'text' (--json-keys); the file has ['body']"),
    (lambda d: _write_parquet(d / "b.parquet", [{"text": "a"}, {"text": None}]),
     "{p}/b.parquet: row 2: key 'text' holds a NoneType, expected a string"),
    (lambda d: (d / "a.json").write_text('[{"text": "a"}, 3]'), "{p}/a.json: item 2: expected a JSON object, got a "
                                                                "JSON int"),
])
def test_bad_inputs_of_the_new_formats(make, why, hf_dir, tmp_path, capsys):
    d = tmp_path / "in"
    d.mkdir()
    make(d)
    p = str(d / "x.txt") if "not a .jsonl" in why else str(d)
    assert pp.main(_mindspeed_args(p, str(tmp_path / "o"), hf_dir)) == 1
    assert capsys.readouterr().err == f"npu-compile preprocess: error: {why.format(p=p)}\n"


def test_pretrained_from_hf_tokenizer_errors_name_its_flag(tmp_path, capsys):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "a"}\n')
    base = ["--input", str(path), "--output-prefix", str(tmp_path / "o")]
    assert pp.main(base) == 1  # PretrainedFromHF is the default, as MindSpeed-LLM's
    assert capsys.readouterr().err == ("npu-compile preprocess: error: PretrainedFromHF needs --tokenizer-name-or-path "
                                       "(a local directory written by save_pretrained; no hub downloads)\n")
    assert pp.main(base + ["--tokenizer-name-or-path", "meta-llama/Llama-2-7b-hf"]) == 1
    assert capsys.readouterr().err == (
        "npu-compile preprocess: error: --tokenizer-name-or-path meta-llama/Llama-2-7b-hf: no such directory "
        "(HuggingFaceTokenizer loads a local directory written by save_pretrained; no hub downloads)\n")


@pytest.mark.parametrize("extra,message", [
    (["--handler-name", "R1AlpacaStyleInstructionHandler"],
     "--handler-name R1AlpacaStyleInstructionHandler is not implemented here: it makes instruction-tuning data "
     "(prompt templates, packed `_packed` outputs for MindSpeed-LLM's --is-instruction-dataset), a feature not built "
     "yet; supported: GeneralPretrainHandler, AlpacaStyleInstructionHandler, SharegptStyleInstructionHandler"),
    (["--handler-name", "AlpacaPretrainHandler"],
     "--handler-name AlpacaPretrainHandler is not implemented here (its own record layout); supported: "
     "GeneralPretrainHandler, with --json-keys naming the text fields"),
    (["--handler-name", "MyHandler"], "--handler-name MyHandler is not a MindSpeed-LLM handler; supported: "
                                      "GeneralPretrainHandler"),
    (["--prompt-type", "qwen"], "--prompt-type is taken here only for instruction data, with --handler-name "
                                "AlpacaStyleInstructionHandler or SharegptStyleInstructionHandler; pretraining "
                                "documents are not packed here (MindSpeed-LLM refuses --pack for them too)"),
    (["--pack"], "--pack is taken here only for instruction data, with --handler-name AlpacaStyleInstructionHandler "
                 "or SharegptStyleInstructionHandler; pretraining documents are not packed here (MindSpeed-LLM "
                 "refuses --pack for them too)"),
    (["--dataset-impl", "lazy"], "--dataset-impl is not implemented here (MindSpeed-LLM's preprocess_data.py has "
                                 "it, for dataset formats other than mmap, the only one megatron-core reads)"),
])
def test_mindspeed_handlers_and_flags_refused(extra, message, hf_dir, corpus, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        pp.main(_mindspeed_args(corpus, str(tmp_path / "o"), hf_dir, *extra))
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"npu-compile preprocess: error: {message}"


def test_no_handler_name_no_effect_flags(hf_dir, corpus, tmp_path):
    """qwen25's data script gives no --handler-name (MindSpeed-LLM then uses GeneralPretrainHandler);
    --tokenizer-not-use-fast and --dataset-impl mmap change nothing."""
    args = _mindspeed_args(corpus, str(tmp_path / "a"), hf_dir)
    i = args.index("--handler-name")
    assert pp.main(args[:i] + args[i + 2:]) == 0
    assert pp.main(_mindspeed_args(corpus, str(tmp_path / "b"), hf_dir, "--tokenizer-not-use-fast",
                                   "--dataset-impl", "mmap")) == 0
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"a_text_document{ext}").read_bytes() == (tmp_path / f"b_text_document{ext}").read_bytes()


def test_magistral_data_script(corpus, gpt2, tmp_path):
    """MindSpeed-LLM's data_convert_magistral_small_pretrain.sh flags: tekken.json as --tokenizer-model."""
    from tekken_files import write_tekken

    tekken, _ = write_tekken(gpt2[1], tmp_path / "tekken.json")
    prefix = str(tmp_path / "out" / "enwiki")
    assert pp.main(["--input", corpus, "--tokenizer-model", tekken, "--output-prefix", prefix, "--handler-name",
                    "GeneralPretrainHandler", "--json-keys", "text", "--workers", "1", "--log-interval", "1000",
                    "--tokenizer-type", "MagistralTokenizer"]) == 0
    tok = build_tokenizer("MagistralTokenizer", tokenizer_model=tekken)
    docs, _ = _documents(f"{prefix}_text_document")
    assert docs == [tok.tokenize(t) for t in TEXTS] + [[]]
    assert min(min(d) for d in docs if d) >= 10  # past the special tokens
