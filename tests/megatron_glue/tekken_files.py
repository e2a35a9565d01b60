"""Mistral tekken.json files made from a trained byte-level BPE (no downloads), for MagistralTokenizer."""

from __future__ import annotations

import base64
import json
from pathlib import Path

# Mistral's Tekken pre-tokenizer pattern, as its tekken.json files carry it in config.pattern
TEKKEN_PATTERN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"
                  r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|"
                  r"\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"]
NUM_SPECIAL = 10


def write_tekken(merge_file: str, path) -> tuple[str, list[bytes]]:
    """A tekken.json at `path` from GPT-2-style merges: the 256 bytes in byte order, then each merge's result in
    merge order (base64), 5 special tokens filled up to 10, and default_vocab_size cutting off the last 3 merges.
    Returns (path, the byte strings by rank)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    to_byte = {c: b for b, c in bytes_to_unicode().items()}
    ranks = [bytes([i]) for i in range(256)]
    for line in Path(merge_file).read_text(encoding="utf-8").splitlines()[1:]:
        merged = bytes(to_byte[c] for c in line.replace(" ", ""))
        if merged not in ranks:
            ranks.append(merged)
    Path(path).write_text(json.dumps({
        "config": {"pattern": TEKKEN_PATTERN, "num_vocab_tokens": len(ranks),
                   "default_vocab_size": NUM_SPECIAL + len(ranks) - 3, "default_num_special_tokens": NUM_SPECIAL,
                   "version": "v7"},
        "vocab": [{"rank": i, "token_bytes": base64.b64encode(b).decode(), "token_str": b.decode("utf-8", "replace")}
                  for i, b in enumerate(ranks)],
        "special_tokens": [{"rank": i, "token_str": s, "is_control": True} for i, s in enumerate(SPECIALS)]}))
    return str(path), ranks
