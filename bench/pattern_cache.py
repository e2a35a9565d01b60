"""What the pattern cache (option ``pattern_cache``, passes/engine.py ``TraceCache``) saves on a cold compile.

The first training step of a 2-layer megatron-core model compiled whole with ``torch.compile(model,
backend="ascend", options={"cache": False})`` (the graph cache off: every pass runs), each in a fresh process with
Inductor's caches empty, three ways side by side for each model: the pattern cache off; on, with an empty cache
dir (the first process on a machine: it traces and stores); on, with the dir the previous run filled (a second
process: a restarted job, another rank, another test worker). Models: megatron-core GPT (LayerNorm, GeLU, learned
positions) and Llama-style (RMSNorm, SwiGLU, RoPE, GQA), hidden 128, 4 heads, seq 128, batch 2, fp32. Rounds
alternate the three ways so that load from other processes on this shared machine falls on each alike; the table
gives each way's median.

    python -m bench.pattern_cache        # writes bench/results/pattern_cache.md
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
ROUNDS = 3
MODELS = ("gpt", "llama")
WAYS = ("off", "empty", "filled")

_CHILD = r"""
import json, sys, time
import torch
from megatron_glue.capture import adapt, models
from megatron_glue.capture.models import build_gpt_model, gpt_config, llama_config, synthetic_batch
from npu_compile.debug.report import collect
from npu_compile.passes import engine
adapt(("cpu", "compile")); models.init_single_process()
family, pattern_cache = sys.argv[1], sys.argv[2] == "on"
config = (gpt_config if family == "gpt" else llama_config)(num_layers=2, hidden_size=128, num_attention_heads=4,
                                                           **({} if family == "gpt" else {"num_query_groups": 2}))
model = build_gpt_model(config, 128, 128, seed=0)
compiled = torch.compile(model, backend="ascend", options={"cache": False, "pattern_cache": pattern_cache})
t = time.perf_counter()
with collect() as reports:
    compiled(**synthetic_batch(2, 128, 128)).float().mean().backward()
first = time.perf_counter() - t
c = engine.TRACE_CACHE
print(json.dumps({"first_step_s": first, "fusions": sum(sum(r.fusions.values()) for r in reports),
                  "rule_tracing_s": sum(r.compile_s.get("rule_tracing", 0.0) for r in reports),
                  "rule_matching_s": sum(r.compile_s.get("rule_matching", 0.0) for r in reports),
                  "traces": c.misses, "stored": c.stored, "loaded": c.loaded}))
"""


def run(family: str, way: str, cache_dir: str) -> dict:
    with tempfile.TemporaryDirectory() as inductor:
        env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", NPU_COMPILE_CACHE_DIR=cache_dir,
                   TORCHINDUCTOR_CACHE_DIR=inductor, TORCHINDUCTOR_FX_GRAPH_CACHE="0",
                   TORCHINDUCTOR_AUTOGRAD_CACHE="0", PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
        done = subprocess.run([sys.executable, "-c", _CHILD, family, "off" if way == "off" else "on"], env=env,
                              capture_output=True, text=True, timeout=1800, cwd=Path(__file__).parent.parent)
    if done.returncode:
        raise RuntimeError(f"{family} ({way}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    got: dict[tuple[str, str], list[dict]] = {(f, w): [] for f in MODELS for w in WAYS}
    for round_ in range(ROUNDS):
        for family in MODELS:
            with tempfile.TemporaryDirectory() as off, tempfile.TemporaryDirectory() as cache:
                for way in WAYS:  # "filled" reads the dir "empty" has just filled
                    r = run(family, way, off if way == "off" else cache)
                    got[family, way].append(r)
                    print(round_, family, way, r, flush=True)
    for family in MODELS:
        fusions = {r["fusions"] for w in WAYS for r in got[family, w]}
        assert len(fusions) == 1, f"{family}: fusion counts differ between the ways: {fusions}"

    def med(family: str, way: str, field: str) -> float:
        return statistics.median(r[field] for r in got[family, way])

    lines = ["# The pattern cache on a cold compile (megatron-core, 2 layers, hidden 128, seq 128, CPU)", "",
             "First training step of `torch.compile(model, backend=\"ascend\", options={\"cache\": False})` in a fresh "
             "process: the pattern cache off, on with an empty cache dir, and on with the dir the previous run "
             f"filled. Median of {ROUNDS} rounds, the three ways alternating within each round; "
             "`python -m bench.pattern_cache`. `rule tracing`: report.json `compile_s.rule_tracing` (each rule's "
             "first trace in the process); `traces`: the engine's trace requests that missed its memory (the first "
             "traces and the exact re-trace of each match), each traced or loaded.", "",
             "| model | pattern cache | first step (s) | × off | rule tracing (s) | rule matching (s) | traces | "
             "stored | loaded | fusions |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for family in MODELS:
        off = med(family, "off", "first_step_s")
        for way, label in zip(WAYS, ("off", "on, empty dir", "on, filled dir")):
            first = med(family, way, "first_step_s")
            r = got[family, way][0]
            lines.append(f"| {family} | {label} | {first:.2f} | {first / off:.2f} | "
                         f"{med(family, way, 'rule_tracing_s'):.2f} | {med(family, way, 'rule_matching_s'):.2f} | "
                         f"{r['traces']} | {r['stored']} | {r['loaded']} | {r['fusions']} |")
    lines += ["", "The fusion counts are the same every way (checked). The `on, empty dir` row is a machine's "
              "first process: it traces as with the cache off and writes each trace besides."]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "pattern_cache.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
