"""MindSpeed-LLM's training scripts through the job's argument check: which of them the job admits as they are.

    python -m bench.mindspeed_census --repo /path/to/MindSpeed-LLM.git [--rev master]

Reads every `examples/mcore/**/{pretrain,tune}*.sh` of a MindSpeed-LLM checkout (a bare git directory or a work
tree) at `--rev`, takes the flags and values its launch line passes to `pretrain_gpt.py` / `posttrain_gpt.py` (or a model's own `pretrain_*.py`)
(`extract`), scales the sizes down to a tiny model on 2 processes with every other flag kept (`scale_down`), and
runs each through `megatron_glue.training.arguments.parse_args` (and the check `--enable-hf2mg-convert` makes before
the job starts, `megatron_glue.convert.at_start.refusal`). The dense training scripts (no `--num-experts`, context
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
# what a script scaled from pipeline stages to CP x 1 stage cannot keep (the door refuses them at PP 1), and from
# tensor parallelism to CP x TP 1 (MC2 fuses TP's collectives: the door refuses it at TP 1)
PIPELINE_ONLY = ("--num-layer-list", "--num-layers-per-virtual-pipeline-stage")
TENSOR_ONLY = ("--use-ascend-mc2",)
SIZES = {"--num-layers": "4", "--hidden-size": "64", "--ffn-hidden-size": "128", "--num-attention-heads": "4",
         "--kv-channels": "16", "--seq-length": "32", "--max-position-embeddings": "32", "--micro-batch-size": "1",
         "--global-batch-size": "4", "--train-iters": "20", "--lr-decay-iters": "20", "--padded-vocab-size": "512",
         "--vocab-size": "500", "--save-interval": "10", "--eval-interval": "10", "--log-interval": "1",
         "--num-layers-per-virtual-pipeline-stage": "1", "--workers": "1", "--num-workers": "0"}


# LongRoPE's factor lists: one per rotary frequency, so the tiny head (64 / 4 heads = --kv-channels 16) takes 8 of
# the script's, evenly spaced across its spectrum
PER_FREQUENCY = ("--long-factor", "--short-factor")


def _per_frequency(text: str) -> str:
    factors, want = text.split(","), int(SIZES["--kv-channels"]) // 2
    return ",".join(factors[:: max(1, len(factors) // want)][:want])


def _values(argv: list[str], i: int) -> int:
    """How many values follow the flag at i."""
    j = i + 1
    while j < len(argv) and not argv[j].startswith("--"):
        j += 1
    return j - i - 1


def _noop_layers(text: str, full: int) -> str:
    """The script's empty layers (--noop-layers, indices of its --num-layers `full`) at the same places of the
    scaled-down model's layers (Qwen3-235B's 94,95 of 96: 3 of 4), never all of them."""
    layers = int(SIZES["--num-layers"])
    scaled = sorted({min(layers - 1, int(i) * layers // full) for i in text.split(",") if i.strip().isdigit()})
    return ",".join(map(str, scaled[-(layers - 1):])) or text


def scale_down(argv: list[str], nproc: int = 2) -> list[str]:
    """The script's flags for a tiny model on `nproc` processes: sizes, parallel sizes and paths replaced, every
    other flag and value kept. TP or PP (whichever the script uses; PP where it interleaves) becomes `nproc`, the
    other 1; GQA keeps 2 groups; the warm-up stays below the decay; empty layers (--noop-layers) keep their place.
    A script with context parallelism above 1 keeps it at `nproc` (its algorithm kept), TP and PP 1; the flags that
    need pipeline stages or tensor parallelism then (PIPELINE_ONLY, TENSOR_ONLY) are left out."""
    flags = {a: argv[i + 1] if _values(argv, i) == 1 else None for i, a in enumerate(argv) if a.startswith("--")}
    tp = int(flags.get("--tensor-model-parallel-size") or 1)
    pp = int(flags.get("--pipeline-model-parallel-size") or 1)
    cp = int(flags.get("--context-parallel-size") or 1)
    if cp > 1:
        tp, pp, cp = 1, 1, nproc
    elif "--num-layer-list" in flags or "--num-layers-per-virtual-pipeline-stage" in flags or (pp > 1 and tp == 1):
        tp, pp = 1, nproc
    elif tp > 1:
        tp, pp = nproc, 1
    else:
        tp, pp = 1, 1
    sizes = dict(SIZES, **{"--tensor-model-parallel-size": str(tp), "--pipeline-model-parallel-size": str(pp),
                           "--context-parallel-size": str(cp),
                           "--num-query-groups": "2", "--lr-warmup-iters": "2",
                           # uneven stages stay uneven: the first stage one layer, the rest even
                           "--num-layer-list": ",".join(["1", *[str((int(SIZES["--num-layers"]) - 1) // (pp - 1))]
                                                                  * (pp - 1)]) if pp > 1 else "4"})
    out = []
    i = 0
    while i < len(argv):
        flag, n = argv[i], _values(argv, i)
        values = argv[i + 1:i + 1 + n]
        if (flag in PIPELINE_ONLY and pp == 1 or flag in TENSOR_ONLY and tp == 1) and cp > 1:
            i += 1 + n
            continue
        if flag in PATHS and n == 1:
            values = [PATHS[flag]]
        elif flag in sizes and n == 1:
            values = [sizes[flag]]
        elif flag in PER_FREQUENCY and n == 1:
            values = [_per_frequency(values[0])]
        elif flag == "--noop-layers" and n == 1:
            values = [_noop_layers(values[0], int(flags.get("--num-layers") or SIZES["--num-layers"]))]
        out += [flag, *values]
        i += 1 + n
    return out


# -- the census -----------------------------------------------------------------------------------------------------

TRAINING_SCRIPT = re.compile(r"^examples/mcore/.*/(pretrain|tune)[^/]*\.sh$")


def _git(repo: str, *args: str) -> str:
    return subprocess.run(["git", f"--git-dir={repo}", *args], capture_output=True, text=True, check=True).stdout


def scripts(repo: str, rev: str) -> dict[str, list[str]]:
    """path -> extracted flags, for every training launch script under examples/mcore/ at `rev`."""
    out = {}
    for path in _git(repo, "ls-tree", "-r", "--name-only", rev, "examples/mcore").split():
        if TRAINING_SCRIPT.match(path):
            text = _git(repo, "show", f"{rev}:{path}")
            if "--micro-batch-size" in text:
                out[path] = extract(text)
    return out


def is_dense(argv: list[str]) -> bool:
    """The census' scripts: no MoE, context parallel <= 1, no instruction data."""
    flags = {a: argv[i + 1] if _values(argv, i) else None for i, a in enumerate(argv) if a.startswith("--")}
    instruction = ("--stage" in flags or "--is-instruction-dataset" in flags
                   or (flags.get("--handler-name") or "GeneralPretrainHandler") != "GeneralPretrainHandler")
    return "--num-experts" not in flags and int(flags.get("--context-parallel-size") or 1) <= 1 and not instruction


def check(argv: list[str]) -> list[str]:
    """[] where the scaled-down flags pass the job's argument check, else its lines (one per refused flag)."""
    from megatron_glue.convert.at_start import refusal
    from megatron_glue.training.arguments import ArgumentError, parse_args

    try:
        parse_args(scale_down(argv), world_size=2, refusals=(refusal,))
        return []
    except ArgumentError as e:
        return list(getattr(e, "lines", None) or [e.message])


def _feature(line: str) -> str:
    """The feature a refusal line names (its reason up to the first ';'; a family the converter lacks as one)."""
    if line.startswith("--model-type-hf "):
        return "HF weights at start (--enable-hf2mg-convert) of a family the converter lacks"
    if line.startswith("--spec "):
        return "a MindSpeed-LLM layer spec of another family (--spec)"
    return line.split(": ", 1)[-1].split(";")[0]


def _by_feature(lines: list[str]) -> str:
    """`--flag`, `--flag value`: feature; ... (flags grouped under the feature their refusal names)."""
    groups: dict[str, list[str]] = {}
    for line in lines:
        groups.setdefault(_feature(line), []).append(f"`{line.split(': ', 1)[0]}`")
    return "; ".join(f"{', '.join(flags)}: {feature}" for feature, flags in groups.items())


def report(found: dict[str, list[str]], repo_rev: str) -> str:
    results = {path: check(argv) for path, argv in found.items()}
    dense = [p for p in found if is_dense(found[p])]
    admitted = [p for p in dense if not results[p]]
    unknown = sorted({line.split(":")[0] for lines in results.values() for line in lines if "unrecognized" in line})
    all_admitted = sum(1 for r in results.values() if not r)
    converter_only = sum(1 for p in dense if results[p] and all(line.startswith("--model-type-hf ")
                                                                 for line in results[p]))
    # refused for a combination of the script's own flags that MindSpeed refuses as well (the script as written
    # does not start there either)
    theirs = [p for p in dense if results[p] and all("MindSpeed refuses this combination too" in line
                                                     for line in results[p])]
    lines = [
        "# MindSpeed-LLM's training scripts through the job's argument check",
        "",
        f"Source: Ascend/MindSpeed-LLM {repo_rev}, every `examples/mcore/**/{{pretrain,tune}}*.sh` that launches "
        f"training ({len(found)} scripts); flags and values extracted from each launch line "
        "(`bench/mindspeed_census.py`), sizes scaled down to a tiny model on 2 processes (TP or PP 2), every other "
        "flag kept, run through `megatron_glue.training.arguments.parse_args` and the converter's family check "
        "of `--enable-hf2mg-convert`. Regenerate: "
        "`python -m bench.mindspeed_census --repo <MindSpeed-LLM git dir>`.",
        "",
        f"- Dense scripts (no `--num-experts`, context parallel <= 1, no instruction data): **{len(admitted)} of "
        f"{len(dense)} admitted** ({100 * len(admitted) / max(1, len(dense)):.0f}%).",
        f"- Refused only for `--model-type-hf` naming a family `npu-compile convert` does not have (they pass once "
        f"it has it): {converter_only}.",
        f"- Refused only for a combination of the script's own flags that MindSpeed refuses too (the script as "
        f"written does not start under MindSpeed-LLM either): {len(theirs)}"
        + (f" ({', '.join(p.removeprefix('examples/mcore/') for p in theirs)})." if theirs else "."),
        f"- All {len(found)} scripts: {all_admitted} admitted; flags no one knows (\"unrecognized\"): "
        f"{', '.join(unknown) if unknown else 'none'}.",
        "",
        "## Dense scripts",
        "",
        "| script | admitted | refused (flags: the feature they name) |",
        "|---|---|---|",
    ]
    for path in dense:
        lines.append(f"| {path.removeprefix('examples/mcore/')} | {'yes' if not results[path] else 'no'} | "
                     f"{_by_feature(results[path]) or '–'} |")
    blocking: dict[str, int] = {}
    for path in dense:
        for feature in dict.fromkeys(_feature(line) for line in results[path]):
            blocking[feature] = blocking.get(feature, 0) + 1
    lines += ["", "## What keeps the dense scripts out", "", "| feature | dense scripts |", "|---|---|"]
    lines += [f"| {feature} | {n} |" for feature, n in sorted(blocking.items(), key=lambda kv: -kv[1])]
    every: dict[str, int] = {}
    for path in found:
        for feature in dict.fromkeys(_feature(line) for line in results[path]):
            every[feature] = every.get(feature, 0) + 1
    lines += ["", f"## All {len(found)} scripts: the features their refusals name", "",
              "| feature | scripts |", "|---|---|"]
    lines += [f"| {feature} | {n} |" for feature, n in sorted(every.items(), key=lambda kv: -kv[1])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.mindspeed_census", description=__doc__.split("\n")[0])
    parser.add_argument("--repo", required=True, help="a MindSpeed-LLM git directory (bare, or a work tree's .git)")
    parser.add_argument("--rev", default="master")
    a = parser.parse_args(argv)
    os.environ["LOCAL_WORLD_SIZE"] = "2"  # the 2 processes on one machine
    commit = _git(a.repo, "rev-parse", "--short", a.rev).strip()
    found = scripts(a.repo, a.rev)
    text = report(found, f"`{a.rev}` {commit}")
    out = Path(__file__).parent / "results"
    (out / "mindspeed_census.md").write_text(text + "\n")
    rows = ",\n".join(f"  {json.dumps(path)}: {json.dumps(argv)}" for path, argv in found.items())
    (out / "mindspeed_census.json").write_text(
        f'{{"source": {json.dumps(f"Ascend/MindSpeed-LLM {a.rev} {commit}")},\n "scripts": {{\n{rows}\n}}}}\n')
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
