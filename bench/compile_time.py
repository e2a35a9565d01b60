"""First-step compile time of a megatron-core GPT (hidden 128, seq 128) at 2, 8 and 32 layers, per-layer compiled
as the training job does (megatron_glue.training.training.compile_model): backend="ascend" cold, "ascend" warm (a second
process on the persistent cache: npu_compile.precompile loads each compile, Dynamo and aot_autograd trace nothing),
and Inductor cold, each in a fresh subprocess with its own empty caches; and compiled whole as the README's usage
does (`megatron_glue.adapt()` then `torch.compile(gpt_model)`), cold: with the layers as one nested compile region
(adapt()'s "regions" group) and with them inlined (the group taken off).

    python -m bench.compile_time                # writes bench/results/compile_time.md and .png
    python -m bench.compile_time --whole-model  # only the whole-model table (with the job's cold run beside it),
                                                # replacing that section of compile_time.md
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

LAYERS = (2, 8, 32)
RESULTS = Path(__file__).parent / "results"

_CHILD = r"""
import json, sys, time, types
import torch
from megatron_glue.capture import adapt, models
from megatron_glue.capture.models import build_gpt_model, gpt_config, synthetic_batch
from megatron_glue.training.training import compile_model
from npu_compile.debug.report import collect
adapt(("cpu", "compile")); models.init_single_process()
layers, backend = int(sys.argv[1]), sys.argv[2]
model = build_gpt_model(gpt_config(hidden_size=128, num_attention_heads=4, num_layers=layers), 128, 128)
if backend == "ascend":
    compile_model(model, types.SimpleNamespace(npu_compile_options={}))
else:
    for m in [*model.decoder.layers, model.embedding, model.output_layer]:
        m.forward = torch.compile(m.forward, backend=backend)
batch = synthetic_batch(2, 128, 128)
t = time.perf_counter()
with collect() as reports:
    model(**batch).mean().backward()
first = time.perf_counter() - t
t = time.perf_counter()
model(**batch).mean().backward()  # the step without compiling: what a warm first step cannot save
second = time.perf_counter() - t
parts = {}
for r in reports:
    for k, v in r.compile_s.items():
        parts[k] = parts.get(k, 0.0) + v
from npu_compile import precompile
print(json.dumps({"first_step_s": first, "second_step_s": second, "parts": parts, "precompile": dict(precompile.counts),
                  "unique_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"]}))
"""


# The whole model under torch.compile, as the README's usage: adapt() (with or without its "regions" group), then
# torch.compile(gpt_model, backend="ascend"); the backend's cache off, torch's caches off.
_WHOLE_CHILD = r"""
import json, sys, time
import torch
import megatron_glue
from megatron_glue.capture import models
from megatron_glue.capture.adaptations import groups_for
from megatron_glue.capture.models import build_gpt_model, gpt_config, synthetic_batch
from npu_compile.debug.report import collect
layers, regions = int(sys.argv[1]), sys.argv[2] == "regions"
megatron_glue.adapt(tuple(g for g in groups_for() if regions or g != "regions")); models.init_single_process()
model = build_gpt_model(gpt_config(hidden_size=128, num_attention_heads=4, num_layers=layers), 128, 128)
compiled = torch.compile(model, backend="ascend", options={"cache": False})
batch = synthetic_batch(2, 128, 128)
t = time.perf_counter()
with collect() as reports:
    compiled(**batch).mean().backward()
first = time.perf_counter() - t
t = time.perf_counter()
compiled(**batch).mean().backward()  # the step itself, which grows with the layers whatever the compile does
second = time.perf_counter() - t
parts = {}
for r in reports:
    for k, v in r.compile_s.items():
        parts[k] = parts.get(k, 0.0) + v
print(json.dumps({"first_step_s": first, "second_step_s": second, "unique_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
                  "parts": parts, "regions": {k: v for r in reports for k, v in r.regions.items()},
                  "attention": sum(r.fusions.get("attention", 0) for r in reports)}))
"""


def run_whole(layers: int, regions: bool) -> dict:
    """First step of the whole model compiled cold in a fresh process: every cache empty or off."""
    with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as inductor:
        env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", NPU_COMPILE_CACHE_DIR=cache,
                   TORCHINDUCTOR_CACHE_DIR=inductor, TORCHINDUCTOR_FX_GRAPH_CACHE="0",
                   TORCHINDUCTOR_AUTOGRAD_CACHE="0", PYTHONWARNINGS="ignore")
        done = subprocess.run([sys.executable, "-c", _WHOLE_CHILD, str(layers), "regions" if regions else "inlined"],
                              env=env, capture_output=True, text=True, timeout=3600, cwd=Path(__file__).parent.parent)
    if done.returncode:
        raise RuntimeError(f"whole model ({'regions' if regions else 'inlined'}) at {layers} layers failed:\n"
                           f"{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def whole_model_lines(rows: list[tuple[int, dict, dict, dict]]) -> list[str]:
    """The whole-model table: (layers, regions, inlined, the job's cold run) per row."""
    base_r, base_i = rows[0][1]["first_step_s"], rows[0][2]["first_step_s"]
    lines = ["", WHOLE_HEADING, "",
             "Layers as one nested compile region (adapt()'s \"regions\" group: traced once, compiled once, called N "
             "times) beside the same model with its layers inlined (the group taken off: every layer traced and "
             "compiled again), and the job's per-layer compile from the table above; each a fresh process with the "
             "backend's and torch's caches off. The first step runs the step too: \"2nd step\" is the regions "
             "model's next step in the same process, and \"first - 2nd\" what is left of the first step without it.",
             "",
             "| layers | regions (s) | vs 2 layers | 2nd step (s) | first - 2nd (s) | vs 2 layers | inlined (s) "
             "| vs 2 layers | job cold (s) | region calls | attention fused |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    base_c = base_r - rows[0][1]["second_step_s"]
    for layers, reg, inl, job in rows:
        r, i, s = reg["first_step_s"], inl["first_step_s"], reg["second_step_s"]
        calls = sum(v["calls"] for v in reg["regions"].values())
        lines.append(f"| {layers} | {r:.2f} | {r / base_r:.2f}x | {s:.2f} | {r - s:.2f} | {(r - s) / base_c:.2f}x "
                     f"| {i:.2f} | {i / base_i:.2f}x | "
                     f"{job['first_step_s']:.2f} | {calls} | {reg['attention']} |")
    return lines


WHOLE_HEADING = "## `adapt()` + `torch.compile(gpt_model)`: the whole model, cold"


def whole_model_main() -> None:
    """The whole-model rows alone, each beside the job's cold run of the same size in the same run."""
    rows = []
    for layers in LAYERS:
        with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as ind:
            job = run(layers, "ascend", cache, ind)
        rows.append((layers, run_whole(layers, regions=True), run_whole(layers, regions=False), job))
        print(layers, rows[-1][1:], flush=True)
    path = RESULTS / "compile_time.md"
    kept = path.read_text().split("\n" + WHOLE_HEADING)[0].rstrip("\n").split("\n") if path.exists() else []
    path.write_text("\n".join(kept + whole_model_lines(rows)) + "\n")
    print(path.read_text())


def run(layers: int, backend: str, cache_dir: str, inductor_dir: str) -> dict:
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", NPU_COMPILE_CACHE_DIR=cache_dir,
               TORCHINDUCTOR_CACHE_DIR=inductor_dir, PYTHONWARNINGS="ignore")
    done = subprocess.run([sys.executable, "-c", _CHILD, str(layers), backend], env=env, capture_output=True,
                          text=True, timeout=1800, cwd=Path(__file__).parent.parent)
    if done.returncode:
        raise RuntimeError(f"{backend} at {layers} layers failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    rows, whole_rows = [], []
    for layers in LAYERS:
        with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as ind, \
                tempfile.TemporaryDirectory() as ind2:
            cold = run(layers, "ascend", cache, ind)
            warm = run(layers, "ascend", cache, ind)  # same cache dir: a restarted job
            if warm["unique_graphs"] or warm["precompile"].get("compiled"):
                raise RuntimeError(f"the warm run at {layers} layers traced again: {warm}")
            inductor = run(layers, "inductor", cache, ind2)
        rows.append((layers, cold, warm, inductor))
        print(layers, cold, warm, inductor, flush=True)
        whole_rows.append((layers, run_whole(layers, regions=True), run_whole(layers, regions=False), cold))
        print(layers, "whole", whole_rows[-1][1:3], flush=True)
    base = rows[0][1]["first_step_s"]
    parts = ("rule_tracing", "rule_matching", "partition", "aten_stages", "lowering", "cache")
    lines = ["# First-step time of a per-layer compiled GPT (hidden 128, seq 128, batch 2, CPU)", "",
             "Each figure from a fresh process; cold = empty caches, warm = a second process on the cache the cold "
             "one wrote: it loads each compile whole (`npu_compile.precompile`: Dynamo's guards, aot_autograd's "
             "wrappers, the lowered graphs) and traces nothing; its second step is the step itself, which a warm "
             "start cannot save (the machine is shared: a loaded run slows the steps more than the compiles). "
             "`python -m bench.compile_time`.", "",
             "| layers | ascend cold (s) | vs 2 layers | ascend warm (s) | warm / cold | warm 2nd step (s) "
             "| inductor cold (s) | graphs |",
             "|---|---|---|---|---|---|---|---|"]
    for layers, cold, warm, ind in rows:
        c, w = cold["first_step_s"], warm["first_step_s"]
        lines.append(f"| {layers} | {c:.2f} | {c / base:.2f}x | {w:.2f} | {w / c:.2f} | {warm['second_step_s']:.2f} "
                     f"| {ind['first_step_s']:.2f} "
                     f"| {cold['unique_graphs']} |")
    lines += ["", "Where the backend's own time goes (report.json `compile_s`, summed over the graphs; the rest of the "
              "first step is Dynamo, aot_autograd and running it):", "",
              "| layers | run | " + " | ".join(parts) + " |", "|---|---|" + "---|" * len(parts)]
    for layers, cold, warm, _ in rows:
        for name, r in (("cold", cold), ("warm", warm)):
            lines.append(f"| {layers} | {name} | " + " | ".join(f"{r['parts'].get(k, 0.0):.2f}" for k in parts) + " |")
    lines += whole_model_lines(whole_rows)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "compile_time.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        xs = [r[0] for r in rows]
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, i in (("ascend cold", 1), ("ascend warm", 2), ("inductor cold", 3)):
            ax.plot(xs, [r[i]["first_step_s"] for r in rows], marker="o", label=label)
        for label, i in (("whole model, regions", 1), ("whole model, inlined", 2)):
            ax.plot(xs, [r[i]["first_step_s"] for r in whole_rows], marker="s", linestyle="--", label=label)
        ax.set(xlabel="transformer layers", ylabel="first step (s)", xscale="log", title="first-step compile time")
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.legend()
        fig.tight_layout()
        fig.savefig(RESULTS / "compile_time.png", dpi=100)
    except ImportError:
        pass
    print((RESULTS / "compile_time.md").read_text())


if __name__ == "__main__":
    whole_model_main() if "--whole-model" in sys.argv[1:] else main()
