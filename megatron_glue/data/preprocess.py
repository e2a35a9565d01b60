"""`npu-compile preprocess`: a jsonl corpus -> megatron-core's indexed dataset (.bin/.idx), for training.

Megatron-LM's `tools/preprocess_data.py` contract, one document per input line:

    npu-compile preprocess --input corpus.jsonl --output-prefix out/corpus --tokenizer-type GPT2BPETokenizer \
        --vocab-file vocab.json --merge-file merges.txt --append-eod --workers 4

writes `out/corpus_text_document.bin/.idx` (one pair per `--json-keys` key) with megatron-core's
IndexedDatasetBuilder, the token dtype chosen from the vocabulary size as Megatron does. Lines are tokenized
by a pool of `--workers` processes, in order. Flags of Megatron's script that are not implemented here
(sentence splitting, partitions, worker search) are refused by name rather than ignored. A bad line stops the
run with the file, the line number and what is wrong; nothing is left at the output paths then (each file is
written under a temporary name and renamed at the end). Blank lines are skipped.

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

from megatron_glue.data.tokenizer import SUPPORTED, DataError, build_tokenizer

_LEVEL = "document"  # Megatron names outputs "<prefix>_<key>_<level>"; "sentence" only with --split-sentences

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


def output_prefix_for(output_prefix: str, key: str) -> str:
    """The data prefix training reads (`--data-path`) for one json key."""
    return f"{output_prefix}_{key}_{_LEVEL}"


def preprocess(input_path: str, output_prefix: str, *, tokenizer_type: str, vocab_file: str | None = None,
               merge_file: str | None = None, tokenizer_model: str | None = None,
               json_keys: tuple[str, ...] | list[str] = ("text",), append_eod: bool = False, workers: int = 1,
               log_interval: int = 1000, log: TextIO | None = None) -> dict[str, str]:
    """Tokenize `input_path` (jsonl) into one indexed dataset per key; returns key -> data prefix.

    Raises ValueError / FileNotFoundError (one line) for a bad input or tokenizer file."""
    log = sys.stderr if log is None else log
    json_keys = tuple(json_keys)
    if not json_keys:
        raise DataError("--json-keys: give at least one key")
    if workers < 1:
        raise DataError(f"--workers must be >= 1, got {workers}")
    if log_interval < 1:
        raise DataError(f"--log-interval must be >= 1, got {log_interval}")
    if not os.path.isfile(input_path):
        raise FileNotFoundError(f"--input {input_path}: no such file (expected a .jsonl file, one JSON object "
                                f"per line)")
    spec = dict(tokenizer_type=tokenizer_type, vocab_file=vocab_file, merge_file=merge_file,
                tokenizer_model=tokenizer_model)
    tokenizer = build_tokenizer(**spec)  # here first, so a bad tokenizer is reported before any worker starts

    from megatron_glue.capture import quiet_megatron

    with quiet_megatron():
        from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    prefixes = {key: output_prefix_for(output_prefix, key) for key in json_keys}
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    tmp = {key: (f"{p}.bin.tmp{os.getpid()}", f"{p}.idx.tmp{os.getpid()}") for key, p in prefixes.items()}
    builders = {}
    start = time.time()
    documents = total_bytes = 0
    try:
        for key in json_keys:
            builders[key] = IndexedDatasetBuilder(tmp[key][0], dtype=dtype)
        for documents, (ids, nbytes) in enumerate(_encoded(input_path, spec, json_keys, append_eod, workers), 1):
            total_bytes += nbytes
            for key in json_keys:
                # One "sentence" per document (no splitting), none for an empty one, as Megatron writes them.
                builders[key].add_document(ids[key], [len(ids[key])] if ids[key] else [])
            if documents % log_interval == 0:
                elapsed = max(time.time() - start, 1e-9)
                print(f"Processed {documents} documents ({documents / elapsed:.1f} docs/s, "
                      f"{total_bytes / elapsed / 2**20:.2f} MB/s).", file=log)
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
        for paths in tmp.values():
            for path in paths:
                if os.path.exists(path):
                    os.remove(path)
    print(f"Wrote {documents} documents: " + ", ".join(f"{p}.bin/.idx" for p in prefixes.values()), file=log)
    return prefixes


# -- workers -----------------------------------------------------------------------------------------------

_worker: dict = {}


def _init_worker(spec: dict, input_path: str, json_keys: tuple[str, ...], append_eod: bool) -> None:
    # Each worker builds its own tokenizer once, as Megatron's Encoder.initializer does.
    _worker.update(tokenizer=build_tokenizer(**spec), input_path=input_path, json_keys=json_keys,
                   append_eod=append_eod)


def _encode(item: tuple[int, str, int]) -> tuple[dict[str, list[int]], int]:
    lineno, line, nbytes = item
    where = f"{_worker['input_path']}:{lineno}"
    try:
        data = json.loads(line.rstrip("\r\n"))  # the newline would make an error's column read "line 2, column 1"
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


def _lines(input_path: str) -> Iterator[tuple[int, str, int]]:
    # Bytes, decoded per line, so a bad byte is reported with its line number.
    with open(input_path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise DataError(f"{input_path}:{lineno}: not UTF-8 ({error.reason} at byte {error.start} of "
                                 f"the line)") from None
            if line.strip():
                yield lineno, line, len(raw)


def _encoded(input_path, spec, json_keys, append_eod, workers) -> Iterator[tuple[dict[str, list[int]], int]]:
    if workers == 1:  # in this process: no pool to start for one worker
        _init_worker(spec, input_path, json_keys, append_eod)
        try:
            yield from map(_encode, _lines(input_path))
        finally:
            _worker.clear()
        return
    # fork: workers start in milliseconds and inherit the imports (spawn would re-import torch in each). The
    # workers only tokenize. TOKENIZERS_PARALLELISM set around the forks keeps HF tokenizers from warning that
    # this process used its thread pool (training a BPE does) before forking.
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
    was = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        pool = context.Pool(workers, initializer=_init_worker, initargs=(spec, input_path, json_keys, append_eod))
    finally:
        if was is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = was
    try:
        yield from pool.imap(_encode, _lines(input_path), chunksize=32)  # Megatron's chunk size; keeps order
    finally:
        pool.terminate()
        pool.join()


# -- command line ------------------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="npu-compile preprocess",
                                description="Tokenize a jsonl corpus into megatron-core's .bin/.idx "
                                            "(Megatron-LM's tools/preprocess_data.py contract).")
    p.add_argument("--input", required=True, help="jsonl file, one JSON object per line")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="keys to tokenize, one output each")
    p.add_argument("--output-prefix", required=True, help="writes <prefix>_<key>_document.bin/.idx")
    p.add_argument("--tokenizer-type", required=True, help=f"one of {', '.join(SUPPORTED)}")
    p.add_argument("--vocab-file", help="GPT2BPETokenizer: GPT-2's vocab.json")
    p.add_argument("--merge-file", help="GPT2BPETokenizer: GPT-2's merges.txt")
    p.add_argument("--tokenizer-model", help="HuggingFaceTokenizer: a local save_pretrained directory")
    p.add_argument("--append-eod", action="store_true", help="end each document with the eod token")
    p.add_argument("--workers", type=int, default=1, help="tokenizing processes (default 1)")
    p.add_argument("--log-interval", type=int, default=1000, help="documents between progress lines")
    for flag in _NOT_IMPLEMENTED:
        if flag in _FLAG_ONLY:
            p.add_argument(flag, action="store_true", default=None, help=argparse.SUPPRESS)
        else:
            p.add_argument(flag, nargs="+" if flag in ("--workers-to-check", "--special-tokens") else None,
                           default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    for flag, harmless in _NOT_IMPLEMENTED.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and not (harmless is not None and str(value) == str(harmless)):
            parser.error(f"{flag} is not implemented here (Megatron-LM's tools/preprocess_data.py has it; this "
                         f"command tokenizes one document per line, in one partition)")
    if args.tokenizer_type not in SUPPORTED:
        parser.error(f"--tokenizer-type {args.tokenizer_type} is not implemented here (supported: "
                     f"{', '.join(SUPPORTED)})")
    try:
        preprocess(args.input, args.output_prefix, tokenizer_type=args.tokenizer_type, vocab_file=args.vocab_file,
                   merge_file=args.merge_file, tokenizer_model=args.tokenizer_model, json_keys=args.json_keys,
                   append_eod=args.append_eod, workers=args.workers, log_interval=args.log_interval)
    except (ValueError, FileNotFoundError) as error:
        print(f"npu-compile preprocess: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
