"""A small real corpus, tokenizer and indexed dataset for the training demo, made offline in a few seconds.

`make_demo_data(out_dir)` writes, from text this project itself ships (the .py and .md files of the installed
`npu_compile` and `megatron_glue` packages, and the README when there is one next to them, in path order; each
file cut at blank lines into documents of about DOCUMENT_CHARS characters, so that Megatron-LM's default
--split 969,30,1 gives every split at least one document):

    corpus.jsonl                          {"text": ..., "path": ...} per line
    vocab.json, merges.txt                a byte-level BPE trained on it, in GPT-2's format (GPT2BPETokenizer)
    corpus_text_document.bin/.idx         `npu-compile preprocess --append-eod` of the corpus

A second call with the same sources reuses what is there when it is whole (manifest.json records what it was
made from). `train_bpe` is the tokenizer step alone (tests use it on their own text).

Call it on one rank (then a barrier) when several share out_dir: the files are renamed into place, but two
ranks would both do the work.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import tempfile

from megatron_glue.data.tokenizer import EOD_TOKEN, build_tokenizer

DEMO_VOCAB_SIZE = 3000  # padded to 3072 for divisible_by 128 at TP up to 8
_PACKAGES = ("npu_compile", "megatron_glue")
DOCUMENT_CHARS = 600
_VERSION = 2  # bump when what is made from the same sources changes


def byte_level_bpe(texts: list[str], vocab_size: int = DEMO_VOCAB_SIZE):
    """A byte-level BPE (GPT-2's scheme, `<|endoftext|>` as its one special token) trained on `texts`: a
    `tokenizers.Tokenizer`. The trainer is deterministic (checked across processes, whose hash seeds differ)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=[EOD_TOKEN],
        # every byte in the base vocabulary, so any text tokenizes (no unknown token, as in GPT-2)
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def train_bpe(texts: list[str], out_dir: str, vocab_size: int = DEMO_VOCAB_SIZE) -> tuple[str, str]:
    """`byte_level_bpe` of `texts`, written as GPT-2's vocab.json + merges.txt into out_dir; returns their paths.
    Same texts, same files."""
    tok = byte_level_bpe(texts, vocab_size)
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        written = tok.model.save(tmp)  # vocab.json and merges.txt ("#version: 0.2" header), GPT-2's layout
        for path in written:
            os.replace(path, os.path.join(out_dir, os.path.basename(path)))
    return os.path.join(out_dir, "vocab.json"), os.path.join(out_dir, "merges.txt")


def _pieces(text: str) -> list[str]:
    """`text` cut at blank lines into pieces of at least DOCUMENT_CHARS characters (the last may be shorter)."""
    pieces, current = [], ""
    for paragraph in text.split("\n\n"):
        current = f"{current}\n\n{paragraph}" if current else paragraph
        if len(current) >= DOCUMENT_CHARS:
            pieces.append(current)
            current = ""
    if current.strip():
        pieces.append(current)
    return pieces


def corpus_documents() -> list[dict]:
    """The demo corpus: {"path", "text"} per piece of each shipped .py/.md file of the packages (and the README),
    in path order."""
    docs = {}
    roots = []
    for package in _PACKAGES:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            continue
        root = os.path.dirname(os.path.abspath(list(spec.submodule_search_locations)[0]))
        roots.append(root)
        for folder, subdirs, files in os.walk(os.path.join(root, package)):
            subdirs[:] = sorted(d for d in subdirs if d != "__pycache__" and not d.startswith("."))
            for name in files:
                if name.endswith((".py", ".md")):
                    path = os.path.join(folder, name)
                    docs[os.path.relpath(path, root)] = path
    for root in roots:
        readme = os.path.join(root, "README.md")
        if os.path.isfile(readme):
            docs.setdefault("README.md", readme)
    out = []
    for rel in sorted(docs):
        with open(docs[rel], encoding="utf-8", errors="replace") as f:
            text = f.read()
        out.extend({"path": rel, "text": piece} for piece in _pieces(text) if piece.strip())
    if not out:
        raise RuntimeError(f"no .py/.md files found in the installed {', '.join(_PACKAGES)} packages")
    return out


def make_demo_data(out_dir: str) -> dict:
    """Make (or reuse) the demo data in out_dir; returns the paths and what training needs:
    {"corpus", "vocab_file", "merge_file", "data_prefix", "tokenizer_type", "vocab_size", "documents"}."""
    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    paths = dict(corpus=os.path.join(out_dir, "corpus.jsonl"), vocab_file=os.path.join(out_dir, "vocab.json"),
                 merge_file=os.path.join(out_dir, "merges.txt"),
                 data_prefix=os.path.join(out_dir, "corpus_text_document"))
    manifest_path = os.path.join(out_dir, "manifest.json")

    docs = corpus_documents()
    corpus = "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs)
    want = {"version": _VERSION, "vocab_size_target": DEMO_VOCAB_SIZE,
            "corpus_sha256": hashlib.sha256(corpus.encode("utf-8")).hexdigest(), "documents": len(docs)}
    if _is_whole(paths, manifest_path, want, corpus):
        return _result(paths, len(docs))

    if os.path.exists(manifest_path):
        os.remove(manifest_path)  # what follows replaces the files; until the end they do not match it
    _write_atomic(paths["corpus"], corpus)
    train_bpe([d["text"] for d in docs], out_dir)
    from megatron_glue.data.preprocess import preprocess

    with open(os.devnull, "w") as quiet:
        preprocess(paths["corpus"], os.path.join(out_dir, "corpus"), tokenizer_type="GPT2BPETokenizer",
                   vocab_file=paths["vocab_file"], merge_file=paths["merge_file"], append_eod=True, workers=1,
                   log=quiet)
    _write_atomic(manifest_path, json.dumps(want, indent=2) + "\n")
    return _result(paths, len(docs))


def _result(paths: dict, documents: int) -> dict:
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=paths["vocab_file"], merge_file=paths["merge_file"])
    return dict(paths, tokenizer_type="GPT2BPETokenizer", vocab_size=tokenizer.vocab_size, documents=documents)


def _is_whole(paths: dict, manifest_path: str, want: dict, corpus: str) -> bool:
    """The manifest says these sources, and every file is there and readable as what it should be."""
    try:
        with open(manifest_path) as f:
            if json.load(f) != want:
                return False
        with open(paths["corpus"], encoding="utf-8") as f:
            if f.read() != corpus:
                return False
        build_tokenizer("GPT2BPETokenizer", vocab_file=paths["vocab_file"], merge_file=paths["merge_file"])
        from megatron_glue.capture import quiet_megatron

        with quiet_megatron():
            from megatron.core.datasets.indexed_dataset import IndexedDataset
        if not IndexedDataset.exists(paths["data_prefix"]):  # its constructor would assert, then fail in __del__
            return False
        dataset = IndexedDataset(paths["data_prefix"])
        return len(dataset.document_indices) - 1 == want["documents"]
    except Exception:  # unreadable in any way (a truncated .idx fails in numpy or struct): make it again
        return False


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
