"""MindSpeed-LLM's training scripts through the job's argument check: which of them the job admits as they are.

    python -m bench.mindspeed_census --repo /path/to/MindSpeed-LLM.git [--rev master]

Reads every `examples/mcore/**/{pretrain,tune}*.sh` of a MindSpeed-LLM checkout (a bare git directory or a work
tree) at `--rev`, takes the flags and values its launch line passes to `pretrain_gpt.py` / `posttrain_gpt.py` (or a model's own `pretrain_*.py`)
(`extract`), scales the sizes down to a tiny model on 2 processes with every other flag kept (`scale_down`), and
runs each through `megatron_glue.arguments.parse_args`. The dense training scripts (no `--num-experts`, context
parallel <= 1, no instruction data) are the census; the others are listed with their first refusal too. Writes
`bench/results/mindspeed_census.md` and the extracted flags as `bench/results/mindspeed_census.json`.

Nothing of MindSpeed-LLM is kept but flag names and values.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

LAUNCH = re.compile(r"\b(pre|post)train_\w+\.py\b")
ASSIGN = re.compile(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.S)
VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:\[[@*]\])?\}|\$([A-Za-z_][A-Za-z0-9_]*)")
REDIRECT = re.compile(r"\d*[<>]+&?\d*")
ARITH = re.compile(r"\$\(\((.*?)\)\)")


def _expand(text: str, env: dict[str, str]) -> str:
    def arith(m):
        expr = VAR.sub(lambda v: env.get(v.group(1) or v.group(2), "0"), m.group(1))
        expr = re.sub(r"\b([A-Za-z_][A-Za-z0-9_]*)\b", lambda v: env.get(v.group(1), "0"), expr)
        if not re.fullmatch(r"[\d\s+\-*/()%]+", expr):
            return "0"
        return str(int(eval(expr.replace("/", "//"))))  # digits and operators only (checked above)

    text = ARITH.sub(arith, text)
    return VAR.sub(lambda m: env.get(m.group(1) or m.group(2), ""), text)


def _placeholder(name: str, value: str) -> str:
    """A path the user fills in ("your data path"): one token naming the variable, as a user's path is one."""
    if " " in value.strip() and "--" not in value:
        return f"<{name}>"
    return value


def extract(script: str) -> list[str]:
    """The flags and values the script's launch line passes to pretrain_*.py / posttrain_*.py, with its shell
    variables expanded (paths left as `<NAME>`), in order. Comment lines are dropped."""
    text = script.replace("\\\r\n", " ").replace("\\\n", " ")
    env: dict[str, str] = {}
    lines = iter(text.splitlines())
    for line in lines:
        if line.lstrip().startswith("#"):
            continue
        if LAUNCH.search(line) and not ASSIGN.match(line):
            command = _expand(line.split("|", 1)[0], env)
            words = shlex.split(command, comments=True)
            at = next(i for i, w in enumerate(words) if LAUNCH.search(w))
            return [w for w in words[at + 1:] if not REDIRECT.fullmatch(w)]
        m = ASSIGN.match(line)
        if not m:
            continue
        name, value = m.groups()
        while value.count('"') % 2 == 1:  # a quoted value over several lines
            value += "\n" + next(lines)
        value = value.strip()
        if value.startswith("'") and value.endswith("'"):
            env[name] = value[1:-1]
            continue
        if value.startswith('"'):
            value = value[1:value.rindex('"')] if value.count('"') >= 2 else value[1:]
        else:
            value = value.split("#", 1)[0].strip()
        value = "\n".join(part for part in value.splitlines() if not part.lstrip().startswith("#"))
        env[name] = _placeholder(name, _expand(value, env))
    raise ValueError("no pretrain_*.py / posttrain_*.py launch line in the script")


# -- scaling a script down to a tiny model on 2 processes, every other flag kept ------------------------------------

PATHS = {"--data-path": "data/corpus_text_document", "--tokenizer-name-or-path": "tokenizer",
         "--tokenizer-model": "tokenizer", "--load": "ckpt", "--save": "ckpt", "--hf-cfg-dir": "hf",
         "--tensorboard-dir": "tb"}
SIZES = {"--num-layers": "4", "--hidden-size": "64", "--ffn-hidden-size": "128", "--num-attention-heads": "4",
         "--kv-channels": "16", "--seq-length": "32", "--max-position-embeddings": "32", "--micro-batch-size": "1",
         "--global-batch-size": "4", "--train-iters": "20", "--lr-decay-iters": "20", "--padded-vocab-size": "512",
         "--vocab-size": "500", "--save-interval": "10", "--eval-interval": "10", "--log-interval": "1",
         "--num-layers-per-virtual-pipeline-stage": "1", "--workers": "1", "--num-workers": "0"}


def _values(argv: list[str], i: int) -> int:
    """How many values follow the flag at i."""
    j = i + 1
    while j < len(argv) and not argv[j].startswith("--"):
        j += 1
    return j - i - 1


def scale_down(argv: list[str], nproc: int = 2) -> list[str]:
    """The script's flags for a tiny model on `nproc` processes: sizes, parallel sizes and paths replaced, every
    other flag and value kept. TP or PP (whichever the script uses; PP where it interleaves) becomes `nproc`, the
    other 1; GQA keeps 2 groups; the warm-up stays below the decay."""
    flags = {a: argv[i + 1] if _values(argv, i) == 1 else None for i, a in enumerate(argv) if a.startswith("--")}
    tp = int(flags.get("--tensor-model-parallel-size") or 1)
    pp = int(flags.get("--pipeline-model-parallel-size") or 1)
    if "--num-layers-per-virtual-pipeline-stage" in flags or (pp > 1 and tp == 1):
        tp, pp = 1, nproc
    elif tp > 1:
        tp, pp = nproc, 1
    else:
        tp, pp = 1, 1
    sizes = dict(SIZES, **{"--tensor-model-parallel-size": str(tp), "--pipeline-model-parallel-size": str(pp),
                           "--num-query-groups": "2", "--lr-warmup-iters": "2"})
    out = []
    i = 0
    while i < len(argv):
        flag, n = argv[i], _values(argv, i)
        values = argv[i + 1:i + 1 + n]
        if flag in PATHS and n == 1:
            values = [PATHS[flag]]
        elif flag in sizes and n == 1:
            values = [sizes[flag]]
        out += [flag, *values]
        i += 1 + n
    return out
