"""`npu-compile preprocess`: a corpus (jsonl, json or parquet; a file or a folder) -> megatron-core's indexed
dataset (.bin/.idx), for training.

Megatron-LM's `tools/preprocess_data.py` contract, one document per record:

    npu-compile preprocess --input corpus.jsonl --output-prefix out/corpus --tokenizer-type GPT2BPETokenizer \
        --vocab-file vocab.json --merge-file merges.txt --append-eod --workers 4

and MindSpeed-LLM's `preprocess_data.py` one for pretraining data (its examples/mcore/*/data_convert_*_pretrain.sh):

    npu-compile preprocess --input train-00000-of-00001.parquet --tokenizer-type PretrainedFromHF \
        --tokenizer-name-or-path HF_DIR --handler-name GeneralPretrainHandler --output-prefix out/enwiki \
        --json-keys text --workers 4 --log-interval 1000 [--n-subs 4]

write `out/corpus_text_document.bin/.idx` (one pair per `--json-keys` key: `<prefix>_<key>_document`, the name
both scripts give and their `--data-path` takes) with megatron-core's IndexedDatasetBuilder, the token dtype chosen
from the vocabulary size as Megatron does (MindSpeed-LLM writes int32 always; the tokens are the same). Records are
tokenized by a pool of `--workers` processes, in order. `--n-subs N` cuts the records into consecutive subsets
(MindSpeed-LLM's cut), writes each as its own dataset in the pool and merges them in order: the output is the same
as without it. `--handler-name AlpacaStyleInstructionHandler --prompt-type NAME [--seq-length N]` writes
MindSpeed-LLM's instruction data instead (megatron_glue/data/instruction.py, docs/instruction_tuning.md). Flags of
either script that are not implemented here (sentence splitting, partitions, worker search, other instruction
handlers, packing) are refused by name rather than ignored. A bad record stops the run with
the file, the line (or row) and what is wrong; nothing is left at the output paths then (each file is written
under a temporary name and renamed at the end). Blank lines are skipped.

`preprocess(...)` is the same without the command line.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import sys
import time
from typing import Iterator, TextIO

from megatron_glue.data.instruction import HANDLERS as INSTRUCTION_HANDLERS
from megatron_glue.data.tokenizer import SUPPORTED, DataError, HuggingFaceTokenizer, build_tokenizer

_LEVEL = "document"  # Megatron names outputs "<prefix>_<key>_<level>"; "sentence" only with --split-sentences

# --input: a file of these, or a folder holding them (one format per folder; .json and .jsonl are one format, JSON,
# as MindSpeed-LLM's loader counts them). Other files in a folder (README.md, .gitattributes) are skipped.
FORMATS = {".jsonl": "JSON", ".json": "JSON", ".parquet": "parquet"}
TOKENIZER_TYPES = SUPPORTED + ("PretrainedFromHF",)

# MindSpeed-LLM's --handler-name values (mindspeed_llm/tasks/preprocess/data_handler.py). Pretraining text is
# GeneralPretrainHandler's: each --json-keys field of a record tokenized whole, --append-eod after it.
PRETRAIN_HANDLER = "GeneralPretrainHandler"
_OTHER_PRETRAIN_HANDLERS = ("AlpacaPretrainHandler", "SharegptPretrainHandler", "StackOverflowPythonPretrainHandler")
_INSTRUCTION_HANDLERS = (
    "LlamaFactoryInstructionHandler", "AlpacaStyleInstructionHandler", "SharegptStyleInstructionHandler",
    "HunyuanInstructionHandler", "OpenAIInstructionHandler", "AlpacaStylePairwiseHandler",
    "SharegptStylePairwiseHandler", "PPOAlpacaStyleInstructionHandler", "R1AlpacaStyleInstructionHandler",
    "R1SharegptStyleInstructionHandler", "GeneralInstructionHandler", "BelleMultiTurnInstructionHandler",
    "MOSSMultiTurnHandler", "MOSSInstructionHandler", "LeetcodePythonInstructionHandler")
_INSTRUCTION_FEATURE = ("instruction-tuning data (prompt templates, packed `_packed` outputs for MindSpeed-LLM's "
                        "--is-instruction-dataset), a feature not built yet")

# Megatron's flags we refuse, with the value that means "not used" (None: any use is refused).
_NOT_IMPLEMENTED = {
    "--split-sentences": None, "--keep-newlines": None, "--lang": None, "--partitions": 1,
    "--find-optimal-num-workers": None, "--workers-to-check": None, "--max-documents": None,
    "--keep-sequential-samples": None, "--vocab-extra-ids": 0, "--vocab-size": None, "--special-tokens": None,
    "--tokenizer-hf-no-use-fast": None, "--tokenizer-hf-no-include-special-tokens": None,
    "--trust-remote-code": None, "--tiktoken-pattern": None, "--chat-template": None, "--metadata-path": None,
}
_FLAG_ONLY = {"--split-sentences", "--keep-newlines", "--find-optimal-num-workers", "--keep-sequential-samples",
              "--tokenizer-hf-no-use-fast", "--tokenizer-hf-no-include-special-tokens", "--trust-remote-code"}
# MindSpeed-LLM's preprocess_data.py flags we refuse: flag -> (the value that means "not used", the feature).
_WITH_HANDLER = (f"instruction data, with --handler-name {' or '.join(INSTRUCTION_HANDLERS)}; pretraining "
                 f"documents are not packed here (MindSpeed-LLM refuses --pack for them too)")
_MINDSPEED_REFUSED = {
    "--prompt-type": (None, _WITH_HANDLER), "--prompt-type-path": (None, _INSTRUCTION_FEATURE),
    "--pack": (None, _WITH_HANDLER), "--neat-pack": (None, _WITH_HANDLER),
    "--map-keys": (None, _INSTRUCTION_FEATURE), "--dataset-additional-keys": (None, _INSTRUCTION_FEATURE),
    "--enable-thinking": (None, _WITH_HANDLER), "--reward-tokens": (None, _INSTRUCTION_FEATURE),
    "--seq-length": (None, _WITH_HANDLER),
    "--pad-to-multiple-of": ("1", "padding each document for context parallelism, a feature not built yet"),
    "--streaming": (None, "streaming a Hugging Face hub dataset; this command reads local files only"),
    "--hf-datasets-params": (None, "datasets.load_dataset parameters; this command reads local jsonl, json and "
                                   "parquet files only"),
    "--merge-group-keys": (None, "merging finished .bin/.idx datasets; give their prefixes to --data-path as a "
                                 "blend instead"),
    "--dataset-impl": ("mmap", "dataset formats other than mmap, the only one megatron-core reads"),
}
# taken with an instruction handler (instruction.py)
_INSTRUCTION_FLAGS = ("--prompt-type", "--seq-length", "--pack", "--neat-pack", "--enable-thinking")
_MINDSPEED_FLAG_ONLY = {"--pack", "--neat-pack", "--streaming"}


def output_prefix_for(output_prefix: str, key: str) -> str:
    """The data prefix training reads (`--data-path`) for one json key."""
    return f"{output_prefix}_{key}_{_LEVEL}"


def input_files(input_path: str) -> list[str]:
    """The files `--input` names: itself, or a folder's files of one format, in name order."""
    expected = "expected a .jsonl, .json or .parquet file, or a folder of them"
    if os.path.isfile(input_path):
        if os.path.splitext(input_path)[1].lower() not in FORMATS:
            raise DataError(f"--input {input_path}: not a .jsonl, .json or .parquet file")
        return [input_path]
    if not os.path.isdir(input_path):
        raise FileNotFoundError(f"--input {input_path}: no such file or folder ({expected})")
    files = sorted(os.path.join(input_path, n) for n in os.listdir(input_path)
                   if os.path.splitext(n)[1].lower() in FORMATS and os.path.isfile(os.path.join(input_path, n)))
    if not files:
        raise DataError(f"--input {input_path}: the folder holds no .jsonl, .json or .parquet file")
    kinds = sorted({FORMATS[os.path.splitext(f)[1].lower()] for f in files})
    if len(kinds) > 1:
        raise DataError(f"--input {input_path}: the folder holds both {' and '.join(kinds)} files; give a folder "
                         f"of one format")
    return files


def _tokenizer(spec: dict):
    """build_tokenizer, plus MindSpeed-LLM's PretrainedFromHF: a local HF tokenizer folder read by AutoTokenizer,
    its own call tokenizing, eod = its eos id (the same as Megatron-LM's HuggingFaceTokenizer)."""
    spec = dict(spec)
    path = spec.pop("tokenizer_name_or_path")
    if spec["tokenizer_type"] != "PretrainedFromHF":
        return build_tokenizer(**spec)
    if path is None:
        raise DataError("PretrainedFromHF needs --tokenizer-name-or-path (a local directory written by "
                        "save_pretrained; no hub downloads)")
    try:
        return HuggingFaceTokenizer(path)
    except (DataError, FileNotFoundError) as error:  # its messages name Megatron's flag for the same folder
        raise type(error)(str(error).replace("--tokenizer-model ", "--tokenizer-name-or-path ", 1)) from None


def preprocess(input_path: str, output_prefix: str, *, tokenizer_type: str, vocab_file: str | None = None,
               merge_file: str | None = None, tokenizer_model: str | None = None,
               tokenizer_name_or_path: str | None = None, json_keys: tuple[str, ...] | list[str] = ("text",),
               append_eod: bool = False, workers: int = 1, n_subs: int = 1, log_interval: int = 1000,
               log: TextIO | None = None) -> dict[str, str]:
    """Tokenize `input_path` (a jsonl, json or parquet file, or a folder of them) into one indexed dataset per key;
    returns key -> data prefix.

    Raises ValueError / FileNotFoundError (one line) for a bad input or tokenizer file."""
    log = sys.stderr if log is None else log
    json_keys = tuple(json_keys)
    if not json_keys:
        raise DataError("--json-keys: give at least one key")
    for flag, value in (("--workers", workers), ("--n-subs", n_subs), ("--log-interval", log_interval)):
        if value < 1:
            raise DataError(f"{flag} must be >= 1, got {value}")
    files = input_files(input_path)
    spec = dict(tokenizer_type=tokenizer_type, vocab_file=vocab_file, merge_file=merge_file,
                tokenizer_model=tokenizer_model, tokenizer_name_or_path=tokenizer_name_or_path)
    tokenizer = _tokenizer(spec)  # here first, so a bad tokenizer is reported before any worker starts

    from megatron_glue.capture import quiet_megatron

    with quiet_megatron():
        from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    prefixes = {key: output_prefix_for(output_prefix, key) for key in json_keys}
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    tmp = {key: (f"{p}.bin.tmp{os.getpid()}", f"{p}.idx.tmp{os.getpid()}") for key, p in prefixes.items()}
    builders = {}
    subsets: list[str] = []
    job = _Job(files, spec, json_keys, append_eod)
    try:
        for key in json_keys:
            builders[key] = IndexedDatasetBuilder(tmp[key][0], dtype=dtype)
        if n_subs == 1:
            documents = _write(builders, _encoded(job, workers), log, log_interval)
        else:
            documents = _write_subsets(job, workers, n_subs, output_prefix, dtype, log, subsets)
            for key in json_keys:
                for sub in subsets:
                    builders[key].add_index(output_prefix_for(sub, key))  # in order: the same as one pass
        for key in json_keys:
            builders[key].finalize(tmp[key][1])
        for key in json_keys:
            os.replace(tmp[key][0], prefixes[key] + ".bin")
            os.replace(tmp[key][1], prefixes[key] + ".idx")
            # megatron-core caches sample indices in <prefix>/cache/ keyed by the path and the dataset config,
            # not by the data (gpt_dataset.py:413): indices of the data just replaced would be read as these.
            stale = os.path.join(prefixes[key], "cache")
            if os.path.isdir(stale):
                shutil.rmtree(stale)
    finally:
        for builder in builders.values():
            builder.data_file.close()  # finalize closes it too; a second close is harmless
        leftovers = [p for paths in tmp.values() for p in paths]
        leftovers += [output_prefix_for(sub, key) + ext for sub in subsets for key in json_keys
                      for ext in (".bin", ".idx")]
        for path in leftovers:
            if os.path.exists(path):
                os.remove(path)
    print(f"Wrote {documents} documents: " + ", ".join(f"{p}.bin/.idx" for p in prefixes.values()), file=log)
    return prefixes


def _write(builders: dict, encoded, log: TextIO | None, log_interval: int) -> int:
    start = time.time()
    documents = total_bytes = 0
    for documents, (ids, nbytes) in enumerate(encoded, 1):
        total_bytes += nbytes
        for key, builder in builders.items():
            # One "sentence" per document (no splitting), none for an empty one, as Megatron writes them.
            builder.add_document(ids[key], [len(ids[key])] if ids[key] else [])
        if log is not None and documents % log_interval == 0:
            elapsed = max(time.time() - start, 1e-9)
            print(f"Processed {documents} documents ({documents / elapsed:.1f} docs/s, "
                  f"{total_bytes / elapsed / 2**20:.2f} MB/s).", file=log)
    return documents


# -- reading the input -------------------------------------------------------------------------------------

class _Job:
    """What every worker needs: the files, the tokenizer spec, the keys, --append-eod."""

    def __init__(self, files, spec, json_keys, append_eod):
        self.files, self.spec, self.json_keys, self.append_eod = files, spec, json_keys, append_eod


def _records(files: list[str], json_keys: tuple[str, ...]) -> Iterator[tuple[str, object, int]]:
    """(where, record, bytes) per document: a record is a JSON text (jsonl lines: parsed by the workers) or an
    object already read (a .json array's items, parquet rows)."""
    for path in files:
        ext = os.path.splitext(path)[1].lower()
        if ext == ".parquet":
            yield from _parquet_rows(path, json_keys)
        elif ext == ".json" and _starts_with(path, b"["):
            yield from _json_array(path)
        else:  # .jsonl, and .json holding JSON lines (both read as JSON by datasets' loader)
            yield from _lines(path)


def _starts_with(path: str, char: bytes) -> bool:
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    return head.removeprefix(b"\xef\xbb\xbf").lstrip()[:1] == char


def _lines(input_path: str) -> Iterator[tuple[str, str, int]]:
    # Bytes, decoded per line, so a bad byte is reported with its line number.
    with open(input_path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise DataError(f"{input_path}:{lineno}: not UTF-8 ({error.reason} at byte {error.start} of "
                                 f"the line)") from None
            if line.strip():
                yield f"{input_path}:{lineno}", line, len(raw)


def _json_array(path: str) -> Iterator[tuple[str, object, int]]:
    try:
        with open(path, encoding="utf-8-sig") as f:
            items = json.load(f)
    except UnicodeDecodeError as error:
        raise DataError(f"{path}: not UTF-8 ({error.reason} at byte {error.start})") from None
    except json.JSONDecodeError as error:
        raise DataError(f"{path}: not valid JSON ({error.msg} at line {error.lineno} column {error.colno}); "
                         f"expected a JSON array of objects, or one JSON object per line") from None
    for n, item in enumerate(items, 1):
        yield f"{path}: item {n}", item, len(json.dumps(item, ensure_ascii=False).encode())


def _parquet_rows(path: str, json_keys: tuple[str, ...]) -> Iterator[tuple[str, object, int]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"--input {path}: reading parquet needs pyarrow (the project's [megatron] extra installs "
                         f"it)") from None
    try:
        table = pq.ParquetFile(path)
    except Exception as error:  # pyarrow's ArrowInvalid and friends
        raise DataError(f"{path}: not a parquet file pyarrow can read ({error})") from None
    columns = table.schema_arrow.names
    for key in json_keys:
        if key not in columns:
            raise DataError(f"{path}: no column {key!r} (--json-keys); the file has {sorted(columns)}")
    row = 0
    for batch in table.iter_batches(batch_size=1024, columns=list(json_keys)):
        for record in batch.to_pylist():
            row += 1
            nbytes = sum(len(v.encode()) for v in record.values() if isinstance(v, str))
            yield f"{path}: row {row}", record, nbytes


# -- workers -----------------------------------------------------------------------------------------------

_worker: dict = {}


def _init_worker(spec: dict, json_keys: tuple[str, ...], append_eod: bool) -> None:
    # Each worker builds its own tokenizer once, as Megatron's Encoder.initializer does.
    _worker.update(tokenizer=_tokenizer(spec), json_keys=json_keys, append_eod=append_eod)


def _encode(item: tuple[str, object, int]) -> tuple[dict[str, list[int]], int]:
    where, data, nbytes = item
    if isinstance(data, str):
        try:
            data = json.loads(data.rstrip("\r\n"))  # the newline would make an error's column read "line 2, column 1"
        except json.JSONDecodeError as error:
            raise DataError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from None
    if not isinstance(data, dict):
        raise DataError(f"{where}: expected a JSON object, got a JSON {type(data).__name__}")
    tokenizer = _worker["tokenizer"]
    ids = {}
    for key in _worker["json_keys"]:
        if key not in data:
            raise DataError(f"{where}: no key {key!r} (--json-keys); the object has {sorted(data)}")
        text = data[key]
        # A list of strings is Megatron's pre-split sentences; we keep them as one document.
        pieces = text if isinstance(text, list) else [text]
        if not all(isinstance(p, str) for p in pieces):
            raise DataError(f"{where}: key {key!r} holds a {type(text).__name__}, expected a string")
        doc = [i for p in pieces for i in tokenizer.tokenize(p)]
        if doc and _worker["append_eod"]:
            doc.append(tokenizer.eod)  # Megatron appends no eod to an empty document either
        ids[key] = doc
    return ids, nbytes


def _pool(job: _Job, workers: int):
    # fork: workers start in milliseconds and inherit the imports (spawn would re-import torch in each) and the
    # records of --n-subs. TOKENIZERS_PARALLELISM set around the forks keeps HF tokenizers from warning that this
    # process used its thread pool (training a BPE does) before forking.
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
    was = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        return context.Pool(workers, initializer=_init_worker, initargs=(job.spec, job.json_keys, job.append_eod))
    finally:
        if was is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = was


def _encoded(job: _Job, workers: int) -> Iterator[tuple[dict[str, list[int]], int]]:
    records = _records(job.files, job.json_keys)
    if workers == 1:  # in this process: no pool to start for one worker
        _init_worker(job.spec, job.json_keys, job.append_eod)
        try:
            yield from map(_encode, records)
        finally:
            _worker.clear()
        return
    pool = _pool(job, workers)
    try:
        yield from pool.imap(_encode, records, chunksize=32)  # Megatron's chunk size; keeps order
    finally:
        pool.terminate()
        pool.join()


# -- --n-subs: consecutive subsets, each its own dataset, merged in order -------------------------------------

_subset: dict = {}


def subset_ranges(n: int, n_subs: int) -> list[tuple[int, int]]:
    """MindSpeed-LLM's cut (preprocess_data.py `cut_range_to_subs`): subsets of n // n_subs records, the remainder
    one more subset."""
    gap = n // n_subs
    return [(start, min(start + gap, n)) for start in range(0, n, gap)]


def _write_subset(task: tuple[int, int, int, str]) -> int:
    k, start, end, prefix = task
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builders = {key: IndexedDatasetBuilder(output_prefix_for(prefix, key) + ".bin", dtype=_subset["dtype"])
                for key in _subset["json_keys"]}
    try:
        documents = _write(builders, map(_encode, _subset["records"][start:end]), None, 1)
        for key, builder in builders.items():
            builder.finalize(output_prefix_for(prefix, key) + ".idx")
    finally:
        for builder in builders.values():
            builder.data_file.close()
    return documents


def _write_subsets(job: _Job, workers: int, n_subs: int, output_prefix: str, dtype, log: TextIO,
                   prefixes: list[str]) -> int:
    """Writes the subsets, their prefixes appended to `prefixes` first (the caller removes them, merged or not);
    returns the documents written."""
    records = list(_records(job.files, job.json_keys))
    if n_subs > len(records):
        raise DataError(f"--n-subs {n_subs}: more subsets than the {len(records)} documents of --input")
    ranges = subset_ranges(len(records), n_subs)
    folder, name = os.path.split(output_prefix)
    last = len(ranges) - 1
    # MindSpeed-LLM's names for the subsets, removed once merged
    prefixes += [os.path.join(folder, f"{k:03d}_of_{last:03d}_{name}") for k in range(len(ranges))]
    tasks = [(k, start, end, prefixes[k]) for k, (start, end) in enumerate(ranges)]
    _subset.update(records=records, dtype=dtype, json_keys=job.json_keys)
    documents = 0
    try:
        if workers == 1:
            _init_worker(job.spec, job.json_keys, job.append_eod)
            counts = map(_write_subset, tasks)
        else:
            pool = _pool(job, min(workers, len(tasks)))
            counts = pool.imap(_write_subset, tasks)
        for k, count in enumerate(counts):
            documents += count
            print(f"Processed subset {k + 1} of {len(tasks)} ({count} documents).", file=log)
    finally:
        if workers > 1:
            pool.terminate()
            pool.join()
        _subset.clear()
        _worker.clear()
    return documents


# -- command line ------------------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="npu-compile preprocess",
                                description="Tokenize a corpus into megatron-core's .bin/.idx (Megatron-LM's "
                                            "tools/preprocess_data.py and MindSpeed-LLM's preprocess_data.py "
                                            "contracts, pretraining data).")
    p.add_argument("--input", required=True, help="a .jsonl (one JSON object per line), .json (an array of "
                                                  "objects, or JSON lines) or .parquet file, or a folder of them")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="keys (parquet: columns) to tokenize, one "
                                                                   "output each")
    p.add_argument("--output-prefix", required=True, help="writes <prefix>_<key>_document.bin/.idx")
    p.add_argument("--tokenizer-type", default="PretrainedFromHF",
                   help=f"one of {', '.join(TOKENIZER_TYPES)} (default PretrainedFromHF, as MindSpeed-LLM's)")
    p.add_argument("--vocab-file", help="GPT2BPETokenizer: GPT-2's vocab.json")
    p.add_argument("--merge-file", help="GPT2BPETokenizer: GPT-2's merges.txt")
    p.add_argument("--tokenizer-model", help="HuggingFaceTokenizer: a local save_pretrained directory; "
                                             "MagistralTokenizer: Mistral's tekken.json (or its folder)")
    p.add_argument("--tokenizer-name-or-path", help="PretrainedFromHF: a local save_pretrained directory")
    p.add_argument("--tokenizer-not-use-fast", action="store_true",
                   help="no effect: transformers 5 always loads the fast tokenizer (AutoTokenizer.from_pretrained "
                        "drops use_fast)")
    p.add_argument("--handler-name", default=PRETRAIN_HANDLER,
                   help=f"MindSpeed-LLM's dataset handler; {PRETRAIN_HANDLER} (the default): each key's text "
                        f"tokenized whole")
    p.add_argument("--append-eod", action="store_true", help="end each document with the eod token")
    p.add_argument("--workers", type=int, default=1, help="tokenizing processes (default 1)")
    p.add_argument("--n-subs", type=int, default=1,
                   help="cut the documents into this many consecutive subsets, each written by one of the "
                        "--workers processes, merged in order (the output is the same)")
    p.add_argument("--log-interval", type=int, default=1000, help="documents between progress lines")
    for flag in _NOT_IMPLEMENTED:
        if flag in _FLAG_ONLY:
            p.add_argument(flag, action="store_true", default=None, help=argparse.SUPPRESS)
        else:
            p.add_argument(flag, nargs="+" if flag in ("--workers-to-check", "--special-tokens") else None,
                           default=None, help=argparse.SUPPRESS)
    for flag in _MINDSPEED_REFUSED:
        if flag in _MINDSPEED_FLAG_ONLY:
            p.add_argument(flag, action="store_true", default=None, help=argparse.SUPPRESS)
        else:
            p.add_argument(flag, nargs="+" if flag in ("--reward-tokens", "--dataset-additional-keys") else None,
                           default=None, help=argparse.SUPPRESS)
    return p


def _handler_refusal(name: str) -> str | None:
    if name in ("", PRETRAIN_HANDLER) or name in INSTRUCTION_HANDLERS:  # no --handler-name: GeneralPretrainHandler
        return None
    if name in _INSTRUCTION_HANDLERS:
        return (f"--handler-name {name} is not implemented here: it makes {_INSTRUCTION_FEATURE}; supported: "
                f"{PRETRAIN_HANDLER}, {', '.join(INSTRUCTION_HANDLERS)}")
    if name in _OTHER_PRETRAIN_HANDLERS:
        return (f"--handler-name {name} is not implemented here (its own record layout); supported: "
                f"{PRETRAIN_HANDLER}, with --json-keys naming the text fields")
    return f"--handler-name {name} is not a MindSpeed-LLM handler; supported: {PRETRAIN_HANDLER}"


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    for flag, harmless in _NOT_IMPLEMENTED.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and not (harmless is not None and str(value) == str(harmless)):
            parser.error(f"{flag} is not implemented here (Megatron-LM's tools/preprocess_data.py has it; this "
                         f"command tokenizes one document per line, in one partition)")
    instruction = args.handler_name in INSTRUCTION_HANDLERS
    for flag, (harmless, feature) in _MINDSPEED_REFUSED.items():
        if instruction and flag in _INSTRUCTION_FLAGS:
            continue
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and not (harmless is not None and str(value) == harmless):
            if feature is _WITH_HANDLER:
                parser.error(f"{flag} is taken here only for {feature}")
            parser.error(f"{flag} is not implemented here (MindSpeed-LLM's preprocess_data.py has it, for "
                         f"{feature})")
    refusal = _handler_refusal(args.handler_name)
    if refusal:
        parser.error(refusal)
    if instruction:
        return _instruction_main(parser, args)
    if args.tokenizer_type not in TOKENIZER_TYPES:
        parser.error(f"--tokenizer-type {args.tokenizer_type} is not implemented here (supported: "
                     f"{', '.join(TOKENIZER_TYPES)})")
    try:
        preprocess(args.input, args.output_prefix, tokenizer_type=args.tokenizer_type, vocab_file=args.vocab_file,
                   merge_file=args.merge_file, tokenizer_model=args.tokenizer_model,
                   tokenizer_name_or_path=args.tokenizer_name_or_path, json_keys=args.json_keys,
                   append_eod=args.append_eod, workers=args.workers, n_subs=args.n_subs,
                   log_interval=args.log_interval)
    except (ValueError, FileNotFoundError) as error:
        print(f"npu-compile preprocess: error: {error}", file=sys.stderr)
        return 1
    return 0


def _instruction_main(parser: argparse.ArgumentParser, args) -> int:
    from megatron_glue.data import instruction

    refusal = instruction.template_refusal(args.prompt_type)
    if refusal:
        parser.error(refusal)
    name = args.handler_name
    if args.tokenizer_type != "PretrainedFromHF" or not args.tokenizer_name_or_path:
        parser.error(f"--handler-name {name} needs --tokenizer-type PretrainedFromHF with "
                     f"--tokenizer-name-or-path (a local Hugging Face tokenizer folder), as MindSpeed-LLM's")
    if args.json_keys != ["text"]:
        parser.error(f"--json-keys is not taken with --handler-name {name}: it writes input_ids, attention_mask "
                     f"and labels always (MindSpeed-LLM overrides the flag)")
    if args.n_subs != 1:
        parser.error(f"--n-subs is not implemented with --handler-name {name}")
    thinking = {"true": True, "false": False, "none": None}.get(str(args.enable_thinking).lower(), "bad")
    if thinking == "bad":
        parser.error(f"--enable-thinking takes true, false or none (MindSpeed-LLM's values), got "
                     f"{args.enable_thinking!r}")
    if args.enable_thinking is not None and not instruction.TEMPLATES[args.prompt_type].reasoning:
        reasoning = ", ".join(n for n, t in instruction.TEMPLATES.items() if t.reasoning)
        parser.error(f"--enable-thinking: --prompt-type {args.prompt_type} has no thinking blocks (it changes "
                     f"ReasoningTemplates only: {reasoning})")
    if args.workers < 1 or args.log_interval < 1:
        parser.error("--workers and --log-interval must be >= 1")
    try:
        files = input_files(args.input)
        prefixes, written, dropped = instruction.write(
            files, args.output_prefix, tokenizer_dir=args.tokenizer_name_or_path, prompt_type=args.prompt_type,
            seq_length=None if args.seq_length is None else int(args.seq_length), workers=args.workers,
            log_interval=args.log_interval, log=sys.stderr, enable_thinking=thinking, pack=bool(args.pack),
            neat_pack=bool(args.neat_pack), append_eod=args.append_eod, handler=name,
            records=lambda fs, _: _records(fs, ("conversations",) if "Sharegpt" in name
                                           else ("instruction", "input", "output")))
    except (ValueError, FileNotFoundError) as error:
        print(f"npu-compile preprocess: error: {error}", file=sys.stderr)
        return 1
    what = "packed rows" if args.pack else "records"
    print(f"Wrote {written} {what} ({dropped} records dropped: --seq-length {args.seq_length} or more tokens): "
          + ", ".join(f"{p}.bin/.idx" for p in prefixes.values()), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
